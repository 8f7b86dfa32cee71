"""The compiler: a mapping + input headers + config -> an immutable :class:`Plan`.

Order of work: resolve params; walk the statements, taking the live branch of each ``if``;
check every ``require`` (if one fails, stop: rule errors against the wrong checkpoint are
noise); route every input to the first rule that matches it; build each rule's outputs; apply
the unmatched policy; apply config edits; check output names. Problems are collected all the
way and raised together as one :class:`CompileError`.
"""

from __future__ import annotations

import copy
import gc
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weightmap.compiler.configedit import apply_config_block
from weightmap.compiler.group import build_group, members_of
from weightmap.compiler.ops import Match, build_simple, dtype_known
from weightmap.compiler.pattern import Alternative, Matcher, compile_pattern
from weightmap.compiler.unmatched import compact_names
from weightmap.errors import CompileError, LocatedProblem, MappingError, Problem
from weightmap.format.dtypes import TensorSpec
from weightmap.format.text import is_utf8, json_problem
from weightmap.language import ast as A
from weightmap.language.expr import (
    EvalError,
    Scope,
    compile_expr,
    render,
    resolve_dtype,
    truth,
)
from weightmap.language.mapping import Mapping
from weightmap.plan.nodes import Node, Source
from weightmap.plan.plan import Dropped, OutputTensor, Plan

__all__ = ["compile_plan"]

MAX_NAME_CHARS = 1024  # far beyond any real tensor name; keeps headers sane
PER_RULE_LIMIT = 20  # past this, one rule's repeated problems are summarised
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass
class _Flat:
    rules: list[A.Rule] = field(default_factory=list)
    checks: list[A.Require | A.Warn] = field(default_factory=list)
    configs: list[A.ConfigBlock] = field(default_factory=list)
    unmatched: A.Unmatched | None = None


