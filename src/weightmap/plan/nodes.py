"""Plan nodes: each output tensor is a small tree of operations over input tensors.

Every node records the dtype and shape of its own result, so a tree can be printed, diffed,
serialized and checked without reading a byte of the checkpoint. ``node_to_dict`` /
``node_from_dict`` are the JSON form pinned by the golden plan files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from weightmap.format.dtypes import DTYPES
from weightmap.format.slots import make_many, slot_setter

__all__ = [
    "Arith",
    "Binary",
    "Cast",
    "Concat",
    "Mask",
    "Node",
    "Permute",
    "Quantize",
    "Reshape",
    "Slice",
    "Source",
    "Stack",
    "int_cast_fits",
    "node_from_dict",
    "node_to_dict",
    "only_sources",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """An operation's result: its safetensors dtype and shape."""

    dtype: str
    shape: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        """The operand nodes."""
        return ()

    def sources(self) -> tuple[Source, ...]:
        """The input tensors this node reads, left to right."""
        children = self.children()
        # A stack or merge of inputs (every expert of a layer): its children are the answer,
        # seen at C speed rather than with a call per child.
        if only_sources(children):
            return children  # type: ignore[return-value]
        out: list[Source] = []
        for c in children:
            out.extend(c.sources())
        return tuple(out)

    def describe(self) -> str:
        """A one-line expression such as ``cast(slice(q, dim=0, 0:64))``."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True, slots=True)
class Source(Node):
    """An input tensor, read whole."""

    name: str

    @classmethod
    def of(cls, name: str, dtype: str, shape: tuple[int, ...]) -> Source:
        """``Source(dtype=dtype, shape=shape, name=name)``, its slots filled directly rather
        than through the frozen dataclass's ``__init__`` (one ``object.__setattr__`` per
        field): one is made per input tensor of every compile."""
        node = _new(cls)
        _set_dtype(node, dtype)
        _set_shape(node, shape)
        _set_name(node, name)
        return node

    @classmethod
    def many(
        cls,
        count: int,
        names: Iterable[str],
        dtypes: Iterable[str],
        shapes: Iterable[tuple[int, ...]],
    ) -> list[Source]:
        """``count`` sources from columns, as :meth:`of` makes each: one per input tensor of a
        rename of a whole checkpoint, at once."""
        fields = ((_set_dtype, dtypes), (_set_shape, shapes), (_set_name, names))
        return make_many(cls, count, fields)

    def sources(self) -> tuple[Source, ...]:
        return (self,)

    def describe(self) -> str:
        return self.name


def only_sources(nodes: tuple[Node, ...]) -> bool:
    """Whether every one of ``nodes`` is an input read whole (and there is one at least)."""
    return set(map(type, nodes)) == _JUST_SOURCE


_JUST_SOURCE = {Source}

# The slots' own setters, for Source.of (format/slots.py).
_new = object.__new__
_set_dtype = slot_setter(Node, "dtype")
_set_shape = slot_setter(Node, "shape")
_set_name = slot_setter(Source, "name")


@dataclass(frozen=True, kw_only=True, slots=True)
class Slice(Node):
    """``src`` narrowed to ``start:stop`` along ``dim`` (split, chunk, unstack)."""

    src: Node
    dim: int
    start: int
    stop: int

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"slice({self.src.describe()}, dim={self.dim}, {self.start}:{self.stop})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Concat(Node):
    """``srcs`` joined along an existing ``dim`` (merge)."""

    srcs: tuple[Node, ...]
    dim: int

    def children(self) -> tuple[Node, ...]:
        return self.srcs

    def describe(self) -> str:
        return f"concat({', '.join(s.describe() for s in self.srcs)}, dim={self.dim})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Stack(Node):
    """``srcs`` (all the same shape) stacked along a new ``dim``."""

    srcs: tuple[Node, ...]
    dim: int

    def children(self) -> tuple[Node, ...]:
        return self.srcs

    def describe(self) -> str:
        if len(self.srcs) > 4:
            inner = f"{self.srcs[0].describe()}, ... {len(self.srcs)} tensors"
        else:
            inner = ", ".join(s.describe() for s in self.srcs)
        return f"stack({inner}, dim={self.dim})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Permute(Node):
    """Axes of ``src`` reordered: result axis i is source axis ``perm[i]`` (transpose, permute)."""

    src: Node
    perm: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"permute({self.src.describe()}, {list(self.perm)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Reshape(Node):
    """``src`` in row-major order viewed with the node's ``shape`` (same element count)."""

    src: Node

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"reshape({self.src.describe()}, {list(self.shape)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Cast(Node):
    """``src`` converted to the node's ``dtype``.

    Float to float rounds to nearest even (as torch does). An integer cast to a narrower type
    (see :attr:`narrowing`) must be range-checked by the executor: a value that does not fit
    is an error, never a wrap-around.
    """

    src: Node

    @property
    def narrowing(self) -> bool:
        """True for integer casts that may not hold every source value."""
        return not int_cast_fits(self.src.dtype, self.dtype)

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"cast({self.src.describe()}, {self.dtype})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Arith(Node):
    """``src`` plus or times a constant (add, mul).

    ``src`` is converted to the ``compute`` dtype, combined with ``value`` there (torch's
    arithmetic in that dtype, rounding once), and the result rounded to the node's ``dtype``.
    """

    src: Node
    op: str  # "add" or "mul"
    value: int | float
    compute: str

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"{self.op}({self.src.describe()}, {self.value}, in {self.compute})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Binary(Node):
    """``a`` plus or times ``b``, elementwise; ``b`` is broadcast over blocks of ``a``.

    ``block`` gives, for the last ``len(block)`` dims of ``a``, how many of its elements each
    element of ``b`` covers (``b``'s size there is the ceiling of ``a``'s over the block, a
    partial block at the end taking the last entry); ``b`` matches ``a`` in the other dims.
    Both are converted to ``compute``, combined there, and rounded to the node's ``dtype``:
    fp8 dequantization is ``mul(weight, weight_scale_inv)`` in float32, to bfloat16.
    """

    a: Node
    b: Node
    op: str  # "add" or "mul"
    block: tuple[int, ...]
    compute: str

    def children(self) -> tuple[Node, ...]:
        return (self.a, self.b)

    def describe(self) -> str:
        block = f", block {list(self.block)}" if self.block else ""
        return f"{self.op}({self.a.describe()}, {self.b.describe()}{block}, in {self.compute})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Quantize(Node):
    """Block-scaled float8 quantization of ``src`` over blocks of its last two dims.

    Per block, in float32: ``scale = fp8_max / amax(|block|)`` (1 for an all-zero block, as
    transformers' ``Fp8Quantize``); ``part`` "values" is ``clamp(block * scale)`` converted to
    the node's float8 ``dtype``, "scales" is ``1 / scale`` (float32, one per block, the
    ``weight_scale_inv`` layout). A partial block at an edge is a block of the elements it has.
    """

    src: Node
    block: tuple[int, int]
    part: str  # "values" or "scales"
    fp8: str  # the float8 dtype of the values (its maximum sets the scale)

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"quantize_{self.part}({self.src.describe()}, {self.fp8}, block {list(self.block)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Mask(Node):
    """A boolean vector of length ``size``, true at the positions ``src`` holds.

    With ``plus_index`` the position of element ``i`` is ``src[i] + i`` (EAGLE-3's ``t2d`` from
    ``d2t``). A position out of range, or twice, is an execution error.
    """

    src: Node
    size: int
    plus_index: bool

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        plus = " plus index" if self.plus_index else ""
        return f"mask({self.src.describe()}, size {self.size}{plus})"


