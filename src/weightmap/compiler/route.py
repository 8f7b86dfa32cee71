"""Rules in order: each rule applies to the working set the rules above it left.

The working set starts as the input tensors. Each rule, in program order, takes the tensors
of the set that match it (its pattern, then its ``where`` and cast ``from``) and puts its
outputs back; tensors it does not match pass by unchanged. So a rule sees the outputs of the
rules above it (composition: transpose, then cast what came out), never those below it, and a
tensor only ever moves forward through the rule list: there are no loops.

Names in the set are unique at every moment. An output whose name another tensor of the set
still holds is a collision, reported with both origins (two renames that swap names collide:
go through a temporary name).

Routing is done tensor by tensor, not rule by rule: a tensor is matched once against "the
first rule at or after position p", with one combined regex per starting position (built on
demand), so a 100,000-tensor checkpoint costs one regex match per tensor and per hop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from weightmap.compiler.ops import Match, namer
from weightmap.compiler.pattern import Alternative, Filter, Matcher, compile_pattern
from weightmap.errors import LocatedProblem
from weightmap.format.dtypes import TensorSpec
from weightmap.format.slots import make_tuple
from weightmap.language import ast as A
from weightmap.language.expr import compile_expr, resolve_dtype
from weightmap.language.values import EvalError, Scope, truth
from weightmap.plan.nodes import Node, Source

__all__ = ["Item", "Router", "WorkingSet"]

Report = Callable[[A.Loc, str], None]


@dataclass(eq=False, slots=True)
class Item:
    """A tensor of the working set: its current name, dtype and shape, the node computing it,
    the input position its output is ordered by, and who made it (None: an input)."""

    spec: TensorSpec
    node: Node
    order: int
    origin: A.Loc | None = None
    # Some rule took it: the unmatched policy is only for inputs that no rule took.
    touched: bool = False


class _FilterError(LocatedProblem):
    """A rule's ``where`` failed while routing; ``rule`` says which, so it is reported once."""

    loc: A.Loc

    def __init__(self, rule: int, loc: A.Loc, message: str) -> None:
        super().__init__(message, loc)
        self.rule = rule


class Router:
    """Finds, for a tensor, the first rule at or after a position that takes it."""

    def __init__(self, rules: Sequence[A.Rule], scope: Scope) -> None:
        self.rules = list(rules)
        self._alts: list[list[Alternative]] = [
            [Alternative(r, i, p, _filter(r, rule, scope)) for i, p in enumerate(rule.patterns)]
            for r, rule in enumerate(self.rules)
        ]
        self._matchers: dict[int, Matcher] = {}

    def matcher(self, start: int) -> Matcher:
        """The matcher over every pattern of the rules from ``start`` on (built once)."""
        found = self._matchers.get(start)
        if found is None:
            alts = [a for rule_alts in self._alts[start:] for a in rule_alts]
            found = self._matchers[start] = Matcher(alts)
        return found


def _filter(r: int, rule: A.Rule, scope: Scope) -> Filter | None:
    """The rule's ``where`` and cast ``from`` as one test of a tensor and its captures."""
    where = compile_expr(rule.where) if rule.where is not None else None
    want = resolve_dtype(rule.from_dtype) if rule.from_dtype else None
    if where is None and want is None:
        return None

    def accept(spec: TensorSpec, caps: dict[str, Any]) -> bool:
        if want is not None and spec.dtype != want:
            return False
        if where is None:
            return True
        try:
            return truth(where(scope.with_tensor(spec, caps)), rule.loc, "where")
        except EvalError as err:
            raise _FilterError(r, err.loc, err.message) from None

    return accept


# Who took a name from the working set (the rule's location) and what it became ("" for
# nothing), for 'matches nothing': a plain tuple, as one is made per tensor and rule.
_Taken = tuple[A.Loc, str]
# A rule's names taken, and what each became (see WorkingSet.history).
_History = tuple[A.Loc, Sequence[str], Sequence[str]]


