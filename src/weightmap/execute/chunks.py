"""The chunked compute path: any node, computed in slices along one output dimension.

Each slice is computed from memory-mapped views of only the input regions it needs, so the
intermediates of one chunk stay within the chunk budget whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from weightmap.execute.kernels import cast, evaluate
from weightmap.format.dtypes import DTYPES, numel
from weightmap.plan.nodes import Cast, Concat, Node, Permute, Reshape, Slice, Source, Stack

if TYPE_CHECKING:
    import torch

__all__ = ["chunk_plan", "region", "tree_nodes"]


def region(
    node: Node, dim: int, start: int, stop: int, get: Callable[[str], torch.Tensor], where: str
) -> torch.Tensor:
    """``node``'s output narrowed to ``[start, stop)`` along ``dim``, computing only that."""
    import torch

    if isinstance(node, Source):
        return get(node.name).narrow(dim, start, stop - start)
    if isinstance(node, Cast):
        return cast(
            region(node.src, dim, start, stop, get, where), node.src.dtype, node.dtype, where
        )
    if isinstance(node, Permute):
        return region(node.src, node.perm[dim], start, stop, get, where).permute(node.perm)
    if isinstance(node, Slice):
        if dim == node.dim:
            return region(node.src, dim, node.start + start, node.start + stop, get, where)
        part = region(node.src, dim, start, stop, get, where)
        return part.narrow(node.dim, node.start, node.stop - node.start)
    if isinstance(node, Concat):
        if dim != node.dim:
            parts = [region(s, dim, start, stop, get, where) for s in node.srcs]
            return torch.cat(parts, node.dim)
        pieces, base = [], 0
        for s in node.srcs:
            size = s.shape[dim]
            lo, hi = max(start, base), min(stop, base + size)
            if lo < hi:
                pieces.append(region(s, dim, lo - base, hi - base, get, where))
            base += size
        return torch.cat(pieces, dim)
    if isinstance(node, Stack):
        if dim == node.dim:
            return torch.stack([evaluate(s, get, where) for s in node.srcs[start:stop]], dim)
        inner = dim if dim < node.dim else dim - 1
        return torch.stack([region(s, inner, start, stop, get, where) for s in node.srcs], node.dim)
    if isinstance(node, Reshape):
        return _reshape_region(node, dim, start, stop, get, where)
    raise TypeError(f"unknown plan node {type(node).__name__}")


def _reshape_region(
    node: Reshape, dim: int, start: int, stop: int, get: Callable[[str], torch.Tensor], where: str
) -> torch.Tensor:
    """A reshape's region along ``dim``: one flat range of its source per outer index.

    With only size-1 dims before ``dim`` that is a single range; under a permute that moves a
    reshaped dim to the front (a rotary permute chain, say) it is one range per index of the
    dims before it, each computed on its own, so memory stays that of the region.
    """
    import torch

    outer = numel(node.shape[:dim])
    extent = node.shape[dim]
    inner = numel(node.shape[dim + 1 :])
    shape = list(node.shape)
    shape[dim] = stop - start
    if outer == 1:
        return _flat(node.src, start * inner, stop * inner, get, where).reshape(shape)
    pieces = [
        _flat(node.src, (o * extent + start) * inner, (o * extent + stop) * inner, get, where)
        for o in range(outer)
    ]
    return torch.cat(pieces).reshape(shape)


def _flat(
    node: Node, lo: int, hi: int, get: Callable[[str], torch.Tensor], where: str
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``node`` in row-major order, as a 1-D tensor."""
    if not node.shape:
        return evaluate(node, get, where).reshape(-1)[lo:hi]
    dim = next((i for i, d in enumerate(node.shape) if d > 1), 0)
    per = numel(node.shape[dim + 1 :])
    r0, r1 = lo // per, -(-hi // per)
    part = region(node, dim, r0, r1, get, where).reshape(-1)
    return part[lo - r0 * per : hi - r0 * per]


def tree_nodes(node: Node) -> list[Node]:
    children: list[Node] = []
    if isinstance(node, Concat | Stack):
        children = list(node.srcs)
    elif isinstance(node, Cast | Permute | Slice | Reshape):
        children = [node.src]
    return [node] + [n for c in children for n in tree_nodes(c)]


def chunk_plan(node: Node, budget: int) -> tuple[int, int]:
    """The output dim to chunk along and how many indices of it per chunk.

    The dim is the first of size > 1, so each chunk is one contiguous byte range of the output.
    The step keeps every intermediate of the tree (each roughly proportional to the chunk,
    computed at up to 8 bytes per element) within ``budget``.
    """
    dim = next((i for i, d in enumerate(node.shape) if d > 1), 0)
    extent = node.shape[dim] if node.shape else 1
    total = sum(numel(n.shape) * max(DTYPES[n.dtype].itemsize, 1) for n in tree_nodes(node))
    per_index = max(1, total // max(extent, 1))
    return dim, max(1, min(extent, budget // per_index))
