"""The built-in functions of the expression language.

Config fields derived from others need integers where a formula goes through floats (Llama 3's
``intermediate_size`` is ``multiple_of * ceil(int(ffn_dim_multiplier * int(8 * dim / 3)) /
multiple_of)``): ``int``, ``round``, ``floor`` and ``ceil`` return integers, and ``ceildiv``
divides integers rounding up without going through a float (exact for any size).

Every function checks its arguments' types strictly (a bool is not a number) and its result
stays within the bounds of every value (see ``values.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from weightmap.format.text import MAX_INT_BITS
from weightmap.language import ast as A
from weightmap.language.values import EvalError, Fn, MissingField, Scope, brief, is_num

__all__ = ["FUNCTIONS", "call"]

# name -> (fewest, most) arguments; None: any number.
FUNCTIONS: dict[str, tuple[int, int | None]] = {
    "has": (1, 1),
    "len": (1, 1),
    "min": (1, None),
    "max": (1, None),
    "int": (1, 1),
    "float": (1, 1),
    "round": (1, 2),
    "floor": (1, 1),
    "ceil": (1, 1),
    "ceildiv": (2, 2),
    "abs": (1, 1),
    "sqrt": (1, 1),
}


def _number(v: Any, name: str, loc: A.Loc) -> int | float:
    if not is_num(v):
        raise EvalError(f"{name}() needs a number, got {brief(v)}", loc)
    if isinstance(v, float) and not math.isfinite(v):
        raise EvalError(f"{name}() of {v!r}, which has no integer value", loc)
    return v  # type: ignore[no-any-return]


def _bounded(v: int, name: str, loc: A.Loc) -> int:
    if v.bit_length() > MAX_INT_BITS:
        raise EvalError(f"{name}() result exceeds {MAX_INT_BITS} bits", loc)
    return v


def _has(args: Sequence[Fn], loc: A.Loc) -> Fn:
    (arg,) = args

    def has(s: Scope) -> bool:
        try:
            arg(s)
        except MissingField:
            return False
        return True

    return has


def _len(args: Sequence[Fn], loc: A.Loc) -> Fn:
    (arg,) = args

    def length(s: Scope) -> int:
        v = arg(s)
        if not isinstance(v, (list, str, dict)):
            raise EvalError(f"len() of {brief(v)}", loc)
        return len(v)

    return length


def _extreme(name: str, args: Sequence[Fn], loc: A.Loc) -> Fn:
    pick = min if name == "min" else max

    def extreme(s: Scope) -> Any:
        vals = [f(s) for f in args]
        if len(vals) == 1 and isinstance(vals[0], list):
            vals = vals[0]
        if not vals or not all(is_num(v) for v in vals):
            raise EvalError(f"{name}() needs numbers, got {brief(vals)}", loc)
        s.charge(len(vals), loc)
        return pick(vals)

    return extreme


def _unary(name: str, args: Sequence[Fn], loc: A.Loc) -> Fn:
    (arg,) = args
    to_int: dict[str, Callable[[int | float], int]] = {
        "int": int,  # towards zero, as Python's int()
        "floor": math.floor,
        "ceil": math.ceil,
    }
    if name in to_int:
        convert = to_int[name]
        return lambda s: _bounded(convert(_number(arg(s), name, loc)), name, loc)
    if name == "float":

        def to_float(s: Scope) -> float:
            v = _number(arg(s), name, loc)
            try:
                return float(v)
            except OverflowError:
                raise EvalError(f"float() of {v}: too large for a float", loc) from None

        return to_float
    if name == "sqrt":

        def root(s: Scope) -> float:
            v = _number(arg(s), name, loc)
            if v < 0:
                raise EvalError(f"sqrt() of a negative number, {brief(v)}", loc)
            try:
                return math.sqrt(v)  # (Python's, as peft's math.sqrt(r))
            except OverflowError:
                raise EvalError(f"sqrt() of {brief(v)}: too large for a float", loc) from None

        return root
    return lambda s: abs(_number(arg(s), name, loc))


def _round(args: Sequence[Fn], loc: A.Loc) -> Fn:
    """``round(x)``: the nearest int, ties to even (as Python); ``round(x, n)``: a float."""

    def run(s: Scope) -> int | float:
        x = _number(args[0](s), "round", loc)
        if len(args) == 1:
            return _bounded(round(x), "round", loc)
        n = args[1](s)
        if not isinstance(n, int) or isinstance(n, bool) or not -30 <= n <= 30:
            raise EvalError(f"round()'s digits must be an integer in -30..30, got {brief(n)}", loc)
        return float(round(x, n))

    return run


def _ceildiv(args: Sequence[Fn], loc: A.Loc) -> Fn:
    def run(s: Scope) -> int:
        a, b = args[0](s), args[1](s)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b)):
            raise EvalError(f"ceildiv() needs two integers, got {brief(a)} and {brief(b)}", loc)
        if b == 0:
            raise EvalError(f"division by zero in ceildiv({a}, 0)", loc)
        result: int = -(-a // b)
        return result

    return run


def call(name: str, args: Sequence[Fn], loc: A.Loc) -> Fn:
    """The compiled call of built-in ``name`` on compiled ``args`` (arity checked by the parser)."""
    if name == "has":
        return _has(args, loc)
    if name == "len":
        return _len(args, loc)
    if name in ("min", "max"):
        return _extreme(name, args, loc)
    if name == "round":
        return _round(args, loc)
    if name == "ceildiv":
        return _ceildiv(args, loc)
    if name in ("int", "float", "floor", "ceil", "abs", "sqrt"):
        return _unary(name, args, loc)
    raise EvalError(f"unknown function `{name}`; the functions are {', '.join(FUNCTIONS)}", loc)