class _Compiler:
    def __init__(self, mapping: Mapping, inputs: Sequence[TensorSpec], config: Any) -> None:
        self.mapping = mapping
        self.inputs = tuple(inputs)
        self.config = config
        self.problems: list[Problem] = []
        self.warnings: list[str] = []
        self._exists: dict[str, bool] = {}
        self._counts: dict[A.Loc, int] = {}
        self.failed_require = False
        self.filter_failed: set[int] = set()

    def report(self, loc: A.Loc, message: str) -> None:
        n = self._counts[loc] = self._counts.get(loc, 0) + 1
        if n <= PER_RULE_LIMIT:
            self.problems.append(Problem(loc, message))
        elif n == PER_RULE_LIMIT + 1:
            self.problems.append(Problem(loc, "... more problems like these (first 20 shown)"))

    def check_unique_inputs(self) -> None:
        seen: set[str] = set()
        for spec in self.inputs:
            if spec.name in seen:
                self.report(
                    A.Loc(self.mapping.name, 1, 1),
                    f"input `{spec.name}` appears twice in the headers",
                )
            seen.add(spec.name)

    def exists(self, pattern: A.Pattern) -> bool:
        if pattern.text not in self._exists:
            rx = compile_pattern(pattern)
            self._exists[pattern.text] = any(rx.fullmatch(s.name) for s in self.inputs)
        return self._exists[pattern.text]

    # ------------------------------------------------------------ params and statements

    def params(self, overrides: dict[str, Any] | None) -> dict[str, Any]:
        values = dict(self.mapping.param_defaults)
        for name, value in (overrides or {}).items():
            if name not in values:
                known = ", ".join(sorted(values)) or "none"
                self.report(
                    A.Loc(self.mapping.name, 1, 1), f"unknown param {name!r} (params: {known})"
                )
            elif (why := json_problem(value)) is not None:
                # Checked first: repr() of a 5000-digit int raises ValueError.
                self.report(self.mapping.param_locs[name], f"param {name!r}: {why}")
            elif type(value) is not type(values[name]) and values[name] is not None:
                self.report(
                    self.mapping.param_locs[name],
                    f"param {name!r} takes a {type(values[name]).__name__}, got {value!r}",
                )
            else:
                values[name] = value
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
            elif isinstance(st, A.Unmatched):
                if out.unmatched is not None:
                    self.report(
                        st.loc, f"a second `unmatched` (the first is at {out.unmatched.loc})"
                    )
                out.unmatched = st

    def checks(self, checks: list[A.Require | A.Warn], scope: Scope) -> None:
        for st in checks:
            try:
                ok = True if st.cond is None else truth(compile_expr(st.cond)(scope), st.cond.loc)
            except EvalError as err:
                self.report(err.loc, err.message)
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

    # ------------------------------------------------------------ tensors

    def route(self, rules: list[A.Rule], scope: Scope) -> tuple[list[list[Match]], list[int]]:
        """Give each input to the first rule that takes it; return matches per rule, leftovers."""
        alts: list[Alternative] = []
        for r, rule in enumerate(rules):
            accept = self._filter(r, rule, scope)
            alts += [Alternative(r, i, p, accept) for i, p in enumerate(rule.patterns)]
        matcher = Matcher(alts)
        per_rule: list[list[Match]] = [[] for _ in rules]
        leftovers: list[int] = []
        failed = self.filter_failed
        for index, spec in enumerate(self.inputs):
            try:
                hit = matcher.match(index, spec.name)
            except _FilterError as err:
                if err.rule not in failed:
                    failed.add(err.rule)
                    self.report(err.loc, f"{err.message} (while matching `{spec.name}`)")
                continue
            if hit is None:
                leftovers.append(index)
            else:
                alt = alts[hit[0]]
                per_rule[alt.rule].append(Match(index, spec, hit[1], alt.pattern_index))
        return per_rule, leftovers

    def _filter(self, r: int, rule: A.Rule, scope: Scope) -> Any:
        where = compile_expr(rule.where) if rule.where is not None else None
        want = resolve_dtype(rule.from_dtype) if rule.from_dtype else None
        if where is None and want is None:
            return None
        inputs = self.inputs

        def accept(index: int, caps: dict[str, Any]) -> bool:
            spec = inputs[index]
            if want is not None and spec.dtype != want:
                return False
            if where is None:
                return True
            try:
                return truth(where(scope.with_tensor(spec, caps)), rule.loc, "where")
            except EvalError as err:
                raise _FilterError(r, err.loc, err.message) from None

        return accept

    def check_rule(self, rule: A.Rule) -> bool:
        for word in (rule.from_dtype, rule.to_dtype):
            if word is not None and not dtype_known(word):
                self.report(
                    rule.loc, f"unknown dtype `{word}` (e.g. f32, bf16, f16, fp8_e4m3, i64)"
                )
                return False
        return True

    def missing(self, rules: list[A.Rule], per_rule: list[list[Match]]) -> None:
        owner = {m.spec.name: rules[r].loc for r, ms in enumerate(per_rule) for m in ms}
        for r, rule in enumerate(rules):
            if rule.optional or r in self.filter_failed:
                continue
            found = {m.pattern_index for m in per_rule[r]}
            for i, p in enumerate(rule.patterns):
                if i in found:
                    continue
                if p.is_literal and p.text in owner:
                    self.report(
                        p.loc,
                        f"input `{p.text}` is consumed twice: first by the rule at {owner[p.text]}",
                    )
                elif p.is_literal:
                    self.report(
                        p.loc,
                        f"input tensor `{p.text}` is missing"
                        f" (write `{rule.op}?` if it is optional)",
                    )
                else:
                    self.report(
                        p.loc,
                        f'pattern "{p.text}" matches no input tensor'
                        f" (write `{rule.op}?` if that is expected)",
                    )


