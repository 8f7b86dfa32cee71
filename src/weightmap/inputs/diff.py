"""Comparing two checkpoints tensor by tensor, in bounded memory."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from weightmap.format.text import field_path, same_json
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.inputs.sidefiles import list_side_files, open_side_file

__all__ = ["CheckpointDiff", "config_diff", "diff_checkpoints", "files_diff"]

_BLOCK = 16 * 2**20  # bytes compared at a time: memory stays at two blocks


@dataclass
class CheckpointDiff:
    """How two checkpoints differ. ``same`` is True when nothing does."""

    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[tuple[str, str, str]] = field(default_factory=list)  # name, a, b (dtype/shape)
    bytes_differ: list[str] = field(default_factory=list)
    equal: int = 0
    config: list[str] = field(default_factory=list)
    # The folders' side files (tokenizer, generation config...): "- name" only in A, "+ name"
    # only in B, "~ name" with other bytes; ``files_equal`` counts the identical ones.
    files: list[str] = field(default_factory=list)
    files_equal: int = 0

    @property
    def same(self) -> bool:
        """True when the checkpoints hold the same tensors, bytes, config and side files."""
        return not (
            self.only_a
            or self.only_b
            or self.changed
            or self.bytes_differ
            or self.config
            or self.files
        )


def _json(value: Any) -> str:
    # Values as config.json writes them (false, null), as `weightmap plan` shows them.
    return json.dumps(value, ensure_ascii=False)


def config_diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Each field where config ``b`` differs from ``a``: ``- path: value`` (only in ``a``),
    ``+ path: value`` (only in ``b``), ``~ path: a -> b``; JSON equality, key order aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            where = field_path(path, key)
            if key not in b:
                out.append(f"- {where}: {_json(a[key])}")
            elif key not in a:
                out.append(f"+ {where}: {_json(b[key])}")
            else:
                out += config_diff(a[key], b[key], where)
        return out
    return [] if same_json(a, b) else [f"~ {path or '<config>'}: {_json(a)} -> {_json(b)}"]


def _same_views(a: Checkpoint, b: Checkpoint, name: str) -> bool:
    """For a tensor that is no byte range of its file (strided in a PyTorch checkpoint):
    compared through views, a block of rows at a time."""
    import torch

    va, vb = a.view(name), b.view(name)
    if va.dim() == 0 or va.numel() == 0:
        return bool(torch.equal(va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8)))
    rows = max(1, _BLOCK // max(1, va[0].numel() * va.element_size()))
    for i in range(0, va.shape[0], rows):
        xa, xb = va[i : i + rows].contiguous(), vb[i : i + rows].contiguous()
        if not torch.equal(xa.view(torch.uint8), xb.view(torch.uint8)):
            return False
    return True


def _same_bytes(a: Checkpoint, b: Checkpoint, name: str) -> bool:
    if not (a.has_range(name) and b.has_range(name)):
        return _same_views(a, b, name)
    la, lb = a.location(name), b.location(name)
    if la.length != lb.length:
        return False
    # Through the descriptors each checkpoint opened its files as, once.
    fa, fb = a.reading(la.path), b.reading(lb.path)
    done = 0
    while done < la.length:
        n = min(_BLOCK, la.length - done)
        if os.pread(fa, n, la.offset + done) != os.pread(fb, n, lb.offset + done):
            return False
        done += n
    return True


def _same_file(fa: int, fb: int, size: int) -> bool:
    done = 0
    while done < size:
        n = min(_BLOCK, size - done)
        if os.pread(fa, n, done) != os.pread(fb, n, done):
            return False
        done += n
    return True


def files_diff(a: Checkpoint, b: Checkpoint) -> tuple[list[str], int]:
    """The side files of two checkpoint folders compared (as a conversion would carry them):
    the differences as ``files`` lists them, and the number of identical files."""
    la = {f.name: f.size for f in list_side_files(a.root).files}
    lb = {f.name: f.size for f in list_side_files(b.root).files}
    out = [f"- {n}" for n in sorted(set(la) - set(lb))]
    out += [f"+ {n}" for n in sorted(set(lb) - set(la))]
    equal = 0
    for name in sorted(set(la) & set(lb)):
        if la[name] == lb[name]:
            fa = open_side_file(a.root, name, la[name])
            try:
                fb = open_side_file(b.root, name, lb[name])
                try:
                    if _same_file(fa, fb, la[name]):
                        equal += 1
                        continue
                finally:
                    os.close(fb)
            finally:
                os.close(fa)
        out.append(f"~ {name}")
    return out, equal


def diff_checkpoints(a: Checkpoint, b: Checkpoint, *, side_files: bool = False) -> CheckpointDiff:
    """Tensors only in one, dtype/shape changes, byte differences, and config differences;
    with ``side_files``, the two folders' side files too (both must be folders)."""
    result = CheckpointDiff()
    ta, tb = a.tensors, b.tensors
    result.only_a = sorted(set(ta) - set(tb))
    result.only_b = sorted(set(tb) - set(ta))
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if (x.dtype, x.shape) != (y.dtype, y.shape):
            result.changed.append((name, f"{x.dtype}{list(x.shape)}", f"{y.dtype}{list(y.shape)}"))
        elif _same_bytes(a, b, name):
            result.equal += 1
        else:
            result.bytes_differ.append(name)
    result.config = config_diff(a.config, b.config)
    if side_files:
        result.files, result.files_equal = files_diff(a, b)
    return result
