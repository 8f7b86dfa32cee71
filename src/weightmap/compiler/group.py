"""merge and stack: several inputs become one output, grouped by their captures.

A group's members are told apart in one of three ways:

* several patterns (``merge "a.{i}.q", "a.{i}.k" ...``): member = which pattern, in order;
* one anonymous alternative (``"{gate,up}_proj"``): member = which word, in listed order;
* one capture the output does not use (``{e:int}`` or ``{p:gate,up}``): member = its value,
  integers ascending and required to be exactly 0..n-1.

All other captures form the group key, and the output template names the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightmap.compiler.ops import (
    Match,
    RuleProblem,
    as_int,
    as_ints,
    evaluate,
    norm_dim,
    template_names,
)
from weightmap.language import ast as A
from weightmap.language.expr import Scope, compile_template, show
from weightmap.plan.nodes import Concat, Node, Source, Stack

__all__ = ["Members", "build_group", "members_of"]


class Members:
    """How a merge/stack rule tells members apart (see the module docstring)."""

    def __init__(self, kind: str, var: str | None, words: tuple[str, ...], key: list[str]):
        self.kind, self.var, self.words, self.key = kind, var, words, key

    def member(self, m: Match) -> Any:
        """The member identity of a match: an index into the order, or an int value."""
        if self.kind == "patterns":
            return m.pattern_index
        assert self.var is not None
        value = m.caps[self.var]
        return self.words.index(value) if self.kind == "words" else value

    def label(self, member: Any) -> str:
        """A member as the user wrote it, for messages."""
        if self.kind == "words":
            return str(self.words[member])
        if self.kind == "int":
            return f"{self.var}={member}"
        return f"pattern {member + 1}"


def members_of(rule: A.Rule, params: set[str]) -> Members:
    """Work out the member scheme of a merge/stack rule (RuleProblem if there is none)."""
    used = template_names(rule.outputs[0]) - params
    pats = rule.patterns
    names = [{c.name for c in p.captures} for p in pats]
    alts = [p for p in pats[0].parts if isinstance(p, A.Alt)]
    if len(pats) > 1:
        if any(n != names[0] for n in names) or any(
            isinstance(x, A.Alt) for p in pats for x in p.parts
        ):
            raise RuleProblem("the patterns of a merge/stack must have the same named captures")
        return Members("patterns", None, (), sorted(names[0]))
    free = sorted(names[0] - used)
    if alts and not free:
        if len(alts) > 1:
            raise RuleProblem("use one {a,b} alternative to tell the members apart, not several")
        return Members("words", "_alt0", alts[0].alts, sorted(names[0]))
    if len(free) != 1 or alts:
        raise RuleProblem(
            "cannot tell the members apart: name exactly one capture the output does not use"
            f" ({'unused: ' + ', '.join(free) if free else 'every capture is used'})"
        )
    (var,) = free
    if rule.over is not None and rule.over != var:
        raise RuleProblem(f"`over {rule.over}`, but the capture the output leaves out is {var}")
    cap = next(c for c in pats[0].captures if c.name == var)
    if cap.kind == "int":
        return Members("int", var, (), sorted(names[0] - {var}))
    if cap.kind == "alt":
        return Members("words", var, cap.alts, sorted(names[0] - {var}))
    raise RuleProblem(
        f"members are told apart by {{{var}}}: make it {{{var}:int}} or {{{var}:a,b}}"
    )


def build_group(
    rule: A.Rule,
    members: Members,
    matches: list[Match],
    scope: Scope,
    emit: Callable[[str, Node], None],
    report: Callable[[A.Loc | None, str], None],
) -> None:
    """Group ``matches`` and emit one Concat/Stack per complete, well-shaped group."""
    groups: dict[tuple[Any, ...], dict[Any, Match]] = {}
    for m in matches:
        key = tuple(m.caps[k] for k in members.key)
        groups.setdefault(key, {})[members.member(m)] = m
    tmpl = compile_template(rule.outputs[0])
    for key, by_member in groups.items():
        caps = dict(zip(members.key, key, strict=True))
        where = ", ".join(f"{k}={show(v)}" for k, v in caps.items())
        where = f"group {where}" if where else "the group"
        try:
            if members.kind == "int":
                expected = list(range(max(by_member) + 1))
            elif members.kind == "words":
                expected = list(range(len(members.words)))
            else:
                expected = list(range(len(rule.patterns)))
            missing = [members.label(x) for x in expected if x not in by_member]
            if missing:
                raise RuleProblem(f"{where} is incomplete: missing {', '.join(missing)}")
            ordered = [by_member[x] for x in expected]
            emit(tmpl(Scope(scope.params, scope.config, caps)), _node(rule, ordered, scope, caps))
        except RuleProblem as p:
            report(p.loc, p.message if p.message.startswith(where) else f"{where}: {p.message}")


def _node(rule: A.Rule, ordered: list[Match], scope: Scope, caps: dict[str, Any]) -> Node:
    specs = [m.spec for m in ordered]
    first = specs[0]
    dtypes = {s.dtype for s in specs}
    if len(dtypes) > 1:
        raise RuleProblem(f"members have different dtypes: {', '.join(sorted(dtypes))}")
    srcs = tuple(Source(dtype=s.dtype, shape=s.shape, name=s.name) for s in specs)
    s = Scope(scope.params, scope.config, caps)
    listing = ", ".join(f"`{x.name}` {list(x.shape)}" for x in specs)
    if rule.op == "stack":
        if len({x.shape for x in specs}) > 1:
            raise RuleProblem(f"members have different shapes: {listing}")
        d = norm_dim(
            as_int(evaluate(rule.dim, s), "dim") if rule.dim else 0,
            len(first.shape),
            f"`{first.name}`",
            1,
        )
        shape = (*first.shape[:d], len(specs), *first.shape[d:])
        return Stack(dtype=first.dtype, shape=shape, srcs=srcs, dim=d)
    d = norm_dim(as_int(evaluate(rule.dim, s), "dim"), len(first.shape), f"`{first.name}`")  # type: ignore[arg-type]
    rest = {x.shape[:d] + x.shape[d + 1 :] for x in specs}
    if len(rest) > 1 or len({len(x.shape) for x in specs}) > 1:
        raise RuleProblem(f"members differ outside dim {d}: {listing}")
    widths = [x.shape[d] for x in specs]
    if rule.sizes is not None:
        declared = as_ints(evaluate(rule.sizes, s), "sizes")
        if declared != widths:
            raise RuleProblem(
                f"declared sizes {declared} but the members have {widths} along dim {d}"
            )
    shape = (*first.shape[:d], sum(widths), *first.shape[d + 1 :])
    return Concat(dtype=first.dtype, shape=shape, srcs=srcs, dim=d)
