"""How a checkpoint is laid out on disk: file names, shard plans and header bytes.

Pure functions of names, dtypes and shapes: the writer plans every shard and header from these
before any data arrives, exactly as the reference writer lays them out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightmap.format.dtypes import DTYPES, TensorSpec

__all__ = [
    "CONFIG_NAME",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "JOURNAL_NAME",
    "SINGLE_NAME",
    "ShardPlan",
    "build_header",
    "parse_size",
    "plan_shards",
]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# An in-place rewrite's journal (see execute/inplace.py); its presence means one was interrupted.
JOURNAL_NAME = ".weightmap-inplace-journal.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Parse a size such as ``"5GB"`` (decimal units, as the hub uses) or ``"512MiB"``.

    >>> parse_size("5GB"), parse_size("1.5KiB"), parse_size(100)
    (5000000000, 1536, 100)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE_RE.match(str(size))
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(
                f"cannot parse size {size!r}: use a number with a unit such as 500MB, 5GB or 2GiB"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def _layout_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    # The reference writer's order: descending dtype rank, then name.
    return sorted(specs, key=lambda s: (-DTYPES[s.dtype].rank, s.name))


def build_header(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Lay out one file: the padded JSON header and each tensor's data offsets.

    The layout is the reference writer's (descending dtype rank, then name; header padded with
    spaces to a multiple of 8), so the same tensors and metadata give the same bytes. Metadata
    keys are written sorted, where the reference writer's order varies from run to run.
    """
    entries: dict[str, Any] = {}
    if metadata:
        entries["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for spec in _layout_order(specs):
        size = spec.nbytes
        offsets[spec.name] = (position, position + size)
        entries[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [position, position + size],
        }
        position += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


@dataclass(frozen=True)
class ShardPlan:
    """One output file: its name, header bytes, and each tensor's absolute file offset."""

    filename: str
    header: bytes
    offsets: Mapping[str, tuple[int, int]]  # absolute [begin, end) in the file
    size: int


def plan_shards(
    specs: Sequence[TensorSpec],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
) -> list[ShardPlan]:
    """Split tensors into shards greedily, in the given order, up to ``max_shard_size``.

    A tensor larger than the limit gets a shard of its own. One shard is named
    ``model.safetensors``; several are ``model-00001-of-0000N.safetensors``.
    """
    limit = parse_size(max_shard_size)
    groups: list[list[TensorSpec]] = [[]]
    current = 0
    for spec in specs:
        size = spec.nbytes
        if groups[-1] and current + size > limit:
            groups.append([])
            current = 0
        groups[-1].append(spec)
        current += size
    n = len(groups)
    plans = []
    for i, group in enumerate(groups, 1):
        header, rel = build_header(group, metadata)
        name = SINGLE_NAME if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        base = len(header)
        offsets = {k: (base + b, base + e) for k, (b, e) in rel.items()}
        size = base + sum(s.nbytes for s in group)
        plans.append(ShardPlan(name, header, offsets, size))
    return plans
