"""Expressions: compiled once to Python closures, evaluated per tensor or per config edit.

Values are JSON values (null, bool, int, float, str, list, object). Evaluation is strict so a
mapping cannot go silently wrong: conditions must be booleans, ``1 == true`` is false, a missing
config field is an error (test with ``has(config.x)``), and ``<`` compares only numbers with
numbers and strings with strings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from weightmap.errors import LocatedProblem
from weightmap.format.dtypes import DTYPES, TensorSpec
from weightmap.format.text import MAX_INT_BITS, MAX_JSON_DEPTH
from weightmap.language import ast as A

__all__ = [
    "DTYPE_ALIASES",
    "EvalError",
    "Fn",
    "MissingField",
    "Scope",
    "compile_expr",
    "render",
    "resolve_dtype",
    "truth",
]

# Lower-case spellings accepted wherever a dtype is named; the canonical upper-case
# safetensors names are accepted too.
DTYPE_ALIASES: dict[str, str] = {
    **dict.fromkeys(("f64", "fp64", "float64", "double"), "F64"),
    **dict.fromkeys(("f32", "fp32", "float32", "float"), "F32"),
    **dict.fromkeys(("f16", "fp16", "float16", "half"), "F16"),
    **dict.fromkeys(("bf16", "bfloat16"), "BF16"),
    **dict.fromkeys(("f8_e4m3", "fp8_e4m3", "float8_e4m3fn", "e4m3"), "F8_E4M3"),
    **dict.fromkeys(("f8_e5m2", "fp8_e5m2", "float8_e5m2", "e5m2"), "F8_E5M2"),
    **{f"i{b}": f"I{b}" for b in (8, 16, 32, 64)},
    **{f"int{b}": f"I{b}" for b in (8, 16, 32, 64)},
    **{f"u{b}": f"U{b}" for b in (8, 16, 32, 64)},
    **{f"uint{b}": f"U{b}" for b in (8, 16, 32, 64)},
    "bool": "BOOL",
    **{name: name for name in DTYPES},
}

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


def resolve_dtype(word: str) -> str | None:
    """The safetensors dtype named by ``word`` (``"bf16"`` -> ``"BF16"``), or None."""
    return DTYPE_ALIASES.get(word)


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


def _type_name(v: Any) -> str:
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
    if _is_num(a) and _is_num(b):
        return bool(a == b)
    return type(a) is type(b) and bool(a == b)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def truth(v: Any, loc: A.Loc, what: str = "condition") -> bool:
    """A condition's value, which must be a boolean."""
    if not isinstance(v, bool):
        raise EvalError(f"{what} is {brief(v)} ({_type_name(v)}), not true or false", loc)
    return v


def describe(e: A.Expr) -> str:
    """A short source-like spelling of a field access, for messages."""
    if isinstance(e, A.ConfigRef):
        return "config"
    if isinstance(e, A.Attr):
        return f"{describe(e.obj)}.{e.name}"
    if isinstance(e, A.Index) and isinstance(e.index, A.Lit):
        return f"{describe(e.obj)}[{show(e.index.value)}]"
    if isinstance(e, A.Name):
        return e.id
    return "value"


def _arith(op: str, a: Any, b: Any, loc: A.Loc, s: Scope | None = None) -> Any:
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        if s is not None:
            s.charge(len(a) + len(b), loc)
        return a + b
    if op == "+" and isinstance(a, list) and isinstance(b, list):
        if s is not None:
            s.charge_value(a, loc)
            s.charge_value(b, loc)
        return a + b
    if op == "*" and isinstance(a, list) and isinstance(b, int) and not isinstance(b, bool):
        if s is not None:
            # Every copy counts: the copies are the same objects, but each is written out,
            # compared and printed in full.
            s.charge_value(a, loc, times=b)
        return a * b
    if not (_is_num(a) and _is_num(b)):
        raise EvalError(f"cannot apply {op} to {brief(a)} and {brief(b)}", loc)
    if op in ("//", "%") and b == 0:
        raise EvalError(f"division by zero in {brief(a)} {op} 0", loc)
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
    if isinstance(result, float) and not math.isfinite(result):
        # JSON has no NaN or Infinity: such a value could never be written to config.json.
        raise EvalError(
            f"{op} on {brief(a)} and {brief(b)} gives {result}, not a finite number", loc
        )
    return result


