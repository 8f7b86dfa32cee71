"""merge, stack, and add/mul of two tensors: several inputs become one output, grouped by
their captures.

A group's members are told apart in one of three ways:

* several patterns (``merge "a.{i}.q", "a.{i}.k" ...``): member = which pattern, in order;
* one anonymous alternative (``"{gate,up}_proj"``): member = which word, in listed order;
* one capture the output does not use (``{e:int}`` or ``{p:gate,up}``): member = its value,
  integers ascending and required to be exactly 0..n-1.

All other captures form the group key, and the output template names the group.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

from weightmap.compiler.arith import binary_node
from weightmap.compiler.ops import (
    Match,
    RuleProblem,
    as_int,
    as_ints,
    evaluate,
    namer,
    norm_dim,
    template_names,
)
from weightmap.errors import LocatedProblem
from weightmap.format.dtypes import TensorSpec
from weightmap.language import ast as A
from weightmap.language.unparse import pattern_text
from weightmap.language.values import EvalError, Scope, show
from weightmap.plan.nodes import Concat, Node, Same, Stack

__all__ = ["Members", "build_group", "members_of"]


class Members:
    """How a merge/stack rule tells members apart (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        var: str | None,
        words: tuple[str, ...],
        key: list[str],
        patterns: tuple[str, ...] = (),
    ):
        self.kind, self.var, self.words, self.key = kind, var, words, key
        self.patterns = patterns  # (kind "patterns": each pattern's text, for messages)

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
        # The pattern itself, not just its place: "missing pattern 2" made the reader count.
        return f"`{self.patterns[member]}` (pattern {member + 1})"


def _several_patterns(rule: A.Rule, names: list[set[str]], used: set[str]) -> Members:
    if rule.over is not None:
        raise RuleProblem(
            f"`over {rule.over}`: with several patterns the members are the patterns, in the "
            f"order listed; drop `over {rule.over}`, or write one pattern with a "
            f"{{{rule.over}}} capture"
        )
    if any(isinstance(x, A.Alt) for p in rule.patterns for x in p.parts):
        raise RuleProblem(
            "an unnamed {a,b} alternative in one of several patterns cannot tell members "
            "apart: name it ({p:a,b}) and use it in the output, or list each pattern"
        )
    if any(n != names[0] for n in names):
        raise RuleProblem("the patterns of a merge/stack must have the same named captures")
    if unused := names[0] - used:
        # Refused even where one group exists: the same mapping would collide on the next
        # checkpoint with two, and the docs promise the rule up front.
        listing = ", ".join(f"{{{x}}}" for x in sorted(unused))
        raise RuleProblem(
            f"the output leaves out {listing}: with several patterns every capture names the "
            "group, so the output must use them all (or different groups would get one name)"
        )
    texts = tuple(pattern_text(p.parts) for p in rule.patterns)
    return Members("patterns", None, (), sorted(names[0]), texts)


def _unnamed_alternative(rule: A.Rule, free: set[str]) -> Members | None:
    """Members told apart by the pattern's one unnamed ``{a,b}``, when that is the scheme."""
    alts = [x for x in rule.patterns[0].parts if isinstance(x, A.Alt)]
    if not alts:
        return None
    words = ", ".join("{" + ",".join(a.alts) + "}" for a in alts)
    if free or rule.over is not None:
        var = rule.over or sorted(free)[0]
        raise RuleProblem(
            f"the members are told apart by {{{var}}}, but the unnamed alternative {words} "
            "would put different tensors in one member: name it (e.g. {p:"
            f"{','.join(alts[0].alts)}}}) and use {{p}} in the output"
        )
    if len(alts) > 1:
        raise RuleProblem("use one {a,b} alternative to tell the members apart, not several")
    names = {c.name for c in rule.patterns[0].captures}
    return Members("words", "_alt0", alts[0].alts, sorted(names))


