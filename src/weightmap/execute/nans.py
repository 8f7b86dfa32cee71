"""Float casts whose NaNs come out with the same bits, however they are split into pieces.

torch's conversion kernels do not agree about NaN payloads. Measured on x86 (AVX2, F16C):
float16 -> float32 keeps a NaN's payload in the vectorised loop (``0x7fff`` -> ``0x7fffe000``)
but writes ``0x7fffffff`` in the scalar loop that converts the last few elements of a run;
float64 -> bfloat16 differs the same way; float32 -> bfloat16 differs between contiguous and
strided sources. A run ends where a chunk ends, and also where torch splits a large tensor
between its threads (at positions that depend on the thread count), so without care a chunked
cast, a whole-tensor cast and two thread counts write different bytes for the same NaN.

The first cast between two float dtypes probes the kernels once with every NaN pattern of the
source (a sample for 32 and 64-bit types) through the vectorised, the scalar and the strided
loop, and picks how that pair is cast from then on:

- ``plain``: the loops agree (bfloat16 -> float32, the common cast, and most pairs): ``copy_``.
- ``contiguous``: the vectorised and scalar loops agree and only strided sources differ
  (float32 -> bfloat16): the source is made contiguous first, so every element goes through
  loops that agree, wherever runs end.
- ``settle``: the vectorised and scalar loops disagree (float16 -> float32, float64 ->
  bfloat16): after the ``copy_``, one reduction tells whether any NaN came out (amax
  propagates NaN; a float cast makes NaN of NaN and of nothing else), and only then are those
  NaNs converted again by the scalar loop, a few at a time so no vector loop sees them.

Values other than NaN are never touched. The choice is the kernels' on the machine at hand:
two machines with different vector units may still differ in NaN payloads, never in values.
"""

from __future__ import annotations

import sys
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["Strategy", "convert", "settle", "strategy"]

Strategy = Literal["plain", "contiguous", "settle"]

_BITS_DTYPE = {8: "uint8", 16: "int16", 32: "int32", 64: "int64"}
# Shorter than any vector loop: a piece this long is converted by the scalar loop alone.
_SCALAR_PIECE = 3


def _nan_patterns(dtype: torch.dtype) -> torch.Tensor:
    """NaNs of ``dtype``: all of them for 8 and 16-bit types, a sample for wider ones."""
    import torch

    bits = torch.finfo(dtype).bits
    as_int = getattr(torch, _BITS_DTYPE[bits])
    if bits <= 16:
        words = torch.arange(2**bits, dtype=torch.int64)
        words = torch.where(words >= 2 ** (bits - 1), words - 2**bits, words).to(as_int)
    else:
        gen = torch.Generator().manual_seed(0)
        words = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1, (1 << 16,), generator=gen)
        words = words.to(as_int)
    values = words.view(dtype)
    nan = torch.isnan(values.to(torch.float64)) if bits < 64 else torch.isnan(values)
    return values[nan].contiguous()


def _scalar(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    import torch

    flat = src.reshape(-1)
    pieces = [flat[i : i + _SCALAR_PIECE].to(dtype) for i in range(0, flat.numel(), _SCALAR_PIECE)]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)


@cache
def strategy(src: torch.dtype, dst: torch.dtype) -> Strategy:
    """How NaNs cast from ``src`` to ``dst`` get bits that do not depend on torch's loops."""
    import torch

    if not (src.is_floating_point and dst.is_floating_point) or src == dst:
        return "plain"
    pats = _nan_patterns(src)
    if pats.numel() == 0:
        return "plain"
    as_bits = getattr(torch, _BITS_DTYPE[torch.finfo(dst).bits])
    vector = pats.repeat(64).to(dst)[: pats.numel()].view(as_bits)
    scalar = _scalar(pats, dst).view(as_bits)
    strided = torch.stack([pats, pats], 1)[:, 0].to(dst).view(as_bits)
    if not torch.equal(vector, scalar):
        return "settle"
    return "plain" if torch.equal(vector, strided) else "contiguous"


