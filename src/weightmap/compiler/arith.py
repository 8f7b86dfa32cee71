"""Value rules: arithmetic with constants and with other tensors, fp8 blocks, masks.

Every check that can be made on names, dtypes and shapes is made here, before a byte is
read: float dtypes only (integers and booleans are never silently converted), a compute dtype
that torch computes in, block sizes that fit, a scale tensor whose shape is the block grid of
its weight (``ceil`` of each dim over the block), two outputs for a quantization.
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
    output_name,
)
from weightmap.format.dtypes import DTYPES, TensorSpec
from weightmap.language import ast as A
from weightmap.language.expr import resolve_dtype
from weightmap.language.values import Scope, brief
from weightmap.plan.nodes import Arith, Binary, Mask, Node, Quantize

__all__ = ["VALUE_OPS", "binary_node", "build_value", "scale_shape"]

VALUE_OPS = frozenset({"add", "mul", "quantize", "mask"})
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


def block_of(rule: A.Rule, s: Scope, rank: int, default: tuple[int, ...] | None) -> tuple[int, ...]:
    """The rule's ``block [...]``: positive ints, one per trailing dim (at most ``rank``)."""
    if rule.block is None:
        if default is None:
            return ()
        return default
    block = tuple(as_ints(evaluate(rule.block, s), "block"))
    if not block or any(b <= 0 for b in block) or len(block) > rank:
        raise RuleProblem(
            f"block {list(block)} must be one to {rank} positive sizes (one per trailing dim)"
        )
    return block


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
    _float_input(spec)
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
    """add/mul of two tensors (one group: the first pattern's tensor, then the second's)."""
    if len(ordered) != 2:
        raise RuleProblem(f"`{rule.op}` combines two tensors, one per pattern; got {len(ordered)}")
    if rule.value is not None:
        raise RuleProblem(f"`{rule.op}` of two tensors takes no value")
    a, b = (m.spec for m in ordered)
    for x in (a, b):
        _float_input(x)
    s = Scope(scope.params, scope.config, caps)
    block = block_of(rule, s, len(a.shape), None)
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
    block = block_of(rule, s, 2, DEFAULT_BLOCK)
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
