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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from weightmap.errors import ExecutionError
from weightmap.execute.nans import convert
from weightmap.format.dtypes import DTYPES
from weightmap.plan.nodes import Arith, Binary, Mask, Quantize

if TYPE_CHECKING:
    import torch

__all__ = ["arith", "binary", "expand_blocks", "mask", "quantize"]


def _torch(name: str) -> torch.dtype:
    return DTYPES[name].torch()


def arith(x: torch.Tensor, node: Arith) -> torch.Tensor:
    """``x`` plus or times ``node.value`` in ``node.compute``, rounded to ``node.dtype``."""
    c = convert(x, _torch(node.compute))
    y = c + node.value if node.op == "add" else c * node.value
    return convert(y, _torch(node.dtype))


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
        bc = expand_blocks(bc, node.block, tuple(a.shape), offsets or (0,) * len(node.block))
    y = ac + bc if node.op == "add" else ac * bc
    return convert(y, _torch(node.dtype))


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
