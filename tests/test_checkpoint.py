"""Checkpoints: layouts, index cross-checks, hostile shard names, zero-copy views."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightmap.errors import CheckpointError, FormatError
from weightmap.inputs.checkpoint import Checkpoint

from sftools import entry, write_raw


def _shards(root: Path) -> None:
    save_file({"a": torch.arange(4.0), "b": torch.ones(2, 2)}, root / "s1.safetensors")
    save_file({"c": torch.arange(3, dtype=torch.int32)}, root / "s2.safetensors")


def _index(root: Path, weight_map: dict[str, object], **extra: object) -> None:
    doc = {"metadata": {"total_size": 36}, "weight_map": weight_map, **extra}
    (root / "model.safetensors.index.json").write_text(json.dumps(doc))


GOOD_MAP = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}


def test_example_has_16_tensors(example: Path) -> None:
    with Checkpoint.open(example) as ckpt:
        assert len(ckpt) == 16
        assert ckpt.config is not None
        assert ckpt.config["speculators_model_type"] == "eagle3"
        assert ckpt.tensors["t2d"].dtype == "BOOL"


def test_open_single_file_uses_sibling_config(example: Path) -> None:
    ckpt = Checkpoint.open(example / "model.safetensors")
    assert ckpt.config is not None and len(ckpt) == 16


def test_sharded(tmp_path: Path) -> None:
    _shards(tmp_path)
    _index(tmp_path, GOOD_MAP)
    with Checkpoint.open(tmp_path) as ckpt:
        assert [p.name for p in ckpt.files] == ["s1.safetensors", "s2.safetensors"]
        assert ckpt.file_of("c").name == "s2.safetensors"
        assert torch.equal(ckpt.view("c"), torch.arange(3, dtype=torch.int32))
        assert ckpt.config is None


def test_view_is_zero_copy_and_location_matches(tmp_path: Path) -> None:
    t = torch.randn(16, 8).to(torch.bfloat16)
    save_file({"w": t}, tmp_path / "model.safetensors")
    with Checkpoint.open(tmp_path) as ckpt:
        v = ckpt.view("w")
        assert v.dtype == torch.bfloat16 and torch.equal(v, t)
        loc = ckpt.location("w")
        raw = (tmp_path / "model.safetensors").read_bytes()[loc.offset : loc.offset + loc.length]
        assert raw == t.view(torch.uint8).numpy().tobytes()


def test_view_special_dtypes(tmp_path: Path) -> None:
    f4 = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    save_file({"f4": f4, "e": torch.zeros(0, 3)}, tmp_path / "model.safetensors")
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.tensors["f4"].shape == (2, 4)  # the header holds the logical shape
        assert ckpt.view("f4").view(torch.uint8).tolist() == [[1, 2], [3, 4]]
        assert ckpt.view("e").shape == (0, 3)


def test_view_of_a_dtype_this_torch_lacks_is_raw_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # float8_e8m0fnu and float4_e2m1fn_x2 came with torch 2.7 and 2.8 (pyproject allows older):
    # view() raised a bare TypeError there, midway through iter_tensors.
    f4 = torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    e8 = torch.tensor([127, 128], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file({"f4": f4, "e8": e8}, tmp_path / "model.safetensors")
    monkeypatch.delattr(torch, "float4_e2m1fn_x2")
    monkeypatch.delattr(torch, "float8_e8m0fnu")
    with Checkpoint.open(tmp_path) as ckpt:
        for name, raw in (("f4", [1, 2, 3, 4]), ("e8", [127, 128])):
            view = ckpt.view(name)
            assert view.dtype == torch.uint8 and view.tolist() == raw


@pytest.mark.parametrize(
    "shard",
    ["../s1.safetensors", "/etc/passwd", "sub/s1.safetensors", "..", "", "a\\b.safetensors"],
)
def test_index_refuses_paths(tmp_path: Path, shard: str) -> None:
    _shards(tmp_path)
    _index(tmp_path, {**GOOD_MAP, "a": shard})
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "shard-name"


def test_index_refuses_escaping_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    _shards(outside)
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink(outside / "s1.safetensors", root / "s1.safetensors")
    save_file({"c": torch.arange(3, dtype=torch.int32)}, root / "s2.safetensors")
    _index(root, GOOD_MAP)
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(root)
    assert info.value.rule == "shard-escape"


def test_hub_cache_symlinks_allowed(tmp_path: Path) -> None:
    blobs = tmp_path / "repo" / "blobs"
    snap = tmp_path / "repo" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    _shards(blobs)
    for name in ("s1.safetensors", "s2.safetensors"):
        os.symlink(blobs / name, snap / name)
    _index(snap, GOOD_MAP)
    assert len(Checkpoint.open(snap)) == 3


def test_index_missing_shard(tmp_path: Path) -> None:
    _shards(tmp_path)
    _index(tmp_path, {**GOOD_MAP, "d": "s3.safetensors"})
    with pytest.raises(CheckpointError, match=r"s3\.safetensors") as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "missing-shard"


@pytest.mark.parametrize(
    ("weight_map", "text"),
    [
        ({**GOOD_MAP, "z": "s1.safetensors"}, "'z' is in the index but in no shard"),
        ({"a": "s1.safetensors", "c": "s2.safetensors"}, "'b' is stored in s1.safetensors"),
        ({**GOOD_MAP, "c": "s1.safetensors", "x": "s2.safetensors"}, "indexed in s1"),
    ],
    ids=["tensor-absent", "tensor-unindexed", "wrong-shard"],
)
def test_index_mismatch(tmp_path: Path, weight_map: dict[str, object], text: str) -> None:
    _shards(tmp_path)
    _index(tmp_path, weight_map)
    with pytest.raises(CheckpointError, match=text) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "index-mismatch"


@pytest.mark.parametrize(
    "weight_map",
    [
        # The same tensor in two shards: the last would otherwise count, silently.
        '{"a": "s1.safetensors", "b": "s1.safetensors", "c": "s1.safetensors", '
        '"c": "s2.safetensors"}',
        # Twice in the same shard, and a space before the colons (the keys counted again).
        '{"a" : "s1.safetensors", "b" : "s1.safetensors", "b" : "s1.safetensors", '
        '"c" : "s2.safetensors"}',
        # Only the second of the two spaced: the count of `":` is one short, the keys even.
        '{"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors", '
        '"c" : "s1.safetensors"}',
    ],
    ids=["two-shards", "one-shard-spaced", "one-spaced"],
)
def test_index_naming_a_tensor_twice_is_refused(tmp_path: Path, weight_map: str) -> None:
    _shards(tmp_path)
    text = '{"metadata": {"total_size": 36}, "weight_map": ' + weight_map + "}"
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"key 'c' twice|key 'b' twice") as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "json-duplicate-key"


def test_index_with_a_quote_colon_inside_a_name_is_read(tmp_path: Path) -> None:
    # (`\":` in a string is counted as a key by the quick count: decoded again, no key twice.)
    save_file({'x":y': torch.zeros(1)}, tmp_path / "s1.safetensors")
    _index(tmp_path, {'x":y': "s1.safetensors"})
    assert list(Checkpoint.open(tmp_path)) == ['x":y']


def test_unreferenced_files_are_ignored(tmp_path: Path) -> None:
    # Hub repositories often ship a consolidated file beside the shards; the index decides.
    _shards(tmp_path)
    _index(tmp_path, GOOD_MAP)
    save_file({"zz": torch.zeros(1)}, tmp_path / "consolidated.safetensors")
    assert sorted(Checkpoint.open(tmp_path)) == ["a", "b", "c"]


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, tmp_path / "s1.safetensors")
    save_file({"a": torch.zeros(1)}, tmp_path / "s2.safetensors")
    _index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "duplicate-name"


@pytest.mark.parametrize(
    ("content", "rule"),
    [
        ("[1, 2]", "index"),
        ('{"weight_map": []}', "index"),
        ("{nope", "json"),
        (b"\xff\xfe", "json"),
    ],
)
def test_bad_index_file(tmp_path: Path, content: str | bytes, rule: str) -> None:
    _shards(tmp_path)
    p = tmp_path / "model.safetensors.index.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == rule


@pytest.mark.parametrize("content", ['["not", "an", "object"]', "3", "null"])
def test_config_not_an_object(tmp_path: Path, content: str) -> None:
    save_file({"a": torch.zeros(1)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match="not an object") as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "config"


def test_folder_without_checkpoint(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, tmp_path / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"found weights\.safetensors") as info:
        Checkpoint.open(tmp_path)
    assert info.value.rule == "layout"
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path / "nothing")


def test_bad_shard_header_is_reported_with_its_file(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, tmp_path / "s1.safetensors")
    write_raw(tmp_path / "s2.safetensors", {"b": entry("F32", [2], 0, 8)}, b"\0" * 4)
    _index(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"})
    with pytest.raises(FormatError, match=r"s2\.safetensors.*truncated"):
        Checkpoint.open(tmp_path)


def test_file_changed_after_open_is_detected(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4)}, tmp_path / "model.safetensors")
    ckpt = Checkpoint.open(tmp_path)
    with (tmp_path / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(FormatError, match="changed since it was opened"):
        ckpt.view("a")


def test_a_config_integer_python_will_not_read_is_named_with_a_fix(tmp_path: Path) -> None:
    # Valid JSON: the message said "not valid JSON" and advised sys.set_int_max_str_digits().
    from weightmap.format.text import read_json_file

    path = tmp_path / "config.json"
    path.write_text('{"x": ' + "9" * 5000 + "}")
    with pytest.raises(CheckpointError, match="holds an integer of more than 4300 digits") as info:
        read_json_file(path, "config.json")
    assert "set_int_max_str_digits" not in str(info.value) and info.value.rule == "json"
