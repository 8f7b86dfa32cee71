"""Expressions: compiled once to Python closures, evaluated per tensor or per config edit.

What they compute with (values, the scope, strict operators) is in ``values.py``; the built-in
functions are in ``functions.py``.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Callable, Iterable
from typing import Any

from weightmap.format.dtypes import DTYPES
from weightmap.language import ast as A
from weightmap.language.functions import call
from weightmap.language.values import (
    TENSOR_NAMES,
    EvalError,
    Fn,
    MissingField,
    Scope,
    arith,
    brief,
    compare,
    contains,
    show,
    truth,
)

__all__ = [
    "DTYPE_ALIASES",
    "capture_format",
    "capture_namer",
    "closest",
    "compile_expr",
    "compile_template",
    "describe",
    "did_you_mean",
    "render",
    "resolve_dtype",
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


def resolve_dtype(word: str) -> str | None:
    """The safetensors dtype named by ``word`` (``"bf16"`` -> ``"BF16"``), or None."""
    return DTYPE_ALIASES.get(word)


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
        known = [*s.local, *s.captures, *s.params, *(TENSOR_NAMES if s.tensor else ())]
        raise EvalError(f"unknown name `{name}`{did_you_mean(name, known)}", loc)

    return get


def closest(word: str, candidates: Iterable[object]) -> str | None:
    """The candidate closest to ``word`` (difflib), or None when none is close.

    Bounded: past 100,000 candidates (a hostile config) no suggestion is looked for.
    """
    pool = list(itertools.islice(candidates, 100_001))
    if len(pool) > 100_000:
        return None
    close = difflib.get_close_matches(word, [c for c in pool if isinstance(c, str)], n=1)
    return close[0] if close else None


def did_you_mean(word: str, candidates: Iterable[object], quote: str = "`") -> str:
    """``" (did you mean `x`?)"`` for the closest candidate, or ``""`` when none is close."""
    close = closest(word, candidates)
    return f" (did you mean {quote}{close}{quote}?)" if close is not None else ""


def _field(obj: Any, key: Any, what: str, loc: A.Loc) -> Any:
    if isinstance(obj, dict):
        if not isinstance(key, str):
            raise EvalError(f"{what}: object keys are strings, not {brief(key)}", loc)
        if key not in obj:
            close = closest(key, obj)
            if close is not None and what.endswith("." + key):
                close = f"{what[: -len(key)]}{close}"  # the whole path: `config.hidden_size`
            hint = f" (did you mean `{close}`?)" if close is not None else ""
            raise MissingField(f"`{what}` is missing from the config{hint}", loc)
        return obj[key]
    if isinstance(obj, list) and isinstance(key, int) and not isinstance(key, bool):
        if not -len(obj) <= key < len(obj):
            raise MissingField(f"{what}: index {key} is out of range for a list of {len(obj)}", loc)
        return obj[key]
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        # A field of a null, a number or a list is no field at all: an error when read, but
        # `has(config.rope_parameters.rope_theta)` is false under `"rope_parameters": null`.
        raise MissingField(f"{what}: cannot index {brief(obj)} with {brief(key)}", loc)
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
        return lambda s: arith("-", 0, inner(s), loc)
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
        return call(e.func, [compile_expr(a) for a in e.args], loc)
    if isinstance(e, A.IfExp):
        cond, then, orelse = compile_expr(e.cond), compile_expr(e.then), compile_expr(e.orelse)
        return lambda s: then(s) if truth(cond(s), loc) else orelse(s)
    if isinstance(e, A.Exists):
        pattern = e.pattern
        names = {c.name for c in pattern.captures}

        def exists(s: Scope) -> bool:
            if s.exists is None:
                raise EvalError("`exists` is only available where input tensors are known", loc)
            if names & s.captures.keys():
                # In a rule, `{x}` is the tensor's own capture: `where exists
                # "{x}.weight_scale_inv"` asks about this tensor's partner.
                return s.exists(bind(pattern, s.captures))
            return s.exists(pattern)

        return exists
    raise TypeError(f"unknown expression {e!r}")  # pragma: no cover


def bind(pattern: A.Pattern, captures: dict[str, Any]) -> A.Pattern:
    """``pattern`` with the captures bound in ``captures`` replaced by their values."""
    parts: list[A.PatPart] = []
    for part in pattern.parts:
        if isinstance(part, A.Capture) and part.name in captures:
            value = str(captures[part.name])
            if parts and isinstance(parts[-1], str):
                parts[-1] += value
            else:
                parts.append(value)
        elif isinstance(part, str) and parts and isinstance(parts[-1], str):
            parts[-1] += part
        else:
            parts.append(part)
    return A.Pattern(text="".join(p if isinstance(p, str) else "{}" for p in parts),
                     parts=tuple(parts), loc=pattern.loc)  # fmt: skip


def _binop(e: A.BinOp) -> Fn:
    op, loc = e.op, e.loc
    left, right = compile_expr(e.left), compile_expr(e.right)
    if op == "and":
        return lambda s: truth(left(s), loc) and truth(right(s), loc)
    if op == "or":
        return lambda s: truth(left(s), loc) or truth(right(s), loc)
    if op in ("==", "!=", "<", "<=", ">", ">="):
        return lambda s: compare(op, left(s), right(s), loc, s)
    if op == "in":
        return lambda s: contains(left(s), right(s), loc, s)
    if op == "not in":
        return lambda s: not contains(left(s), right(s), loc, s)
    return lambda s: arith(op, left(s), right(s), loc, s)


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


def capture_format(t: A.Template) -> str | None:
    """The template as a ``str.format_map`` pattern over the captures, where every hole is a
    bare name, else None. ``format_map`` raises ``KeyError`` for captures that lack a hole's
    name (a param, say), which then needs a scope. Output names are rendered once per tensor:
    this is the common template, and one ``format_map`` call the cheapest way to fill it.

    Captures are only ever str (segments, alternatives) or int (``{n:int}``, unstack index),
    and both print the same through format() as through show(); a name is an identifier, so
    ``{name}`` is a plain field of the pattern (no index, attribute or conversion).
    """
    out = []
    for part in t.parts:
        if isinstance(part, str):
            out.append(part.replace("{", "{{").replace("}", "}}"))
        elif isinstance(part, A.Name):
            out.append(f"{{{part.id}}}")
        else:
            return None
    return "".join(out)


def capture_namer(t: A.Template) -> Callable[[dict[str, Any]], str | None] | None:
    """A renderer of the template from captures alone (see ``capture_format``), else None; it
    answers None for captures that lack a hole's name."""
    fmt = capture_format(t)
    if fmt is None:
        return None

    def from_captures(caps: dict[str, Any]) -> str | None:
        try:
            return fmt.format_map(caps)
        except KeyError:
            return None

    return from_captures


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

    direct = capture_namer(t)
    if direct is None:
        return run

    def fast(s: Scope) -> str:
        if s.local:
            return run(s)
        name = direct(s.captures)
        return run(s) if name is None else name

    return fast


def _capture_first(name: str, slow: Fn) -> Fn:
    # Output names are rendered once per tensor; a bare {capture} is by far the common hole.
    def get(s: Scope) -> Any:
        if not s.local and name in s.captures:
            return s.captures[name]
        return slow(s)

    return get
