"""What expressions compute with: JSON values, the scope names are looked up in, and the
strict operators.

Values are JSON values (null, bool, int, float, str, list, object). Evaluation is strict so a
mapping cannot go silently wrong: conditions must be booleans, ``1 == true`` is false, a missing
config field is an error (test with ``has(config.x)``), ``<`` compares only numbers with numbers
and strings with strings, and every operation is bounded (see ``WORK_LIMIT``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from weightmap.errors import LocatedProblem
from weightmap.format.dtypes import TensorSpec
from weightmap.format.text import MAX_INT_BITS, MAX_JSON_DEPTH
from weightmap.language import ast as A

__all__ = [
    "TENSOR_NAMES",
    "WORK_LIMIT",
    "EvalError",
    "Fn",
    "MissingField",
    "Scope",
    "arith",
    "brief",
    "compare",
    "contains",
    "equal",
    "is_num",
    "show",
    "truth",
    "type_name",
    "weight",
]

TENSOR_NAMES = ("name", "dtype", "shape")

# Hostile-input bounds (a mapping is a program from a stranger): `[0] * 10**12`, strings or
# ints squared param by param, or nested comprehensions would otherwise take unbounded memory
# and time. One evaluation (a param default, a condition, one tensor's where/template, a
# config block, a message) may spend at most WORK_LIMIT units of work: every value a list,
# object or string it builds holds, counted as written, so a list repeated by reference
# (`[[[[0] * 100] * 100] * 100] * 100`: 400 items allocated, 10**8 written) counts each time it
# appears; every comparison and membership test, by the values it walks; every character of a
# rendered message. Values stay within MAX_JSON_DEPTH levels (deeper ones could not be copied,
# compared or written without recursing past the stack) and ints within MAX_INT_BITS (the
# bound on every JSON value weightmap writes).
WORK_LIMIT = 1_000_000


class EvalError(LocatedProblem):
    """An expression cannot be evaluated; the compiler turns it into a located problem."""

    loc: A.Loc

    def __init__(self, message: str, loc: A.Loc) -> None:
        super().__init__(message, loc)


class MissingField(EvalError):
    """A config field that the expression reads is absent."""


@dataclass
class Scope:
    """What names mean while evaluating: captures, the tensor, params, config, locals."""

    params: dict[str, Any] = field(default_factory=dict)
    config: Any = None
    captures: dict[str, Any] = field(default_factory=dict)
    tensor: TensorSpec | None = None
    exists: Callable[[A.Pattern], bool] | None = None
    local: dict[str, Any] = field(default_factory=dict)
    # Work left for this evaluation (shared by comprehension scopes; see WORK_LIMIT).
    budget: list[int] = field(default_factory=lambda: [WORK_LIMIT])

    def with_tensor(self, tensor: TensorSpec, captures: dict[str, Any]) -> Scope:
        """A scope for one matched tensor (cheap: shares params and config)."""
        return Scope(self.params, self.config, captures, tensor, self.exists, self.local)

    def charge(self, work: int, loc: A.Loc) -> None:
        """Spend ``work`` units; EvalError once WORK_LIMIT is spent."""
        self.budget[0] -= work
        if self.budget[0] < 0:
            raise EvalError(
                f"expression builds more than {WORK_LIMIT:,} values (list items, object "
                "entries, characters, and the values comparisons walk)",
                loc,
            )

    def charge_value(self, value: Any, loc: A.Loc, times: int = 1) -> None:
        """Spend what ``value`` holds as written, ``times`` over (``[v] * times``)."""
        times = max(times, 0)
        limit = self.budget[0] // max(times, 1) + 1
        self.charge(weight(value, limit, loc) * times, loc)


def weight(value: Any, limit: int, loc: A.Loc) -> int:
    """The values ``value`` holds as written: 1 per number, null, bool, list or object, a
    string's length, and its keys' lengths; a list that appears twice counts twice.

    Stops counting once past ``limit``, so the walk costs no more than the work it measures.
    EvalError for a value nested deeper than MAX_JSON_DEPTH.
    """
    total = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack and total <= limit:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise EvalError(
                f"expression builds a value nested deeper than {MAX_JSON_DEPTH} levels", loc
            )
        if isinstance(v, str):
            total += max(len(v), 1)
        elif isinstance(v, list):
            total += 1 + len(v)
            if total <= limit:
                stack.extend((x, depth + 1) for x in v if isinstance(x, (list, dict, str)))
        elif isinstance(v, dict):
            total += 1 + len(v)
            for k, x in v.items():
                total += len(k)
                if total > limit:
                    break
                if isinstance(x, (list, dict, str)):
                    stack.append((x, depth + 1))
        else:
            total += 1
    return total


Fn = Callable[[Scope], Any]


def type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {
        bool: "bool",
        int: "int",
        float: "float",
        str: "string",
        list: "list",
        dict: "object",
    }.get(type(v), type(v).__name__)


def _pieces(v: Any) -> Iterator[str]:
    if v is None:
        yield "null"
    elif isinstance(v, bool):
        yield "true" if v else "false"
    elif isinstance(v, str):
        yield f'"{v}"'
    elif isinstance(v, list):
        yield "["
        for i, x in enumerate(v):
            if i:
                yield ", "
            yield from _pieces(x)
        yield "]"
    elif isinstance(v, dict):
        yield "{"
        for i, (k, x) in enumerate(v.items()):
            yield f'{", " if i else ""}"{k}": '
            yield from _pieces(x)
        yield "}"
    else:
        yield repr(v)


def show(v: Any, limit: int | None = None) -> str:
    """A value as the language would write it; past ``limit`` characters, cut with "..."."""
    if limit is None:
        return "".join(_pieces(v))
    out: list[str] = []
    size = 0
    for piece in _pieces(v):
        out.append(piece)
        size += len(piece)
        if size > limit:
            return "".join(out)[:limit] + "..."
    return "".join(out)


def brief(v: Any) -> str:
    """A value for an error message: a hostile one may be megabytes long."""
    return show(v, 80)


def equal(a: Any, b: Any) -> bool:
    """JSON equality: bools are not numbers; ints and floats compare by value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if is_num(a) and is_num(b):
        return bool(a == b)
    return type(a) is type(b) and bool(a == b)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def truth(v: Any, loc: A.Loc, what: str = "condition") -> bool:
    """A condition's value, which must be a boolean."""
    if not isinstance(v, bool):
        raise EvalError(f"{what} is {brief(v)} ({type_name(v)}), not true or false", loc)
    return v


