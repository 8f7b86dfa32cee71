"""The clone-friendly layout: copied bytes keep their input offsets modulo the block, the
output stays a valid safetensors file for every loader, and the reference layout stays the
bytes ``safetensors.save_file`` writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

import weightmap
import weightmap.cli
from weightmap.format import layout as layout_module
from weightmap.format.dtypes import TensorSpec
from weightmap.format.layout import (
    CLONE_BLOCK,
    Extent,
    Origin,
    WholeOrigins,
    aligned_middle,
    plan_layout,
)
from weightmap.inputs.checkpoint import Checkpoint

RENAME = 'weightmap 1\nrename "layers.{n:int}.{r*}" -> "blocks.{n}.{r}"\nunmatched keep\n'


def _header_size(path: Path) -> int:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return int(n)


def _tensors() -> dict[str, torch.Tensor]:
    """Sizes that are not multiples of the block, in several dtypes, as real models have."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(300, 70, generator=gen).to(torch.bfloat16),
        "layers.0.attn.weight": torch.randn(70, 70, generator=gen),
        "layers.0.norm.weight": torch.randn(70, generator=gen).to(torch.bfloat16),
        "layers.1.attn.weight": torch.randn(70, 70, generator=gen),
        "layers.1.norm.weight": torch.randn(70, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(300, 70, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(1001, dtype=torch.int64),
        "mask": torch.ones(1003, dtype=torch.bool),
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "in"
    root.mkdir()
    save_file(_tensors(), root / "model.safetensors", metadata={"format": "pt"})
    return root


def test_rename_keeps_the_data_buffer_and_its_offsets_modulo_the_block(
    ckpt: Path, tmp_path: Path
) -> None:
    result = weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, progress=False)
    src, out = ckpt / "model.safetensors", tmp_path / "out" / "model.safetensors"
    start_in, start_out = 8 + _header_size(src), 8 + _header_size(out)
    # The renames reorder the names; the data keeps the input's order, byte for byte.
    assert out.read_bytes()[start_out:] == src.read_bytes()[start_in:]
    assert start_out % CLONE_BLOCK == start_in % CLONE_BLOCK
    assert start_out % 8 == 0 and start_out - start_in < CLONE_BLOCK
    # The padding is JSON whitespace after the object.
    header = out.read_bytes()[8:start_out]
    assert header.startswith(b"{") and header.rstrip(b" ").endswith(b"}")
    assert result.bytes_written == result.bytes_copied + result.bytes_cloned
    assert result.bytes_computed == 0


@pytest.mark.parametrize("loader", ["load_file", "safe_open", "checkpoint"])
def test_clone_layout_loads_everywhere(ckpt: Path, tmp_path: Path, loader: str) -> None:
    weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, progress=False)
    path = tmp_path / "out" / "model.safetensors"
    expected = {n.replace("layers.", "blocks.", 1): t for n, t in _tensors().items()}
    if loader == "load_file":
        got = load_file(path)
    elif loader == "safe_open":
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    else:
        with Checkpoint.open(path.parent) as c:
            got = {k: c.view(k).clone() for k in c}
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_transformers_loads_the_clone_layout(ckpt: Path, tmp_path: Path) -> None:
    modeling = pytest.importorskip("transformers.modeling_utils", reason="transformers missing")
    weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, progress=False)
    got = modeling.load_state_dict(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(got["blocks.1.attn.weight"], _tensors()["layers.1.attn.weight"])


def test_reference_layout_is_what_save_file_writes(ckpt: Path, tmp_path: Path) -> None:
    weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, progress=False, layout="reference")
    expected = {n.replace("layers.", "blocks.", 1): t for n, t in _tensors().items()}
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert ours == save(expected, metadata={"format": "pt"})


def test_cli_layout_flag(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r.wm").write_text(RENAME)
    args = ["convert", str(ckpt), str(tmp_path / "out"), "--mapping", str(tmp_path / "r.wm")]
    assert weightmap.cli.main([*args, "--layout", "reference", "--no-progress"]) == 0
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert "cloned" in closing and "copied" in closing and "0 B computed" in closing
    expected = {n.replace("layers.", "blocks.", 1): t for n, t in _tensors().items()}
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert ours == save(expected, metadata={"format": "pt"})


def test_computed_tensors_keep_their_alignment(ckpt: Path, tmp_path: Path) -> None:
    mapping = (
        'weightmap 1\ncast "{x*}" to f16 where dtype == f32\n'
        'rename "layers.{n:int}.{r*}" -> "blocks.{n}.{r}"\nunmatched keep\n'
    )
    result = weightmap.remap(ckpt, tmp_path / "out", mapping=mapping, progress=False)
    assert result.bytes_computed == 2 * 70 * 70 * 2
    path = tmp_path / "out" / "model.safetensors"
    start = 8 + _header_size(path)
    header = json.loads(path.read_bytes()[8:start])
    header.pop("__metadata__")
    sizes = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "BOOL": 1}
    for name, entry in header.items():
        assert (start + entry["data_offsets"][0]) % sizes[entry["dtype"]] == 0, name
    # Rules apply in order: the cast tensor goes on into the rename.
    assert load_file(path)["blocks.0.attn.weight"].dtype == torch.float16
    # The casts leave two copied runs; the larger (embed .. lm_head) keeps its input offsets
    # modulo the block, the computed tensors going first so that all stay aligned.
    src_start = 8 + _header_size(ckpt / "model.safetensors")
    src_header = json.loads((ckpt / "model.safetensors").read_bytes()[8:src_start])
    at_in = src_start + src_header["embed.weight"]["data_offsets"][0]
    assert (start + header["embed.weight"]["data_offsets"][0]) % CLONE_BLOCK == at_in % CLONE_BLOCK


