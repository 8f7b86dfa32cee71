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
    node: Node,
    dim: int,
    start: int,
    stop: int,
    get: Callable[[str], torch.Tensor],
    where: str,
    seen: list[tuple[str, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``node``'s output narrowed to ``[start, stop)`` along ``dim``, computing only that.

    ``seen`` (when given) collects each input view the region reads, by input name.
    """
    import torch

    def sub(n: Node, d: int, lo: int, hi: int) -> torch.Tensor:
        return region(n, d, lo, hi, get, where, seen)

    if isinstance(node, Source):
        view = get(node.name).narrow(dim, start, stop - start)
        if seen is not None:
            seen.append((node.name, view))
        return view
    if isinstance(node, Cast):
        return cast(sub(node.src, dim, start, stop), node.src.dtype, node.dtype, where)
    if isinstance(node, Permute):
        return sub(node.src, node.perm[dim], start, stop).permute(node.perm)
    if isinstance(node, Slice):
        if dim == node.dim:
            return sub(node.src, dim, node.start + start, node.start + stop)
        return sub(node.src, dim, start, stop).narrow(node.dim, node.start, node.stop - node.start)
    if isinstance(node, Concat):
        if dim != node.dim:
            return torch.cat([sub(s, dim, start, stop) for s in node.srcs], node.dim)
        pieces, base = [], 0
        for s in node.srcs:
            size = s.shape[dim]
            lo, hi = max(start, base), min(stop, base + size)
            if lo < hi:
                pieces.append(sub(s, dim, lo - base, hi - base))
            base += size
        return torch.cat(pieces, dim)
    if isinstance(node, Stack):
        if dim == node.dim:
            return torch.stack([evaluate(s, get, where) for s in node.srcs[start:stop]], dim)
        inner = dim if dim < node.dim else dim - 1
        return torch.stack([sub(s, inner, start, stop) for s in node.srcs], node.dim)
    if isinstance(node, Reshape):
        if numel(node.shape[:dim]) == 1:
            # With only size-1 dims before it, a range along `dim` is a flat range of the
            # source too.
            per_out = numel(node.shape[dim + 1 :])
            part = _flat(node.src, start * per_out, stop * per_out, get, where, seen)
            shape = list(node.shape)
            shape[dim] = stop - start
            return part.reshape(shape)
        # Only reachable under a permute that moves a reshaped dim: computed whole.
        return evaluate(node, get, where).narrow(dim, start, stop - start)
    raise TypeError(f"unknown plan node {type(node).__name__}")


def _flat(
    node: Node,
    lo: int,
    hi: int,
    get: Callable[[str], torch.Tensor],
    where: str,
    seen: list[tuple[str, torch.Tensor]] | None,
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``node`` in row-major order, as a 1-D tensor."""
    if not node.shape:
        return evaluate(node, get, where).reshape(-1)[lo:hi]
    dim = next((i for i, d in enumerate(node.shape) if d > 1), 0)
    per = numel(node.shape[dim + 1 :])
    r0, r1 = lo // per, -(-hi // per)
    part = region(node, dim, r0, r1, get, where, seen).reshape(-1)
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
