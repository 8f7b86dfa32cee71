"""The value kernels: every plan operation on whole torch tensors.

This is the simple, obviously correct semantics of every operation. The streaming executor's
chunks call these kernels on slices; the in-memory executor (``memory.py``) calls them on whole
tensors, and the tests compare the two bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from weightmap.errors import ExecutionError
from weightmap.execute import values
from weightmap.execute.nans import convert
from weightmap.format.dtypes import DTYPES
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
    int_cast_fits,
)

if TYPE_CHECKING:
    import torch

__all__ = ["OPAQUE_DTYPES", "cast", "evaluate", "tensor_bytes"]

# dtypes torch cannot compute with; they may only be moved byte for byte.
OPAQUE_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2"})


def cast(t: torch.Tensor, src: str, dst: str, where: str = "") -> torch.Tensor:
    """Cast ``t`` from dtype ``src`` to ``dst``; a cast that may change values past rounding
    (``int_cast_fits``) checks every value first and stops with the range it found."""
    import torch

    if src == dst:
        return t
    if src in OPAQUE_DTYPES or dst in OPAQUE_DTYPES:
        raise ExecutionError(f"{where}: cannot cast {src} to {dst}: torch cannot compute on it")
    target = DTYPES[dst]
    if t.numel() and not int_cast_fits(src, dst):
        if DTYPES[src].kind in ("int", "uint"):
            # numpy reduces every integer width (torch lacks min/max for uint16..uint64).
            values = t.numpy()
            lo, hi = int(values.min()), int(values.max())
        else:
            lo, hi = _whole_range(t, src, dst, where)
        if target.kind in ("int", "uint"):
            info = torch.iinfo(target.torch())
            low, high = int(info.min), int(info.max)
        else:
            high = int(torch.finfo(target.torch()).max)
            low = -high
        if lo < low or hi > high:
            raise ExecutionError(
                f"{where}: values in [{lo}, {hi}] do not fit in {dst} "
                f"([{low}, {high}]); the cast would change them"
            )
    return convert(t, target.torch())


def _whole_range(t: torch.Tensor, src: str, dst: str, where: str) -> tuple[int, int]:
    """The least and greatest value of a float tensor cast to an integer type, which must all
    be whole numbers: a cast does not round (a `round`, `floor` or `ceil` rule does)."""
    import torch

    wide = t.to(torch.float64)  # every float type's values, exactly
    if not bool(torch.isfinite(wide).all()):
        raise ExecutionError(f"{where}: a NaN or an infinity cannot be cast from {src} to {dst}")
    if not bool((wide == wide.trunc()).all()):
        bad = float(wide[wide != wide.trunc()][0])
        raise ExecutionError(
            f"{where}: {bad!r} is not a whole number: a cast from {src} to {dst} does not round"
            " (a `round`, `floor` or `ceil` rule before it does)"
        )
    return int(wide.min()), int(wide.max())


def same(tensors: Sequence[torch.Tensor], node: Same, where: str) -> torch.Tensor:
    """The first of ``tensors``, once every other holds the same bytes (``merge ... same``);
    ExecutionError naming the first member that differs. Bytes, not values: ``-0.0`` is not
    ``0.0``, and a NaN equals a NaN of the same bits."""
    import torch

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    first = raw(tensors[0])
    for src, t in zip(node.srcs[1:], tensors[1:], strict=True):
        if not torch.equal(raw(t), first):
            raise ExecutionError(
                f"{where}: {src.describe()} holds other bytes than {node.srcs[0].describe()}, "
                "which `merge ... same` takes as one tensor every member holds whole; the "
                "members come from different checkpoints, or the tensor is split, not "
                "replicated (merge it along its dim)"
            )
    return tensors[0]


def slice_first(node: Slice) -> Node:
    """``node`` with its slice taken before the casts and permutes under it, down to a
    narrowing cast (the same values); ``node`` itself where there is none.

    A narrowing cast checks every value it casts: sliced first, it checks the values an output
    holds, not those of a part no output keeps (the rest of a split whose other part is
    dropped, transposed or not). Every executor evaluates a slice so (``evaluate`` here, the
    streaming executor's regions), so that they stop on the same inputs.
    """
    chain: list[Permute | Cast] = []
    below: Node = node.src
    while isinstance(below, Permute) or (isinstance(below, Cast) and not below.narrowing):
        chain.append(below)
        below = below.src
    if not (isinstance(below, Cast) and below.narrowing):
        return node
    chain.append(below)
    # The slice's dim in each node's source, walking down: a permute moves it.
    dim = node.dim
    for n in chain:
        if isinstance(n, Permute):
            dim = n.perm[dim]
    bottom = chain[-1].src
    shape = list(bottom.shape)
    shape[dim] = node.stop - node.start
    sunk: Node = replace(node, src=bottom, dim=dim, dtype=bottom.dtype, shape=tuple(shape))
    # Back up: each node over the sliced source, its shape narrowed as the slice narrows it.
    for n in reversed(chain):
        if isinstance(n, Permute):
            dims = sunk.shape
            sunk = replace(n, src=sunk, shape=tuple(dims[p] for p in n.perm))
        else:
            sunk = replace(n, src=sunk, shape=sunk.shape)
    return sunk


def evaluate(node: Node, get: Callable[[str], torch.Tensor], where: str = "") -> torch.Tensor:
    """The tensor a node produces, given ``get(name)`` for its input tensors."""
    import torch

    if isinstance(node, Source):
        return get(node.name)
    if isinstance(node, Cast):
        return cast(evaluate(node.src, get, where), node.src.dtype, node.dtype, where)
    if node.dtype in OPAQUE_DTYPES and not isinstance(node, Reshape):
        raise ExecutionError(
            f"{where}: {node.dtype} tensors can only be renamed, kept or reshaped here"
        )
    if isinstance(node, Slice):
        sunk = slice_first(node)
        if sunk is not node:
            return evaluate(sunk, get, where)
        return evaluate(node.src, get, where).narrow(node.dim, node.start, node.stop - node.start)
    if isinstance(node, Concat):
        return torch.cat([evaluate(s, get, where) for s in node.srcs], node.dim)
    if isinstance(node, Same):
        return same([evaluate(s, get, where) for s in node.srcs], node, where)
    if isinstance(node, Stack):
        return torch.stack([evaluate(s, get, where) for s in node.srcs], node.dim)
    if isinstance(node, Permute):
        return evaluate(node.src, get, where).permute(node.perm)
    if isinstance(node, Arith):
        return values.arith(evaluate(node.src, get, where), node)
    if isinstance(node, Binary):
        return values.binary(evaluate(node.a, get, where), evaluate(node.b, get, where), node)
    if isinstance(node, Quantize):
        return values.quantize(evaluate(node.src, get, where), node)
    if isinstance(node, Mask):
        return values.mask(evaluate(node.src, get, where), node, where)
    if isinstance(node, Matmul):
        return values.matmul(evaluate(node.a, get, where), evaluate(node.b, get, where), node)
    if isinstance(node, Unpack):
        return values.unpack(evaluate(node.src, get, where), node)
    if isinstance(node, Pack):
        return values.pack(evaluate(node.src, get, where), node, where)
    if isinstance(node, Gather):
        src, index = evaluate(node.src, get, where), evaluate(node.index, get, where)
        return values.gather(src, index, node, where)
    if isinstance(node, Lookup):
        codes, table = evaluate(node.codes, get, where), evaluate(node.table, get, where)
        return values.lookup(codes, table, node, where)
    if isinstance(node, Round):
        return values.round_values(evaluate(node.src, get, where), node)
    if isinstance(node, Clamp):
        return values.clamp(evaluate(node.src, get, where), node)
    if isinstance(node, Reduce):
        return values.reduce(evaluate(node.src, get, where), node)
    if isinstance(node, Reshape):
        src = evaluate(node.src, get, where)
        if node.dtype in OPAQUE_DTYPES:
            if src.dtype != torch.uint8:  # an F4 view with its packed shape: go to raw bytes
                src = src.view(torch.uint8)
            return src.reshape(-1)
        return src.reshape(node.shape)
    raise TypeError(f"unknown plan node {type(node).__name__}")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The row-major little-endian bytes of a tensor, as safetensors stores them."""
    import torch

    if t.numel() == 0:
        return b""
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        # contiguous() may keep an odd stride on size-1 dims; a 1-D copy never does.
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().tobytes()
