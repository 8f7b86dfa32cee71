"""On copy-on-write filesystems (loop-mounted XFS with reflink, and btrfs): unchanged bytes
are cloned, the output shares the input's extents, and its bytes are right.

Skipped, with the reason, where a filesystem image cannot be mounted (not root, mkfs.xfs or
mkfs.btrfs missing, no loop device).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap

from conftest import cow_mount, cowfs

BLOCK = 4096


@pytest.fixture(scope="module", params=cowfs.KINDS)
def fs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from cow_mount(str(request.param), tmp_path_factory)


def _drafter(root: Path) -> dict[str, torch.Tensor]:
    """A small EAGLE-3-shaped drafter: sizes that are not multiples of the block."""
    gen = torch.Generator().manual_seed(1)
    h = 200
    tensors = {
        "d2t": torch.arange(333, dtype=torch.int64),
        "t2d": torch.ones(1001, dtype=torch.bool),
        "embed_tokens.weight": torch.randn(1001, h, generator=gen).to(torch.bfloat16),
        "fc.weight": torch.randn(h, 3 * h, generator=gen).to(torch.bfloat16),
        "layers.0.self_attn.q_proj.weight": torch.randn(h, 2 * h, generator=gen).to(torch.bfloat16),
        "layers.0.input_layernorm.weight": torch.randn(h, generator=gen).to(torch.bfloat16),
        "layers.0.mlp.down_proj.weight": torch.randn(h, 3 * h, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(517, h, generator=gen).to(torch.bfloat16),
    }
    root.mkdir()
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    return tensors


RENAME = 'weightmap 1\nrename "layers.0.{r*}" -> "midlayer.{r}"\nunmatched keep\n'


def test_rename_clones_and_shares_the_input_extents(fs: Path) -> None:
    src = fs / "in-rename"
    tensors = _drafter(src)
    result = weightmap.remap(src, fs / "out-rename", mapping=RENAME, progress=False)
    out = fs / "out-rename" / "model.safetensors"
    # All but the block holding the new header is cloned.
    assert result.bytes_cloned >= result.bytes_written - BLOCK
    assert result.bytes_cloned + result.bytes_copied == result.bytes_written
    shared = cowfs.shared_bytes(out)
    assert shared >= result.bytes_cloned
    assert shared >= out.stat().st_size - BLOCK
    got = load_file(out)
    for name, t in tensors.items():
        assert torch.equal(got[name.replace("layers.0.", "midlayer.")], t)


def test_reference_layout_copies_where_offsets_differ(fs: Path) -> None:
    src = fs / "in-ref"
    _drafter(src)
    result = weightmap.remap(
        src, fs / "out-ref", mapping=RENAME, progress=False, layout="reference"
    )
    # The reference layout reorders the renamed tensors and pads the header to 8 only: what
    # happens to line up still clones, the rest is copied, and the bytes are the same.
    assert result.bytes_copied > 0
    clone = weightmap.remap(src, fs / "out-clone", mapping=RENAME, progress=False)
    assert clone.bytes_cloned > result.bytes_cloned
    a, b = (
        load_file(fs / "out-ref" / "model.safetensors"),
        load_file(fs / "out-clone" / "model.safetensors"),
    )
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_mixed_cast_and_keep_clones_what_it_keeps(fs: Path) -> None:
    src = fs / "in-mixed"
    tensors = _drafter(src)
    mapping = 'weightmap 1\ncast "fc.weight" to f32\nunmatched keep\n'
    result = weightmap.remap(src, fs / "out-mixed", mapping=mapping, progress=False, verify=True)
    assert result.bytes_computed == tensors["fc.weight"].numel() * 4
    assert result.bytes_cloned > 0
    got = load_file(fs / "out-mixed" / "model.safetensors")
    assert torch.equal(got["fc.weight"], tensors["fc.weight"].float())
    assert torch.equal(got["embed_tokens.weight"], tensors["embed_tokens.weight"])


def test_sharded_many_tensor_rename_clones_every_shard(fs: Path) -> None:
    src = fs / "in-moe"
    src.mkdir()
    gen = torch.Generator().manual_seed(2)
    weight_map = {}
    for i in range(3):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        shard = {
            f"model.layers.{i}.mlp.experts.{e}.w": torch.randn(37, 61, generator=gen)
            for e in range(40)
        }
        save_file(shard, src / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    mapping = 'weightmap 1\nrename "model.layers.{i:int}.{r*}" -> "layers.{i}.{r}"\n'
    result = weightmap.remap(src, fs / "out-moe", mapping=mapping, progress=False)
    assert len(result.paths) == 3  # one output shard per input file
    assert result.bytes_cloned >= result.bytes_written - 3 * 2 * BLOCK
    for path in result.paths:
        assert cowfs.shared_bytes(path) >= path.stat().st_size - 2 * BLOCK
