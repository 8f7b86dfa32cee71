"""The compiler: a mapping + input headers + config -> an immutable :class:`Plan`.

Order of work: resolve params; walk the statements, taking the live branch of each ``if``;
check every ``require`` (if one fails, stop: rule errors against the wrong checkpoint are
noise); apply the rules in order to the working set (``route.py``: each rule sees what the
rules above it left); apply the unmatched policy; apply config edits; check output names.
Problems are collected all the way and raised together as one :class:`CompileError`.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import json
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, cast

from weightmap.compiler.arith import VALUE_OPS, build_value
from weightmap.compiler.bulk import bulk_renames
from weightmap.compiler.configedit import apply_config_block
from weightmap.compiler.dtypefields import stale_dtype_fields
from weightmap.compiler.files import apply_files_blocks, file_exists
from weightmap.compiler.group import build_group, members_of
from weightmap.compiler.names import MAX_NAME_CHARS, check_names
from weightmap.compiler.ops import Match, build_simple, dtype_known, output_name, tensor_namer
from weightmap.compiler.outputs import check_member_files, families, place
from weightmap.compiler.pattern import compile_pattern
from weightmap.compiler.problems import Problems
from weightmap.compiler.route import Item, Router, WorkingSet
from weightmap.compiler.unmatched import compact_names
from weightmap.errors import CompileError, LocatedProblem, MappingError
from weightmap.format.dtypes import SpecTable, TensorSpec
from weightmap.format.text import json_problem
from weightmap.fs.gcpause import gc_paused
from weightmap.inputs.sidefiles import FolderFiles
from weightmap.language import ast as A
from weightmap.language.expr import closest, compile_expr, did_you_mean, render
from weightmap.language.mapping import Mapping
from weightmap.language.values import EvalError, Scope, truth, type_name
from weightmap.plan.nodes import Node, Source
from weightmap.plan.parts import OutputTable
from weightmap.plan.plan import Dropped, OutputTensor, Plan

__all__ = ["compile_plan"]

_ORDER = operator.attrgetter("order")
_IS_ORDER = functools.partial(operator.is_not, None)
_NAME = operator.attrgetter("name")
_NODE = operator.attrgetter("node")
_SPEC_NAME = operator.attrgetter("spec.name")


@dataclass
class _Flat:
    rules: list[A.Rule] = field(default_factory=list)
    checks: list[A.Require | A.Warn] = field(default_factory=list)
    configs: list[A.ConfigBlock] = field(default_factory=list)
    files: list[A.FilesBlock] = field(default_factory=list)
    unmatched: A.Unmatched | None = None


class _Compiler:
    def __init__(
        self,
        mapping: Mapping,
        inputs: Sequence[TensorSpec],
        config: Any,
        files: FolderFiles | None = None,
    ) -> None:
        self.mapping = mapping
        # A checkpoint's table of specs is kept as its columns (format/dtypes.py).
        self.inputs: Sequence[TensorSpec] = (
            inputs if isinstance(inputs, SpecTable) else tuple(inputs)
        )
        self._input_names: Sequence[str] = (
            inputs.names if isinstance(inputs, SpecTable) else [i.name for i in self.inputs]
        )
        # (The names made a set at C speed; only where one comes twice is it looked for.)
        self.unique_inputs = len(set(self._input_names)) == len(self.inputs)
        self.config = config
        self.files = files
        self.problems = Problems()
        self.warnings: list[str] = []
        self._exists: dict[A.Pattern, bool] = {}
        self._names: frozenset[str] | None = None
        self.failed_require = False
        self.refused_params: set[str] = set()  # given, but of the wrong type: see checks()
        self.filter_failed: set[int] = set()

    def report(self, loc: A.Loc, message: str) -> None:
        self.problems.report(loc, message)

    def check_unique_inputs(self) -> None:
        if self.unique_inputs:
            return
        seen: set[str] = set()
        for spec in self.inputs:
            if spec.name in seen:
                self.report(
                    A.Loc(self.mapping.name, 1, 1),
                    f"input `{spec.name}` appears twice in the headers",
                )
            seen.add(spec.name)

    def check_input_names(self) -> None:
        """Refuse input names longer than any output may be, before a pattern is matched
        against them: a pattern costs up to the square of a name's length to match (see
        language/syntax.py), and such a name could only ever be dropped."""
        names = self._input_names
        if not names or max(map(len, names)) <= MAX_NAME_CHARS:
            return
        long = [n for n in names if len(n) > MAX_NAME_CHARS]
        self.report(
            A.Loc(self.mapping.name, 1, 1),
            f"{len(long)} input tensor name(s) longer than {MAX_NAME_CHARS:,} characters, the "
            f"longest an output may have (the first, {len(long[0]):,} characters: "
            f"{long[0][:80]!r}...): no real checkpoint names a tensor so; weightmap does not "
            "match patterns against such names",
        )
        raise CompileError(self.problems.grouped(), self.mapping.name)

    def exists(self, pattern: A.Pattern) -> bool:
        if isinstance(pattern, A.FilePattern):
            # Asked once per pattern: every call walks all the side files (up to 10,000), which
            # a comprehension repeating `exists file` would multiply past the work budget.
            if pattern not in self._exists:
                files = None if self.files is None else self.files.files
                self._exists[pattern] = file_exists(files, pattern)
            return self._exists[pattern]
        if pattern.is_literal:  # a name (or a pattern whose captures were bound): a lookup
            if self._names is None:
                self._names = frozenset(self._input_names)
            return "".join(pattern.parts) in self._names  # type: ignore[arg-type]
        if pattern not in self._exists:
            rx = compile_pattern(pattern)
            self._exists[pattern] = any(map(rx.fullmatch, self._input_names))
        return self._exists[pattern]

    # ------------------------------------------------------------ params and statements

    def params(self, overrides: dict[str, Any] | None) -> dict[str, Any]:
        values = dict(self.mapping.param_defaults)
        for name, value in (overrides or {}).items():
            if name not in values:
                known = ", ".join(sorted(values)) or "none"
                hint = did_you_mean(name, values, quote="'")
                self.report(
                    A.Loc(self.mapping.name, 1, 1),
                    f"unknown param {name!r}{hint} (params: {known})",
                )
            elif (why := json_problem(value)) is not None:
                # Checked first: repr() of a 5000-digit int raises ValueError.
                self.report(self.mapping.param_locs[name], f"param {name!r}: {why}")
            elif type(value) is not type(values[name]) and values[name] is not None:
                # In JSON's words, with the default as the example: `--set` reads JSON, and
                # "got None" or "takes a str" says nothing to whoever typed null or lm_head.
                default = json.dumps(values[name])
                got = "null" if value is None else f"the {type_name(value)} {json.dumps(value)}"
                self.report(
                    self.mapping.param_locs[name],
                    f"param {name!r} takes {_a(type_name(values[name]))} like its default"
                    f" {default[:80]}, got {got[:80]}"
                    f" (with --set the value is read as JSON: --set '{name}={default[:80]}')",
                )
            else:
                values[name] = value
                continue
            self.refused_params.add(name)
        return values

    def flatten(self, stmts: tuple[A.Stmt, ...], scope: Scope, out: _Flat) -> None:
        for st in stmts:
            if isinstance(st, A.If):
                try:
                    ok = truth(compile_expr(st.cond)(scope), st.cond.loc)
                except EvalError as err:
                    self.report(err.loc, err.message)
                    continue
                self.flatten(st.then if ok else st.orelse, scope, out)
            elif isinstance(st, A.Rule):
                out.rules.append(st)
            elif isinstance(st, (A.Require, A.Warn)):
                out.checks.append(st)
            elif isinstance(st, A.ConfigBlock):
                out.configs.append(st)
            elif isinstance(st, A.FilesBlock):
                out.files.append(st)
            elif isinstance(st, A.Unmatched):
                if out.unmatched is not None:
                    self.report(
                        st.loc, f"a second `unmatched` (the first is at {out.unmatched.loc})"
                    )
                out.unmatched = st

    def checks(self, checks: list[A.Require | A.Warn], scope: Scope) -> None:
        # A check that cannot be evaluated is reported only if no require failed: the later
        # requires of a preset read what the first one found missing (no quantization_config
        # at all: every require about its fields fails to evaluate), a second error for one
        # cause.
        unevaluated: list[EvalError] = []
        for st in checks:
            if self.refused_params and A.reads_names((st.cond, st.message), self.refused_params):
                # Computed from the default in place of a value the caller gave and was
                # refused (`multiple_of=256` where they set abc): an error about a value they
                # never gave. The refusal itself is reported.
                continue
            try:
                ok = True if st.cond is None else truth(compile_expr(st.cond)(scope), st.cond.loc)
            except EvalError as err:
                unevaluated.append(err)
                continue
            fire = (not ok) if isinstance(st, A.Require) else ok
            self.failed_require |= fire and isinstance(st, A.Require)
            if not fire:
                continue
            try:
                message = render(st.message, scope)
            except EvalError:
                message = st.message.text
            if isinstance(st, A.Require):
                self.report(st.loc, f"requirement failed: {message}")
            else:
                self.warnings.append(f"{st.loc}: {message}")
        if not self.failed_require:
            for problem in unevaluated:
                self.report(problem.loc, problem.message)

    def check_rule(self, rule: A.Rule) -> bool:
        for word in (rule.from_dtype, rule.to_dtype, rule.compute):
            if word is not None and not dtype_known(word):
                self.report(
                    rule.loc, f"unknown dtype `{word}` (e.g. f32, bf16, f16, fp8_e4m3, i64)"
                )
                return False
        return True


def compile_plan(
    mapping: Mapping,
    inputs: Sequence[TensorSpec],
    config: dict[str, Any] | None = None,
    *,
    params: dict[str, Any] | None = None,
    files: FolderFiles | None = None,
    allow_code: bool = False,
    inputs_seen: dict[str, Any] | None = None,
) -> Plan:
    """Compile ``mapping`` against input headers and config.json into a Plan.

    ``files`` are the side files of the input folder (``inputs/sidefiles.py``); None when they
    are not carried. ``allow_code``: the mapping's files blocks may add or rename into code
    files (``*.py``; see ``files.py``). ``inputs_seen``: what expressions see under each
    declared input's name (``{"adapter": {"config": {...}}}``, binding.py), whose tensors
    are among ``inputs`` as ``adapter:NAME``. Never reads tensor data. Raises :class:`CompileError`
    (a MappingError) listing every problem with its file:line:col.

    >>> from weightmap.language.mapping import load_mapping
    >>> m = load_mapping('weightmap 1\\nrename "a.{x}" -> "b.{x}"')
    >>> compile_plan(m, [TensorSpec("a.w", "F32", (2,))], None).outputs[0].name
    'b.w'
    """
    with gc_paused():  # (fs/gcpause.py: a plan of many tensors makes no cycles)
        return _compile(mapping, inputs, config, params, files, allow_code, inputs_seen)


def _check_arguments(params: Any, config: Any) -> None:
    if params is not None and not isinstance(params, dict):
        raise MappingError(f"params must be a dict of name to value, not {type(params).__name__}")
    if config is not None and (not isinstance(config, dict) or json_problem(config) is not None):
        why = "is not an object" if not isinstance(config, dict) else json_problem(config)
        raise MappingError(
            f"the checkpoint's config {why}: fix the file it was read from (config.json, or"
            " the mapping's `config from` file), since the output's config.json must be JSON"
        )


def _compile(
    mapping: Mapping,
    inputs: Sequence[TensorSpec],
    config: dict[str, Any] | None,
    params: dict[str, Any] | None,
    files: FolderFiles | None = None,
    allow_code: bool = False,
    inputs_seen: dict[str, Any] | None = None,
) -> Plan:
    _check_arguments(params, config)
    c = _Compiler(mapping, inputs, config, files)
    c.check_input_names()
    c.check_unique_inputs()
    values = c.params(params)
    declared = [d.name for d in mapping.inputs]
    missing = [n for n in declared if n not in (inputs_seen or {})]
    if missing:
        raise MappingError(
            f"{mapping.name} reads input {missing[0]!r}, which is not bound: give it, "
            f'remap(..., inputs={{"{missing[0]}": PATH}}) or --input {missing[0]}=PATH'
        )
    # One work budget (values.WORK_LIMIT) for everything a mapping evaluates once: `if`
    # conditions, checks, config and files blocks. A budget per statement would let a short
    # mapping multiply the work by its number of statements (`files { add ... }` repeated).
    # Each tensor's expressions get their own budget, as their number follows the input's.
    # The declared inputs are names in expressions (`adapter.config.r`), not params: the
    # plan's params stay what the caller may set.
    seen = {**values, **{n: (inputs_seen or {})[n] for n in declared}}
    scope = Scope(seen, config, {}, None, c.exists)
    flat = _Flat()
    c.flatten(mapping.program.stmts, scope, flat)
    c.checks(flat.checks, scope)
    if c.failed_require:
        # Rule errors against a checkpoint the mapping refuses would only be noise.
        raise CompileError(c.problems.grouped(), mapping.name)
    fams = families(mapping.outputs, scope, c.report)
    rules = [r for r in flat.rules if c.check_rule(r)]
    outputs, dropped = run_rules(c, rules, scope, flat.unmatched)
    locs = {d.name: d.loc for d in mapping.outputs}
    outputs = place(outputs, fams, c.report, locs)
    out_config = _edit_config(c, flat.configs, config, scope)
    where = A.Loc(mapping.name, 1, 1)
    side = apply_files_blocks(
        flat.files,
        None if files is None else files.files,
        scope,
        c.report,
        where,
        allow_code=allow_code,
    )
    if files is None:
        # No side files are carried (one file given, or side files off): a block's drops and
        # renames have nothing to act on, but an added file would have been written.
        added = [x for block in flat.files for x in block.stmts if x.op == "add"]
        if added:
            c.warnings.append(
                f'{added[0].loc}: files {{ add "{added[0].name}" ... }} is skipped: no side '
                "files are written when the input is a single file (or side files are off); "
                "give the checkpoint's folder to write it"
            )
    check_names(outputs, c.report)
    check_member_files(fams, locs, c.report)
    if declared:
        _check_no_input_names(outputs, declared, c.report)
    c.warnings += stale_dtype_fields(outputs, config, out_config)
    if c.problems:
        raise CompileError(c.problems.grouped(), mapping.name)
    return Plan.build(
        mapping_name=mapping.name,
        inputs=c.inputs,
        outputs=outputs if isinstance(outputs, OutputTable) else tuple(outputs),
        dropped=tuple(dropped),
        warnings=(*c.warnings, *(files.skipped if files is not None else ())),
        params=values,
        config=out_config,
        input_config=config,
        files=side,
        families=tuple(fams),
    )


def _check_no_input_names(
    outputs: Sequence[OutputTensor], declared: list[str], report: Callable[[A.Loc, str], None]
) -> None:
    """Report the outputs still named as one of the declared inputs' tensors (``adapter:x``):
    only the main namespace is written, so each must be taken by a rule (merged, renamed,
    dropped) rather than written under a name no loader expects."""
    rx = re.compile(f"(?:{'|'.join(map(re.escape, declared))}):")
    left = [o for o in outputs if rx.match(o.name)]
    if not left:
        return
    first = left[0]
    more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
    report(
        first.origin,
        f"output {first.name[:80]!r}{more} is still input {first.name.split(':', 1)[0]!r}'s "
        "tensor: a mapping writes the main namespace only; take it with a rule (merge, "
        'rename "NAME:{x*}" -> "{x}", drop) or `unmatched drop`',
    )


def run_rules(
    c: _Compiler, rules: list[A.Rule], scope: Scope, unmatched: A.Unmatched | None
) -> tuple[Sequence[OutputTensor], list[Dropped]]:
    """Apply the rules in order to the working set (route.py); outputs in plan order, drops."""
    router = Router(rules, scope)
    where = unmatched.loc if unmatched else A.Loc(c.mapping.name, 1, 1)
    bulk = bulk_renames(router, scope, c.inputs, unmatched, where, unique_inputs=c.unique_inputs)
    if bulk is not None:  # keep and rename alone, nothing to report (bulk.py)
        return bulk
    ws = WorkingSet(router, c.report)
    ws.start(c.inputs)
    gone: dict[str, A.Loc] = {}  # input name -> the rule that last took a tensor made from it
    for r, rule in enumerate(rules):
        ws.carry_failed(rule, scope)
        taken = ws.take(r)
        if len(rule.patterns) == 1:  # most rules: one pattern, found if anything was taken
            missing = [] if taken else list(rule.patterns)
        else:
            found = {m.pattern_index for _i, m in taken}
            missing = [p for i, p in enumerate(rule.patterns) if i not in found]
        if missing and _nothing(ws, rule, r, missing, c.report):
            # What this rule would make from them is missing for the same cause.
            ws.failed_outputs.extend(rule.outputs)
        if not taken:
            continue
        if rule.op == "keep" and not rule.outputs:
            # The common catch-all (`keep "**"`, `unmatched`-like keeps): each tensor goes on
            # as it is, with no new name, node or template to evaluate.
            ws.pass_on_all(taken, r)
            continue
        step = _Step(ws, rule, r, scope, c.report)
        if rule.op in ("merge", "stack") or (rule.op in VALUE_OPS and len(rule.patterns) > 1):
            step.group(taken)
        elif rule.op in ("keep", "rename"):
            step.renames(taken, c.problems)
        else:
            for item, m in taken:
                c.problems.tensor = item.spec.name  # a problem now is about this tensor
                step.one(item, m)
            c.problems.tensor = None
        for item, _m in taken:
            node = item.node
            if type(node) is Source:  # an input as it came: its own one source, no call
                gone[node.name] = rule.loc
            else:
                for src in node.sources():
                    gone[src.name] = rule.loc
    return _finish(c, ws, unmatched, gone, where)


class _Step:
    """One rule applied to what it took: each output goes back into the working set."""

    def __init__(
        self,
        ws: WorkingSet,
        rule: A.Rule,
        r: int,
        scope: Scope,
        report: Callable[[A.Loc, str], None],
    ) -> None:
        self.ws, self.rule, self.r, self.scope = ws, rule, r, scope
        self._report = report
        # The tensor being worked on: outputs take its order, and an output that is that very
        # tensor under the same name (a no-op cast, `keep -> same`) keeps its maker as origin.
        self.item: Item | None = None
        self.outs: list[str] = []

    def report(self, loc: A.Loc | None, message: str) -> None:
        self._report(loc or self.rule.loc, message)

    def emit(self, name: str, node: Node) -> None:
        item = self.item
        assert item is not None
        self.outs.append(name)
        same = node is item.node and name == item.spec.name
        origin = item.origin if same and item.origin is not None else self.rule.loc
        spec = item.spec if same else TensorSpec(name, node.dtype, node.shape)
        self.ws.put(Item(spec, node, item.order, origin), self.r)

    def one(self, item: Item, m: Match) -> None:
        """A one-input rule on one tensor."""
        self.item, self.outs = item, []
        if self.rule.op == "copy":
            # Fan-out: the source goes on as it is; the copies are new tensors.
            self.ws.pass_on(item, self.r)
        if self.rule.op != "drop":
            build = build_value if self.rule.op in VALUE_OPS else build_simple
            try:
                build(self.rule, m, self.scope, self.emit)
            except LocatedProblem as p:  # shapes, dims, or an output name's template
                self.report(p.loc, p.message)
                self.ws.failed_rules.add(self.rule.loc)
                with contextlib.suppress(LocatedProblem, EvalError):
                    made = output_name(self.rule, self.scope.with_tensor(item.spec, m.caps))
                    self.ws.failed_names.add(made)
        self.ws.record(item.spec.name, self.rule.loc, self.outs[0] if self.outs else "")

    def renames(self, taken: list[tuple[Item, Match]], problems: Problems) -> None:
        """keep/rename on every tensor taken: what ``one`` does through ``build_simple`` and
        ``emit``, in one loop, as a rename of every tensor of a 100,000-tensor checkpoint is
        the most common plan there is."""
        ws, r, loc = self.ws, self.r, self.rule.loc
        render = tensor_namer(self.rule.outputs[0], self.scope) if self.rule.outputs else None
        # ws.put and ws.record, inlined for an output whose name is free: routed on to the
        # rules below (or straight to the end after the last rule).
        alive = ws.alive
        took: list[str] = []  # (for ws.record_all: what each name became)
        became: list[str] = []
        send = ws.sender(r + 1)
        for item, m in taken:
            spec = item.spec
            problems.tensor = spec.name  # a problem now is about this tensor
            try:
                name = spec.name if render is None else render(spec, m.caps)
            except LocatedProblem as p:  # the output name's template
                self.report(p.loc, p.message)
                ws.record(spec.name, loc, "")
                continue
            node = item.node
            if name == spec.name:  # the tensor itself goes on: it keeps its maker
                origin = item.origin if item.origin is not None else loc
                out = Item(spec, node, item.order, origin, True)
            else:  # the same bytes under another name (and size, where it is known)
                out = Item(spec.named(name), node, item.order, loc, True)
            if name in alive:
                ws.put(out, r)  # a collision, which put reports
            else:
                alive[name] = out
                send(out)
            took.append(spec.name)
            became.append(name)
        ws.record_all(loc, took, became)
        problems.tensor = None

    def group(self, taken: list[tuple[Item, Match]]) -> None:
        """merge/stack: members grouped by their captures, one output per group."""
        # By C calls where they can be, not a step per member: a stack takes every expert of
        # a checkpoint.
        items: tuple[Item, ...] = ()
        matches: tuple[Match, ...] = ()
        if taken:
            items, matches = zip(*taken, strict=True)
        node_ids = list(map(id, map(_NODE, matches)))
        order_of = dict(zip(node_ids, map(_ORDER, items), strict=True)).get
        emitted: list[tuple[str, Node]] = []

        def emit(name: str, node: Node) -> None:
            # By C calls alone, not a step per member: a stack takes every expert of a layer.
            # (A member under a node of its own, a cast in add/mul, is no direct child.)
            found = filter(_IS_ORDER, map(order_of, map(id, node.children())))
            orders = cast("Iterator[int]", found)
            spec = TensorSpec(name, node.dtype, node.shape)
            self.ws.put(Item(spec, node, min(orders, default=0), self.rule.loc), self.r)
            emitted.append((name, node))

        try:
            members = members_of(self.rule, set(self.scope.params))
            build_group(
                self.rule,
                members,
                list(matches),
                self.scope,
                emit,
                self.report,
                failed=lambda p, caps: (
                    self.ws.taken_by_failed_rule(p) or self.ws.made_by_failed_rule(p, caps)
                ),
                lost=self.ws.failed_names.add,
            )
        except LocatedProblem as p:  # the member scheme, or an output name's template
            self.report(p.loc, p.message)
            self.ws.failed_outputs.extend(self.rule.outputs)  # (no group went through)
        loc = self.rule.loc

        def history() -> tuple[A.Loc, list[str], list[str]]:
            """Each member's name and the output made of it ("" for none)."""
            made: dict[int, str] = {}  # id of a member's node -> the output made of it
            for name, node in emitted:
                made.update(dict.fromkeys(map(id, node.children()), name))
            became = list(map(made.get, node_ids, repeat("")))
            return loc, list(map(_SPEC_NAME, items)), became

        self.ws.record_later(history)