def members_of(rule: A.Rule, params: set[str]) -> Members:
    """Work out the member scheme of a merge/stack rule (RuleProblem if there is none)."""
    names = [{c.name for c in p.captures} for p in rule.patterns]
    # A capture is found before a param of its name (as a rename reads `{e}`): only names
    # that no pattern captures are the params'. Subtracting every param took `{e}` in
    # `stack "x.{e:int}.w" -> "out.{e}"` beside `param e = 0` for the param, and stacked
    # every expert into out.0.
    used = template_names(rule.outputs[0]) - (params - set().union(*names))
    if len(rule.patterns) > 1:
        # Every name of the output counts here: a capture is found before a param of its
        # name, so `{i}` in the output is the capture even where a param is called i.
        return _several_patterns(rule, names, template_names(rule.outputs[0]))
    free = names[0] - used
    if rule.over is not None:
        if rule.over not in names[0]:
            raise RuleProblem(f"`over {rule.over}`: the pattern has no capture {{{rule.over}}}")
        if rule.over in used:
            raise RuleProblem(
                f"`over {rule.over}`: the output uses {{{rule.over}}}, so every member would "
                "get an output of its own; leave it out of the output"
            )
    by_words = _unnamed_alternative(rule, free)
    if by_words is not None:
        return by_words
    if rule.over is not None and free - {rule.over}:
        extra = ", ".join(f"{{{x}}}" for x in sorted(free - {rule.over}))
        raise RuleProblem(
            f"the output must use every capture but {{{rule.over}}}: without {extra}, "
            "different groups would get the same output name"
        )
    if rule.over is None and len(free) != 1:
        if not free:
            raise RuleProblem(
                "cannot tell the members apart: the output uses every capture; leave out the "
                "one the members differ by (e.g. {e:int}), or list several patterns"
            )
        listing = ", ".join(f"{{{x}}}" for x in sorted(free))
        raise RuleProblem(
            f"the output leaves out {listing}: leave out exactly one, the capture the members "
            "differ by, and use the others in the output"
        )
    var = rule.over or next(iter(free))
    cap = next(c for c in rule.patterns[0].captures if c.name == var)
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
    failed: Callable[[A.Pattern, dict[str, Any]], bool] = lambda pattern, caps: False,
    lost: Callable[[str], None] = lambda name: None,
) -> None:
    """Group ``matches`` and emit one Concat/Stack per complete, well-shaped group.

    ``failed(pattern, caps)``: whether an earlier rule that reported a problem took, or would
    have made, the member a pattern names with a group's captures. A group missing only such
    members is left unsaid: its cause is. ``lost(name)`` is told the output of each group that
    failed or was left, for the rules after this one to leave unsaid in turn."""
    groups: dict[tuple[Any, ...], dict[Any, Match]] = {}
    key_of = _key_of(members.key)
    if members.kind == "int":  # (the commonest: experts by number) a C call, not a method
        assert members.var is not None
        value_of = operator.itemgetter(members.var)
        for m in matches:  # one per tensor of the group's rule: a stack takes every expert
            caps = m.caps
            groups.setdefault(key_of(caps), {})[value_of(caps)] = m
    else:
        member = members.member
        for m in matches:
            groups.setdefault(key_of(m.caps), {})[member(m)] = m
    if sum(map(len, groups.values())) != len(matches):
        _refuse_shared_slots(members, matches, groups, report)
    tmpl = namer(rule.outputs[0])
    ranks = _family_size(rule, members, scope)
    for key, by_member in groups.items():
        caps = dict(zip(members.key, key, strict=True))
        where = _group_label(caps)
        try:
            if members.kind == "int":
                count = len(by_member) if ranks is None else ranks
                if max(by_member) >= count:
                    # Counted, not listed: `e.0` beside `e.99999999999999999999` is one gap.
                    gaps = _gaps(members, by_member)
                    raise RuleProblem(f"{where} is incomplete: missing {gaps}")
                expected = list(range(count))
            elif members.kind == "words":
                expected = list(range(len(members.words)))
            else:
                expected = list(range(len(rule.patterns)))
            absent = [x for x in expected if x not in by_member]
            if absent and all(_member_failed(rule, members, x, caps, failed) for x in absent):
                _lose(tmpl, scope, caps, lost)
                continue
            missing = [members.label(x) for x in absent]
            if missing:
                raise RuleProblem(f"{where} is incomplete: missing {', '.join(missing)}")
            ordered = [by_member[x] for x in expected]
            emit(tmpl(Scope(scope.params, scope.config, caps)), _node(rule, ordered, scope, caps))
        except RuleProblem as p:
            report(p.loc, p.message if p.message.startswith(where) else f"{where}: {p.message}")
            _lose(tmpl, scope, caps, lost)


def _member_failed(
    rule: A.Rule,
    members: Members,
    member: int,
    caps: dict[str, Any],
    failed: Callable[[A.Pattern, dict[str, Any]], bool],
) -> bool:
    """Whether ``failed`` says the missing ``member`` of a group (an index into the patterns
    or the words) was lost to an earlier failure."""
    if members.kind == "patterns":
        return failed(rule.patterns[member], caps)
    if members.kind == "words" and members.var is not None:
        return failed(rule.patterns[0], {**caps, members.var: members.words[member]})
    return False


def _lose(
    tmpl: Callable[[Scope], str], scope: Scope, caps: dict[str, Any], lost: Callable[[str], None]
) -> None:
    """Tell ``lost`` the output name a group that did not go through would have had."""
    with contextlib.suppress(LocatedProblem, EvalError):
        lost(tmpl(Scope(scope.params, scope.config, caps)))


