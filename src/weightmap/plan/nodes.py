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
    "Clamp",
    "Concat",
    "Gather",
    "Lookup",
    "Mask",
    "Matmul",
    "Node",
    "Pack",
    "Permute",
    "Quantize",
    "Reduce",
    "Reshape",
    "Round",
    "Same",
    "Slice",
    "Source",
    "Stack",
    "Unpack",
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
class Same(Node):
    """``srcs[0]``, where every one of ``srcs`` must hold the same bytes (``merge ... same``:
    a tensor each tensor-parallel rank holds whole), checked as it is computed."""

    srcs: tuple[Node, ...]

    def children(self) -> tuple[Node, ...]:
        return self.srcs

    def describe(self) -> str:
        return f"same({', '.join(s.describe() for s in self.srcs)})"


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

    Float to float, and integer to float, rounds to nearest even (as torch does). A cast that
    may change values past that (see :attr:`narrowing`: an integer to a narrower integer, a
    float to an integer, an integer to a float of smaller range) is checked by the executor: a
    value that does not fit, or a float that is not a whole number, is an error, never a
    wrap-around or a silent truncation.
    """

    src: Node

    @property
    def narrowing(self) -> bool:
        """True for casts that may not hold every source value (checked when run)."""
        return not int_cast_fits(self.src.dtype, self.dtype)

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"cast({self.src.describe()}, {self.dtype})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Arith(Node):
    """``src`` plus, minus or times a constant (add, sub, mul).

    ``src`` is converted to the ``compute`` dtype, combined with ``value`` there (torch's
    arithmetic in that dtype, rounding once), and the result rounded to the node's ``dtype``.
    """

    src: Node
    op: str  # "add", "sub" or "mul"
    value: int | float
    compute: str

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"{self.op}({self.src.describe()}, {self.value}, in {self.compute})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Binary(Node):
    """``a`` plus, minus or times ``b``, elementwise; ``b`` is broadcast over blocks of ``a``.

    ``block`` gives, for the last ``len(block)`` dims of ``a``, how many of its elements each
    element of ``b`` covers (``b``'s size there is the ceiling of ``a``'s over the block, a
    partial block at the end taking the last entry); ``b`` matches ``a`` in the other dims.
    Both are converted to ``compute``, combined there, and rounded to the node's ``dtype``:
    fp8 dequantization is ``mul(weight, weight_scale_inv)`` in float32, to bfloat16.
    """

    a: Node
    b: Node
    op: str  # "add", "sub" or "mul"
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Matmul(Node):
    """The matrix product ``a @ b`` of two 2-D tensors (``[m, k] @ [k, n]``).

    Both are converted to ``compute`` and multiplied there in tiles of fixed shape (see
    ``execute/values.py``), so each output element is the same whatever part of the output is
    computed at once; the result is rounded once to the node's ``dtype``.
    """

    a: Node
    b: Node
    compute: str

    def children(self) -> tuple[Node, ...]:
        return (self.a, self.b)

    def describe(self) -> str:
        return f"matmul({self.a.describe()}, {self.b.describe()}, in {self.compute})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Unpack(Node):
    """Each integer word of ``src`` split into ``bits``-bit codes along ``dim``.

    A word of w bits holds ``w // bits`` codes; code ``i`` of a word (its i-th value along
    ``dim``) is the word's field number ``order[i]``, fields counted from the least
    significant bits (field j is ``(word >> (j * bits)) & (2**bits - 1)``). ``dim`` grows by
    ``w // bits``; the codes are unsigned (U8, or U16 for 16-bit fields).
    """

    src: Node
    dim: int
    bits: int
    order: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return _packing("unpack", self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Pack(Node):
    """The inverse of :class:`Unpack`: each run of ``w // bits`` codes of ``src`` along
    ``dim`` becomes one word of the node's integer dtype (w bits), code ``i`` going to field
    ``order[i]``. A code outside ``0 .. 2**bits - 1`` is an execution error."""

    src: Node
    dim: int
    bits: int
    order: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return _packing("pack", self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Round(Node):
    """``src`` rounded to whole numbers, in its own float dtype (exact: every whole number
    near a value of a float type is a value of it): ``mode`` "round" (nearest, ties to
    even), "floor" or "ceil"."""

    src: Node
    mode: str

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"{self.mode}({self.src.describe()})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Clamp(Node):
    """``src`` limited to ``[low, high]`` (a bound rounded once to the dtype; NaN stays NaN)."""

    src: Node
    low: int | float
    high: int | float

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"clamp({self.src.describe()}, {self.low}, {self.high})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduce(Node):
    """``op`` ("amax", "amin" or "sum") of ``src`` along ``dim``: over the whole dim (which the
    result no longer has), or over each run of ``group`` elements (the dim becomes its number
    of groups). amax/amin are exact (NaN wins); a sum adds the elements in order, each sum
    rounded in ``compute``, and rounds once to the node's dtype."""

    src: Node
    op: str
    dim: int
    group: int  # 0: the whole dim
    compute: str

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        group = f", group {self.group}" if self.group else ""
        return f"{self.op}({self.src.describe()}, dim={self.dim}{group})"