def _compare(op: str, a: Any, b: Any, loc: A.Loc, s: Scope) -> bool:
    # A comparison walks at most the smaller value: that is its work.
    limit = s.budget[0] + 1
    s.charge(min(weight(a, limit, loc), weight(b, limit, loc)), loc)
    if op == "==":
        return equal(a, b)
    if op == "!=":
        return not equal(a, b)
    if not ((_is_num(a) and _is_num(b)) or (isinstance(a, str) and isinstance(b, str))):
        raise EvalError(f"cannot compare {brief(a)} {op} {brief(b)}", loc)
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


def _contains(a: Any, b: Any, loc: A.Loc, s: Scope) -> bool:
    if isinstance(b, list):
        s.charge_value(b, loc)
        return any(equal(a, x) for x in b)
    if isinstance(b, dict) and isinstance(a, str):
        return a in b
    if isinstance(b, str) and isinstance(a, str):
        s.charge(len(b), loc)
        return a in b
    raise EvalError(f"cannot test {brief(a)} in {brief(b)}", loc)


def _lookup(name: str, loc: A.Loc) -> Fn:
    def get(s: Scope) -> Any:
        if name in s.local:
            return s.local[name]
        if name in s.captures:
            return s.captures[name]
        if s.tensor is not None and name in TENSOR_NAMES:
            t = s.tensor
            return t.name if name == "name" else t.dtype if name == "dtype" else list(t.shape)
        if name in s.params:
            return s.params[name]
        dt = resolve_dtype(name)
        if dt is not None:
            return dt
        raise EvalError(f"unknown name `{name}`", loc)

    return get


def _field(obj: Any, key: Any, what: str, loc: A.Loc) -> Any:
    if isinstance(obj, dict):
        if not isinstance(key, str):
            raise EvalError(f"{what}: object keys are strings, not {brief(key)}", loc)
        if key not in obj:
            raise MissingField(f"`{what}` is missing from the config", loc)
        return obj[key]
    if isinstance(obj, list) and isinstance(key, int) and not isinstance(key, bool):
        if not -len(obj) <= key < len(obj):
            raise EvalError(f"{what}: index {key} is out of range for a list of {len(obj)}", loc)
        return obj[key]
    raise EvalError(f"{what}: cannot index {brief(obj)} with {brief(key)}", loc)


def compile_expr(e: A.Expr) -> Fn:
    """Compile an expression to a function of a :class:`Scope`; raises EvalError when run."""
    loc = e.loc
    if isinstance(e, A.Lit):
        v = e.value
        return lambda s: v
    if isinstance(e, A.Name):
        return _lookup(e.id, loc)
    if isinstance(e, A.ConfigRef):

        def config(s: Scope) -> Any:
            if s.config is None:
                raise MissingField("the checkpoint has no config.json", loc)
            return s.config

        return config
    if isinstance(e, (A.Attr, A.Index)):
        obj = compile_expr(e.obj)
        what = describe(e)
        if isinstance(e, A.Attr):
            key: str = e.name
            return lambda s: _field(obj(s), key, what, loc)
        idx = compile_expr(e.index)
        return lambda s: _field(obj(s), idx(s), what, loc)
    if isinstance(e, A.Unary):
        inner = compile_expr(e.operand)
        if e.op == "not":
            return lambda s: not truth(inner(s), loc)
        return lambda s: _arith("-", 0, inner(s), loc)
    if isinstance(e, A.BinOp):
        return _binop(e)
    if isinstance(e, A.ListExpr):
        items = [compile_expr(x) for x in e.items]

        def make_list(s: Scope) -> list[Any]:
            s.charge(len(items), loc)
            out = [f(s) for f in items]
            # Items are counted as written: `[a, a, a]` holds a three times.
            s.charge_value(out, loc)
            return out

        return make_list
    if isinstance(e, A.DictExpr):
        pairs = [(k, compile_expr(x)) for k, x in e.items]

        def make_dict(s: Scope) -> dict[str, Any]:
            s.charge(len(pairs), loc)
            out = {k: f(s) for k, f in pairs}
            s.charge_value(out, loc)
            return out

        return make_dict
    if isinstance(e, A.Comp):
        return _comprehension(e)
    if isinstance(e, A.Call):
        return _call(e)
    if isinstance(e, A.Exists):
        pattern = e.pattern

        def exists(s: Scope) -> bool:
            if s.exists is None:
                raise EvalError("`exists` is only available where input tensors are known", loc)
            return s.exists(pattern)

        return exists
    raise TypeError(f"unknown expression {e!r}")  # pragma: no cover


