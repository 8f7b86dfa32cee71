"""``Plan.explain()``: the plan as a table a person can review before converting."""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Protocol, TypeVar

from weightmap.format.dtypes import TensorSpec
from weightmap.format.text import field_path, one_line
from weightmap.plan.nodes import (
    Arith,
    Binary,
    Cast,
    Clamp,
    Concat,
    Gather,
    Lookup,
    Mask,
    Matmul,
    Node,
    Pack,
    Permute,
    Quantize,
    Reduce,
    Reshape,
    Round,
    Same,
    Slice,
    Source,
    Stack,
    Unpack,
)
from weightmap.plan.parts import Dropped, OutputFamily, OutputTensor, SideFile

__all__ = ["Explainable", "config_diff", "explain", "natural_key", "side_files"]

_DIGITS = re.compile(r"(\d+)")


class Explainable(Protocol):
    """What :func:`explain` reads of a plan: ``Plan`` has it, and this module needs nothing
    else of the ``Plan`` class (which imports this module)."""

    @property
    def mapping_name(self) -> str: ...
    @property
    def inputs(self) -> Sequence[TensorSpec]: ...
    @property
    def outputs(self) -> Sequence[OutputTensor]: ...
    @property
    def dropped(self) -> Sequence[Dropped]: ...
    @property
    def warnings(self) -> Sequence[str]: ...
    @property
    def files(self) -> Sequence[SideFile]: ...
    @property
    def families(self) -> Sequence[OutputFamily]: ...
    @property
    def params(self) -> dict[str, Any]: ...
    @property
    def config(self) -> dict[str, Any] | None: ...
    @property
    def input_config(self) -> dict[str, Any] | None: ...


def _shape(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}{list(shape)}"


def _op(node: Node) -> str:
    """The operations that make a node, first to last (``reshape [..], permute [..], cast``).

    A stack or concat shows what was done to its first member before the join.
    """
    if isinstance(node, Source):
        return "="
    if isinstance(node, Slice):
        inner, here = _op(node.src), f"slice dim {node.dim} [{node.start}:{node.stop}]"
    elif isinstance(node, (Concat, Stack)):
        word = "concat" if isinstance(node, Concat) else "stack"
        inner = _op(node.srcs[0])
        n = len(node.srcs)
        if inner == "=":
            here = f"{word} dim {node.dim} of {n}"
        else:
            inner, here = f"{inner} (each of {n})", f"{word} dim {node.dim}"
    elif isinstance(node, Same):
        inner, here = _op(node.srcs[0]), f"same bytes in all {len(node.srcs)}"
    elif isinstance(node, Permute):
        inner, here = _op(node.src), f"permute {list(node.perm)}"
    elif isinstance(node, Reshape):
        inner, here = _op(node.src), f"reshape {list(node.shape)}"
    elif isinstance(node, Arith):
        inner = _op(node.src)
        here = f"{node.op} {node.value} in {node.compute}" + _to(node.src.dtype, node.dtype)
    elif isinstance(node, Binary):
        inner = _op(node.a)
        other = node.b.sources()[0].name if node.b.sources() else "?"
        block = f" block {list(node.block)}" if node.block else ""
        here = f"{node.op} {other}{block} in {node.compute}" + _to(node.a.dtype, node.dtype)
    elif isinstance(node, Quantize):
        inner = _op(node.src)
        what = "values" if node.part == "values" else "scales (F32)"
        here = f"quantize {node.fp8} block {list(node.block)}: {what}"
    elif isinstance(node, Mask):
        inner = _op(node.src)
        here = f"mask size {node.size}" + (" plus index" if node.plus_index else "")
    elif isinstance(node, Matmul):
        inner = _op(node.a)
        here = f"matmul {_first(node.b)} in {node.compute}" + _to(node.a.dtype, node.dtype)
    elif isinstance(node, (Unpack, Pack)):
        word = "unpack" if isinstance(node, Unpack) else "pack"
        inner = _op(node.src)
        here = f"{word} dim {node.dim} bits {node.bits} order {list(node.order)} -> {node.dtype}"
    elif isinstance(node, Gather):
        inner, here = _op(node.src), f"gather dim {node.dim} by {_first(node.index)}"
    elif isinstance(node, Lookup):
        inner, here = _op(node.codes), f"lookup in {_first(node.table)} -> {node.dtype}"
    elif isinstance(node, Round):
        inner, here = _op(node.src), node.mode
    elif isinstance(node, Clamp):
        inner, here = _op(node.src), f"clamp [{node.low}, {node.high}]"
    elif isinstance(node, Reduce):
        group = f" group {node.group}" if node.group else ""
        inner, here = (
            _op(node.src),
            f"{node.op} dim {node.dim}{group}" + _to(node.src.dtype, node.dtype),
        )
    else:
        assert isinstance(node, Cast)
        inner, here = _op(node.src), f"cast {node.src.dtype}->{node.dtype}"
    return here if inner == "=" else f"{inner}, {here}"


def _first(node: Node) -> str:
    """The first input tensor an operand reads, naming it in a step."""
    srcs = node.sources()
    return srcs[0].name if srcs else "?"


