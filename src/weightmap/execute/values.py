"""The value kernels: arithmetic, block-broadcast products, fp8 block quantization, masks.

Each kernel is written once and called by both executors: on whole tensors by the in-memory
one, on regions by the chunked one (``chunks.py`` hands in the region's offsets into the block
grid, so a chunk that cuts through blocks computes the same values as the whole tensor).

Rounding is what the reference converters do, because it is their code path: the operands are
converted to the compute dtype, torch computes in it (one rounding per operation), and the
result is converted once to the output dtype. fp8 dequantization is DeepSeek-V3's
``weight_dequant``: ``float32(w) * scale_inv`` rounded once to bfloat16; quantization is
transformers' ``Fp8Quantize``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from weightmap.errors import ExecutionError
from weightmap.execute.nans import convert
from weightmap.format.dtypes import DTYPES
from weightmap.plan.nodes import (
    Arith,
    Binary,
    Clamp,
    Gather,
    Lookup,
    Mask,
    Matmul,
    Pack,
    Quantize,
    Reduce,
    Round,
    Unpack,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "arith",
    "binary",
    "clamp",
    "expand_blocks",
    "gather",
    "lookup",
    "mask",
    "matmul",
    "pack",
    "quantize",
    "reduce",
    "round_values",
    "unpack",
]


def _torch(name: str) -> torch.dtype:
    return DTYPES[name].torch()


def arith(x: torch.Tensor, node: Arith) -> torch.Tensor:
    """``x`` plus or times ``node.value`` in ``node.compute``, rounded to ``node.dtype``."""
    c = convert(x, _torch(node.compute))
    return convert(_combine(node.op, c, node.value), _torch(node.dtype))


def _combine(op: str, a: torch.Tensor, b: torch.Tensor | int | float) -> torch.Tensor:
    out: torch.Tensor = _OPS[op](a, b)
    return out


# Each op, and the same op in place into its first operand (the same bits: one kernel).
_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
}
_IN_PLACE: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.iadd,
    "sub": operator.isub,
    "mul": operator.imul,
}


def expand_blocks(
    b: torch.Tensor, block: tuple[int, ...], shape: Sequence[int], offsets: Sequence[int]
) -> torch.Tensor:
    """Broadcast ``b`` (one value per block) to ``shape``.

    ``b`` covers the blocks of a region of the full tensor; ``offsets[i]`` is where the
    region's first element sits inside the first block, for each blocked (trailing) dim.
    """
    lead = len(shape) - len(block)
    for i, size in enumerate(block):
        d = lead + i
        b = b.repeat_interleave(size, dim=d).narrow(d, offsets[i], shape[d])
    return b


def binary(
    a: torch.Tensor, b: torch.Tensor, node: Binary, offsets: Sequence[int] | None = None
) -> torch.Tensor:
    """``a`` plus or times ``b`` (block-broadcast), in ``node.compute``, to ``node.dtype``."""
    compute = _torch(node.compute)
    ac, bc = convert(a, compute), convert(b, compute)
    if node.block:
        offsets = offsets or (0,) * len(node.block)
        if node.block[0] >= _BAND_MIN and node.compute in _BAND_COMPUTE:
            return convert(_by_bands(node.op, ac, a, bc, node.block, offsets), _torch(node.dtype))
        bc = expand_blocks(bc, node.block, tuple(a.shape), offsets)
    return convert(_combine(node.op, ac, bc), _torch(node.dtype))


# From this block height on, a block-broadcast operand is applied a band of block rows at a
# time rather than expanded to the full shape. Only where the compute dtype's NaNs do not
# depend on how the elements are split into runs: torch's bfloat16 arithmetic gives one NaN
# in its vector loop and another in its scalar one, and each band ends a run of its own.
_BAND_MIN = 8
_BAND_COMPUTE = frozenset({"F32", "F64"})


def _by_bands(
    op: str,
    ac: torch.Tensor,
    a: torch.Tensor,
    bc: torch.Tensor,
    block: tuple[int, ...],
    offsets: Sequence[int],
) -> torch.Tensor:
    """``_combine(op, ac, expand_blocks(bc, ...))`` without the expanded operand or a third
    tensor: ``bc`` is expanded along every blocked dim but the first (a block's height fewer
    elements than the whole), and combined into ``ac`` in place one band of block rows at a
    time, each band with its row of ``bc`` broadcast over it. Element by element the same
    operation on the same operands, so the same bits; a chunk's intermediates are ``ac`` alone
    (fp8 dequantization: 4 bytes an element, where the expanded scales and the product were
    8 more)."""
    if ac.data_ptr() == a.data_ptr():
        ac = ac.clone()  # (the conversion was a no-op: never write into the input's view)
    lead = ac.dim() - len(block)
    shape = tuple(ac.shape)
    rest = bc
    for i in range(1, len(block)):
        d = lead + i
        rest = rest.repeat_interleave(block[i], dim=d).narrow(d, offsets[i], shape[d])
    first = block[0]
    start, j = 0, 0
    while start < shape[lead]:
        stop = min(shape[lead], (j + 1) * first - offsets[0])
        band = ac.narrow(lead, start, stop - start)
        _IN_PLACE[op](band, rest.narrow(lead, j, 1))
        start, j = stop, j + 1
    return ac


def quantize(x: torch.Tensor, node: Quantize) -> torch.Tensor:
    """Fp8Quantize over the blocks of ``x``'s last two dims: the values or the scales.

    ``x`` must hold whole blocks except at the tensor's own bottom and right edges; a partial
    block there is a block of the elements it has (as if padded with zeros, which leave the
    absolute maximum unchanged).
    """
    import torch

    bm, bn = node.block
    *lead, m, n = x.shape
    rows, cols = -(-m // bm), -(-n // bn)
    xf = convert(x, torch.float32)
    if m % bm or n % bn:
        padded = torch.zeros((*lead, rows * bm, cols * bn), dtype=torch.float32)
        padded[..., :m, :n] = xf
        xf = padded
    tiles = xf.reshape(*lead, rows, bm, cols, bn)
    fp8_max = torch.finfo(_torch(node.fp8)).max
    max_abs = tiles.abs().amax(dim=(-3, -1))
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = fp8_max / safe
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    if node.part == "scales":
        return (1.0 / scales).to(torch.float32)
    scaled = tiles * scales.unsqueeze(-1).unsqueeze(-3)
    q = convert(torch.clamp(scaled, min=-fp8_max, max=fp8_max), _torch(node.dtype))
    return q.reshape(*lead, rows * bm, cols * bn)[..., :m, :n]


def mask(positions: torch.Tensor, node: Mask, where: str) -> torch.Tensor:
    """A boolean vector of ``node.size``, true at ``positions`` (``+ index`` if asked)."""
    import torch

    pos = positions.to(torch.int64)
    if node.plus_index:
        pos = pos + torch.arange(pos.numel(), dtype=torch.int64)
    out = torch.zeros(node.size, dtype=torch.bool)
    if pos.numel() == 0:
        return out
    lo, hi = int(pos.min()), int(pos.max())
    if lo < 0 or hi >= node.size:
        raise ExecutionError(
            f"{where}: mask positions run from {lo} to {hi}, outside 0..{node.size - 1}"
        )
    out[pos] = True
    if int(out.sum()) != pos.numel():
        raise ExecutionError(
            f"{where}: mask positions repeat ({pos.numel() - int(out.sum())} of {pos.numel()}): "
            "each position must appear once"
        )
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, node: Matmul) -> torch.Tensor:
    """``a @ b`` in ``node.compute``, rounded once to ``node.dtype``; ``a`` may be some rows
    of the node's ``a`` and ``b`` some columns of its ``b`` (a chunk of the product).

    Each output element is ``((a[i,0]*b[0,j] + a[i,1]*b[1,j]) + ...)`` summed in order of
    the inner index, every product and sum rounded in the compute dtype: one elementwise
    multiply and one add over the whole chunk per inner index. Elementwise IEEE operations
    give the same bits in torch's vector and scalar loops and whatever its threads, so an
    element does not depend on the chunk it is computed in, the thread count or the machine.
    BLAS (``torch.matmul``) does not promise that: its blocking, vector lanes and the split
    between threads follow the operands' shapes and the thread count, and a [5, 5] @ [5, 17]
    product differs in the last bits between one thread and two. The price is one pass over
    the chunk per inner index: cheap for a LoRA delta (rank 8 to 256), slow for a large inner
    dimension.
    """
    import torch

    compute = _torch(node.compute)
    ac, bc = convert(a, compute), convert(b, compute)
    out = torch.zeros((ac.shape[0], bc.shape[1]), dtype=compute)
    product = torch.empty_like(out)
    for i in range(ac.shape[1]):
        # Multiply, then add: two roundings, as written; a fused multiply-add would round
        # once in vector loops and twice in scalar ones.
        torch.mul(ac[:, i : i + 1], bc[i : i + 1, :], out=product)
        out.add_(product)
    return convert(out, _torch(node.dtype))


def _fields(bits: int, order: Sequence[int]) -> list[int]:
    """The shift of each code of a word, in code order."""
    return [f * bits for f in order]


def unpack(words: torch.Tensor, node: Unpack) -> torch.Tensor:
    """Each word split into its codes along ``node.dim``, code i from field ``order[i]``."""
    import torch

    per = len(node.order)
    dim = node.dim
    # Every source width as int64 (a U64 by its bits): an arithmetic shift then the mask
    # gives each field whatever the sign bit.
    wide = words.view(torch.int64) if words.dtype == torch.uint64 else words.to(torch.int64)
    mask = (1 << node.bits) - 1
    shifts = torch.tensor(_fields(node.bits, node.order), dtype=torch.int64)
    view = [1] * (wide.dim() + 1)
    view[dim + 1] = per
    codes = (wide.unsqueeze(dim + 1) >> shifts.view(view)) & mask
    shape = list(words.shape)
    shape[dim] *= per
    return codes.reshape(shape).to(_torch(node.dtype))


def pack(codes: torch.Tensor, node: Pack, where: str) -> torch.Tensor:
    """Runs of codes along ``node.dim`` packed into words, code i into field ``order[i]``."""
    import torch

    per = len(node.order)
    dim = node.dim
    wide = codes.to(torch.int64)
    if wide.numel():
        lo, hi = int(wide.min()), int(wide.max())
        if lo < 0 or hi >= 1 << node.bits:
            raise ExecutionError(
                f"{where}: codes in [{lo}, {hi}] do not fit in {node.bits} bits "
                f"([0, {(1 << node.bits) - 1}])"
            )
    shape = list(codes.shape)
    shape[dim : dim + 1] = [shape[dim] // per, per]
    grouped = wide.reshape(shape)
    view = [1] * grouped.dim()
    view[dim + 1] = per
    shifts = torch.tensor(_fields(node.bits, node.order), dtype=torch.int64).view(view)
    words = (grouped << shifts).sum(dim + 1)  # fields do not overlap: the sum is an or
    bits = DTYPES[node.dtype].bits
    if DTYPES[node.dtype].kind == "int" and bits < 64:
        # The top field lands in the sign bit: the word's two's complement, as stored.
        words = torch.where(words >= 1 << (bits - 1), words - (1 << bits), words)
    if node.dtype == "U64":
        return words.view(torch.uint64)
    return words.to(_torch(node.dtype))


def _check_index(index: torch.Tensor, size: int, what: str, where: str) -> torch.Tensor:
    import torch

    idx = index.to(torch.int64)
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= size:
            raise ExecutionError(f"{where}: {what} run from {lo} to {hi}, outside 0..{size - 1}")
    return idx


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed integers of its width: torch selects elements of every
    dtype that way (it lacks index_select for uint16..uint64 and some float8 types)."""
    import torch

    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