@dataclass
class WorkingSet:
    """The tensors between rules, and the history needed to explain what happened to them."""

    router: Router
    report: Report
    alive: dict[str, Item] = field(default_factory=dict)
    buckets: list[list[tuple[Item, Match]]] = field(default_factory=list)
    final: list[Item] = field(default_factory=list)
    # Who took which names, rule by rule: (the rule, the names it took, what each became), or
    # what makes that when asked. Read only to explain a pattern that matched nothing, so kept
    # as each rule's lists and made into a dict when asked (``taken``): a stack takes every
    # expert of a checkpoint.
    history: list[_History | Callable[[], _History]] = field(default_factory=list)
    failed_filters: set[int] = field(default_factory=set)
    # Rules (by location) that failed on a tensor they took: it went nowhere, but nothing
    # dropped it, and a later rule's "matches nothing" must not say it did.
    failed_rules: set[A.Loc] = field(default_factory=set)
    # What rules that reported a problem did not make: their output templates (a rule that
    # failed everywhere), and the names a rule that failed for some tensors or groups would
    # have given them, carried through the rules after it (``carry_failed``). A later rule
    # that finds one of them missing would say the same error again.
    failed_outputs: list[A.Template] = field(default_factory=list)
    failed_names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.buckets = [[] for _ in self.router.rules]

    def start(self, inputs: Sequence[TensorSpec]) -> None:
        """Put the inputs in the set, each on its way to the first rule that takes it."""
        alive = self.alive
        send = self.sender(0)
        for i, spec in enumerate(inputs):
            name = spec.name
            if name in alive:
                continue  # duplicate input names are reported by the compiler
            item = alive[name] = Item(spec, Source.of(name, spec.dtype, spec.shape), i)
            send(item)

    def sender(self, start: int) -> Callable[[Item], None]:
        """``place(item, start)`` as one function, for a loop that sends many items on from the
        same rule (every input at the start; every tensor a rename or keep takes): the matcher
        looked up once, and an item whose match has no filter routed without a further call."""
        if start >= len(self.buckets):
            return self.final.append
        matcher = self.router.matcher(start)
        fullmatch, outer, captures, accepts = matcher.parts()
        owners, buckets, final, place = matcher.owners, self.buckets, self.final, self.place

        def send(item: Item) -> None:
            spec = item.spec
            found = fullmatch(spec.name)
            if found is None:
                final.append(item)
                return
            k = outer[found.lastindex or 0]
            if accepts[k] is not None:  # a filter to apply, or a later pattern: match decides
                place(item, start)
                return
            rule, pattern_index = owners[k]
            # (make_tuple: Match's own __new__ is Python code; this runs per tensor.)
            match = make_tuple(Match, (spec, item.node, captures[k](found), pattern_index))
            buckets[rule].append((item, match))

        return send

    def place(self, item: Item, start: int) -> None:
        """Send ``item`` to the first rule from ``start`` that takes it, or to the end."""
        if start >= len(self.buckets):
            self.final.append(item)
            return
        matcher = self.router.matcher(start)
        spec = item.spec
        try:
            hit = matcher.match(spec)
        except _FilterError as err:
            self._filter_failed(item, err)
            return
        if hit is None:
            self.final.append(item)
            return
        k, caps = hit
        rule, pattern_index = matcher.owners[k]
        self.buckets[rule].append((item, Match(spec, item.node, caps, pattern_index)))

    def _filter_failed(self, item: Item, err: _FilterError) -> None:
        if err.rule not in self.failed_filters:
            self.failed_filters.add(err.rule)
            self.report(err.loc, f"{err.message} (while matching `{item.spec.name}`)")
        # The compile fails on that problem; listing the tensor as unmatched too would only be
        # noise.
        item.touched = True

    def take(self, r: int) -> list[tuple[Item, Match]]:
        """Rule ``r``'s matches, removed from the set."""
        taken = self.buckets[r]
        for item, _m in taken:
            self.alive.pop(item.spec.name, None)
        return taken

    def pass_on(self, item: Item, r: int) -> None:
        """Rule ``r`` took ``item`` and lets it go on unchanged (keep, the source of a copy)."""
        item.touched = True
        if item.origin is None:  # an input: the rule that kept it is where it comes from
            item.origin = self.router.rules[r].loc
        self.alive[item.spec.name] = item
        self.place(item, r + 1)

    def pass_on_all(self, taken: Sequence[tuple[Item, Match]], r: int) -> None:
        """``pass_on`` for everything rule ``r`` took, in one loop (``keep "**"`` takes what is
        left of a checkpoint)."""
        loc = self.router.rules[r].loc
        alive = self.alive
        send = self.sender(r + 1)
        for item, _m in taken:
            item.touched = True
            if item.origin is None:
                item.origin = loc
            alive[item.spec.name] = item
            send(item)

    def record(self, name: str, rule: A.Loc, became: str) -> None:
        """Remember that ``rule`` took ``name`` and made ``became`` of it ("" for nothing)."""
        self.history.append((rule, (name,), (became,)))

    def record_all(self, rule: A.Loc, names: Sequence[str], became: Sequence[str]) -> None:
        """``record`` for many names at once: ``became[i]`` is what ``names[i]`` became."""
        self.history.append((rule, names, became))

    def record_later(self, made: Callable[[], _History]) -> None:
        """``record_all`` of what ``made()`` returns, called only if a message needs it."""
        self.history.append(made)

    @property
    def taken(self) -> dict[str, _Taken]:
        """Each name a rule took: the last rule that took it, and what it became."""
        found: dict[str, _Taken] = {}
        for entry in self.history:
            rule, names, became = entry() if callable(entry) else entry
            found.update(zip(names, zip(repeat(rule), became), strict=False))  # (repeat: endless)
        return found

    def put(self, item: Item, r: int) -> None:
        """Add rule ``r``'s output; it continues to the rules below ``r``."""
        item.touched = True
        other = self.alive.get(item.spec.name)
        if other is not None:
            self.report(item.origin or self.router.rules[r].loc, _collision(item, other))
            return
        self.alive[item.spec.name] = item
        self.place(item, r + 1)

    def _first_taken(self, pattern: A.Pattern) -> tuple[str, A.Loc, str] | None:
        """A name of ``pattern`` that an earlier rule took: the name, the rule, what it became."""
        taken = self.taken
        if pattern.is_literal:
            names = [pattern.text] if pattern.text in taken else []
        else:
            rx = compile_pattern(pattern)
            names = [n for n in taken if rx.fullmatch(n)][:1]
        if not names:
            return None
        rule, became = taken[names[0]]
        return names[0], rule, became

    def taken_by_failed_rule(self, pattern: A.Pattern) -> bool:
        """True when a rule that failed took the tensor ``pattern`` names: its own error says
        all there is, and "matches nothing" after it would be a second error for one cause."""
        hit = self._first_taken(pattern)
        return hit is not None and not hit[2] and hit[1] in self.failed_rules

    def carry_failed(self, rule: A.Rule, scope: Scope) -> None:
        """Add what ``rule`` would have made of the names failed so far: a rule after a
        failure takes what it can and goes on, and the tensor it would have made of the one
        that failed is missing from the rules after it in turn."""
        if not self.failed_names or not rule.outputs:
            return  # (a rule that keeps names keeps a failed one failed)
        for pattern in rule.patterns:
            for name in list(self.failed_names):
                caps = captures_of(pattern, name)
                if caps is None:
                    continue
                for template in rule.outputs:
                    with contextlib.suppress(LocatedProblem, EvalError):
                        self.failed_names.add(
                            namer(template)(Scope(scope.params, scope.config, caps))
                        )

    def made_by_failed_rule(self, pattern: A.Pattern, caps: dict[str, Any] | None = None) -> bool:
        """True when a rule that failed would have made a tensor ``pattern`` names (with
        ``caps``, the one it names with those captures): a failed name it matches, or a
        failed rule's template filled with a digit or a letter for each hole (a guess, used
        only to leave out a second error for a cause already reported)."""
        if caps is not None:
            name = pattern_name(pattern, caps)
            if name is not None and name in self.failed_names:
                return True
        rx = compile_pattern(pattern)
        if any(map(rx.fullmatch, self.failed_names)):
            return True
        for template in self.failed_outputs:
            for filler in ("0", "x"):
                name = "".join(p if isinstance(p, str) else filler for p in template.parts)
                if rx.fullmatch(name):
                    return True
        return False

    def explain_nothing(self, pattern: A.Pattern) -> str | None:
        """Why a pattern matched nothing, if an earlier rule took a tensor it names."""
        hit = self._first_taken(pattern)
        if hit is None:
            return None
        name, rule, became = hit
        what = "dropped it" if not became else f"made it `{became}`"
        return f"`{name}` was taken by the rule at {rule}, which {what}"