def settle(out: torch.Tensor, src: torch.Tensor) -> None:
    """For a ``settle`` pair: give the NaNs of ``out = src.to(...)`` the scalar loop's bits."""
    import torch

    if out.numel() == 0 or not _may_hold_nan(out, src):
        return
    mask = torch.isnan(out)
    if bool(mask.any()):
        out[mask] = _scalar(src[mask], out.dtype)


def _may_hold_nan(out: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``out`` may hold a NaN, from one vectorised reduction over the wider side (its
    reduction is the fast one: bfloat16's is several times slower than float32's)."""
    import torch

    for t in sorted((out, src), key=lambda t: -t.element_size()):
        try:
            return bool(torch.isnan(t.amax()))
        except RuntimeError:  # no amax kernel for this dtype (float8)
            continue
    return True


def convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` with NaN bits that do not depend on how the tensor is split (nans.py)."""
    decoded = _decode_e4m3(t, dtype)
    if decoded is not None:
        return decoded
    how = strategy(t.dtype, dtype)
    if how == "contiguous":
        t = t.contiguous()
    out = t.to(dtype)
    if how == "settle":
        settle(out, t)
    return out


# float8_e4m3fn -> float32/bfloat16/float16 through a table of every pair of bytes. torch
# converts e4m3 one element at a time (no vector loop: 0.43 s per 8192^2 tensor on one thread,
# against 0.19 s for e5m2, which is a truncated float16); a lookup of two elements per 16-bit
# index in a 256 KiB to 512 KiB table (numpy's take, a tight gather loop) is about twice as
# fast on one thread (bench/bench_fp8.py). The table is built by ``convert`` itself from the
# 256 byte values, so every element, NaNs included, has the bits the cast above gives.
# Smaller tensors (a chunk's edge, a scale) keep torch's path: building the table costs more.
_TABLE_MIN_ELEMENTS = 1 << 16
_PAIR_WORD = {4: "uint64", 2: "uint32"}  # the output's element size -> a pair's numpy type
_TAKE_PAIRS = 1 << 17  # pairs looked up per call (a 1 MiB copy of their indices)


@cache
def _pair_table(src: torch.dtype, dst: torch.dtype) -> Any:
    """``table[b0 | b1 << 8]``: the two converted values of bytes ``b0, b1``, as one word."""
    import numpy as np
    import torch

    single = convert(torch.arange(256, dtype=torch.int32).to(torch.uint8).view(src), dst)
    index = torch.arange(65536, dtype=torch.int64)
    pairs = torch.stack([single[index & 255], single[index >> 8]], 1).contiguous()
    word = np.dtype(_PAIR_WORD[dst.itemsize])
    return pairs.view(torch.uint8).numpy().view(word).reshape(-1)


def _decode_e4m3(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert(t, dtype)`` for a contiguous float8_e4m3fn tensor of at least
    ``_TABLE_MIN_ELEMENTS`` elements into float32, bfloat16 or float16; None otherwise."""
    import torch

    if (
        t.dtype != torch.float8_e4m3fn
        or dtype not in (torch.float32, torch.bfloat16, torch.float16)
        or t.numel() < _TABLE_MIN_ELEMENTS
        or not t.is_contiguous()
        or sys.byteorder != "little"  # (the pair's first byte is the index's low byte)
    ):
        return None
    import numpy as np

    table = _pair_table(t.dtype, dtype)
    codes = t.reshape(-1).view(torch.uint8).numpy()
    n = codes.size
    even = n - n % 2
    out = torch.empty(n, dtype=dtype)
    words = out.view(torch.uint8).numpy()[: even * dtype.itemsize].view(table.dtype)
    # mode="clip": every 16-bit index is in the table, and unlike "raise" it writes into
    # ``out`` without a buffer. In slices: numpy copies the indices into an array of its
    # own index type (8 bytes a pair), which for a whole chunk was as large as the output.
    pairs = codes[:even].view(np.uint16)
    for lo in range(0, pairs.size, _TAKE_PAIRS):
        hi = lo + _TAKE_PAIRS
        np.take(table, pairs[lo:hi], out=words[lo:hi], mode="clip")
    if n % 2:
        out[-1:] = convert(t.reshape(-1)[-1:], dtype)  # (one element: torch's path)
    return out.view(t.shape)