def gather(src: torch.Tensor, index: torch.Tensor, node: Gather, where: str) -> torch.Tensor:
    """``src.index_select(dim, index)``; an index out of range is an error."""
    idx = _check_index(index, src.shape[node.dim], "gather indexes", where)
    return _as_bits(src).index_select(node.dim, idx).view(src.dtype)


def lookup(codes: torch.Tensor, table: torch.Tensor, node: Lookup, where: str) -> torch.Tensor:
    """``table[codes]``; a code outside the table is an error."""
    idx = _check_index(codes, table.shape[0], "lookup codes", where)
    return _as_bits(table)[idx].view(table.dtype)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """A float tensor in float32 (float64 stays): exact, and a dtype torch computes in."""
    import torch

    return x if x.dtype == torch.float64 else convert(x, torch.float32)


def round_values(x: torch.Tensor, node: Round) -> torch.Tensor:
    """Nearest (ties to even), floor or ceil; the result converts back exactly."""
    import torch

    how = {"round": torch.round, "floor": torch.floor, "ceil": torch.ceil}[node.mode]
    return convert(how(_wide(x)), _torch(node.dtype))


def clamp(x: torch.Tensor, node: Clamp) -> torch.Tensor:
    """``x`` within ``[low, high]``; a bound outside the dtype's values rounds once to it."""
    import torch

    return convert(torch.clamp(_wide(x), node.low, node.high), _torch(node.dtype))


def reduce(x: torch.Tensor, node: Reduce) -> torch.Tensor:
    """amax / amin / sum of ``x`` along ``node.dim``, whole or by groups (``x`` holds whole
    groups along that dim)."""
    import torch

    d = node.dim
    if node.group:
        shape = (*x.shape[:d], x.shape[d] // node.group, node.group, *x.shape[d + 1 :])
        x, d = x.reshape(shape), d + 1
    if node.op == "sum":
        c = convert(x, _torch(node.compute))
        if c.shape[d] == 0:
            out = torch.zeros(_without(c.shape, d), dtype=c.dtype)
        else:
            out = c.select(d, 0).clone()
            for i in range(1, c.shape[d]):  # in order: the bits do not depend on the chunking
                out.add_(c.select(d, i))
        return convert(out, _torch(node.dtype))
    kind = DTYPES[node.dtype].kind
    wide = x.to(torch.int64) if kind in ("int", "uint") else _wide(x)
    picked = torch.amax(wide, d) if node.op == "amax" else torch.amin(wide, d)
    return convert(picked, _torch(node.dtype))


def _without(shape: Sequence[int], d: int) -> tuple[int, ...]:
    return (*shape[:d], *shape[d + 1 :])