_HOLE = re.compile(r"\{[^{}]*\}")
_NUMBER = re.compile(r"\d+")


def _like(pattern: A.Pattern, names: Iterable[str]) -> str:
    """``"; did you mean a name like `x`?"`` for the tensor whose shape of name (numbers as
    holes) is closest to the pattern's (holes as holes): `model.layer.{n}` vs `layers.0`."""
    shape = _HOLE.sub("#", pattern.text)
    shapes: dict[str, str] = {}
    for name in names:
        shapes.setdefault(_NUMBER.sub("#", name), name)
    close = difflib.get_close_matches(shape, list(shapes), n=1, cutoff=0.75)
    return f"; did you mean a name like `{shapes[close[0]]}`?" if close else ""


def _nothing(
    ws: WorkingSet,
    rule: A.Rule,
    r: int,
    patterns: list[A.Pattern],
    report: Callable[[A.Loc, str], None],
) -> bool:
    """Patterns of a rule that took nothing: fine with `?`, else say why (an earlier rule took
    the tensor?). True when one names what an earlier rule that failed took or would have
    made: its error said all there is."""
    after_failure = False
    for p in patterns:
        if ws.taken_by_failed_rule(p) or ws.made_by_failed_rule(p):
            after_failure = True
            continue
        if rule.optional or r in ws.failed_filters:
            continue
        why = ws.explain_nothing(p)
        if why is not None and p.is_literal:
            report(p.loc, f"input `{p.text}` is consumed twice: {why}")
        elif why is not None:
            report(
                p.loc,
                f'pattern "{p.text}" matches nothing here: {why} (rules apply in order, each to '
                "what the rules above it left)",
            )
        elif p.is_literal:
            close = closest(p.text, ws.alive)
            hint = f"; did you mean `{close}`?" if close is not None else ""
            report(
                p.loc,
                f"input tensor `{p.text}` is missing{hint} (write `{rule.op}?` if it is optional)",
            )
        else:
            report(
                p.loc,
                f'pattern "{p.text}" matches no input tensor{_like(p, ws.alive)} '
                f"(write `{rule.op}?` if that is expected)",
            )
    return after_failure