def int_cast_fits(src: str, dst: str) -> bool:
    """True unless ``src`` -> ``dst`` is an integer cast that can lose values."""
    a, b = DTYPES[src], DTYPES[dst]
    if a.kind not in ("int", "uint") or b.kind not in ("int", "uint"):
        return True
    if a.kind == b.kind:
        return b.bits >= a.bits
    return a.kind == "uint" and b.bits > a.bits


def node_to_dict(n: Node) -> dict[str, Any]:
    """One node (and its operands) as a JSON-ready dict keyed by ``op``."""
    d: dict[str, Any] = {"op": type(n).__name__.lower(), "dtype": n.dtype, "shape": list(n.shape)}
    if isinstance(n, Source):
        d["name"] = n.name
    elif isinstance(n, Slice):
        d.update(src=node_to_dict(n.src), dim=n.dim, start=n.start, stop=n.stop)
    elif isinstance(n, (Concat, Stack)):
        d.update(srcs=[node_to_dict(s) for s in n.srcs], dim=n.dim)
    elif isinstance(n, Permute):
        d.update(src=node_to_dict(n.src), perm=list(n.perm))
    elif isinstance(n, (Reshape, Cast)):
        d["src"] = node_to_dict(n.src)
    elif isinstance(n, Arith):
        d.update(src=node_to_dict(n.src), arith=n.op, value=n.value, compute=n.compute)
    elif isinstance(n, Binary):
        d.update(a=node_to_dict(n.a), b=node_to_dict(n.b), arith=n.op, block=list(n.block))
        d["compute"] = n.compute
    elif isinstance(n, Quantize):
        d.update(src=node_to_dict(n.src), block=list(n.block), part=n.part, fp8=n.fp8)
    elif isinstance(n, Mask):
        d.update(src=node_to_dict(n.src), size=n.size, plus_index=n.plus_index)
    return d


