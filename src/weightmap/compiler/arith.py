"""Value rules: arithmetic with constants and with other tensors, fp8 blocks, masks, the
matrix product, and the primitives of quantized formats (packed codes, gathers, tables).

Every check that can be made on names, dtypes and shapes is made here, before a byte is
read: float dtypes only for arithmetic (integers and booleans are never silently converted: a
`cast` says so), a compute dtype that torch computes in, block sizes that fit, a scale tensor
whose shape is the block grid of its weight (``ceil`` of each dim over the block), two outputs
for a quantization, integer words that hold whole codes, index tensors of an integer dtype.
What only the data shows (an index out of range, a code too wide for its field) stops the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from weightmap.compiler.ops import (
    FLOAT_CASTS,
    Match,
    RuleProblem,
    as_int,
    as_ints,
    evaluate,
    namer,
    norm_dim,
    output_name,
)
from weightmap.format.dtypes import DTYPES, TensorSpec
from weightmap.language import ast as A
from weightmap.language.expr import resolve_dtype
from weightmap.language.values import Scope, brief
from weightmap.plan.nodes import (
    Arith,
    Binary,
    Clamp,
    Gather,
    Lookup,
    Mask,
    Matmul,
    Node,
    Pack,
    Quantize,
    Reduce,
    Round,
    Unpack,
)

__all__ = ["PAIR_OPS", "VALUE_OPS", "binary_node", "build_value", "scale_shape"]

ROUNDING = frozenset({"round", "floor", "ceil"})
REDUCTIONS = frozenset({"amax", "amin", "sum"})
VALUE_OPS = frozenset(
    {"add", "sub", "mul", "quantize", "mask", "matmul", "gather", "lookup", "unpack", "pack",
     "clamp", *ROUNDING, *REDUCTIONS}
)  # fmt: skip
# The rules that always combine two tensors, one per pattern (add/sub/mul may take one).
PAIR_OPS = frozenset({"matmul", "gather", "lookup"})
INT_KINDS = ("int", "uint")
# Code widths a word splits into: each divides every integer width.
CODE_BITS = (1, 2, 4, 8, 16)
# The dtypes arithmetic runs in: torch computes in these (float8 only stores).
COMPUTE_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
DEFAULT_BLOCK = (128, 128)


def _dtype(word: str | None, default: str, what: str, allowed: frozenset[str]) -> str:
    if word is None:
        return default
    dt = resolve_dtype(word)
    if dt is None:
        raise RuleProblem(f"unknown dtype `{word}` for the {what}")
    if dt not in allowed:
        raise RuleProblem(f"the {what} must be one of {', '.join(sorted(allowed))}, not {dt}")
    return dt


def _float_input(spec: TensorSpec) -> None:
    if spec.dtype not in FLOAT_CASTS:
        # (No "cast it first": casts go between float types or between integer types, so the
        # compiler would refuse that cast too.)
        raise RuleProblem(
            f"`{spec.name}` is {spec.dtype}: arithmetic runs on float tensors only "
            f"({', '.join(sorted(FLOAT_CASTS))}), and a {spec.dtype} tensor cannot be cast to "
            "one; leave it out of this rule (a narrower pattern, or `where dtype == ...`)"
        )


# The largest finite value of each compute dtype. torch converts the constant to the compute
# dtype, where a larger one is infinite: every result would be an infinity or NaN, silently.
_LARGEST = {"F64": 1.7976931348623157e308, "F32": 3.4028234663852886e38,
            "BF16": 3.3895313892515355e38, "F16": 65504.0}  # fmt: skip
_INT64 = 2**63


def _constant(rule: A.Rule, s: Scope, compute: str) -> int | float:
    assert rule.value is not None
    v = evaluate(rule.value, s)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RuleProblem(f"the value to {rule.op} must be a number, got {brief(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise RuleProblem(f"the value to {rule.op} must be finite, got {v}")
    if isinstance(v, int) and not -_INT64 <= v < _INT64:
        # torch reads a Python int as a 64-bit integer first: past that it raises midway.
        raise RuleProblem(
            f"the value to {rule.op}, {brief(v)}, is past the 64-bit integers torch reads;"
            " write it as a float (1e20)"
        )
    if abs(float(v)) > _LARGEST[compute]:
        wider = "; write `in f64` to compute in f64" if compute != "F64" else ""
        raise RuleProblem(
            f"the value to {rule.op}, {brief(v)}, does not fit the compute dtype {compute}"
            f" (largest {_LARGEST[compute]:g}{wider})"
        )
    return v


def block_of(
    rule: A.Rule, s: Scope, shape: tuple[int, ...], default: tuple[int, ...] | None
) -> tuple[int, ...]:
    """The rule's ``block [...]``: positive ints, one per trailing dim of ``shape`` (at most
    its rank); -1 is the whole of its dim (GPTQ's group_size -1: one group of every row)."""
    if rule.block is None:
        if default is None:
            return ()
        return default
    rank = len(shape)
    block = tuple(as_ints(evaluate(rule.block, s), "block"))
    if not block or any(b <= 0 and b != -1 for b in block) or len(block) > rank:
        raise RuleProblem(
            f"block {list(block)} must be one to {rank} positive sizes, or -1 for a whole dim "
            "(one per trailing dim)"
        )
    trailing = shape[rank - len(block) :]
    return tuple(d if b == -1 else b for b, d in zip(block, trailing, strict=True))


def scale_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The block grid of ``shape``: ``ceil(d / b)`` in the trailing dims the block covers."""
    k = len(block)
    lead = shape[: len(shape) - k]
    return (*lead, *(-(-d // b) for d, b in zip(shape[len(shape) - k :], block, strict=True)))


def build_value(rule: A.Rule, m: Match, scope: Scope, emit: Callable[[str, Node], None]) -> None:
    """A one-input value rule (add/mul by a constant, quantize, mask) on one match."""
    spec, src = m.spec, m.node
    s = scope.with_tensor(spec, m.caps)
    if rule.op == "mask":
        emit(output_name(rule, s), _mask(rule, spec, src, s))
        return
    if rule.op in PAIR_OPS:
        raise RuleProblem(
            f"`{rule.op}` takes two tensors, one per pattern "
            f'(`{rule.op} "{rule.patterns[0].text}", "..."`)'
        )
    if rule.op in ("unpack", "pack"):
        emit(output_name(rule, s), _packing(rule, spec, src, s))
        return
    if rule.op in REDUCTIONS:
        emit(output_name(rule, s), _reduce(rule, spec, src, s))
        return
    _float_input(spec)
    if rule.op in ROUNDING:
        emit(output_name(rule, s), Round(dtype=spec.dtype, shape=spec.shape, src=src, mode=rule.op))
        return
    if rule.op == "clamp":
        low, high = _bounds(rule, s)
        emit(output_name(rule, s), Clamp(dtype=spec.dtype, shape=spec.shape, src=src, low=low,
                                         high=high))  # fmt: skip
        return
    if rule.op == "quantize":
        values, scales = _quantize(rule, spec, src, s)
        emit(namer(rule.outputs[0])(s), values)
        emit(namer(rule.outputs[1])(s), scales)
        return
    if rule.value is None:
        raise RuleProblem(
            f'`{rule.op}` with one pattern needs a value (`{rule.op} "..." 1.0`); to combine two '
            "tensors, list both patterns"
        )
    if rule.block is not None:
        raise RuleProblem("`block` applies to two tensors (the second one broadcast over blocks)")
    compute = _dtype(rule.compute, "F32", "compute dtype (`in`)", COMPUTE_DTYPES)
    out = _dtype(rule.to_dtype, spec.dtype, "result dtype (`to`)", FLOAT_CASTS)
    value = _constant(rule, s, compute)
    node = Arith(dtype=out, shape=spec.shape, src=src, op=rule.op, value=value, compute=compute)
    emit(output_name(rule, s), node)


def binary_node(rule: A.Rule, ordered: list[Match], scope: Scope, caps: dict[str, Any]) -> Node:
    """add/sub/mul, matmul, gather or lookup of two tensors (one group: the first pattern's
    tensor, then the second's)."""
    if len(ordered) != 2:
        raise RuleProblem(f"`{rule.op}` combines two tensors, one per pattern; got {len(ordered)}")
    if rule.op in PAIR_OPS:
        s = Scope(scope.params, scope.config, caps)
        return _pair(rule, ordered[0], ordered[1], s)
    if rule.value is not None:
        raise RuleProblem(f"`{rule.op}` of two tensors takes no value")
    a, b = (m.spec for m in ordered)
    for x in (a, b):
        _float_input(x)
    s = Scope(scope.params, scope.config, caps)
    block = block_of(rule, s, a.shape, None)
    expected = scale_shape(a.shape, block) if block else a.shape
    if b.shape != expected:
        how = f"the block grid of {list(a.shape)} over {list(block)}" if block else "the same"
        raise RuleProblem(
            f"`{b.name}` is {list(b.shape)} but must be {list(expected)} ({how} as `{a.name}`)"
        )
    compute = _dtype(rule.compute, "F32", "compute dtype (`in`)", COMPUTE_DTYPES)
    out = _dtype(rule.to_dtype, a.dtype, "result dtype (`to`)", FLOAT_CASTS)
    return Binary(dtype=out, shape=a.shape, a=ordered[0].node, b=ordered[1].node, op=rule.op,
                  block=block, compute=compute)  # fmt: skip


def _quantize(rule: A.Rule, spec: TensorSpec, src: Node, s: Scope) -> tuple[Node, Node]:
    if len(spec.shape) < 2:
        raise RuleProblem(
            f"`{spec.name}` {list(spec.shape)}: quantize works on blocks of the last two dims"
        )
    out = _dtype(rule.to_dtype, "F8_E4M3", "quantized dtype (`to`)", FP8_DTYPES)
    block = block_of(rule, s, spec.shape[-2:], DEFAULT_BLOCK)
    if len(block) != 2:
        raise RuleProblem(f"quantize takes a block of two sizes (rows, columns), got {list(block)}")
    pair = (block[0], block[1])
    values = Quantize(dtype=out, shape=spec.shape, src=src, block=pair, part="values", fp8=out)
    scales = Quantize(dtype="F32", shape=scale_shape(spec.shape, pair), src=src, block=pair,
                      part="scales", fp8=out)  # fmt: skip
    return values, scales


def _mask(rule: A.Rule, spec: TensorSpec, src: Node, s: Scope) -> Node:
    if DTYPES[spec.dtype].kind not in ("int", "uint") or len(spec.shape) != 1:
        raise RuleProblem(
            f"`{spec.name}` is {spec.dtype}{list(spec.shape)}: mask reads a 1-D integer tensor "
            "of positions"
        )
    assert rule.size is not None
    size = as_int(evaluate(rule.size, s), "size")
    if size <= 0:
        raise RuleProblem(f"mask size must be positive, got {size}")
    return Mask(dtype="BOOL", shape=(size,), src=src, size=size, plus_index=rule.plus_index)


def _pair(rule: A.Rule, first: Match, second: Match, s: Scope) -> Node:
    """matmul ``a @ b``; gather ``src`` by ``index``; lookup ``codes`` in ``table``."""
    a, b = first.spec, second.spec
    if rule.op == "matmul":
        for x in (a, b):
            _float_input(x)
            if len(x.shape) != 2:
                raise RuleProblem(f"`{x.name}` is {list(x.shape)}: matmul multiplies 2-D tensors")
        if a.shape[1] != b.shape[0]:
            raise RuleProblem(
                f"`{a.name}` {list(a.shape)} @ `{b.name}` {list(b.shape)}: the columns of the "
                "first must match the rows of the second (transpose one first?)"
            )
        compute = _dtype(rule.compute, "F32", "compute dtype (`in`)", MATMUL_COMPUTE)
        out = _dtype(rule.to_dtype, a.dtype, "result dtype (`to`)", FLOAT_CASTS)
        shape = (a.shape[0], b.shape[1])
        return Matmul(dtype=out, shape=shape, a=first.node, b=second.node, compute=compute)
    index = b if rule.op == "gather" else a
    if DTYPES[index.dtype].kind not in INT_KINDS:
        role = "index" if rule.op == "gather" else "codes"
        raise RuleProblem(
            f"`{index.name}` is {index.dtype}: the {role} of a {rule.op} must be an integer tensor"
        )
    if rule.op == "gather":
        if len(b.shape) != 1:
            raise RuleProblem(f"`{b.name}` is {list(b.shape)}: a gather's index is 1-D")
        assert rule.dim is not None
        d = norm_dim(as_int(evaluate(rule.dim, s), "dim"), len(a.shape), f"`{a.name}`")
        if a.shape[d] == 0 and b.shape[0]:
            raise RuleProblem(f"`{a.name}` has nothing along dim {d} to gather")
        gathered = (*a.shape[:d], b.shape[0], *a.shape[d + 1 :])
        return Gather(dtype=a.dtype, shape=gathered, src=first.node, index=second.node, dim=d)
    if len(b.shape) != 1 or not b.shape[0]:
        raise RuleProblem(
            f"`{b.name}` is {list(b.shape)}: a lookup table is a non-empty 1-D tensor"
        )
    return Lookup(dtype=b.dtype, shape=a.shape, codes=first.node, table=second.node)


MATMUL_COMPUTE = frozenset({"F32", "F64"})


def _packing(rule: A.Rule, spec: TensorSpec, src: Node, s: Scope) -> Node:
    """unpack: words -> codes along ``dim``; pack: codes -> words."""
    unpack = rule.op == "unpack"
    assert rule.dim is not None and rule.bits is not None
    d = norm_dim(as_int(evaluate(rule.dim, s), "dim"), len(spec.shape), f"`{spec.name}`")
    bits = as_int(evaluate(rule.bits, s), "bits")
    if bits not in CODE_BITS:
        raise RuleProblem(f"bits must be one of {', '.join(map(str, CODE_BITS))}, got {bits}")
    if DTYPES[spec.dtype].kind not in INT_KINDS:
        what = "integer words" if unpack else "integer codes (cast them first)"
        raise RuleProblem(f"`{spec.name}` is {spec.dtype}: {rule.op} reads {what}")
    word = spec.dtype if unpack else _dtype(rule.to_dtype, "I32", "word dtype (`to`)", WORDS)
    width = DTYPES[word].bits
    if bits >= width:
        raise RuleProblem(f"{bits}-bit codes need a word wider than {word}'s {width} bits")
    per = width // bits
    order = list(range(per))
    if rule.order is not None:
        order = as_ints(evaluate(rule.order, s), "order")
        if sorted(order) != list(range(per)):
            raise RuleProblem(
                f"order {order} must list each of the {per} fields of a {width}-bit word "
                f"once (0 to {per - 1}; 0 is the least significant)"
            )
    if unpack:
        shape = (*spec.shape[:d], spec.shape[d] * per, *spec.shape[d + 1 :])
        out = "U8" if bits <= 8 else "U16"
        return Unpack(dtype=out, shape=shape, src=src, dim=d, bits=bits, order=tuple(order))
    if spec.shape[d] % per:
        raise RuleProblem(
            f"`{spec.name}` {list(spec.shape)}: dim {d} must hold whole words of {per} codes"
        )
    shape = (*spec.shape[:d], spec.shape[d] // per, *spec.shape[d + 1 :])
    return Pack(dtype=word, shape=shape, src=src, dim=d, bits=bits, order=tuple(order))


WORDS = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"})


def _bounds(rule: A.Rule, s: Scope) -> tuple[int | float, int | float]:
    """A clamp's ``[low, high]``: two finite numbers, low <= high."""
    assert rule.value is not None
    v = evaluate(rule.value, s)
    ok = isinstance(v, list) and len(v) == 2
    if not ok or not all(not isinstance(x, bool) and isinstance(x, (int, float)) for x in v):
        raise RuleProblem(f"clamp takes [low, high], two numbers; got {brief(v)}")
    low, high = v
    if not all(math.isfinite(float(x)) for x in v) or low > high:
        raise RuleProblem(f"clamp bounds [{low}, {high}] must be finite, low <= high")
    return low, high


def _reduce(rule: A.Rule, spec: TensorSpec, src: Node, s: Scope) -> Node:
    """amax / amin / sum along a dim, whole or by groups."""
    name = f"`{spec.name}` {list(spec.shape)}"
    kind = DTYPES[spec.dtype].kind
    if rule.op == "sum":
        _float_input(spec)
    elif kind not in ("float", "int", "uint") or spec.dtype in ("U64", *OPAQUE):
        raise RuleProblem(f"{name} is {spec.dtype}: {rule.op} reads floats or integers (not U64)")
    if not spec.shape:
        raise RuleProblem(f"{name} has no dim to reduce")
    assert rule.dim is not None
    d = norm_dim(as_int(evaluate(rule.dim, s), "dim"), len(spec.shape), name)
    extent = spec.shape[d]
    group = 0
    if rule.group is not None:
        group = as_int(evaluate(rule.group, s), "group")
        if group <= 0 or extent % group:
            raise RuleProblem(
                f"group {group} must be positive and divide dim {d} of {name} ({extent})"
            )
        shape = (*spec.shape[:d], extent // group, *spec.shape[d + 1 :])
    else:
        if rule.op != "sum" and extent == 0:
            raise RuleProblem(f"{name}: the {rule.op} of nothing along dim {d}")
        shape = (*spec.shape[:d], *spec.shape[d + 1 :])
    compute = _dtype(rule.compute, "F32", "compute dtype (`in`)", MATMUL_COMPUTE)
    out = spec.dtype
    if rule.op == "sum":
        out = _dtype(rule.to_dtype, spec.dtype, "result dtype (`to`)", FLOAT_CASTS)
    return Reduce(dtype=out, shape=shape, src=src, op=rule.op, dim=d, group=group,
                  compute=compute)  # fmt: skip


OPAQUE = ("F4", "F6_E2M3", "F6_E3M2")
