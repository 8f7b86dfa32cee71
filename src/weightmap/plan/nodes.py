"""Plan nodes: each output tensor is a small tree of operations over input tensors.

Every node records the dtype and shape of its own result, so a tree can be printed, diffed,
serialized and checked without reading a byte of the checkpoint. ``node_to_dict`` /
``node_from_dict`` are the JSON form pinned by the golden plan files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightmap.format.dtypes import DTYPES

__all__ = [
    "Cast",
    "Concat",
    "Node",
    "Permute",
    "Reshape",
    "Slice",
    "Source",
    "Stack",
    "int_cast_fits",
    "node_from_dict",
    "node_to_dict",
]


@dataclass(frozen=True, kw_only=True)
class Node:
    """An operation's result: its safetensors dtype and shape."""

    dtype: str
    shape: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        """The operand nodes."""
        return ()

    def sources(self) -> tuple[Source, ...]:
        """The input tensors this node reads, left to right."""
        out: list[Source] = []
        for c in self.children():
            out.extend(c.sources())
        return tuple(out)

    def describe(self) -> str:
        """A one-line expression such as ``cast(slice(q, dim=0, 0:64))``."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class Source(Node):
    """An input tensor, read whole."""

    name: str

    def sources(self) -> tuple[Source, ...]:
        return (self,)

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
class Concat(Node):
    """``srcs`` joined along an existing ``dim`` (merge)."""

    srcs: tuple[Node, ...]
    dim: int

    def children(self) -> tuple[Node, ...]:
        return self.srcs

    def describe(self) -> str:
        return f"concat({', '.join(s.describe() for s in self.srcs)}, dim={self.dim})"


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
class Permute(Node):
    """Axes of ``src`` reordered: result axis i is source axis ``perm[i]`` (transpose, permute)."""

    src: Node
    perm: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"permute({self.src.describe()}, {list(self.perm)})"


@dataclass(frozen=True, kw_only=True)
class Reshape(Node):
    """``src`` in row-major order viewed with the node's ``shape`` (same element count)."""

    src: Node

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"reshape({self.src.describe()}, {list(self.shape)})"


@dataclass(frozen=True, kw_only=True)
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
    raise ValueError(f"unknown plan node {op!r}")
