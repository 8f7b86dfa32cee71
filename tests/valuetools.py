"""Helpers of the value-rule tests: a checkpoint saved from tensors, and a conversion run by
the streaming executor at several chunk sizes and by the in-memory one, which must agree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import weightmap
from weightmap.execute.streaming import execute
from weightmap.inputs.checkpoint import Checkpoint


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as integers, so NaNs and fp8 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def save_checkpoint(root: Path, tensors: dict[str, torch.Tensor], config: Any = None) -> Path:
    """``tensors`` as ``root/model.safetensors`` (and ``config`` as its config.json)."""
    root.mkdir(parents=True)
    save_file(tensors, root / "model.safetensors")
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


def run_every_way(
    root: Path,
    *,
    chunks: tuple[int, ...],
    mapping: str | None = None,
    preset: str | None = None,
    params: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Convert streamed at every chunk size and in memory; all must agree; return one."""
    how: dict[str, Any] = {"mapping": mapping} if preset is None else {"preset": preset}
    plan = weightmap.compile(root, params=params, **how)
    memory = {k: v.clone() for k, v in weightmap.iter_tensors(root, params=params, **how)}
    for i, chunk in enumerate(chunks):
        dest = root.parent / f"{root.name}-out{i}"
        with Checkpoint.open(root) as ckpt:
            execute(plan, ckpt, dest, chunk_bytes=chunk, workers=2, overwrite=True)
        streamed = load_file(dest / "model.safetensors")
        assert streamed.keys() == memory.keys()
        for name, t in streamed.items():
            assert t.dtype == memory[name].dtype, name
            assert torch.equal(as_bytes(t), as_bytes(memory[name])), (name, chunk)
    return memory
