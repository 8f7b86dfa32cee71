"""The value kernels: every plan operation on whole torch tensors.

This is the simple, obviously correct semantics of every operation. The streaming executor's
chunks call these kernels on slices; the in-memory executor (``memory.py``) calls them on whole
tensors, and the tests compare the two bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from weightmap.errors import ExecutionError
from weightmap.execute import values
from weightmap.execute.nans import convert
from weightmap.format.dtypes import DTYPES
from weightmap.plan.nodes import (
    Arith,
    Binary,
    Cast,
    Concat,
    Mask,
    Node,
    Permute,
    Quantize,
    Reshape,
    Slice,
    Source,
    Stack,
    int_cast_fits,
)

if TYPE_CHECKING:
    import torch

__all__ = ["OPAQUE_DTYPES", "cast", "evaluate", "tensor_bytes"]

# dtypes torch cannot compute with; they may only be moved byte for byte.
OPAQUE_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2"})


def cast(t: torch.Tensor, src: str, dst: str, where: str = "") -> torch.Tensor:
    """Cast ``t`` from dtype ``src`` to ``dst``; integer narrowing checks every value fits."""
    import torch

    if src == dst:
        return t
    if src in OPAQUE_DTYPES or dst in OPAQUE_DTYPES:
        raise ExecutionError(f"{where}: cannot cast {src} to {dst}: torch cannot compute on it")
    target = DTYPES[dst]
    if t.numel() and not int_cast_fits(src, dst):
        # numpy reduces every integer width (torch lacks min/max for uint16..uint64).
        values = t.numpy()
        info = torch.iinfo(target.torch())
        lo, hi = int(values.min()), int(values.max())
        if lo < info.min or hi > info.max:
            raise ExecutionError(
                f"{where}: values in [{lo}, {hi}] do not fit in {dst} "
                f"([{info.min}, {info.max}]); the cast would change them"
            )
    return convert(t, target.torch())


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
        return evaluate(node.src, get, where).narrow(node.dim, node.start, node.stop - node.start)
    if isinstance(node, Concat):
        return torch.cat([evaluate(s, get, where) for s in node.srcs], node.dim)
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
