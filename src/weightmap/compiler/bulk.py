"""The rules of the commonest plan there is, keep and rename alone, applied in one pass.

A rename of every tensor of a checkpoint (``layers.{i}.{rest}``, a prefix added or removed)
is most of what people convert, and a checkpoint may hold 100,000 tensors. The working set
(``route.py``) makes several objects per tensor so that it can route any rule's outputs on
and explain any problem; this pass makes only the plan's own: one spec, one source node and
one output per tensor. It gives the very plan the working set gives, or None wherever the two
could differ or there is anything to report (a rule that takes nothing, a collision, a
template that fails, an output a later rule would rename, an input no rule takes while the
policy says error): the working set then runs from the start, and says what is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from itertools import starmap
from operator import attrgetter, methodcaller
from typing import cast

from weightmap.compiler.names import MAX_NAME_CHARS
from weightmap.compiler.ops import tensor_namer
from weightmap.compiler.route import Router
from weightmap.errors import LocatedProblem
from weightmap.format.dtypes import SpecTable, TensorSpec, sized_specs
from weightmap.language import ast as A
from weightmap.language.values import Scope
from weightmap.plan.nodes import Source
from weightmap.plan.parts import OutputTable, output_names
from weightmap.plan.plan import Dropped, OutputTensor

__all__ = ["bulk_renames"]

FullMatch = Callable[[str], "re.Match[str] | None"]
Owner = tuple[int, int]  # (rule, pattern index)

_RENAMES = ("keep", "rename")


def bulk_renames(
    router: Router,
    scope: Scope,
    inputs: Sequence[TensorSpec],
    unmatched: A.Unmatched | None,
    where: A.Loc,
    *,
    unique_inputs: bool,
) -> tuple[Sequence[OutputTensor], list[Dropped]] | None:
    """``run_rules``'s outputs and drops for keep/rename rules without filters, or None.

    ``unique_inputs``: whether no name comes twice among ``inputs``, as the compiler has
    found (it reports the name; the working set then runs).

    Each input goes to the first rule that takes it, as in the working set; its output is
    that rule's name for it, made by that rule (its origin). A later rule may take the output
    only to keep it as it is (``keep "**"`` below the renames: the output goes on unchanged,
    its origin too); any other second hop is the working set's. Outputs come in input order,
    as there.
    """
    rules = router.rules
    if not unique_inputs or not rules or any(rule.op not in _RENAMES for rule in rules):
        return None
    matcher = router.matcher(0)
    fullmatch, outer, captures, accepts = matcher.parts()
    if any(accept is not None for accept in accepts):  # a `where`: the working set filters
        return None
    owners = matcher.owners
    count = len(rules)
    namers = [tensor_namer(rule.outputs[0], scope) if rule.outputs else None for rule in rules]
    # Each alternative's output name straight from the match's groups, where it can be.
    positional = [
        _positional(rules[r].outputs[0], matcher.capture_groups(k))
        if rules[r].outputs and not scope.local
        else None
        for k, (r, _) in enumerate(owners)
    ]
    # The rules below r, which an output of r goes on to: (fullmatch, outer groups, owners).
    below = [_after(router, r) for r in range(count)]
    # Where each rule's patterns start among all of them (``hit`` is indexed so).
    first = [0]
    for rule in rules:
        first.append(first[-1] + len(rule.patterns))
    policy = unmatched.policy if unmatched else "error"
    hit = [False] * len(owners)  # which patterns took something
    rule_of: dict[str, int] = {}  # input name -> the rule that takes it (count: none)
    outputs: list[OutputTensor] = []
    append = outputs.append
    made: list[tuple[str, int]] = []  # (output name, rule) where it differs from the input's
    dropped: list[Dropped] = []
    of_source, of_output = Source.of, OutputTensor.of
    table: OutputTable | None = None
    taken = _one_alternative(inputs, fullmatch, outer, owners, rules, namers, positional, below)
    if taken is not None:  # every input to one alternative: by C calls, as the loop would
        k, found_outputs = taken
        if isinstance(found_outputs, OutputTable):
            table = found_outputs
        else:
            outputs = list(found_outputs)
        hit[k] = True
    else:
        for spec in inputs:
            name = spec.name
            found = fullmatch(name)
            if found is None:
                rule_of[name] = count
                if policy == "keep":
                    append(of_output(spec, of_source(name, spec.dtype, spec.shape), where))
                elif policy == "drop":
                    dropped.append(Dropped(name=name, origin=where))
                else:
                    return None  # unmatched inputs are an error: the working set lists them
                continue
            k = outer[found.lastindex or 0]
            r = owners[k][0]
            rule_of[name] = r
            hit[k] = True
            render = namers[r]
            if render is None:
                out = spec
            else:
                quick = positional[k]
                if quick is not None:
                    new = quick(*found.groups())
                    if len(new) > MAX_NAME_CHARS:
                        return None  # (the working set refuses it, as it makes each name)
                else:
                    try:
                        new = render(spec, captures[k](found))
                    except LocatedProblem:
                        return None
                if new == name:
                    out = spec
                else:
                    out = spec.named(new)
                    made.append((new, r))
            origin = rules[r].loc
            rest = below[r]
            while rest is not None:
                again = rest[0](out.name)
                if again is None:
                    break
                r, pattern_index = rest[2][rest[1][again.lastindex or 0]]
                if namers[r] is not None:
                    return None  # renamed twice: the working set's
                hit[first[r] + pattern_index] = True  # kept as it is, and on to the rules below
                rest = below[r]
            append(of_output(out, of_source(name, spec.dtype, spec.shape), origin))
    used = {owner for owner, taken in zip(owners, hit, strict=True) if taken}
    for r, rule in enumerate(rules):
        if not rule.optional and any((r, i) not in used for i in range(len(rule.patterns))):
            return None  # a pattern that matches nothing: the working set says why
    # Names are unique in the working set at every moment: an output may only take the name
    # of an input that a rule up to its own has taken already.
    names = output_names(outputs if table is None else table)
    if len(set(names)) != len(names):
        return None
    for new, r in made:
        if rule_of.get(new, -1) > r:
            return None
    return (outputs if table is None else table), dropped


def _one_alternative(
    inputs: Sequence[TensorSpec],
    fullmatch: FullMatch,
    outer: Mapping[int, int],
    owners: Sequence[Owner],
    rules: Sequence[A.Rule],
    namers: Sequence[object],
    positional: Sequence[Callable[..., str] | None],
    below: Sequence[tuple[FullMatch, dict[int, int], list[Owner]] | None],
) -> tuple[int, Sequence[OutputTensor]] | None:
    """The outputs of the loop in ``bulk_renames`` where one pattern alternative takes every
    input, and that alternative; None where it is not so, or where a rule below would take an
    output (the loop then goes input by input).

    Made column by column, each column by one ``map`` (the matches, their groups, the names
    made of them, then the specs, sources and outputs through their slot-filling
    constructors): no loop body runs per tensor, where the loop runs a dozen steps for each.
    """
    if not inputs:
        return None
    if isinstance(inputs, SpecTable):
        parts = (fullmatch, outer, owners, rules, namers, positional, below)
        return _table_alternative(inputs, *parts)
    names = list(map(_NAME, inputs))
    one = _the_alternative(names, fullmatch, outer, owners)
    if one is None:
        return None
    found, k, r = one
    count = len(inputs)
    dtypes = list(map(_DTYPE, inputs))
    shapes = list(map(_SHAPE, inputs))
    if namers[r] is None:  # a keep: each output is its input's spec
        specs = list(inputs)
    else:
        quick = positional[k]
        if quick is None:
            return None
        if not _fits(quick, found, names):
            return None  # (the loop makes the names one by one, refusing a long one)
        new_names = starmap(quick, map(_GROUPS, found))
        # As TensorSpec.named makes each: the inputs' dtypes, shapes and known sizes.
        specs = sized_specs(count, new_names, dtypes, shapes, map(_KNOWN_SIZE, inputs))
    rest = below[r]
    if rest is not None and any(map(rest[0], map(_NAME, specs))):
        return None
    sources = Source.many(count, names, dtypes, shapes)
    return k, OutputTensor.many(count, specs, sources, rules[r].loc)


def _the_alternative(
    names: Sequence[str], fullmatch: FullMatch, outer: Mapping[int, int], owners: Sequence[Owner]
) -> tuple[list[re.Match[str]], int, int] | None:
    """Each name's match, the one pattern alternative that takes them all and its rule; None
    where a name matches nothing or the names go to several alternatives."""
    found = list(map(fullmatch, names))
    if None in found:
        return None
    alternatives = {outer[last or 0] for last in set(map(_LASTINDEX, found))}
    if len(alternatives) != 1:
        return None
    (k,) = alternatives
    return cast(list["re.Match[str]"], found), k, owners[k][0]


def _table_alternative(
    inputs: SpecTable,
    fullmatch: FullMatch,
    outer: Mapping[int, int],
    owners: Sequence[Owner],
    rules: Sequence[A.Rule],
    namers: Sequence[object],
    positional: Sequence[Callable[..., str] | None],
    below: Sequence[tuple[FullMatch, dict[int, int], list[Owner]] | None],
) -> tuple[int, OutputTable] | None:
    """``_one_alternative`` of a checkpoint's table of inputs: the outputs as a table too,
    sharing every column but the names with the inputs (no object made per tensor).

    The names are matched a slice at a time, each slice's matches let go once its names are
    made: a match object per tensor of a whole checkpoint at once is 30 MB at 200,000."""
    names = inputs.names
    made: list[str] = []
    k = r = -1
    quick: Callable[..., str] | None = None
    for start in range(0, len(names), _SLICE):
        one = _the_alternative(names[start : start + _SLICE], fullmatch, outer, owners)
        if one is None or (k >= 0 and one[1] != k):
            return None  # (a name no alternative takes, or two alternatives)
        found, k, r = one
        if namers[r] is not None:
            quick = positional[k]
            if quick is None:
                return None
            if not _fits(quick, found, names[start : start + _SLICE]):
                return None  # (the loop makes the names one by one, refusing a long one)
            made += starmap(quick, map(_GROUPS, found))
    if k < 0:
        return None
    specs = inputs if namers[r] is None else inputs.renamed(made)  # (a keep: the inputs)
    rest = below[r]
    if rest is not None and any(map(rest[0], specs.names)):
        return None
    return k, OutputTable(specs, inputs, rules[r].loc)


# Names matched at a time by _table_alternative.
_SLICE = 16384


_NAME = attrgetter("name")
_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")
_LASTINDEX = attrgetter("lastindex")
_KNOWN_SIZE = attrgetter("_nbytes")  # (None where not yet counted, as TensorSpec.named keeps)
_GROUPS = methodcaller("groups")


def _fits(quick: Callable[..., str], found: Sequence[re.Match[str]], names: Sequence[str]) -> bool:
    """Whether every name ``quick`` makes of these matches is short enough to be an output's,
    known before any is made: each hole prints a part of its input's name, so the template
    with the longest input name in every hole is as long as the longest name it can make."""
    widest = "x" * max(map(len, names))
    return len(quick(*[widest] * len(found[0].groups()))) <= MAX_NAME_CHARS


def _positional(template: A.Template, groups: Mapping[str, int]) -> Callable[..., str] | None:
    """The template as ``str.format`` of a match's ``groups()``, where every hole is a capture
    of the pattern (``groups``: capture -> group number); None otherwise.

    It renders what ``tensor_namer`` renders from the captures: a capture prints as the text it
    matched, an ``{n:int}`` one too, as the pattern takes canonical decimal digits alone
    (``0|[1-9][0-9]*``, which ``str(int(...))`` gives back unchanged). It makes no dict of
    captures and no int per tensor: this runs once per tensor of a checkpoint.
    """
    out: list[str] = []
    for part in template.parts:
        if isinstance(part, str):
            out.append(part.replace("{", "{{").replace("}", "}}"))
        elif isinstance(part, A.Name) and part.id in groups:
            out.append(f"{{{groups[part.id] - 1}}}")  # (groups() starts at group 1)
        else:
            return None
    return "".join(out).format


def _after(router: Router, r: int) -> tuple[FullMatch, dict[int, int], list[Owner]] | None:
    """What finds the rule below ``r`` that takes a name, or None below the last rule."""
    if r + 1 >= len(router.rules):
        return None
    matcher = router.matcher(r + 1)
    fullmatch, outer, _captures, _accepts = matcher.parts()
    return fullmatch, outer, matcher.owners