def _packing(word: str, n: Unpack | Pack) -> str:
    return f"{word}({n.src.describe()}, dim={n.dim}, bits {n.bits}, order {list(n.order)})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Gather(Node):
    """Slices of ``src`` along ``dim`` picked by ``index``, a 1-D integer tensor: result index
    ``i`` along ``dim`` is ``src``'s index ``index[i]`` (``src.index_select(dim, index)``,
    GPTQ's ``scales[g_idx]``). An index out of range is an execution error."""

    src: Node
    index: Node
    dim: int

    def children(self) -> tuple[Node, ...]:
        return (self.src, self.index)

    def describe(self) -> str:
        return f"gather({self.src.describe()}, dim={self.dim}, by {self.index.describe()})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Lookup(Node):
    """Each integer code of ``codes`` replaced by its entry of ``table``, a small 1-D tensor
    (``table[codes]``: a codebook). The result has the codes' shape and the table's dtype; a
    code outside the table is an execution error."""

    codes: Node
    table: Node

    def children(self) -> tuple[Node, ...]:
        return (self.codes, self.table)

    def describe(self) -> str:
        return f"lookup({self.codes.describe()}, {self.table.describe()})"


# The largest finite value of each float type a cast from an integer may go to.
_FLOAT_MAX = {"F64": 1.7976931348623157e308, "F32": 3.4028234663852886e38,
              "BF16": 3.3895313892515355e38, "F16": 65504.0, "F8_E4M3": 448.0,
              "F8_E5M2": 57344.0}  # fmt: skip
_INTS = ("int", "uint")


def int_cast_fits(src: str, dst: str) -> bool:
    """True unless ``src`` -> ``dst`` is a cast that can change values past a float's rounding:
    an integer cast to a narrower type, a float to an integer (which must hold whole numbers
    in range), or an integer to a float type whose largest value is below the integer's."""
    a, b = DTYPES[src], DTYPES[dst]
    if a.kind in _INTS and b.kind in _INTS:
        if a.kind == b.kind:
            return b.bits >= a.bits
        return a.kind == "uint" and b.bits > a.bits
    if b.kind in _INTS:
        return a.kind not in ("float", "complex")
    if a.kind in _INTS and dst in _FLOAT_MAX:
        largest: int = 2**a.bits - 1 if a.kind == "uint" else 2 ** (a.bits - 1)
        return largest <= _FLOAT_MAX[dst]
    return True


def node_to_dict(n: Node) -> dict[str, Any]:
    """One node (and its operands) as a JSON-ready dict keyed by ``op``."""
    d: dict[str, Any] = {"op": type(n).__name__.lower(), "dtype": n.dtype, "shape": list(n.shape)}
    if isinstance(n, Source):
        d["name"] = n.name
    elif isinstance(n, Slice):
        d.update(src=node_to_dict(n.src), dim=n.dim, start=n.start, stop=n.stop)
    elif isinstance(n, (Concat, Stack)):
        d.update(srcs=[node_to_dict(s) for s in n.srcs], dim=n.dim)
    elif isinstance(n, Same):
        d["srcs"] = [node_to_dict(s) for s in n.srcs]
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
    elif isinstance(n, Matmul):
        d.update(a=node_to_dict(n.a), b=node_to_dict(n.b), compute=n.compute)
    elif isinstance(n, (Unpack, Pack)):
        d.update(src=node_to_dict(n.src), dim=n.dim, bits=n.bits, order=list(n.order))
    elif isinstance(n, Gather):
        d.update(src=node_to_dict(n.src), index=node_to_dict(n.index), dim=n.dim)
    elif isinstance(n, Lookup):
        d.update(codes=node_to_dict(n.codes), table=node_to_dict(n.table))
    elif isinstance(n, Round):
        d.update(src=node_to_dict(n.src), mode=n.mode)
    elif isinstance(n, Clamp):
        d.update(src=node_to_dict(n.src), low=n.low, high=n.high)
    elif isinstance(n, Reduce):
        d.update(src=node_to_dict(n.src), reduce=n.op, dim=n.dim, group=n.group)
        d["compute"] = n.compute
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
    if op == "same":
        return Same(dtype=dt, shape=shape, srcs=tuple(node_from_dict(s) for s in d["srcs"]))
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
    if op == "matmul":
        a, b = node_from_dict(d["a"]), node_from_dict(d["b"])
        return Matmul(dtype=dt, shape=shape, a=a, b=b, compute=d["compute"])
    if op in ("unpack", "pack"):
        packing: type[Unpack | Pack] = Unpack if op == "unpack" else Pack
        return packing(dtype=dt, shape=shape, src=node_from_dict(d["src"]), dim=d["dim"],
                       bits=d["bits"], order=tuple(d["order"]))  # fmt: skip
    if op == "gather":
        src, index = node_from_dict(d["src"]), node_from_dict(d["index"])
        return Gather(dtype=dt, shape=shape, src=src, index=index, dim=d["dim"])
    if op == "lookup":
        codes, table = node_from_dict(d["codes"]), node_from_dict(d["table"])
        return Lookup(dtype=dt, shape=shape, codes=codes, table=table)
    if op == "round":
        return Round(dtype=dt, shape=shape, src=node_from_dict(d["src"]), mode=d["mode"])
    if op == "clamp":
        src = node_from_dict(d["src"])
        return Clamp(dtype=dt, shape=shape, src=src, low=d["low"], high=d["high"])
    if op == "reduce":
        return Reduce(dtype=dt, shape=shape, src=node_from_dict(d["src"]), op=d["reduce"],
                      dim=d["dim"], group=d["group"], compute=d["compute"])  # fmt: skip
    raise ValueError(f"unknown plan node {op!r}")