class _FilterError(LocatedProblem):
    """A rule's ``where`` failed while routing; ``rule`` says which, so it is reported once."""

    loc: A.Loc

    def __init__(self, rule: int, loc: A.Loc, message: str) -> None:
        super().__init__(message, loc)
        self.rule = rule


def compile_plan(
    mapping: Mapping,
    inputs: Sequence[TensorSpec],
    config: dict[str, Any] | None = None,
    *,
    params: dict[str, Any] | None = None,
) -> Plan:
    """Compile ``mapping`` against input headers and config.json into a Plan.

    Never reads tensor data. Raises :class:`CompileError` (a MappingError) listing every
    problem with its file:line:col.

    >>> from weightmap.language.mapping import load_mapping
    >>> m = load_mapping('weightmap 1\\nrename "a.{x}" -> "b.{x}"')
    >>> compile_plan(m, [TensorSpec("a.w", "F32", (2,))], None).outputs[0].name
    'b.w'
    """
    # Building ~100k small acyclic objects triggers repeated full cyclic-GC passes that cost
    # a third of the compile time; nothing here makes cycles, so pause the collector.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _compile(mapping, inputs, config, params)
    finally:
        if paused:
            gc.enable()


def _check_arguments(params: Any, config: Any) -> None:
    if params is not None and not isinstance(params, dict):
        raise MappingError(f"params must be a dict of name to value, not {type(params).__name__}")
    if config is not None and (not isinstance(config, dict) or json_problem(config) is not None):
        why = "is not an object" if not isinstance(config, dict) else json_problem(config)
        raise MappingError(f"the checkpoint's config {why}")


def _compile(
    mapping: Mapping,
    inputs: Sequence[TensorSpec],
    config: dict[str, Any] | None,
    params: dict[str, Any] | None,
) -> Plan:
    _check_arguments(params, config)
    c = _Compiler(mapping, inputs, config)
    c.check_unique_inputs()
    values = c.params(params)
    scope = Scope(values, config, {}, None, c.exists)
    flat = _Flat()
    c.flatten(mapping.program.stmts, scope, flat)
    c.checks(flat.checks, scope)
    if c.failed_require:
        # Rule errors against a checkpoint the mapping refuses would only be noise.
        raise CompileError(c.problems, mapping.name)
    rules = [r for r in flat.rules if c.check_rule(r)]
    per_rule, leftovers = c.route(rules, scope)
    c.missing(rules, per_rule)
    outputs, dropped = _build_outputs(c, rules, per_rule, scope, values)
    _apply_unmatched(c, flat.unmatched, leftovers, outputs, dropped)
    out_config = _edit_config(c, flat.configs, config, scope)
    outputs.sort(key=lambda x: (x[0], x[1].name))
    _check_names([o for _i, o in outputs], c)
    if c.problems:
        raise CompileError(c.problems, mapping.name)
    return Plan.build(
        mapping_name=mapping.name,
        inputs=c.inputs,
        outputs=tuple(o for _i, o in outputs),
        dropped=tuple(dropped),
        warnings=tuple(c.warnings),
        params=values,
        config=out_config,
        input_config=config,
    )


def _build_outputs(
    c: _Compiler,
    rules: list[A.Rule],
    per_rule: list[list[Match]],
    scope: Scope,
    values: dict[str, Any],
) -> tuple[list[tuple[int, OutputTensor]], list[Dropped]]:
    """Each rule applied to its matches: outputs keyed by input position, and drops."""
    position = {s.name: i for i, s in enumerate(c.inputs)}
    outputs: list[tuple[int, OutputTensor]] = []
    dropped: list[Dropped] = []
    for rule, matches in zip(rules, per_rule, strict=True):

        def emit(name: str, node: Node, rule: A.Rule = rule) -> None:
            if isinstance(node, Source):
                order = position[node.name]
            else:
                order = min(position[s.name] for s in node.sources())
            outputs.append((order, OutputTensor(name=name, node=node, origin=rule.loc)))

        def report(loc: A.Loc | None, message: str, rule: A.Rule = rule) -> None:
            c.report(loc or rule.loc, message)

        if rule.op in ("merge", "stack"):
            try:
                build_group(rule, members_of(rule, set(values)), matches, scope, emit, report)
            except LocatedProblem as p:  # the member scheme, or an output name's template
                report(p.loc, p.message)
            continue
        for m in matches:
            try:
                gone = build_simple(rule, m, scope, emit)
            except LocatedProblem as p:  # shapes, dims, or an output name's template
                report(p.loc, p.message)
            else:
                if gone is not None:
                    dropped.append(gone)
    return outputs, dropped