def _binop(e: A.BinOp) -> Fn:
    op, loc = e.op, e.loc
    left, right = compile_expr(e.left), compile_expr(e.right)
    if op == "and":
        return lambda s: truth(left(s), loc) and truth(right(s), loc)
    if op == "or":
        return lambda s: truth(left(s), loc) or truth(right(s), loc)
    if op in ("==", "!=", "<", "<=", ">", ">="):
        return lambda s: _compare(op, left(s), right(s), loc, s)
    if op == "in":
        return lambda s: _contains(left(s), right(s), loc, s)
    if op == "not in":
        return lambda s: not _contains(left(s), right(s), loc, s)
    return lambda s: _arith(op, left(s), right(s), loc, s)


def _comprehension(e: A.Comp) -> Fn:
    elt, it = compile_expr(e.elt), compile_expr(e.iterable)
    cond = compile_expr(e.cond) if e.cond is not None else None
    var, loc = e.var, e.loc

    def run(s: Scope) -> list[Any]:
        seq = it(s)
        if not isinstance(seq, list):
            raise EvalError(f"`for {var} in` needs a list, got {brief(seq)}", loc)
        s.charge(len(seq), loc)
        out = []
        for x in seq:
            local = {**s.local, var: x}
            inner = Scope(s.params, s.config, s.captures, s.tensor, s.exists, local, s.budget)
            if cond is None or truth(cond(inner), loc):
                item = elt(inner)
                s.charge_value(item, loc)
                out.append(item)
        return out

    return run


def _call(e: A.Call) -> Fn:
    loc, name = e.loc, e.func
    args = [compile_expr(a) for a in e.args]
    if name == "has":
        if len(args) != 1:
            raise EvalError("has() takes one field, e.g. has(config.rope_scaling)", loc)
        (arg,) = args

        def has(s: Scope) -> bool:
            try:
                arg(s)
            except MissingField:
                return False
            return True

        return has
    if name == "len":
        if len(args) != 1:
            raise EvalError("len() takes one argument", loc)
        (arg,) = args

        def length(s: Scope) -> int:
            v = arg(s)
            if not isinstance(v, (list, str, dict)):
                raise EvalError(f"len() of {brief(v)}", loc)
            return len(v)

        return length
    if name in ("min", "max"):
        pick = min if name == "min" else max

        def extreme(s: Scope) -> Any:
            vals = [f(s) for f in args]
            if len(vals) == 1 and isinstance(vals[0], list):
                vals = vals[0]
            if not vals or not all(_is_num(v) for v in vals):
                raise EvalError(f"{name}() needs numbers, got {brief(vals)}", loc)
            s.charge(len(vals), loc)
            return pick(vals)

        return extreme
    raise EvalError(f"unknown function `{name}`; the functions are has, len, min, max", loc)


def render(t: A.Template, scope: Scope) -> str:
    """Fill a template's holes (ints and strings print plainly, other values as written)."""
    out = []
    for part in t.parts:
        if isinstance(part, str):
            out.append(part)
        else:
            v = compile_expr(part)(scope)
            text = v if isinstance(v, str) else show(v, scope.budget[0] + 1)
            # Every character of a message is work: a hole may print a huge value.
            scope.charge(len(text), part.loc)
            out.append(text)
    return "".join(out)


def compile_template(t: A.Template) -> Callable[[Scope], str]:
    """A fast renderer for output names (compiled once per rule, run once per tensor)."""
    fns: list[Callable[[Scope], Any]] = []
    for part in t.parts:
        if isinstance(part, str):
            fns.append(lambda s, p=part: p)  # type: ignore[misc]
        elif isinstance(part, A.Name):
            fns.append(_capture_first(part.id, compile_expr(part)))
        else:
            fns.append(compile_expr(part))

    def run(s: Scope) -> str:
        return "".join(v if isinstance(v := f(s), str) else show(v) for f in fns)

    names = [p.id for p in t.parts if isinstance(p, A.Name)]
    if len(names) != sum(not isinstance(p, str) for p in t.parts):
        return run
    # Every hole is a bare name: one str.format call when they are all string/int captures.
    fmt = "".join(
        p.replace("{", "{{").replace("}", "}}") if isinstance(p, str) else "{}" for p in t.parts
    )

    def fast(s: Scope) -> str:
        caps = s.captures
        if s.local:
            return run(s)
        try:
            values = [caps[n] for n in names]
        except KeyError:
            return run(s)
        # Captures are only ever str (segments, alternatives) or int ({n:int}, unstack index),
        # and both print the same through format() as through show().
        return fmt.format(*values)

    return fast


def _capture_first(name: str, slow: Fn) -> Fn:
    # Output names are rendered once per tensor; a bare {capture} is by far the common hole.
    def get(s: Scope) -> Any:
        if not s.local and name in s.captures:
            return s.captures[name]
        return slow(s)

    return get