def arith(op: str, a: Any, b: Any, loc: A.Loc, s: Scope | None = None) -> Any:
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        if s is not None:
            s.charge(len(a) + len(b), loc)
        return a + b
    if op == "+" and isinstance(a, list) and isinstance(b, list):
        if s is not None:
            s.charge_value(a, loc)
            s.charge_value(b, loc)
        return a + b
    if op == "+" and isinstance(a, dict) and isinstance(b, dict):
        # An object with the right one's keys added (its values win): a file or config value
        # whose fields depend on a condition, `{...} + ({"k": v} if cond else {})`.
        if s is not None:
            s.charge_value(a, loc)
            s.charge_value(b, loc)
        return {**a, **b}
    if op == "*" and isinstance(a, list) and isinstance(b, int) and not isinstance(b, bool):
        if s is not None:
            # Every copy counts: the copies are the same objects, but each is written out,
            # compared and printed in full.
            s.charge_value(a, loc, times=b)
        return a * b
    if not (is_num(a) and is_num(b)):
        raise EvalError(f"cannot apply {op} to {brief(a)} and {brief(b)}", loc)
    if op in ("//", "%", "/") and b == 0:
        raise EvalError(f"division by zero in {brief(a)} {op} 0", loc)
    if op == "/":
        # True division gives a float, as in Python; int(), round(), floor(), ceil() and
        # ceildiv() turn results back into integers.
        try:
            return _finite(a / b, op, a, b, loc)
        except OverflowError:
            raise EvalError(f"/ overflows on {brief(a)} and {brief(b)}", loc) from None
    # Check before multiplying: squaring a huge int param after param takes minutes.
    if (
        op == "*"
        and isinstance(a, int)
        and isinstance(b, int)
        and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1
    ):
        raise EvalError(f"integer {op} result exceeds {MAX_INT_BITS} bits", loc)
    try:
        result = (
            {"+": a + b, "-": a - b, "*": a * b}[op]
            if op in "+-*"
            else (a // b if op == "//" else a % b)
        )
    except OverflowError:  # a huge int meeting a float
        raise EvalError(f"{op} overflows on {brief(a)} and {brief(b)}", loc) from None
    if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
        raise EvalError(f"integer {op} result exceeds {MAX_INT_BITS} bits", loc)
    return _finite(result, op, a, b, loc)


def _finite(result: Any, op: str, a: Any, b: Any, loc: A.Loc) -> Any:
    if isinstance(result, float) and not math.isfinite(result):
        # JSON has no NaN or Infinity: such a value could never be written to config.json.
        raise EvalError(
            f"{op} on {brief(a)} and {brief(b)} gives {result}, not a finite number", loc
        )
    return result


def compare(op: str, a: Any, b: Any, loc: A.Loc, s: Scope) -> bool:
    # A comparison walks at most the smaller value: that is its work.
    limit = s.budget[0] + 1
    s.charge(min(weight(a, limit, loc), weight(b, limit, loc)), loc)
    if op == "==":
        return equal(a, b)
    if op == "!=":
        return not equal(a, b)
    if not ((is_num(a) and is_num(b)) or (isinstance(a, str) and isinstance(b, str))):
        raise EvalError(f"cannot compare {brief(a)} {op} {brief(b)}", loc)
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


def contains(a: Any, b: Any, loc: A.Loc, s: Scope) -> bool:
    if isinstance(b, list):
        s.charge_value(b, loc)
        return any(equal(a, x) for x in b)
    if isinstance(b, dict) and isinstance(a, str):
        return a in b
    if isinstance(b, str) and isinstance(a, str):
        s.charge(len(b), loc)
        return a in b
    raise EvalError(f"cannot test {brief(a)} in {brief(b)}", loc)