def node_from_dict(d: dict[str, Any]) -> Node:
    """Inverse of :func:`node_to_dict`."""
    op, dt, shape = d["op"], d["dtype"], tuple(d["shape"])
    if op == "source":
        return Source(dtype=dt, shape=shape, name=d["name"])
    if op == "slice":
        src = node_from_dict(d["src"])
        return Slice(dtype=dt, shape=shape, src=src, dim=d["dim"], start=d["start"], stop=d["stop"])
    if op in ("concat", "stack"):
        srcs = tuple(node_from_dict(s) for s in d["srcs"])
        kind = Concat if op == "concat" else Stack
        return kind(dtype=dt, shape=shape, srcs=srcs, dim=d["dim"])
    if op == "permute":
        return Permute(dtype=dt, shape=shape, src=node_from_dict(d["src"]), perm=tuple(d["perm"]))
    if op == "reshape":
        return Reshape(dtype=dt, shape=shape, src=node_from_dict(d["src"]))
    if op == "cast":
        return Cast(dtype=dt, shape=shape, src=node_from_dict(d["src"]))
    if op == "arith":
        src = node_from_dict(d["src"])
        return Arith(dtype=dt, shape=shape, src=src, op=d["arith"], value=d["value"],
                     compute=d["compute"])  # fmt: skip
    if op == "binary":
        a, b = node_from_dict(d["a"]), node_from_dict(d["b"])
        return Binary(dtype=dt, shape=shape, a=a, b=b, op=d["arith"], block=tuple(d["block"]),
                      compute=d["compute"])  # fmt: skip
    if op == "quantize":
        block = (d["block"][0], d["block"][1])
        return Quantize(dtype=dt, shape=shape, src=node_from_dict(d["src"]), block=block,
                        part=d["part"], fp8=d["fp8"])  # fmt: skip
    if op == "mask":
        return Mask(dtype=dt, shape=shape, src=node_from_dict(d["src"]), size=d["size"],
                    plus_index=d["plus_index"])  # fmt: skip
    raise ValueError(f"unknown plan node {op!r}")