def _family_size(rule: A.Rule, members: Members, scope: Scope) -> int | None:
    """The number of ranks when the members are a family's ranks (``"ranks:{r:int}:..."``,
    binding.py), which every group must have all of: a group that holds the ranks
    0..k-1 of n is a tensor some rank lacks, not a smaller merge."""
    if members.kind != "int" or len(rule.patterns) != 1:
        return None
    parts = rule.patterns[0].parts
    if len(parts) < 3 or not isinstance(parts[0], str) or not parts[0].endswith(":"):
        return None
    cap, after = parts[1], parts[2]
    if not isinstance(cap, A.Capture) or cap.name != members.var:
        return None
    if not isinstance(after, str) or not after.startswith(":"):
        return None
    family = scope.params.get(parts[0][:-1])
    count = family.get("count") if isinstance(family, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _group_label(caps: dict[str, Any]) -> str:
    where = ", ".join(f"{k}={show(v)}" for k, v in caps.items())
    return f"group {where}" if where else "the group"


def _refuse_shared_slots(
    members: Members,
    matches: list[Match],
    groups: dict[tuple[Any, ...], dict[Any, Match]],
    report: Callable[[A.Loc | None, str], None],
) -> None:
    """Report, and leave out, each group where two tensors fill one member's place (a glob
    in the pattern: ``m.{i}.{gate,up}_proj.*`` takes the weight and the bias). Keeping the
    last of them, as a dict does, merged one and silently dropped the other."""
    key_of = _key_of(members.key)
    slots: dict[tuple[Any, ...], dict[Any, list[str]]] = {}
    for m in matches:
        value = members.member(m)
        slots.setdefault(key_of(m.caps), {}).setdefault(value, []).append(m.spec.name)
    for key, by_member in slots.items():
        shared = [(v, names) for v, names in by_member.items() if len(names) > 1]
        if not shared:
            continue
        value, names = shared[0]
        where = _group_label(dict(zip(members.key, key, strict=True)))
        shown = ", ".join(f"`{n}`" for n in names[:4]) + (" ..." if len(names) > 4 else "")
        report(
            None,
            f"{where}: member {members.label(value)} is matched by {len(names)} tensors"
            f" ({shown}); each member must be one tensor: narrow the pattern (a glob takes"
            " them all), or capture what tells them apart",
        )
        del groups[key]


def _gaps(members: Members, present: dict[Any, Match]) -> str:
    """The missing members 0..max of an int group, as ranges: at most five, and a count."""
    ranges: list[str] = []
    missing = gaps = expect = 0
    for value in sorted(present):
        if value > expect:
            missing += value - expect
            gaps += 1
            if gaps <= 5:
                last = f"..{value - 1}" if value - 1 > expect else ""
                ranges.append(f"{members.label(expect)}{last}")
        expect = value + 1
    more = " ..." if gaps > 5 else ""
    total = f" ({missing:,} in all)" if missing > len(ranges) else ""
    return ", ".join(ranges) + more + total


def _key_of(names: Sequence[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """The tuple of the captures ``names`` of a match's captures, read at C speed."""
    if len(names) == 1:
        get = operator.itemgetter(names[0])
        return lambda caps: (get(caps),)
    if not names:
        return lambda caps: ()
    return operator.itemgetter(*names)


_SPEC = operator.attrgetter("spec")
_NODE = operator.attrgetter("node")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def _listing(specs: Sequence[TensorSpec]) -> str:
    """The members and their shapes, for a message."""
    return ", ".join(f"`{x.name}` {list(x.shape)}" for x in specs)


def _node(rule: A.Rule, ordered: list[Match], scope: Scope, caps: dict[str, Any]) -> Node:
    if rule.op not in ("merge", "stack"):  # add/sub/mul, matmul, gather, lookup
        return binary_node(rule, ordered, scope, caps)
    # By C calls where they can be: a stack takes every expert of a layer (hundreds).
    specs = list(map(_SPEC, ordered))
    first = specs[0]
    dtypes = set(map(_DTYPE, specs))
    if len(dtypes) > 1:
        raise RuleProblem(f"members have different dtypes: {', '.join(sorted(dtypes))}")
    srcs = tuple(map(_NODE, ordered))
    s = Scope(scope.params, scope.config, caps)
    if rule.op == "stack":
        if len(set(map(_SHAPE, specs))) > 1:
            raise RuleProblem(f"members have different shapes: {_listing(specs)}")
        d = norm_dim(
            as_int(evaluate(rule.dim, s), "dim") if rule.dim else 0,
            len(first.shape),
            f"`{first.name}`",
            1,
        )
        shape = (*first.shape[:d], len(specs), *first.shape[d:])
        return Stack(dtype=first.dtype, shape=shape, srcs=srcs, dim=d)
    if rule.same:  # one tensor every member holds: checked to be the same as it is written
        if len(set(map(_SHAPE, specs))) > 1:
            raise RuleProblem(f"members of `merge ... same` differ in shape: {_listing(specs)}")
        return Same(dtype=first.dtype, shape=first.shape, srcs=srcs)
    d = norm_dim(as_int(evaluate(rule.dim, s), "dim"), len(first.shape), f"`{first.name}`")  # type: ignore[arg-type]
    rest = {x.shape[:d] + x.shape[d + 1 :] for x in specs}
    if len(rest) > 1 or len({len(x.shape) for x in specs}) > 1:
        raise RuleProblem(f"members differ outside dim {d}: {_listing(specs)}")
    widths = [x.shape[d] for x in specs]
    if rule.sizes is not None:
        declared = as_ints(evaluate(rule.sizes, s), "sizes")
        if declared != widths:
            raise RuleProblem(
                f"declared sizes {declared} but the members have {widths} along dim {d}"
            )
    shape = (*first.shape[:d], sum(widths), *first.shape[d + 1 :])
    return Concat(dtype=first.dtype, shape=shape, srcs=srcs, dim=d)