def _apply_unmatched(
    c: _Compiler,
    unmatched: A.Unmatched | None,
    leftovers: list[int],
    outputs: list[tuple[int, OutputTensor]],
    dropped: list[Dropped],
) -> None:
    policy = unmatched.policy if unmatched else "error"
    where = unmatched.loc if unmatched else A.Loc(c.mapping.name, 1, 1)
    if leftovers and policy == "error":
        names = [c.inputs[i].name for i in leftovers]
        listing = "\n    ".join(compact_names(names))
        c.report(
            where,
            f"{len(names)} input tensor(s) match no rule (add rules, or `unmatched keep` /"
            f" `unmatched drop`):\n    {listing}",
        )
    for i in leftovers:
        spec = c.inputs[i]
        if policy == "keep":
            outputs.append((i, OutputTensor(name=spec.name, node=_source(spec), origin=where)))
        elif policy == "drop":
            dropped.append(Dropped(name=spec.name, origin=where))


def _edit_config(
    c: _Compiler, blocks: list[A.ConfigBlock], config: dict[str, Any] | None, scope: Scope
) -> dict[str, Any] | None:
    out_config = copy.deepcopy(config) if config is not None else None
    for block in blocks:
        if out_config is None:
            c.report(block.loc, "the mapping edits config.json but the checkpoint has none")
            break
        apply_config_block(block, out_config, scope, c.report)
    if out_config is not None and blocks and (why := json_problem(out_config)) is not None:
        c.report(blocks[-1].loc, f"the edited config.json {why}")
    try:
        json.dumps(out_config)
    except (TypeError, ValueError) as err:  # pragma: no cover - configs come from JSON
        raise MappingError(f"the output config is not JSON: {err}") from None
    return out_config


def _source(spec: TensorSpec) -> Node:
    return Source(dtype=spec.dtype, shape=spec.shape, name=spec.name)


def _check_names(outputs: list[OutputTensor], c: _Compiler) -> None:
    seen: dict[str, OutputTensor] = {}
    for o in outputs:
        bad = _bad_name(o.name)
        if bad:
            c.report(o.origin, f"output name {o.name[:80]!r} {bad}")
        if o.name in seen:
            first, here = seen[o.name].node.sources()[0].name, o.node.sources()[0].name
            c.report(
                o.origin,
                f"output `{o.name}` (from `{here}`) is also made from `{first}`"
                f" by the rule at {seen[o.name].origin}",
            )
        else:
            seen[o.name] = o


def _bad_name(name: str) -> str | None:
    if not name:
        return "is empty"
    if name == "__metadata__":
        return "is reserved by safetensors"
    if _CONTROL.search(name):
        return "contains control characters"
    if not is_utf8(name):
        return "contains a lone surrogate, which is not UTF-8"
    # Names are module paths to every loader (`model.layers.0.w`): whitespace, path
    # separators and empty segments never name a parameter, and look like path tricks.
    if any(ch.isspace() for ch in name):
        return "contains whitespace"
    if "/" in name or "\\" in name:
        return "contains a path separator; tensor names are dotted module paths"
    if name.startswith(".") or name.endswith(".") or ".." in name:
        return "has an empty dotted segment"
    if len(name) > MAX_NAME_CHARS:
        return f"is longer than {MAX_NAME_CHARS} characters"
    return None
