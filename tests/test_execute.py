"""The streaming executor against the in-memory reference, on generated plans and checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file

import weightmap
from strategies import UNFIT, cases, src
from weightmap.errors import CheckpointError, ExecutionError, PlanError
from weightmap.execute.chunks import chunk_plan, region, scratch
from weightmap.execute.compute import _Arena
from weightmap.execute.inplace import recover, rewrite_inplace
from weightmap.execute.kernels import evaluate, tensor_bytes
from weightmap.execute.segments import byte_segments
from weightmap.execute.streaming import execute
from weightmap.format.dtypes import DTYPES, TensorSpec, numel
from weightmap.format.header import read_header
from weightmap.format.layout import Layouts
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.language.ast import Loc
from weightmap.plan.nodes import Cast, Concat, Node, Permute, Reshape, Slice, Source
from weightmap.plan.plan import Dropped, OutputTensor, Plan

from sftools import entry, write_raw

HERE = Loc("<test>", 1, 1)


def plan_of(inputs: dict[str, torch.Tensor], outputs: dict[str, Node], **kw: object) -> Plan:
    specs = tuple(
        TensorSpec(
            n,
            next(k for k, d in DTYPES.items() if d.torch_name and d.torch() == t.dtype),
            tuple(t.shape),
        )
        for n, t in inputs.items()
    )
    outs = tuple(OutputTensor(name=n, node=node, origin=HERE) for n, node in outputs.items())
    return Plan.build(mapping_name="test", inputs=specs, outputs=outs, **kw)  # type: ignore[arg-type]


# -- generated plans ---------------------------------------------------------------------------


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=cases(),
    chunk=st.sampled_from([1, 7, 64, 1 << 20]),
    workers=st.sampled_from([1, 3]),
    shard=st.sampled_from(["64B", "5GB"]),
)
def test_streaming_matches_reference(
    tmp_path_factory: pytest.TempPathFactory,
    layout: Layouts,
    case: tuple[dict[str, torch.Tensor], dict[str, Node]],
    chunk: int,
    workers: int,
    shard: str,
) -> None:
    inputs, outputs = case
    root = tmp_path_factory.mktemp("c")
    save_file(inputs, root / "model.safetensors")
    plan = plan_of(inputs, outputs)
    options = {"chunk_bytes": chunk, "workers": workers, "max_shard_size": shard}
    try:
        values = {n: evaluate(node, inputs.__getitem__) for n, node in outputs.items()}
    except ExecutionError:
        # A narrowing cast met a value it cannot hold: the run stops too, in whichever chunk
        # meets one, and leaves nothing.
        with Checkpoint.open(root) as ckpt, pytest.raises(ExecutionError, match=UNFIT):
            execute(plan, ckpt, root / "out", layout=layout, **options)  # type: ignore[arg-type]
        assert sorted(p.name for p in root.iterdir()) == ["model.safetensors"]
        return
    expected = {n: tensor_bytes(t) for n, t in values.items()}
    with Checkpoint.open(root) as ckpt:
        execute(plan, ckpt, root / "out", layout=layout, **options)  # type: ignore[arg-type]
    if layout == "reference" and shard == "5GB":
        ours = (root / "out" / "model.safetensors").read_bytes()
        fresh = {n: t.clone(memory_format=torch.contiguous_format) for n, t in values.items()}
        assert ours == save(fresh, {"format": "pt"})
    with Checkpoint.open(root / "out") as out:
        assert sorted(out) == sorted(outputs)
        for name, node in outputs.items():
            info = out.tensors[name]
            assert (info.dtype, info.shape) == (node.dtype, node.shape)
            loc = out.location(name)
            with loc.path.open("rb") as f:
                f.seek(loc.offset)
                assert f.read(loc.length) == expected[name], name


# -- paths, bounds, errors ---------------------------------------------------------------------


def _ckpt(tmp_path: Path, **tensors: torch.Tensor) -> Path:
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_renames_and_dim0_ops_are_pure_copies(tmp_path: Path) -> None:
    w = torch.randn(8, 4)
    root = _ckpt(tmp_path, w=w)
    s = src("w", w)
    outputs: dict[str, Node] = {
        "renamed": s,
        "top": Slice(src=s, dim=0, start=0, stop=3, dtype="F32", shape=(3, 4)),
        "flat": Reshape(src=s, dtype="F32", shape=(32,)),
        "twice": Concat(srcs=(s, s), dim=0, dtype="F32", shape=(16, 4)),
    }
    with Checkpoint.open(root) as ckpt:
        _, stats = execute(plan_of({"w": w}, outputs), ckpt, tmp_path / "out")
    assert stats.bytes_computed == 0
    assert stats.bytes_copied == (32 + 12 + 32 + 64) * 4
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["top"], w[:3]) and torch.equal(out["twice"], torch.cat([w, w]))


def test_byte_segments_of_column_split() -> None:
    s = Source(name="w", dtype="F32", shape=(2, 6))
    col = Slice(src=s, dim=1, start=2, stop=5, dtype="F32", shape=(2, 3))
    segs = byte_segments(col)
    assert segs is not None
    assert [(x.offset, x.length) for x in segs] == [(8, 12), (32, 12)]
    cast = Cast(src=s, dtype="BF16", shape=(2, 6))
    assert byte_segments(cast) is None
    assert byte_segments(Permute(src=s, perm=(1, 0), dtype="F32", shape=(6, 2))) is None
    unit = Source(name="u", dtype="F32", shape=(1, 6))
    assert byte_segments(Permute(src=unit, perm=(1, 0), dtype="F32", shape=(6, 1))) is not None


def test_chunk_plan_bounds_memory() -> None:
    # A 2.3 GB-class embedding cast: each chunk's intermediates stay within the budget.
    s = Source(name="embed", dtype="BF16", shape=(163840, 7168))
    node = Cast(src=s, dtype="F32", shape=s.shape)
    dim, step = chunk_plan(node, 64 * 2**20)
    assert dim == 0
    per_row = 7168 * (2 + 4)
    assert step * per_row <= 64 * 2**20
    assert step >= 1000


def test_chunk_plan_counts_the_source_a_quantization_scale_reads() -> None:
    # One scale per 128 x 128 block: the grid is small, but each chunk of it reads its rows of
    # blocks of the source in float32 (a copy and its magnitudes). Counted on the grid alone,
    # one chunk took the whole 4096 x 4096 source: 128 MiB of float32 against 32 MiB.
    from weightmap.plan.nodes import Quantize

    s = Source(name="w", dtype="BF16", shape=(4096, 4096))
    scales = Quantize(src=s, dtype="F32", shape=(32, 32), block=(128, 128), part="scales",
                      fp8="F8_E4M3")  # fmt: skip
    budget = 32 * 2**20
    dim, step = chunk_plan(scales, budget)
    assert dim == 0 and 1 <= step < 32
    assert step * 128 * 4096 * (2 + 4 + 4) <= budget


def test_computed_path_used_for_casts(tmp_path: Path) -> None:
    w = torch.randn(300, 7)
    root = _ckpt(tmp_path, w=w)
    node = Cast(src=src("w", w), dtype="BF16", shape=(300, 7))
    with Checkpoint.open(root) as ckpt:
        _, stats = execute(
            plan_of({"w": w}, {"w": node}), ckpt, tmp_path / "out", chunk_bytes=1000, checksum=True
        )
    assert stats.bytes_copied == 0 and stats.bytes_computed == 300 * 7 * 2
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], w.to(torch.bfloat16))
    assert stats.checksums is not None and set(stats.checksums) == {"w"}


def test_narrowing_int_cast_out_of_range_fails_cleanly(tmp_path: Path) -> None:
    w = torch.tensor([1, 2, 300], dtype=torch.int64)
    root = _ckpt(tmp_path, w=w)
    node = Cast(src=src("w", w), dtype="I8", shape=(3,))
    with Checkpoint.open(root) as ckpt, pytest.raises(ExecutionError, match=r"\[1, 300\]"):
        execute(plan_of({"w": w}, {"w": node}), ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_plan_for_another_checkpoint_is_refused(tmp_path: Path) -> None:
    w = torch.zeros(4)
    root = _ckpt(tmp_path, w=w)
    plan = plan_of({"w": torch.zeros(5)}, {"w": src("w", torch.zeros(5))})
    with Checkpoint.open(root) as ckpt, pytest.raises(ExecutionError, match="compile the plan"):
        execute(plan, ckpt, tmp_path / "out")


def test_invalid_worker_and_chunk_arguments(tmp_path: Path) -> None:
    w = torch.zeros(4)
    root = _ckpt(tmp_path, w=w)
    plan = plan_of({"w": w}, {"w": src("w", w)})
    with Checkpoint.open(root) as ckpt:
        with pytest.raises(ValueError, match="workers"):
            execute(plan, ckpt, tmp_path / "out", workers=0)
        with pytest.raises(ValueError, match="chunk_bytes"):
            execute(plan, ckpt, tmp_path / "out", chunk_bytes=0)


# -- in place ----------------------------------------------------------------------------------


def _rename_plan(inputs: dict[str, torch.Tensor], renames: dict[str, str], **kw: object) -> Plan:
    return plan_of(inputs, {renames.get(n, n): src(n, t) for n, t in inputs.items()}, **kw)


def test_inplace_rename_keeps_data(tmp_path: Path) -> None:
    inputs = {"layers.0.a": torch.randn(3, 3), "layers.0.b": torch.arange(4), "fc": torch.ones(2)}
    root = _ckpt(tmp_path, **inputs)
    before = (root / "model.safetensors").read_bytes()
    plan = _rename_plan(inputs, {"layers.0.a": "midlayer.a", "layers.0.b": "midlayer.b"})
    with Checkpoint.open(root) as ckpt:
        rewrite_inplace(plan, ckpt)
    after = (root / "model.safetensors").read_bytes()
    assert len(after) == len(before)
    header_end = 8 + int.from_bytes(before[:8], "little")
    assert after[header_end:] == before[header_end:]
    loaded = load_file(root / "model.safetensors")
    assert sorted(loaded) == ["fc", "midlayer.a", "midlayer.b"]
    assert torch.equal(loaded["midlayer.a"], inputs["layers.0.a"])
    assert not list(root.glob(".weightmap*"))


def test_inplace_refusals(tmp_path: Path) -> None:
    inputs = {"a": torch.zeros(2), "b": torch.zeros(2)}
    root = _ckpt(tmp_path, **inputs)
    with Checkpoint.open(root) as ckpt:
        long = _rename_plan(inputs, {"a": "a" * 200})
        with pytest.raises(PlanError, match="room for"):
            rewrite_inplace(long, ckpt)
        dropping = plan_of(
            inputs, {"a": src("a", inputs["a"])}, dropped=(Dropped(name="b", origin=HERE),)
        )
        with pytest.raises(PlanError, match="cannot drop"):
            rewrite_inplace(dropping, ckpt)
        cast = plan_of(
            inputs,
            {
                "a": Cast(src=src("a", inputs["a"]), dtype="F16", shape=(2,)),
                "b": src("b", inputs["b"]),
            },
        )
        with pytest.raises(PlanError, match="only renames"):
            rewrite_inplace(cast, ckpt)


def test_interrupted_inplace_is_refused_then_recovered(tmp_path: Path) -> None:
    import weightmap.execute.inplace as inplace

    inputs = {"layers.0.a": torch.randn(3)}
    root = _ckpt(tmp_path, **inputs)
    plan = _rename_plan(inputs, {"layers.0.a": "midlayer.a"})
    real = inplace._replay

    def crash(*_: object) -> None:
        raise KeyboardInterrupt  # the journal is on disk; the headers were not yet touched

    inplace._replay = crash  # type: ignore[assignment]
    try:
        with Checkpoint.open(root) as ckpt, pytest.raises(KeyboardInterrupt):
            rewrite_inplace(plan, ckpt)
    finally:
        inplace._replay = real  # type: ignore[assignment]
    with pytest.raises(CheckpointError, match="weightmap clean"):
        Checkpoint.open(root)
    assert recover(root) is True
    assert sorted(load_file(root / "model.safetensors")) == ["midlayer.a"]
    assert recover(root) is False


def test_math_sanity() -> None:
    assert math.prod((2, 3)) == numel((2, 3))


@pytest.mark.parametrize(
    ("src", "dst"), [("F16", "F32"), ("F32", "BF16"), ("F64", "BF16"), ("BF16", "F32")]
)
def test_float_casts_give_nans_the_same_bits_whatever_the_chunks(
    tmp_path: Path, src: str, dst: str
) -> None:
    # torch converts a NaN's payload differently in its vector loop, in the scalar loop that
    # ends a run, and for strided sources; chunk sizes and thread counts move where runs end.
    # Every NaN pattern of the source, at every position, chunked and whole, transposed too.
    bits = DTYPES[src].bits
    as_int = {16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1, (97 * 64,), generator=gen)
    x = words.to(as_int).view(DTYPES[src].torch())
    if bits == 16:
        # Random 16-bit words hold few NaNs: make every non-NaN a NaN too (the canonical one).
        x = torch.where(torch.isnan(x.to(torch.float64)), x, torch.full_like(x, float("nan")))
    save_file({"x": x.reshape(97, 64).contiguous()}, tmp_path / "model.safetensors")
    outputs = []
    for mapping, chunk in (
        (f'weightmap 1\ncast "x" to {dst}\n', 1 << 20),
        (f'weightmap 1\ncast "x" to {dst}\n', 3 * 64 * 8),
        (f'weightmap 1\ntranspose "x"\ncast "x" to {dst}\ntranspose "x"\n', 5 * 97 * 8),
    ):
        plan = weightmap.compile(tmp_path, mapping=mapping)
        with Checkpoint.open(tmp_path) as ckpt:
            dest = tmp_path / f"out{len(outputs)}"
            execute(plan, ckpt, dest, chunk_bytes=chunk, workers=2)
        outputs.append((dest / "model.safetensors").read_bytes())
        memory = dict(weightmap.iter_tensors(tmp_path, mapping=mapping))["x"]
        with Checkpoint.open(dest) as out:
            assert tensor_bytes(memory) == tensor_bytes(out.view("x").clone()), mapping
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 1, 3 * (1 << 16) + 7])
def test_e4m3_decodes_through_the_pair_table_with_torch_s_bits(dst: torch.dtype, n: int) -> None:
    """The byte-pair table (nans.py) gives every element the bits of the cast it replaces,
    NaNs too, at even and odd lengths and at an offset into a larger tensor."""
    from weightmap.execute import nans

    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 256, (n + 3,), generator=gen, dtype=torch.int32).to(torch.uint8)
    codes[3:259] = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every byte once
    x = codes.view(torch.float8_e4m3fn)[3:]  # (a view at an odd offset)
    got = nans.convert(x, dst)
    assert got.dtype == dst and got.shape == x.shape
    single = torch.stack(
        [
            nans.convert(b.reshape(1), dst)
            for b in torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn)
        ]
    ).reshape(-1)
    expected = single[x.view(torch.uint8).to(torch.int64)]
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    # The values (not the NaN payloads, which torch's loops may differ in) are torch's own.
    plain = x.to(dst)
    nan = torch.isnan(plain)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.uint8), plain[~nan].view(torch.uint8))
    # A strided tensor or a small one keeps torch's path, with the same values.
    strided = nans.convert(x[::2], dst)
    assert torch.equal(strided.view(torch.uint8), expected[::2].contiguous().view(torch.uint8))


def test_sources_of_a_rename_are_the_general_sources(tmp_path: Path) -> None:
    """Where every output is an input tensor in full, ``_sources`` skips the general loop and
    makes ``copied`` and ``where`` only when asked: they must be what the general loop gives."""
    from unittest.mock import patch

    from weightmap.execute import sources as sources_module

    gen = torch.Generator().manual_seed(3)
    root = tmp_path / "in"
    root.mkdir()
    tensors = {"a": torch.randn(5, 3, generator=gen), "b": torch.ones(0), "c": torch.arange(7)}
    save_file({"a": tensors["a"], "b": tensors["b"]}, root / "one.safetensors")
    save_file({"c": tensors["c"]}, root / "two.safetensors")
    index = {"weight_map": {"a": "one.safetensors", "b": "one.safetensors", "c": "two.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    plan = plan_of(
        tensors,
        {
            "x.c": Source(name="c", dtype="I64", shape=(7,)),
            "x.a": Source(name="a", dtype="F32", shape=(5, 3)),
            "x.b": Source(name="b", dtype="F32", shape=(0,)),
        },
    )
    with Checkpoint.open(root) as ckpt:
        fast = sources_module._sources(plan, ckpt)
        assert fast._copied is None and fast._where is None  # (the one-pass branch ran)
        with patch.object(sources_module, "_whole_origins", lambda *args: None):
            general = sources_module._sources(plan, ckpt)
        assert fast.origins == general.origins
        assert fast.computed() == general.computed() == []
        assert fast.copied == general.copied
        assert fast.where == general.where
        names = [o.name for o in plan.outputs]
        assert [fast.ranges(n) for n in names] == [general.ranges(n) for n in names]


@pytest.mark.parametrize("shape", [(8192, 2, 128), (64, 2, 128), (4, 2, 256)])
def test_sub_byte_splits_and_merges_along_whole_bytes_copy_whatever_their_count(
    tmp_path: Path, shape: tuple[int, int, int]
) -> None:
    # F4 packs two elements a byte. The split's ranges are whole bytes (64 a row here), but
    # 8192 of them went to the computed path (many small copies cost more than computing),
    # which cannot compute F4; and a split of the last dim was measured one index (4 bits)
    # at a time and refused. Both now copy the bytes, and the merge puts them back.
    rows, parts, cols = shape
    size = rows * parts * cols // 2
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    folder = tmp_path / "in"
    folder.mkdir()
    write_raw(folder / "model.safetensors", {"w": entry("F4", list(shape), 0, size)}, data)
    split = tmp_path / "split.wm"
    split.write_text('weightmap 1\nchunk "w" dim 1 -> "w.a", "w.b"\n')
    weightmap.remap(folder, tmp_path / "out", mapping=split, progress=False)

    def tensor(path: Path, name: str) -> bytes:
        header = read_header(path)
        info = header.tensors[name]
        raw = path.read_bytes()
        return raw[header.data_start + info.begin : header.data_start + info.end]

    out = tmp_path / "out" / "model.safetensors"
    half = cols // 2  # bytes of one part of one row
    for k, name in enumerate(("w.a", "w.b")):
        expected = b"".join(
            data[(r * parts + k) * half : (r * parts + k + 1) * half] for r in range(rows)
        )
        assert tensor(out, name) == expected
    merge = tmp_path / "merge.wm"
    merge.write_text('weightmap 1\nmerge "w.{p:a,b}" dim 1 -> "w"\n')
    weightmap.remap(tmp_path / "out", tmp_path / "back", mapping=merge, progress=False)
    assert tensor(tmp_path / "back" / "model.safetensors", "w") == data


def test_a_sub_byte_split_of_the_last_dim_at_a_whole_byte_is_copied(tmp_path: Path) -> None:
    # One index of the last dim of an F4 tensor is 4 bits, so the split was refused, though
    # each half of a row is 64 whole bytes.
    data = bytes(range(256)) * 2
    folder = tmp_path / "in"
    folder.mkdir()
    write_raw(folder / "model.safetensors", {"w": entry("F4", [4, 256], 0, 512)}, data)
    mapping = tmp_path / "m.wm"
    mapping.write_text('weightmap 1\nchunk "w" dim 1 -> "w.a", "w.b"\n')
    weightmap.remap(folder, tmp_path / "out", mapping=mapping, progress=False)
    out = tmp_path / "out" / "model.safetensors"
    header, raw = read_header(out), out.read_bytes()
    for k, name in enumerate(("w.a", "w.b")):
        info = header.tensors[name]
        got = raw[header.data_start + info.begin : header.data_start + info.end]
        assert info.shape == (4, 128)
        assert got == b"".join(data[r * 128 + k * 64 : r * 128 + (k + 1) * 64] for r in range(4))


def test_a_sub_byte_split_through_a_byte_is_refused_before_writing(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    write_raw(folder / "model.safetensors", {"w": entry("F4", [2, 3], 0, 3)}, b"\x12\x34\x56")
    mapping = tmp_path / "m.wm"
    mapping.write_text('weightmap 1\nsplit "w" dim 1 sizes [1, 2] -> "w.a", "w.b"\n')
    with pytest.raises((ExecutionError, PlanError), match="F4"):
        weightmap.remap(folder, tmp_path / "out", mapping=mapping, progress=False)
    assert not (tmp_path / "out").exists()


def test_region_copies_go_into_the_same_scratch_slots_chunk_after_chunk() -> None:
    """The rotary permute of joined ranks (concat, reshape, permute, reshape): its two copies
    per chunk go into the computer's buffers, the same slots for every chunk, and the values
    are those computed without them."""
    full = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
    inputs = {"r0": full[:32], "r1": full[32:]}
    joined = Concat(
        dtype="F32",
        shape=(64, 6),
        srcs=(Source.of("r0", "F32", (32, 6)), Source.of("r1", "F32", (32, 6))),
        dim=0,
    )
    heads = Reshape(dtype="F32", shape=(4, 8, 2, 6), src=joined)
    swapped = Permute(dtype="F32", shape=(4, 2, 8, 6), src=heads, perm=(0, 2, 1, 3))
    top = Reshape(dtype="F32", shape=(64, 6), src=swapped)
    expected = full.view(4, 8, 2, 6).permute(0, 2, 1, 3).reshape(64, 6)
    taken: list[list[int]] = []

    def buffers(dtype: torch.dtype, shape: tuple[int, ...], slot: int) -> torch.Tensor:
        taken[-1].append(slot)
        return torch.full(shape, -1.0, dtype=dtype)  # (stale values must not show)

    for lo in range(0, 64, 24):
        hi = min(64, lo + 24)
        taken.append([])
        with scratch(buffers):
            got = region(top, 0, lo, hi, inputs.__getitem__, "t").clone()
        assert torch.equal(got, expected[lo:hi])
        assert torch.equal(region(top, 0, lo, hi, inputs.__getitem__, "t"), expected[lo:hi])
    # (A slot taken by the region computed outside ``scratch`` would show in its chunk's list.)
    assert taken[0] and all(t == taken[0] for t in taken), taken


def test_a_thread_keeps_the_most_one_chunk_took_not_each_slots_largest() -> None:
    """A join's output buffer (one slot) and a rotary permute's two copies (two other slots)
    are never live in the same chunk: the thread's block grows to the larger of the two
    chunks, not to the sum of every slot's largest; buffers of one chunk never overlap."""
    mib = 2**20
    arena = _Arena()

    def chunk(*sizes: int) -> list[torch.Tensor]:
        arena.start()
        return [arena.take(size * mib, slot) for slot, size in enumerate(sizes, start=8)]

    def spans(rooms: list[torch.Tensor]) -> list[tuple[int, int]]:
        return sorted((r.data_ptr(), r.data_ptr() + r.numel()) for r in rooms)

    (join,) = chunk(8)
    assert join.numel() == 8 * mib and arena.block is not None
    first = arena.block.data_ptr()
    permute = chunk(3, 4)  # fits in the join's block: no new memory
    assert arena.block.data_ptr() == first
    assert all(first <= lo and hi <= first + arena.block.numel() for lo, hi in spans(permute))
    (a, b), (c, d) = spans(permute)
    assert b <= c  # (distinct bytes)
    wider = chunk(5, 5)  # the second does not fit: its own tensor, the block grows next chunk
    (a, b), (c, d) = spans(wider)
    assert b <= c or d <= a
    again = chunk(5, 5)
    assert arena.block.numel() >= 10 * mib
    assert all(
        arena.block.data_ptr() <= lo and hi <= arena.block.data_ptr() + arena.block.numel()
        for lo, hi in spans(again)
    )
    assert arena.block.numel() < (8 + 5 + 5) * mib  # what a buffer per slot would keep
    # A slot taken twice in one chunk gets the same bytes when they are enough.
    arena.start()
    assert arena.take(mib, 0).data_ptr() == arena.take(mib // 2, 0).data_ptr()
    # With the chunk budget reserved (pages untouched until a chunk writes them), chunks
    # within it never grow the block nor get tensors of their own.
    reserved = _Arena(12 * mib)
    reserved.start()
    reserved.take(8 * mib, 0)
    assert reserved.block is not None and reserved.block.numel() == 12 * mib
    block = reserved.block.data_ptr()
    reserved.start()
    rooms = [reserved.take(5 * mib, 8), reserved.take(5 * mib, 9)]
    assert reserved.block.data_ptr() == block
    assert all(block <= r.data_ptr() < block + 12 * mib for r in rooms)