def _finish(
    c: _Compiler,
    ws: WorkingSet,
    unmatched: A.Unmatched | None,
    gone: dict[str, A.Loc],
    where: A.Loc,
) -> tuple[list[OutputTensor], list[Dropped]]:
    """The set after the last rule: outputs, the unmatched policy (``where``: its statement,
    or the mapping's first line for the default), and the dropped inputs."""
    policy = unmatched.policy if unmatched else "error"
    leftovers = [item for item in ws.final if not item.touched]
    if leftovers and policy == "error":
        listing = "\n    ".join(compact_names([i.spec.name for i in leftovers]))
        c.report(
            where,
            f"{len(leftovers)} input tensor(s) match no rule (add rules, or `unmatched keep` /"
            f" `unmatched drop`):\n    {listing}",
        )
    kept = [i for i in ws.final if i.touched or policy == "keep"]
    for item in leftovers:
        if policy == "drop":
            gone[item.spec.name] = where
    # Outputs in input order, a tensor's outputs by name. They mostly come so already, one
    # per input (a rename of every tensor): seen in one pass over the orders, not sorted.
    orders = [i.order for i in kept]
    if not all(map(operator.lt, orders, orders[1:])):  # strictly increasing: no ties either
        kept.sort(key=lambda i: (i.order, i.spec.name))
    outputs = [OutputTensor.of(i.spec, i.node, i.origin or where) for i in kept]
    used: set[str] = set()
    add = used.add
    for o in outputs:
        node = o.node
        if type(node) is Source:  # a renamed or kept input, the common output: no call
            add(node.name)
        else:
            used.update(map(_NAME, node.sources()))
    dropped = [
        Dropped(name=s.name, origin=gone.get(s.name, where))
        for s in c.inputs
        if s.name not in used and (s.name in gone or policy == "drop")
    ]
    return outputs, dropped


def _edit_config(
    c: _Compiler, blocks: list[A.ConfigBlock], config: dict[str, Any] | None, scope: Scope
) -> dict[str, Any] | None:
    out_config = copy.deepcopy(config) if config is not None else None
    # The mapping's one work budget (see _compile), spent by the config blocks in turn.
    scope = Scope(scope.params, config, {}, None, scope.exists, budget=scope.budget)
    for block in blocks:
        if out_config is None:
            c.report(block.loc, "the mapping edits config.json but the checkpoint has none")
            break
        apply_config_block(block, out_config, scope, c.report)
    if out_config is not None and blocks and (why := json_problem(out_config)) is not None:
        c.report(blocks[-1].loc, f"the edited config.json {why}")
        return out_config  # reported; dumping a config nested that deep could overflow the stack
    try:
        json.dumps(out_config)
    except (TypeError, ValueError) as err:  # pragma: no cover - configs come from JSON
        raise MappingError(f"the output config is not JSON: {err}") from None
    return out_config


def _a(noun: str) -> str:
    """The noun with its indefinite article: "an int", "a string"."""
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"
