"""The byte path: outputs whose bytes are a sequence of input byte ranges.

Renames, keeps, reshapes, slices and concatenations whose outer dimensions allow it, casts to
the same dtype and permutes that only move size-1 dimensions change no byte: such an output is
a list of input ranges, copied in the kernel and never through Python objects.
"""

from __future__ import annotations

from typing import NamedTuple

from weightmap.format.dtypes import DTYPES, nbytes, numel
from weightmap.plan.nodes import Cast, Concat, Node, Permute, Reshape, Slice, Source, Stack

__all__ = ["Segment", "byte_segments"]


class Segment(NamedTuple):
    """``length`` bytes of input tensor ``name`` starting ``offset`` bytes into it.

    A named tuple, not a dataclass: a plan of 100,000 renames makes one per tensor."""

    name: str
    offset: int
    length: int


def _row_bits(node: Node, dim: int) -> int:
    """Bits of one index along ``dim`` (the product of the later dims)."""
    return numel(node.shape[dim + 1 :]) * DTYPES[node.dtype].bits


def _whole_bytes(*bits: int) -> bool:
    # A sub-byte dtype (F4, F6) packs several elements in a byte: one index may be a fraction
    # of a byte while the range a split or merge moves is whole bytes, and only that counts.
    return all(b % 8 == 0 for b in bits)


def _take(segments: list[Segment], offset: int, length: int) -> list[Segment]:
    """The sub-sequence of bytes ``[offset, offset + length)`` of a segment list."""
    out: list[Segment] = []
    position = 0
    for seg in segments:
        end = position + seg.length
        if end > offset and position < offset + length:
            start = max(offset, position) - position
            stop = min(offset + length, end) - position
            out.append(Segment(seg.name, seg.offset + start, stop - start))
        position = end
        if position >= offset + length:
            break
    return out


def _merge(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for seg in segments:
        if seg.length == 0:
            continue
        last = out[-1] if out else None
        if last and last.name == seg.name and last.offset + last.length == seg.offset:
            out[-1] = Segment(last.name, last.offset, last.length + seg.length)
        else:
            out.append(seg)
    return out


def byte_segments(node: Node, limit: int = 1 << 20) -> list[Segment] | None:
    """The input byte ranges whose concatenation is the node's output, or None.

    None means the output's bytes differ from any arrangement of input bytes (a cast, a real
    permute), or that it would take more than ``limit`` ranges.
    """
    if isinstance(node, Source):
        return [Segment(node.name, 0, nbytes(node.dtype, node.shape))]
    if isinstance(node, Reshape):
        return byte_segments(node.src, limit)
    if isinstance(node, Cast):
        return byte_segments(node.src, limit) if node.src.dtype == node.dtype else None
    if isinstance(node, Permute):
        # Moving size-1 dims around leaves the bytes as they are.
        moved = [p for p in node.perm if node.src.shape[p] != 1]
        return byte_segments(node.src, limit) if moved == sorted(moved) else None
    if isinstance(node, Slice):
        src = byte_segments(node.src, limit)
        inner = _row_bits(node.src, node.dim)
        outer = numel(node.src.shape[: node.dim])
        row, start, length = (
            node.src.shape[node.dim] * inner,
            node.start * inner,
            (node.stop - node.start) * inner,
        )
        if src is None or not _whole_bytes(row, start, length) or outer > limit:
            return None
        out: list[Segment] = []
        for o in range(outer):
            out += _take(src, (o * row + start) // 8, length // 8)
        return _merge(out)
    if isinstance(node, Concat | Stack):
        parts = [byte_segments(s, limit) for s in node.srcs]
        if any(p is None for p in parts):
            return None
        outer = numel(node.shape[: node.dim])
        if isinstance(node, Stack):
            rows = [_row_bits(node, node.dim) for _ in node.srcs]
        else:
            rows = [_row_bits(s, node.dim) * s.shape[node.dim] for s in node.srcs]
        if outer * len(node.srcs) > limit or not _whole_bytes(*rows):
            return None
        out = []
        for o in range(outer):
            for part, r in zip(parts, rows, strict=True):
                assert part is not None
                out += _take(part, o * r // 8, r // 8)
        return _merge(out)
    return None