def test_a_shard_with_nothing_to_share_is_laid_out_as_the_reference(tmp_path: Path) -> None:
    specs = [TensorSpec("b", "F32", (3,)), TensorSpec("a", "I64", (2,))]
    origins = {"a": Origin((0, 100), (Extent(0, 100, 16),)), "b": Origin((0, 50))}
    planned = plan_layout(specs, origins=origins)
    reference = plan_layout(specs, layout="reference")
    assert planned.shards == reference.shards
    assert [(c.src, c.length) for c in planned.copies] == [(100, 16)]


def test_adjacent_ranges_are_coalesced_and_shards_follow_input_files() -> None:
    block = CLONE_BLOCK
    specs = [TensorSpec(f"t{i}", "U8", (3 * block + 10,)) for i in range(4)]
    size = 3 * block + 10
    # t0, t1 from file 0 back to back; t2, t3 from file 1 back to back.
    origins = {
        f"t{i}": Origin(
            (i // 2, 1000 + (i % 2) * size), (Extent(i // 2, 1000 + (i % 2) * size, size),)
        )
        for i in range(4)
    }
    planned = plan_layout(specs, origins=origins)
    assert [sorted(s.offsets) for s in planned.shards] == [["t0", "t1"], ["t2", "t3"]]
    assert [(c.file, c.src, c.shard, c.length) for c in planned.copies] == [
        (0, 1000, 0, 2 * size),
        (1, 1000, 1, 2 * size),
    ]
    for c in planned.copies:
        assert c.dst % block == c.src % block
        head, middle = aligned_middle(c.src, c.dst, c.length)
        assert middle >= c.length - 2 * block and head < block


def test_dropped_tensor_in_between_keeps_the_larger_run_congruent() -> None:
    block = CLONE_BLOCK
    specs = [TensorSpec("small", "U8", (block + 8,)), TensorSpec("big", "U8", (8 * block,))]
    # In the input, 16 bytes of a dropped tensor sat between them: one congruence cannot
    # serve both, and the big one wins.
    at = 2048 + block + 8 + 16
    origins = {
        "small": Origin((0, 2048), (Extent(0, 2048, block + 8),)),
        "big": Origin((0, at), (Extent(0, at, 8 * block),)),
    }
    planned = plan_layout(specs, origins=origins)
    (shard,) = planned.shards
    assert shard.offsets["big"][0] % block == at % block
    assert shard.offsets["small"][0] % block != 2048


# -- the one-pass layout of a plan that copies every output whole ------------------------------

_DTYPES = ("BOOL", "U8", "BF16", "F16", "F32", "I64")


@st.composite
def _whole_copies(draw: st.DrawFn) -> tuple[list[TensorSpec], dict[str, Origin], int]:
    """Outputs that are each one input range in full: mostly in input order (the one-pass
    layout's case), sometimes not (it must then leave the plan to the general passes), across
    input files, with empty tensors, odd sizes and gaps (dropped tensors) between them."""
    n = draw(st.integers(1, 24))
    specs: list[TensorSpec] = []
    origins: dict[str, Origin] = {}
    file, at = 0, draw(st.integers(0, 3 * CLONE_BLOCK))
    for i in range(n):
        dtype = draw(st.sampled_from(_DTYPES))
        # Mostly large enough to hold whole blocks, sometimes tiny or empty.
        count = draw(st.one_of(st.integers(0, 40), st.integers(CLONE_BLOCK, 3 * CLONE_BLOCK)))
        spec = TensorSpec(f"t{i}", dtype, (count,))
        if draw(st.integers(0, 9)) == 0:
            file, at = file + 1, draw(st.integers(0, 2 * CLONE_BLOCK))
        at += draw(st.sampled_from((0, 0, 0, 1, 8, 16, CLONE_BLOCK)))  # a dropped tensor
        origins[spec.name] = Origin((file, at), (Extent(file, at, spec.nbytes),))
        specs.append(spec)
        at += spec.nbytes
    if draw(st.booleans()) and n > 1:
        specs = draw(st.permutations(specs))
    # Limits a group fills exactly, too (a tensor that ends on the limit stays in its shard).
    exact = sum(s.nbytes for s in specs[: draw(st.integers(1, n))]) or 1
    limit = draw(st.sampled_from((CLONE_BLOCK, 5 * CLONE_BLOCK, 10**9, exact)))
    return specs, origins, limit


@given(_whole_copies(), st.sampled_from((None, {"format": "pt"})))
@settings(max_examples=300, deadline=None)
def test_one_pass_layout_is_the_general_layout(
    case: tuple[list[TensorSpec], dict[str, Origin], int], metadata: dict[str, str] | None
) -> None:
    specs, origins, limit = case
    fast = plan_layout(specs, limit, metadata, origins)
    # The same plan laid out by the general passes alone.
    with patch.object(layout_module, "_whole_copies", lambda *args: None):
        general = plan_layout(specs, limit, metadata, origins)
    assert fast == general


def test_one_pass_layout_takes_the_plans_it_is_for() -> None:
    # (The property above holds trivially if the one-pass layout never runs.)
    specs = [TensorSpec(f"t{i}", "F32", (1000 + i,)) for i in range(3)]
    at = 100
    origins = {}
    for s in specs:
        origins[s.name] = Origin((0, at), (Extent(0, at, s.nbytes),))
        at += s.nbytes
    found = layout_module._whole_copies(specs, origins, 10**9)
    assert found is not None and [len(group) for group, _, _ in found] == [3]
    assert layout_module._whole_copies(specs[::-1], origins, 10**9) is None  # not input order
    computed = {**origins, "t1": Origin((0, 100))}
    assert layout_module._whole_copies(specs, computed, 10**9) is None


def _columns(specs: list[TensorSpec], origins: dict[str, Origin]) -> WholeOrigins:
    """The origins as columns, listed as the outputs are (as the executor makes them)."""
    names = [s.name for s in specs]
    extents = [origins[n].extents[0] for n in names]  # type: ignore[index]
    return WholeOrigins(
        names, [e.file for e in extents], [e.offset for e in extents], [e.length for e in extents]
    )


@given(_whole_copies(), st.sampled_from((None, {"format": "pt"})))
@settings(max_examples=300, deadline=None)
def test_columns_lay_out_what_the_one_pass_layout_does(
    case: tuple[list[TensorSpec], dict[str, Origin], int], metadata: dict[str, str] | None
) -> None:
    specs, origins, limit = case
    columns = _columns(specs, origins)
    assert dict(columns) == origins  # (read as a mapping, the same origins)
    found = layout_module._whole_columns(specs, columns, limit)
    if found is not None:
        assert found == layout_module._whole_copies(specs, origins, limit)
    assert plan_layout(specs, limit, metadata, columns) == plan_layout(
        specs, limit, metadata, origins
    )
    reference = plan_layout(specs, limit, metadata, columns, layout="reference")
    assert reference == plan_layout(specs, limit, metadata, origins, layout="reference")


def test_columns_take_the_plans_they_are_for() -> None:
    # (The property above holds trivially if the columns are never laid out as such.)
    specs = [TensorSpec(f"t{i}", "F32", (1000 + i,)) for i in range(4)]
    at, origins = 100, {}
    for i, s in enumerate(specs):
        if i == 2:
            at += 8  # a dropped tensor: two runs of copies
        origins[s.name] = Origin((0, at), (Extent(0, at, s.nbytes),))
        at += s.nbytes
    found = layout_module._whole_columns(specs, _columns(specs, origins), 10**9)
    assert found is not None and [len(runs or ()) for _, _, runs in found] == [2]
    assert found == layout_module._whole_copies(specs, origins, 10**9)
    # Listed in another order than the outputs, or not in input order: not for the columns.
    assert layout_module._whole_columns(specs[::-1], _columns(specs, origins), 10**9) is None
    assert layout_module._whole_columns(specs[::-1], _columns(specs[::-1], origins), 10**9) is None
    # An input file's tensors over the limit take several shards: the one-pass loop's.
    assert layout_module._whole_columns(specs, _columns(specs, origins), 5000) is None


@pytest.mark.parametrize("layout", ["clone", "reference"])
def test_shard_offsets_read_as_the_dict_of_each_tensors_range(
    layout: layout_module.Layouts,
) -> None:
    """A shard's offsets are kept as columns (names and bounds); read as a mapping they are the
    dict of every tensor's absolute [begin, end), back to back in file order from the end of
    the header, by lookup and by items."""
    specs = [TensorSpec(f"t{i}", "F32" if i % 2 else "U8", (i + 1,)) for i in range(6)]
    sizes = {s.name: s.nbytes for s in specs}
    planned = layout_module.plan_layout(specs, 40, None, None, layout)
    for shard in planned.shards:
        offsets = shard.offsets
        assert isinstance(offsets, layout_module.Offsets)
        position, want = len(shard.header), {}
        for name in offsets:
            want[name] = (position, position + sizes[name])
            position += sizes[name]
        assert position == shard.size
        assert dict(offsets.items()) == want and offsets == want and len(offsets) == len(want)
        assert {name: offsets[name] for name in want} == want
        with pytest.raises(KeyError):
            offsets["missing"]
    assert sorted(name for shard in planned.shards for name in shard.offsets) == sorted(sizes)