def _to(src: str, dst: str) -> str:
    return f" -> {dst}" if dst != src else ""


_Listed = TypeVar("_Listed", OutputTensor, Dropped)


def natural_key(name: str) -> tuple[str | int, ...]:
    """Sort key reading runs of digits as numbers: ``layers.2`` before ``layers.10``."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(name)))


def _listed(items: Sequence[_Listed], limit: int | None) -> list[_Listed]:
    """The first ``limit`` of ``items`` (all for None) in the order a reader looks for a name
    (``layers.2`` before ``layers.10``), not the file's: a summary of 100,000 tensors sorts
    only the few it shows."""

    def key(x: _Listed) -> tuple[str | int, ...]:
        return natural_key(x.name)

    if limit is None:
        return sorted(items, key=key)
    return heapq.nsmallest(limit, items, key=key)


def explain(plan: Explainable, limit: int | None = None) -> str:
    """Render ``plan`` as text: one line per output, dropped inputs, warnings, config diff.

    ``limit``: at most that many outputs and dropped inputs are listed, each list ending with
    how many more there are (a checkpoint may hold 100,000 tensors); None lists them all."""
    inputs = dict(zip(map(_NAME, plan.inputs), plan.inputs, strict=True))
    lines = [f"plan for mapping {plan.mapping_name!r}"]
    if plan.params:
        lines.append("params: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in plan.params.items()))
    lines.append(
        f"{len(plan.inputs)} inputs -> {len(plan.outputs)} outputs, {len(plan.dropped)} dropped"
    )
    rows = []
    for out in _listed(plan.outputs, limit):
        srcs = out.node.sources()
        first = inputs[srcs[0].name]
        # Names escaped before the widths are taken: one with a line break stays one row.
        src = f"{one_line(first.name)} {_shape(first.dtype, first.shape)}"
        if len(srcs) > 1:
            src += f" (+{len(srcs) - 1} more)"
        made = f"{one_line(out.name)} {_shape(out.node.dtype, out.node.shape)}"
        rows.append((src, _op(out.node), made))
    if rows:
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines += [f"  {a:<{w0}}  -> {b:<{w1}} -> {c}" for a, b, c in rows]
    lines += _more(len(plan.outputs), limit, "outputs")
    lines += _families(plan)
    for d in _listed(plan.dropped, limit):
        lines.append(f"  dropped {one_line(d.name)}  ({d.origin})")
    lines += _more(len(plan.dropped), limit, "dropped inputs")
    lines += side_files(plan)
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    diff = config_diff(plan.input_config, plan.config)
    if diff:
        lines.append("config.json:")
        lines += [f"  {x}" for x in diff]
    return "\n".join(lines)


def _families(plan: Explainable) -> list[str]:
    """One line per output family: the files its members are written to."""
    lines = []
    for f in plan.families:
        files = f.filename(0) if f.count == 1 else f"{f.filename(0)} .. {f.filename(f.count - 1)}"
        lines.append(
            f"output family {f.name}: {f.name}:RANK:NAME -> NAME in {files} ({f.count} file(s))"
        )
    return lines


def _more(count: int, limit: int | None, what: str) -> list[str]:
    """The line that says how many of ``count`` were left out past ``limit``, if any were."""
    if limit is None or count <= limit:
        return []
    return [f"  ... and {count - limit:,} more {what} (`weightmap plan --all` lists every one)"]


_NAME = attrgetter("name")


def side_files(plan: Explainable) -> list[str]:
    """One line per side file: carried as it is, renamed, or added by the mapping."""
    if not plan.files:
        return []
    total = sum(f.size for f in plan.files)
    lines = [f"side files: {len(plan.files)} ({total:,} bytes)"]
    for f in plan.files:
        if f.source is None:
            how = f"added ({f.origin})"
        elif f.source != f.name:
            how = f"from {one_line(f.source)} ({f.origin})"
        else:
            how = "carried"
        code = ", code" if f.code else ""
        lines.append(f"  file {one_line(f.name)}  {f.size:,} bytes, {how}{code}")
    code_files = [one_line(f.name) for f in plan.files if f.code]
    if code_files:
        # Said apart, so that nobody loads the output with trust_remote_code unawares.
        lines.append(
            f"code files: {len(code_files)} (loaders run them: transformers' trust_remote_code "
            f"imports *.py): {', '.join(code_files)}"
        )
    return lines


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            out.update(_flatten(v, field_path(prefix, k)))
    else:
        out[prefix] = obj
    return out


def config_diff(before: Any, after: Any) -> list[str]:
    """Field-level differences: ``+ path = value``, ``- path``, ``~ path: old -> new``."""
    if before is None and after is None:
        return []
    a, b = _flatten(before or {}), _flatten(after or {})
    out = []
    for key in sorted(a.keys() | b.keys()):
        if key not in b:
            out.append(f"- {key}")
        elif key not in a:
            out.append(f"+ {key} = {json.dumps(b[key])}")
        elif json.dumps(a[key]) != json.dumps(b[key]):
            out.append(f"~ {key}: {json.dumps(a[key])} -> {json.dumps(b[key])}")
    return out
