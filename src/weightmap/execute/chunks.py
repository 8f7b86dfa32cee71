"""The chunked compute path: any node, computed in slices along one output dimension.

Each slice is computed from memory-mapped views of only the input regions it needs, so the
intermediates of one chunk stay within the chunk budget whatever the tensor's size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from weightmap.execute import values
from weightmap.execute.kernels import cast, evaluate, same, slice_first
from weightmap.format.dtypes import DTYPES, numel
from weightmap.plan.nodes import (
    Arith,
    Binary,
    Cast,
    Clamp,
    Concat,
    Gather,
    Lookup,
    Mask,
    Matmul,
    Node,
    Pack,
    Permute,
    Quantize,
    Reduce,
    Reshape,
    Round,
    Same,
    Slice,
    Source,
    Stack,
    Unpack,
)

if TYPE_CHECKING:
    import torch

__all__ = ["chunk_plan", "concat_pieces", "region", "scratch", "tree_nodes"]

# A buffer source: (dtype, shape, slot) -> a tensor of that dtype and shape, reused by slot.
Buffers = Callable[["torch.dtype", tuple[int, ...], int], "torch.Tensor"]
_pool = threading.local()
# The first slot ``region`` takes from a ``scratch`` pool (the computer keeps the ones below).
_FIRST_SLOT = 8


@contextmanager
def scratch(buffers: Buffers) -> Iterator[None]:
    """While inside, the copies ``region`` makes on this thread (a concatenation, the gather of
    a reshape's range) go into ``buffers``, a slot each in the order they are made: the same
    slots chunk after chunk, so one chunk's intermediates reuse the last one's memory. A
    fresh tensor per copy would be freed into the allocator's per-thread heaps, which keep
    what the largest chunk needed, several times over. Results are valid until the next
    ``scratch`` on this thread."""
    _pool.buffers, _pool.next = buffers, _FIRST_SLOT
    try:
        yield
    finally:
        _pool.buffers = None


def _empty(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised tensor: the next ``scratch`` slot where one is open, else a new one."""
    buffers: Buffers | None = getattr(_pool, "buffers", None)
    if buffers is None:
        import torch

        return torch.empty(shape, dtype=dtype)
    slot = _pool.next
    _pool.next += 1
    return buffers(dtype, shape, slot)


def _cat(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(pieces, dim)``, into a scratch slot where one is open."""
    import torch

    shape = list(pieces[0].shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    return torch.cat(pieces, dim, out=_empty(pieces[0].dtype, tuple(shape)))


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
        sunk = slice_first(node)
        if sunk is not node:  # (a narrowing cast under it: see slice_first)
            return sub(sunk, dim, start, stop)
        if dim == node.dim:
            return sub(node.src, dim, node.start + start, node.start + stop)
        return sub(node.src, dim, start, stop).narrow(node.dim, node.start, node.stop - node.start)
    if isinstance(node, Concat):
        return _cat(concat_pieces(node, dim, start, stop, sub), node.dim)
    if isinstance(node, Same):  # each member's region, compared; the first's written
        return same([sub(s, dim, start, stop) for s in node.srcs], node, where)
    if isinstance(node, Stack):
        if dim == node.dim:
            return torch.stack([evaluate(s, get, where) for s in node.srcs[start:stop]], dim)
        inner = dim if dim < node.dim else dim - 1
        return torch.stack([sub(s, inner, start, stop) for s in node.srcs], node.dim)
    if isinstance(node, Reshape):
        return _reshape_region(node, dim, start, stop, get, where, seen)
    if isinstance(node, Arith):
        return values.arith(sub(node.src, dim, start, stop), node)
    if isinstance(node, Binary):
        return _binary_region(node, dim, start, stop, get, where, seen)
    if isinstance(node, Quantize):
        return _quantize_region(node, dim, start, stop, get, where, seen)
    if isinstance(node, Mask):
        # Positions can land anywhere in the output: the (small) source is read whole.
        out = values.mask(evaluate(node.src, get, where), node, where)
        return out.narrow(dim, start, stop - start)
    if isinstance(node, Matmul):
        return _matmul_region(node, dim, start, stop, sub)
    if isinstance(node, (Unpack, Pack)):
        return _packing_region(node, dim, start, stop, sub, where)
    if isinstance(node, Gather):
        if dim == node.dim:  # the indexes of the region; the (small) source whole along dim
            index = sub(node.index, 0, start, stop)
            return values.gather(evaluate(node.src, get, where), index, node, where)
        index = evaluate(node.index, get, where)
        return values.gather(sub(node.src, dim, start, stop), index, node, where)
    if isinstance(node, Round):
        return values.round_values(sub(node.src, dim, start, stop), node)
    if isinstance(node, Clamp):
        return values.clamp(sub(node.src, dim, start, stop), node)
    if isinstance(node, Reduce):  # the source's region that the region's results reduce
        if node.group:
            if dim == node.dim:
                lo, hi = start * node.group, stop * node.group
                return values.reduce(sub(node.src, dim, lo, hi), node)
            return values.reduce(sub(node.src, dim, start, stop), node)
        return values.reduce(sub(node.src, dim if dim < node.dim else dim + 1, start, stop), node)
    if isinstance(node, Lookup):  # one entry per code: the codes of the region, the whole table
        table = evaluate(node.table, get, where)
        return values.lookup(sub(node.codes, dim, start, stop), table, node, where)
    raise TypeError(f"unknown plan node {type(node).__name__}")


Sub = Callable[[Node, int, int, int], "torch.Tensor"]


def concat_pieces(node: Concat, dim: int, start: int, stop: int, sub: Sub) -> list[torch.Tensor]:
    """The pieces whose concatenation along ``node.dim`` is the region ``[start, stop)`` of
    ``node`` along ``dim``: every source's region across the concatenated dim, or the sources
    the region overlaps along it."""
    if dim != node.dim:
        return [sub(s, dim, start, stop) for s in node.srcs]
    pieces, base = [], 0
    for s in node.srcs:
        size = s.shape[dim]
        lo, hi = max(start, base), min(stop, base + size)
        if lo < hi:
            pieces.append(sub(s, dim, lo - base, hi - base))
        base += size
    return pieces


def _matmul_region(node: Matmul, dim: int, start: int, stop: int, sub: Sub) -> torch.Tensor:
    """Rows of ``a`` with the whole of ``b``, or the whole of ``a`` with columns of ``b``: each
    element of the product is computed alone (``values.matmul``), so any region will do."""
    m, n = node.shape
    if dim == 0:
        return values.matmul(sub(node.a, 0, start, stop), sub(node.b, 1, 0, n), node)
    return values.matmul(sub(node.a, 0, 0, m), sub(node.b, 1, start, stop), node)


def _packing_region(
    node: Unpack | Pack, dim: int, start: int, stop: int, sub: Sub, where: str
) -> torch.Tensor:
    """Unpack: the words that hold the region's codes; pack: the codes of the region's words."""
    if dim != node.dim:
        src = sub(node.src, dim, start, stop)
        return (
            values.unpack(src, node) if isinstance(node, Unpack) else values.pack(src, node, where)
        )
    per = len(node.order)
    if isinstance(node, Pack):
        return values.pack(sub(node.src, dim, start * per, stop * per), node, where)
    lo, hi = start // per, -(-stop // per)
    out = values.unpack(sub(node.src, dim, lo, hi), node)
    return out.narrow(dim, start - lo * per, stop - start)


def _block_dim(shape: tuple[int, ...], block: tuple[int, ...], dim: int) -> int | None:
    """The block size along ``dim`` of a tensor of ``shape``, or None if ``dim`` has none."""
    first = len(shape) - len(block)
    return block[dim - first] if dim >= first else None


def _binary_region(
    node: Binary,
    dim: int,
    start: int,
    stop: int,
    get: Callable[[str], torch.Tensor],
    where: str,
    seen: list[tuple[str, torch.Tensor]] | None,
) -> torch.Tensor:
    """``a`` over the region, ``b`` over the blocks that cover it (a chunk may cut a block)."""
    a = region(node.a, dim, start, stop, get, where, seen)
    size = _block_dim(node.shape, node.block, dim)
    offsets = [0] * len(node.block)
    if size is None:
        b = region(node.b, dim, start, stop, get, where, seen)
    else:
        lo, hi = start // size, (stop - 1) // size + 1
        b = region(node.b, dim, lo, hi, get, where, seen)
        offsets[dim - (len(node.shape) - len(node.block))] = start - lo * size
    return values.binary(a, b, node, offsets)


def _quantize_region(
    node: Quantize,
    dim: int,
    start: int,
    stop: int,
    get: Callable[[str], torch.Tensor],
    where: str,
    seen: list[tuple[str, torch.Tensor]] | None,
) -> torch.Tensor:
    """Quantize the whole blocks that cover the region, then keep the region."""
    src_shape = node.src.shape
    size = _block_dim(src_shape, node.block, dim)
    if size is None:  # a leading dim (experts): whole blocks whatever the range
        return values.quantize(region(node.src, dim, start, stop, get, where, seen), node)
    if node.part == "scales":  # output index i is source block i along this dim
        lo, hi = start * size, min(stop * size, src_shape[dim])
        return values.quantize(region(node.src, dim, lo, hi, get, where, seen), node)
    lo, hi = start // size * size, min(-(-stop // size) * size, src_shape[dim])
    out = values.quantize(region(node.src, dim, lo, hi, get, where, seen), node)
    return out.narrow(dim, start - lo, stop - start)


def _reshape_region(
    node: Reshape,
    dim: int,
    start: int,
    stop: int,
    get: Callable[[str], torch.Tensor],
    where: str,
    seen: list[tuple[str, torch.Tensor]] | None,
) -> torch.Tensor:
    """A reshape's region along ``dim``: one flat range of its source per outer index.

    With only size-1 dims before ``dim`` that is a single range; under a permute that moves a
    reshaped dim to the front (a rotary permute chain, say) it is one range per index of the
    dims before it, each computed on its own, so memory stays that of the region.
    """
    outer = numel(node.shape[:dim])
    extent = node.shape[dim]
    inner = numel(node.shape[dim + 1 :])
    shape = list(node.shape)
    shape[dim] = stop - start
    if outer == 1:
        return _flat(node.src, start * inner, stop * inner, get, where, seen).reshape(shape)
    pieces = [
        _flat(node.src, (o * extent + start) * inner, (o * extent + stop) * inner, get, where, seen)
        for o in range(outer)
    ]
    return _cat(pieces, 0).reshape(shape)


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
    part = region(node, dim, r0, r1, get, where, seen)
    if part.is_contiguous():
        flat = part.reshape(-1)
    else:  # (a permuted region: gathered into row-major order)
        flat = _empty(part.dtype, (part.numel(),))
        flat.view(part.shape).copy_(part)
    return flat[lo - r0 * per : hi - r0 * per]


def tree_nodes(node: Node) -> list[Node]:
    """Every node of the tree, root first."""
    return [node] + [n for c in node.children() for n in tree_nodes(c)]


# Bytes per element that computing a node holds besides its result: value nodes convert
# their operands to the compute dtype and keep a product or a quantized copy (float32).
_WORKING_BYTES = {Arith: 8, Binary: 16, Quantize: 16, Unpack: 24, Pack: 24, Matmul: 16,
                  Gather: 8, Lookup: 8, Round: 8, Clamp: 8, Reduce: 8}  # fmt: skip


def _working_bytes(n: Node) -> int:
    per = _WORKING_BYTES.get(type(n), 0)
    if isinstance(n, Matmul):
        # The sum and one product per output element, in the compute dtype (up to 8 bytes
        # each), and a row of ``a`` converted; ``b`` is read whole for every chunk of rows.
        return numel(n.shape) * per + numel(n.a.shape) * 8
    if isinstance(n, (Pack, Reduce)):  # the source is held wide (int64, the compute dtype)
        return numel(n.src.shape) * per
    if isinstance(n, Quantize) and n.part == "scales":
        # One scale per block, but each is the largest magnitude of a whole block of the
        # source, converted to float32 to find it: the work is the source's size, not the grid's.
        return numel(n.src.shape) * per
    return numel(n.shape) * per


def chunk_plan(node: Node, budget: int) -> tuple[int, int]:
    """The output dim to chunk along and how many indices of it per chunk.

    The dim is the first of size > 1, so each chunk is one contiguous byte range of the output.
    The step keeps every intermediate of the tree (each roughly proportional to the chunk,
    computed at up to 8 bytes per element) within ``budget``.
    """
    dim = next((i for i, d in enumerate(node.shape) if d > 1), 0)
    extent = node.shape[dim] if node.shape else 1
    total = sum(
        numel(n.shape) * max(DTYPES[n.dtype].itemsize, 1) + _working_bytes(n)
        for n in tree_nodes(node)
    )
    per_index = max(1, total // max(extent, 1))
    step = max(1, min(extent, budget // per_index))
    if isinstance(node, Quantize) and node.part == "values":
        # Whole blocks per chunk, or each chunk's edge blocks would be quantized twice.
        size = _block_dim(node.src.shape, node.block, dim)
        if size is not None and step < extent:
            step = max(size, step // size * size)
    return dim, step
