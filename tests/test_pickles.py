"""PyTorch checkpoints as inputs: byte ranges in the zip archive, views where there are none,
and one-line refusals of what cannot be read without running code."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import weightmap
from races import swap_after_check
from weightmap.errors import CheckpointError
from weightmap.inputs import checkpoint as checkpoint_module
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.inputs.diff import diff_checkpoints

KEEP_ALL = "weightmap 1\nunmatched keep\n"


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    return {
        "embed.weight": base,
        "lm_head.weight": base,  # tied: one storage
        "row": base[2],  # a slice: a range inside that storage
        "transposed": base.t(),  # strided: no byte range
        "half": torch.randn(3, 5).to(torch.bfloat16),
        "ids": torch.arange(7),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(2.5),
    }


def test_tensors_are_byte_ranges_of_the_archive(tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.format == "pytorch"
        raw = (tmp_path / "pytorch_model.bin").read_bytes()
        for name, t in state.items():
            assert ckpt.tensors[name].shape == tuple(t.shape)
            assert torch.equal(ckpt.view(name), t)
            if name == "transposed":
                assert not ckpt.has_range(name)
                continue
            loc = ckpt.location(name)
            expected = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert raw[loc.offset : loc.offset + loc.length] == expected, name
        shared = ckpt.location("embed.weight"), ckpt.location("lm_head.weight")
        assert shared[0] == shared[1]


def test_conversion_is_exact_and_copies_in_the_kernel(tmp_path: Path) -> None:
    state = _state()
    (tmp_path / "in").mkdir()
    torch.save(state, tmp_path / "in" / "model.pt")
    mapping = 'weightmap 1\nrename "embed.weight" -> "model.embed_tokens.weight"\nunmatched keep\n'
    result = weightmap.remap(tmp_path / "in", tmp_path / "out", mapping=mapping, verify=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["model.embed_tokens.weight"], state["embed.weight"])
    for name in set(state) - {"embed.weight"}:
        assert torch.equal(out[name], state[name]), name
    # Everything but the strided tensor went through the kernel (copied or cloned).
    assert result.bytes_computed == state["transposed"].nbytes
    # diff reads the strided tensor through its view.
    with Checkpoint.open(tmp_path / "in") as a, Checkpoint.open(tmp_path / "in") as b:
        assert diff_checkpoints(a, b).equal == len(state)
    plain = weightmap.remap(tmp_path / "in", tmp_path / "same", mapping=KEEP_ALL)
    with Checkpoint.open(tmp_path / "in") as a, Checkpoint.open(tmp_path / "same") as b:
        assert diff_checkpoints(a, b).same and plain.bytes_written


def test_a_cast_reads_the_archive_in_chunks(tmp_path: Path) -> None:
    """Computed from the mapped archive a few rows at a time, its pages released as it goes."""
    torch.manual_seed(1)
    state = {"w": torch.randn(300, 64), "v": torch.randn(50, 7), "t": torch.randn(9, 33).t()}
    (tmp_path / "in").mkdir()
    torch.save(state, tmp_path / "in" / "pytorch_model.bin")
    mapping = 'weightmap 1\ncast "**" to bf16\n'
    weightmap.remap(tmp_path / "in", tmp_path / "out", mapping=mapping, chunk_bytes=4096)
    out = load_file(tmp_path / "out" / "model.safetensors")
    for name, t in state.items():
        assert torch.equal(out[name], t.to(torch.bfloat16)), name


def test_training_checkpoints_keep_weights_one_level_down(tmp_path: Path) -> None:
    optimizer = {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1}]}
    weights = {"w": torch.arange(4.0)}
    torch.save({"optimizer": optimizer, "model": weights, "epoch": 3}, tmp_path / "last.pt")
    with Checkpoint.open(tmp_path / "last.pt") as ckpt:
        assert list(ckpt.tensors) == ["w"]
        # The optimizer's storages sit in the archive too; the weights are still byte ranges.
        assert ckpt.has_range("w")
        loc = ckpt.location("w")
        raw = (tmp_path / "last.pt").read_bytes()[loc.offset : loc.offset + loc.length]
        assert raw == weights["w"].numpy().tobytes()


def _save_legacy(path: Path) -> None:
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)


@pytest.mark.parametrize(
    ("obj", "rule", "message"),
    [
        (_save_legacy, "pickle-legacy", "legacy (pre-1.6, non-zip) format"),
        (
            {"w": torch.ones(2), "args": argparse.Namespace(lr=1)},
            "pickle-code",
            "holds objects that loading would have to run code for (argparse.Namespace)",
        ),
        # A module torch blocks outright is worded otherwise (torch 2.13): named all the same.
        (
            {"w": torch.ones(2), "run": os.system},
            "pickle-code",
            "holds objects that loading would have to run code for (posix.system)",
        ),
        ([torch.ones(2)], "pickle", "holds a list, not a dict of tensors"),
        ({"w": torch.ones(2, dtype=torch.complex128)}, "pickle", "which safetensors has no name"),
        ({"w": torch.ones(2), "step": 3}, "pickle", "1 entry ('step') are not tensors"),
    ],
)
def test_refusals_are_one_line(tmp_path: Path, obj: object, rule: str, message: str) -> None:
    path = tmp_path / "pytorch_model.bin"
    if callable(obj):
        obj(path)
    else:
        torch.save(obj, path)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == rule and message in str(info.value)
    r = subprocess.run(
        [sys.executable, "-m", "weightmap", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and message in r.stderr


def test_sharded_bin_index_is_checked(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.ones(2)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    index = {"weight_map": {"a": "pytorch_model-00001-of-00002.bin"}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "unindexed-shard"
    index["weight_map"]["b"] = "pytorch_model-00002-of-00002.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with Checkpoint.open(tmp_path) as ckpt:
        assert sorted(ckpt.tensors) == ["a", "b"]


def test_inplace_is_refused_for_pytorch(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="in-place renames rewrite safetensors headers"):
        weightmap.remap(tmp_path, mapping='weightmap 1\nrename "a" -> "b"\n', inplace=True)


META = """weightmap 1
config from "params.json"
rename "layers.{n}.attention.w{p:q,k,v,o}.weight" -> "model.layers.{n}.self_attn.{p}_proj.weight"
rename "tok_embeddings.weight" -> "model.embed_tokens.weight"
rename "norm.weight" -> "model.norm.weight"
rename "output.weight" -> "lm_head.weight"
drop? "rope.freqs"
config {
    model_type = "llama"
    hidden_size = config.dim
    num_attention_heads = config.n_heads
    delete dim, n_heads
}
"""


def _meta(folder: Path, shards: int) -> None:
    folder.mkdir()
    (folder / "params.json").write_text(json.dumps({"dim": 8, "n_heads": 2}))
    (folder / "tokenizer.model").write_bytes(b"\x0a\x03spm")
    for i in range(shards):
        state = {f"layers.0.attention.w{p}.weight": torch.randn(8, 8) for p in "qkvo"}
        state |= {"tok_embeddings.weight": torch.randn(5, 8), "norm.weight": torch.ones(8)}
        state |= {"output.weight": torch.randn(5, 8), "rope.freqs": torch.ones(4)}
        torch.save(state, folder / f"consolidated.{i:02d}.pth")


def test_meta_consolidated_with_params_json(tmp_path: Path) -> None:
    _meta(tmp_path / "meta", 1)
    result = weightmap.remap(tmp_path / "meta", tmp_path / "hf", mapping=META)
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2}
    # params.json is replaced by config.json; the tokenizer travels.
    assert sorted(f.name for f in result.plan.files) == ["tokenizer.model"]
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(out / "model.safetensors")


def test_meta_model_parallel_shards_are_refused(tmp_path: Path) -> None:
    _meta(tmp_path / "meta", 2)
    for target in (tmp_path / "meta", tmp_path / "meta" / "consolidated.00.pth"):
        with pytest.raises(CheckpointError) as info:
            weightmap.compile(target, mapping=META)
        assert info.value.rule == "model-parallel"
        assert "consolidated.00.pth ... consolidated.01.pth" in str(info.value)


def test_config_from_a_missing_file(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"reads its config from params\.json"):
        weightmap.compile(tmp_path, mapping='weightmap 1\nconfig from "params.json"\nkeep "a"\n')
    assert os.listdir(tmp_path) == ["model.pt"]


def test_damaged_archives_are_refused_with_our_errors(tmp_path: Path) -> None:
    """Bytes flipped, files cut short or spliced: a valid checkpoint or a CheckpointError,
    never another exception."""
    import random
    import warnings

    torch.save(
        {"a": torch.arange(10.0), "b": torch.ones(3, 4, dtype=torch.bfloat16)}, tmp_path / "o"
    )
    original = (tmp_path / "o").read_bytes()
    rng = random.Random(0)
    target = tmp_path / "model.pt"
    for _ in range(300):
        data = bytearray(original)
        kind = rng.random()
        if kind < 0.5:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind < 0.8:
            data = data[: rng.randrange(len(data))]
        else:
            at = rng.randrange(len(data))
            data[at:at] = rng.randbytes(rng.randint(1, 50))
        target.write_bytes(bytes(data))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Checkpoint.open(target) as ckpt:
                    for name in ckpt:
                        ckpt.view(name).sum()
        except CheckpointError:
            pass


def test_conjugated_and_negated_views_are_written_as_their_values(tmp_path: Path) -> None:
    # torch keeps conj() and neg() of some tensors as a bit on a view of the same storage:
    # the bytes in the archive are the values before it, so they are no byte range to copy.
    src = tmp_path / "src"
    src.mkdir()
    complex_values = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    plain = torch.arange(1.0, 5.0)
    torch.save(
        {"c": complex_values.conj(), "n": torch._neg_view(plain), "p": plain},
        src / "pytorch_model.bin",
    )
    ckpt = Checkpoint.open(src)
    assert {"c", "n"} <= ckpt.strided and "p" not in ckpt.strided
    r = weightmap.remap(src, tmp_path / "out", mapping=KEEP_ALL, verify=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["c"], complex_values.conj().resolve_conj())
    assert torch.equal(out["n"], -plain) and torch.equal(out["p"], plain)
    assert weightmap.verify(tmp_path / "out", r.plan, source=src) == []


@pytest.mark.parametrize(
    ("value", "rule", "message"),
    [
        (lambda: torch.eye(3).to_sparse(), "pickle", "is not a dense tensor (torch.sparse_coo)"),
        (lambda: torch.eye(3).to_sparse_csr(), "pickle", "is not a dense tensor"),
        (
            lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "pickle",
            "is a nested tensor",
        ),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tensors_without_plain_storage_are_refused(
    tmp_path: Path, value: Callable[[], torch.Tensor], rule: str, message: str
) -> None:
    torch.save({"w": value()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == rule and message in str(info.value)


def test_names_that_are_no_utf8_are_refused(tmp_path: Path) -> None:
    torch.save({"\ud800x": torch.ones(2), "good": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "header-utf8" and "lone surrogate" in str(info.value)


def test_a_zero_stride_tensor_past_the_file_is_refused_leaving_nothing(tmp_path: Path) -> None:
    # 2**64 bytes from one stored value: the writer crashed with OverflowError at ftruncate
    # and left its temporary folder behind.
    src = tmp_path / "src"
    src.mkdir()
    huge = torch.zeros(1, dtype=torch.float64).as_strided((2**30, 2**31), (0, 0))
    torch.save({"w": torch.ones(2), "huge": huge}, src / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(src)
    assert info.value.rule == "overflow" and "past 2**63" in str(info.value)
    out = tmp_path / "out"
    (tmp_path / "keep.wm").write_text(KEEP_ALL)
    command = ["convert", str(src), str(out), "--mapping", str(tmp_path / "keep.wm")]
    r = subprocess.run(
        [sys.executable, "-m", "weightmap", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "'huge'" in r.stderr and "[overflow]" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.wm", "src"]


def test_compressed_members_are_refused_by_name(tmp_path: Path) -> None:
    import zipfile

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(1000)}, plain)
    src = tmp_path / "src"
    src.mkdir()
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(src / "pytorch_model.bin", "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/data.pkl"):  # deflated, as no torch.save writes it
                zout.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED)
            else:
                zout.writestr(info, data)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(src)
    assert info.value.rule == "pickle-compressed"
    assert "member 'plain/data.pkl' is compressed" in str(info.value)


def test_an_indexed_shard_swapped_for_a_link_after_its_check_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shard = src / "pytorch_model-00001-of-00001.bin"
    torch.save({"a": torch.ones(2)}, shard)
    index = {"weight_map": {"a": shard.name}}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    outside = tmp_path / "someone-elses.bin"
    torch.save({"a": torch.full((2,), 7.0)}, outside)
    swapped = swap_after_check(monkeypatch, shard, outside)  # (right after the name's check)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(src)
    # (Refused by whichever check sees the link first: the weight file's own, or the open's.)
    assert swapped and info.value.rule in ("shard-escape", "link-escape")


def test_a_shard_swapped_for_a_link_between_the_opens_check_and_the_open_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap after every check by name, as the open resolves the path it then opens: the
    open follows no link on that path, and says the file changed."""
    src = tmp_path / "src"
    src.mkdir()
    shard = src / "pytorch_model.bin"
    torch.save({"a": torch.ones(2)}, shard)
    outside = tmp_path / "someone-elses.bin"
    torch.save({"a": torch.full((2,), 7.0)}, outside)
    # (The resolution whose result is checked, then opened: the weight file's, checkpoint.py.)
    swapped = swap_after_check(monkeypatch, shard, outside, checkpoint_module, "resolve_path")
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(src)
    assert swapped and info.value.rule == "changed"