def _collision(item: Item, other: Item) -> str:
    here, there = item.node.sources(), other.node.sources()
    made_from = f" (from `{here[0].name}`)" if here and here[0].name != item.spec.name else ""
    if other.origin is not None and other.origin == item.origin:
        first = there[0].name if there else other.spec.name
        return (
            f"output `{item.spec.name}`{made_from} is also made from `{first}` by the same "
            "rule: the output name must tell them apart (use every capture in it)"
        )
    if other.origin is None:
        return (
            f"output `{item.spec.name}`{made_from} collides with the input `{other.spec.name}`, "
            "which no rule has taken yet: rename one of them (to swap two names, rename one "
            "to a temporary name first)"
        )
    return (
        f"output `{item.spec.name}`{made_from} collides with `{other.spec.name}`, made by the "
        f"rule at {other.origin} and still in the working set: rename one of them"
    )


def captures_of(pattern: A.Pattern, name: str) -> dict[str, Any] | None:
    """The captures of ``pattern`` in ``name`` (``{n:int}`` ones as ints), or None."""
    m = compile_pattern(pattern).fullmatch(name)
    if m is None:
        return None
    return {
        part.name: int(m[part.name]) if part.kind == "int" else m[part.name]
        for part in pattern.parts
        if isinstance(part, A.Capture)
    }


def pattern_name(pattern: A.Pattern, caps: dict[str, Any]) -> str | None:
    """The name ``pattern`` names with ``caps`` for its captures (and ``_alt0``, ``_alt1``...
    for its unnamed alternatives, as ``pattern_regex`` names them); None where it has a glob,
    or a capture ``caps`` lacks."""
    out = []
    alts = 0
    for part in pattern.parts:
        key = None
        if isinstance(part, A.Alt):
            key, alts = f"_alt{alts}", alts + 1
        elif isinstance(part, A.Capture):
            key = part.name
        if isinstance(part, str):
            out.append(part)
        elif key is not None and key in caps:
            out.append(str(caps[key]))
        else:
            return None
    return "".join(out)
