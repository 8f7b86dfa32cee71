"""Inverting a mapping: turn each rule around, or say why it cannot be turned around.

A rule inverts when its output names keep every capture of its input pattern (so the input
name can be rebuilt) and its operation loses nothing:

* the rules come back in reverse order: rules apply in order, each to what the rules above it
  left, so the last one is undone first;
* rename/keep: output template <-> input pattern; a hole ``{n - 1}`` becomes ``{n:int}`` and
  the way back writes ``{n + 1}``;
* copy (fan-out): the source went on unchanged, so the inverse drops the copies;
* split/chunk <-> merge; stack <-> unstack; transpose is its own inverse; permute inverts its
  order; reshape needs ``from [...]`` (the shape to go back to); merge needs ``sizes``;
* cast needs ``from`` and must widen (every value of the source type is exact in the target:
  bf16/f16 -> f32 -> f64, fp8 -> f16/bf16/f32/f64, integers to a wider type). Its inverse
  narrows again, which is exact for values that came from the narrower type;
* ``where`` may use captures and params only; requires and warnings are dropped (they speak of
  the forward input); config blocks invert only when they hold nothing but ``move``.

drop, ``unmatched drop``, globs in renamed patterns, set/delete/lift are refused, and so are
the value rules (add, mul, quantize, mask): they round or lose information, and an inverse
that only approximately undoes them is said to be one (the fp8 presets), never claimed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from weightmap.compiler.ops import template_names
from weightmap.errors import MappingError
from weightmap.format.dtypes import DTYPES
from weightmap.language import ast as A
from weightmap.language.expr import resolve_dtype
from weightmap.language.mapping import Mapping, from_program
from weightmap.language.parse import parse_program
from weightmap.language.unparse import pattern_text, template_text, unparse
from weightmap.language.values import TENSOR_NAMES
from weightmap.plan.nodes import int_cast_fits
from weightmap.plan.plan import Plan

__all__ = ["invert", "invert_program", "lossless_cast"]

# (exponent bits, mantissa bits): A's values are all exact in B when both are <=.
_FLOAT_BITS = {"F8_E4M3": (4, 3), "F8_E5M2": (5, 2), "F16": (5, 10), "BF16": (8, 7),
               "F32": (8, 23), "F64": (11, 52)}  # fmt: skip


class _Refuse(Exception):
    pass


def lossless_cast(src: str, dst: str) -> bool:
    """True when every ``src`` value is represented exactly in ``dst``."""
    if src in _FLOAT_BITS and dst in _FLOAT_BITS:
        (e1, m1), (e2, m2) = _FLOAT_BITS[src], _FLOAT_BITS[dst]
        return e1 <= e2 and m1 <= m2
    kinds = {DTYPES[src].kind, DTYPES[dst].kind}
    return kinds <= {"int", "uint"} and int_cast_fits(src, dst)


def _pattern(parts: list[A.PatPart]) -> A.Pattern:
    return A.Pattern(text=pattern_text(tuple(parts)), parts=tuple(parts))


def _template(parts: list[str | A.Expr]) -> A.Template:
    return A.Template(text=template_text(tuple(parts)), parts=tuple(parts))


def _to_template(p: A.Pattern, subst: dict[str, A.Expr]) -> A.Template:
    """The forward input pattern as the inverse's output template."""
    parts: list[str | A.Expr] = []
    for part in p.parts:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, A.Capture):
            parts.append(subst.get(part.name, A.Name(id=part.name)))
        else:
            raise _Refuse(
                f'"{p.text}" has an unnamed glob or alternative the output cannot restore'
            )
    return _template(parts)


def _affine(e: A.Expr) -> tuple[str, A.Expr] | None:
    """``x + k`` / ``x - k`` / ``k + x`` -> (x, the expression that undoes it)."""
    if isinstance(e, A.BinOp) and e.op in ("+", "-"):
        left, right = e.left, e.right
        if isinstance(left, A.Name) and isinstance(right, A.Lit) and type(right.value) is int:
            back = "-" if e.op == "+" else "+"
            return left.id, A.BinOp(op=back, left=A.Name(id=left.id), right=right)
        if (
            e.op == "+"
            and isinstance(right, A.Name)
            and isinstance(left, A.Lit)
            and type(left.value) is int
        ):
            return right.id, A.BinOp(op="-", left=A.Name(id=right.id), right=left)
    return None


def _to_pattern(t: A.Template, caps: dict[str, A.Capture]) -> tuple[A.Pattern, dict[str, A.Expr]]:
    """The forward output template as the inverse's input pattern, and the substitutions."""
    parts: list[A.PatPart] = []
    subst: dict[str, A.Expr] = {}
    seen: set[str] = set()
    for part in t.parts:
        if isinstance(part, str):
            if "*" in part:
                raise _Refuse(f'output "{t.text}" contains `*`, which a pattern reads as a glob')
            parts.append(part)
            continue
        if parts and not isinstance(parts[-1], str):
            raise _Refuse(f'output "{t.text}" has two holes side by side: ambiguous to read back')
        if isinstance(part, A.Name) and part.id in caps:
            name, cap = part.id, caps[part.id]
        elif (aff := _affine(part)) is not None and aff[0] in caps and caps[aff[0]].kind == "int":
            name, cap = aff[0], caps[aff[0]]
            subst[name] = aff[1]
        else:
            raise _Refuse(f'output "{t.text}": only {{capture}} and {{capture +/- integer}} invert')
        if name in seen:
            raise _Refuse(f'output "{t.text}" uses {{{name}}} twice')
        seen.add(name)
        parts.append(cap)
    return _pattern(parts), subst


def _names_in(e: Any) -> set[str]:
    """The names an expression reads."""
    if isinstance(e, A.Name):
        return {e.id}
    found: set[str] = set()
    if dataclasses.is_dataclass(e) and not isinstance(e, type):
        for f in dataclasses.fields(e):
            v = getattr(e, f.name)
            for x in v if isinstance(v, tuple) else (v,):
                found |= _names_in(x)
    return found


def _subst(e: Any, subst: dict[str, A.Expr], caps: set[str]) -> Any:
    """Rewrite a ``where`` for the inverse: captures through ``subst``; tensor facts refused."""
    if isinstance(e, A.Name):
        if e.id in subst:
            return subst[e.id]
        if e.id in TENSOR_NAMES and e.id not in caps:
            raise _Refuse(f"`where` reads the tensor's {e.id}, which the rule changes")
        return e
    if isinstance(e, A.Exists):
        raise _Refuse("`exists` speaks of the forward input")
    if dataclasses.is_dataclass(e) and not isinstance(e, type):
        changes = {}
        for f in dataclasses.fields(e):
            v = getattr(e, f.name)
            if isinstance(v, tuple):
                changes[f.name] = tuple(_subst(x, subst, caps) for x in v)
            elif dataclasses.is_dataclass(v):
                changes[f.name] = _subst(v, subst, caps)
        return dataclasses.replace(e, **changes)
    return e


def _is_minus_one(e: A.Expr) -> bool:
    if isinstance(e, A.Lit):
        return e.value == -1 and type(e.value) is int
    return (
        isinstance(e, A.Unary)
        and e.op == "-"
        and isinstance(e.operand, A.Lit)
        and (e.operand.value == 1)
    )


def _const(e: A.Expr | None) -> Any:
    if isinstance(e, A.Lit):
        return e.value
    if isinstance(e, A.Unary) and e.op == "-" and isinstance(e.operand, A.Lit):
        return -e.operand.value  # type: ignore[operator]
    if isinstance(e, A.ListExpr):
        return [_const(x) for x in e.items]
    raise _Refuse("dims must be written as constants to invert")


# Why each primitive of quantized formats has no inverse here.
_NO_INVERSE = {
    "matmul": "a matrix product cannot be factored back into its operands",
    "gather": "a gather repeats or leaves out slices of its source: the source and the "
    "index cannot be told back from the result (a dequantization's scales by g_idx)",
    "lookup": "a table lookup cannot be read back into codes: entries may repeat, and the "
    "table itself is not in the result",
    "unpack": "unpacking does not say the words' dtype, which a pack back needs: write the "
    "`pack ... to DTYPE` rule for the inverse yourself (it is exact)",
    "pack": "the codes' dtype before the pack is not in the rule: write the `unpack` (and a "
    "`cast` to that dtype) for the inverse yourself",
    **dict.fromkeys(
        ("round", "floor", "ceil", "clamp"),
        "rounding and clamping forget the values they change",
    ),
    **dict.fromkeys(("amax", "amin", "sum"), "a reduction keeps one value of many"),
}


def _invert_rule(r: A.Rule) -> A.Rule:
    op, caps = r.op, {c.name: c for p in r.patterns for c in p.captures}
    if op == "drop":
        raise _Refuse("dropped tensors cannot be brought back")
    if op in _NO_INVERSE:
        raise _Refuse(_NO_INVERSE[op])
    if op in ("add", "sub", "mul"):
        raise _Refuse(
            "arithmetic rounds to its result dtype: undoing it would give values that differ in "
            "the last bits, so no inverse is claimed (fp8 dequantization: the fp8-quant preset "
            "re-quantizes, approximately)"
        )
    if op == "quantize":
        raise _Refuse(
            "quantization loses precision; dequantizing (the fp8-dequant preset) gives values "
            "within half an fp8 step of the originals, not the originals"
        )
    if op == "mask":
        raise _Refuse("a mask cannot give back the positions' order: keep the source instead")
    rep = dataclasses.replace
    if op == "keep":
        return r
    if op == "copy":
        # Fan-out: the source goes on as it is, so undoing it is dropping the copies.
        (p,) = r.patterns
        copies, substs = [], []
        for t in r.outputs:
            back, subst = _to_pattern(t, caps)
            copies.append(back)
            substs.append(subst)
        if r.where is not None and any(x != substs[0] for x in substs):
            raise _Refuse("its copies shift captures differently, so one `where` cannot read them")
        # The where reads the copy's captures, rewritten as its name wrote them ({n + 1}).
        where = _subst(r.where, substs[0], set(caps)) if r.where is not None else None
        return A.Rule(op="drop", optional=r.optional, patterns=tuple(copies), where=where,
                      outputs=(), loc=r.loc)  # fmt: skip
    if op in ("rename", "transpose", "permute", "reshape", "cast"):
        (p,) = r.patterns
        if r.outputs:
            new_p, subst = _to_pattern(r.outputs[0], caps)
            missing = set(caps) - template_names(r.outputs[0])
            if missing:
                raise _Refuse(f"the output drops {{{', '.join(sorted(missing))}}}")
            outs: tuple[A.Template, ...] = (_to_template(p, subst),)
        else:
            new_p, subst, outs = p, {}, ()
        where = _subst(r.where, subst, set(caps)) if r.where is not None else None
        new = rep(r, patterns=(new_p,), outputs=outs, where=where)
        if op == "permute":
            perm = _const(r.dims)
            # Negative dims count from the end: which dim they are depends on the rank.
            if not isinstance(perm, list) or sorted(map(str, perm)) != sorted(
                map(str, range(len(perm)))
            ):
                raise _Refuse(
                    f"dims {perm!r} must list 0..n-1 once each, as constants, to invert"
                    " (negative dims depend on the tensor's rank)"
                )
            inv = [perm.index(i) for i in range(len(perm))]
            return rep(new, dims=A.ListExpr(items=tuple(A.Lit(value=x) for x in inv)))
        if op == "transpose" and r.dims is not None:
            _const(r.dims)
        if op == "reshape":
            if r.from_shape is None:
                raise _Refuse("reshape needs `from [...]` to know the shape to go back to")
            if not isinstance(r.to_shape, A.ListExpr) or any(
                _is_minus_one(x) for x in r.to_shape.items
            ):
                raise _Refuse(
                    "reshape `to` must be a list without -1 to invert (it becomes `from`)"
                )
            return rep(new, from_shape=r.to_shape, to_shape=r.from_shape)
        if op == "cast":
            if r.from_dtype is None:
                raise _Refuse("cast needs `from <dtype>` to invert")
            src, dst = resolve_dtype(r.from_dtype), resolve_dtype(r.to_dtype or "")
            if src is None or dst is None or not lossless_cast(src, dst):
                raise _Refuse(f"cast from {r.from_dtype} to {r.to_dtype} loses precision")
            return rep(new, from_dtype=r.to_dtype, to_dtype=r.from_dtype)
        return new
    if op in ("split", "chunk"):
        (p,) = r.patterns
        converted = [_to_pattern(t, caps) for t in r.outputs]
        for t in r.outputs:
            if set(caps) - template_names(t):
                raise _Refuse(f'output "{t.text}" drops a capture')
        subst = converted[0][1]
        return A.Rule(op="merge", optional=r.optional, patterns=tuple(c[0] for c in converted),
                      outputs=(_to_template(p, subst),), dim=r.dim, sizes=r.sizes,
                      where=_subst(r.where, subst, set(caps)) if r.where else None,
                      loc=r.loc)  # fmt: skip
    if op == "unstack":
        (p,) = r.patterns
        free = sorted(template_names(r.outputs[0]) - set(caps))
        if len(free) != 1:
            raise _Refuse("the unstack output needs exactly one index name, e.g. {e}")
        var = free[0]
        new_p, subst = _to_pattern(r.outputs[0], {**caps, var: A.Capture(var, "int")})
        where = _subst(r.where, subst, set(caps)) if r.where is not None else None
        return A.Rule(op="stack", optional=r.optional, patterns=(new_p,), over=var, dim=r.dim,
                      outputs=(_to_template(p, subst),), where=where, loc=r.loc)  # fmt: skip
    return _invert_group(r, caps)


def _invert_group(r: A.Rule, caps: dict[str, A.Capture]) -> A.Rule:
    used = template_names(r.outputs[0])
    new_p, subst = _to_pattern(r.outputs[0], caps)
    # A `where` on a group reads the captures that name the group (those the output uses);
    # dropped, the inverse took groups the forward rule had left alone.
    if r.where is not None and _names_in(r.where) & (set(caps) - used):
        raise _Refuse("its `where` reads a member's capture, which the inverse has no more")
    where = _subst(r.where, subst, used) if r.where is not None else None
    if r.op == "stack":
        free = [c for c in caps.values() if c.name not in used]
        if len(r.patterns) != 1 or len(free) != 1 or free[0].kind != "int":
            raise _Refuse("only a stack over one {x:int} capture inverts (to unstack)")
        var = free[0].name
        out = _to_template(r.patterns[0], {**subst, var: A.Name(id=var)})
        return A.Rule(op="unstack", optional=r.optional, patterns=(new_p,), dim=r.dim,
                      outputs=(out,), where=where, loc=r.loc)  # fmt: skip
    if r.same:
        raise _Refuse(
            "`merge ... same` inverts over a family's ranks only (to a rename into every rank)"
        )
    if r.sizes is None:
        raise _Refuse("merge needs `sizes [...]` to know where to split again")
    members: list[A.Pattern] = list(r.patterns)
    if len(members) == 1:
        (p,) = members
        free = [c for c in p.captures if c.name not in used]
        alts = [i for i, x in enumerate(p.parts) if isinstance(x, A.Alt)]
        if alts and not free:
            i = alts[0]
            words: tuple[str, ...] = p.parts[i].alts  # type: ignore[union-attr]
        elif len(free) == 1 and free[0].kind == "alt":
            i, words = p.parts.index(free[0]), free[0].alts
        else:
            raise _Refuse("only merges whose members are listed (patterns or {a,b}) invert")
        members = [_pattern([*p.parts[:i], w, *p.parts[i + 1 :]]) for w in words]
    outs = tuple(_to_template(m, subst) for m in members)
    return A.Rule(op="split", optional=r.optional, patterns=(new_p,), outputs=outs, dim=r.dim,
                  sizes=r.sizes, where=where, loc=r.loc)  # fmt: skip


def _file_pattern(p: A.Pattern) -> A.FilePattern:
    return A.FilePattern(text=p.text, parts=p.parts, loc=p.loc)


def _invert_file(r: A.FileRule) -> A.FileRule:
    """``rename`` back, an ``add`` becomes a ``drop`` of the added file; a drop is final."""
    if r.op == "drop":
        raise _Refuse("dropped files cannot be brought back")
    if r.op == "add":
        assert r.name is not None
        if "*" in r.name:
            raise _Refuse(f"the added file {r.name!r} has a `*`, which a pattern reads as a glob")
        back = _file_pattern(_pattern([r.name]))
        return A.FileRule(op="drop", optional=False, patterns=(back,), loc=r.loc)
    (p,) = r.patterns
    assert r.output is not None
    caps = {c.name: c for c in p.captures}
    new_p, subst = _to_pattern(r.output, caps)
    missing = set(caps) - template_names(r.output)
    if missing:
        raise _Refuse(f"the output drops {{{', '.join(sorted(missing))}}}")
    if _no_fixed_text(new_p):
        # The folder's other files are carried as they are: a pattern of holes alone would
        # take them too when read back.
        raise _Refuse(
            f'the output "{r.output.text}" is all holes: read back as a pattern it would take '
            "every other carried file too; give it a fixed prefix or suffix"
        )
    return dataclasses.replace(r, patterns=(_file_pattern(new_p),), output=_to_template(p, subst))


def _makers(stmts: tuple[A.Stmt, ...]) -> int:
    """How many statements put tensors in the output: rules and ``unmatched keep``; of an
    ``if`` block, the branch with more (only one runs)."""
    count = 0
    for st in stmts:
        if isinstance(st, A.Rule):
            # A copy puts its source in the output beside the copies: two makers on its own.
            count += 2 if st.op == "copy" else 1
        elif isinstance(st, A.Unmatched) and st.policy == "keep":
            count += 1
        elif isinstance(st, A.If):
            count += max(_makers(st.then), _makers(st.orelse))  # (one branch runs)
    return count


def _no_fixed_text(p: A.Pattern) -> bool:
    return not any(isinstance(x, str) and x for x in p.parts)


def _check_readable(forward: A.Rule, r: A.Rule, others: bool) -> None:
    """Refuse an inverse rule that reads back with a pattern of holes alone (``"{f}"``, from a
    forward output ``-> "{f}"``) where other tensors reach the output: the pattern would take
    them too, and give them names they never had."""
    if r.op == "keep" or not forward.outputs or not others:
        return  # (a rule without outputs keeps its names: its inverse reads what it read)
    for p in r.patterns:
        if _no_fixed_text(p):
            raise _Refuse(
                f'its output is all holes ("{p.text}"): read back as a pattern it would take '
                "every other tensor of the output too; give the output a fixed prefix or suffix"
            )


def _invert_stmts(
    stmts: tuple[A.Stmt, ...],
    problems: list[str],
    others: bool = False,
    fams: frozenset[str] = frozenset(),
) -> tuple[A.Stmt, ...]:
    """Each statement inverted, rules and config blocks in reverse order, params first.

    Rules apply in order, each to what the rules above it left, so undoing them means undoing
    the last one first: the inverse of ``A`` then ``B`` is ``B⁻¹`` then ``A⁻¹``. ``others``:
    other rules (or ``unmatched keep``) put tensors in the output too (``_check_readable``).
    """
    params: list[A.Stmt] = []
    out: list[A.Stmt] = []
    for st in stmts:
        try:
            if isinstance(st, A.Rule):
                gather = _invert_gather(st, fams)
                if gather is not None:  # (a scatter, or nothing: see _invert_gather)
                    out += gather
                    continue
                back = _invert_rule(st)
                _check_readable(st, back, others)
                out.append(back)
            elif isinstance(st, A.Param):
                params.append(st)
            elif isinstance(st, A.Unmatched):
                if st.policy == "drop":
                    raise _Refuse("`unmatched drop` loses tensors")
                out.append(st)
            elif isinstance(st, A.If):
                cond = _subst(st.cond, {}, set())
                then = _invert_stmts(st.then, problems, others, fams)
                orelse = _invert_stmts(st.orelse, problems, others, fams)
                out.append(A.If(cond=cond, then=then, orelse=orelse, loc=st.loc))
            elif isinstance(st, A.FilesBlock):
                files = tuple(_invert_file(x) for x in reversed(st.stmts))
                out.append(A.FilesBlock(stmts=files, loc=st.loc))
            elif isinstance(st, A.ConfigFrom):
                raise _Refuse("the output's config is config.json, not the file this one reads")
            elif isinstance(st, A.InputDecl):
                if st.files is None:
                    raise _Refuse(
                        f"input {st.name!r} is one checkpoint combined into the output (an "
                        "adapter merged, a model averaged in): its tensors cannot be told "
                        "apart from the output's again"
                    )
                params.append(
                    A.Param(name=count_param(st.name), default=A.Lit(value=0), loc=st.loc)
                )
                params.append(_output_of(st))
            elif isinstance(st, A.OutputDecl):
                raise _Refuse(
                    "a mapping that writes several files inverts only as a gather of a family "
                    "of inputs, which weightmap does not derive from a scatter"
                )
            elif isinstance(st, A.ConfigBlock):
                back_cfg = tuple(_invert_config_edit(x) for x in reversed(st.stmts))
                out.append(A.ConfigBlock(stmts=back_cfg, loc=st.loc))
        except _Refuse as why:
            problems.append(f"{st.loc}: cannot invert this {_kind(st)}: {why}")
    return (*params, *reversed(out))


def count_param(family: str) -> str:
    """The param of an inverted gather that says how many ranks to write (``ranks_count``):
    the forward mapping read it off the folder, which the inverse has no more."""
    return f"{family}_count"


def _output_of(decl: A.InputDecl) -> A.OutputDecl:
    """The output family that gives back input family ``decl``: its members named as the
    input's, as safetensors files (``consolidated.{rank}.pth`` -> ``.safetensors``)."""
    assert decl.files is not None
    parts = decl.files.parts
    at = next(i for i, p in enumerate(parts) if isinstance(p, A.Capture))
    head = parts[: at + 1]
    after = list(parts[at + 1 :])
    if after and isinstance(after[-1], A.Glob) and not after[-1].multi:
        after[-1] = "any"  # (an extension read as `*`, replaced below)
    tail = "".join(p if isinstance(p, str) else "\0" for p in after)
    if not all(isinstance(p, str) for p in head[:-1]) or "\0" in tail:
        raise _Refuse(f"its files {decl.files.text!r} hold globs the output cannot name")
    base = tail.rsplit(".", 1)[0] if "." in tail else tail
    cap = parts[at]
    assert isinstance(cap, A.Capture)
    new_parts: tuple[A.PatPart, ...] = (
        *head[:-1],
        A.Capture(cap.name, "seg"),
        base + ".safetensors",
    )
    text = pattern_text(new_parts)
    files = A.FilePattern(text=text, parts=new_parts, loc=decl.loc)
    return A.OutputDecl(
        name=decl.name, files=files, count=A.Name(id=count_param(decl.name)), loc=decl.loc
    )


def _family_head(
    p: A.Pattern, fams: frozenset[str]
) -> tuple[str, A.PatPart, list[A.PatPart]] | None:
    """``(family, rank, the rest)`` of a pattern ``"NAME:RANK:rest"`` that reads a member of
    input family ``NAME`` (the rank a capture, or a literal number as a string); None for
    any other pattern."""
    parts = list(p.parts)
    if not parts or not isinstance(parts[0], str) or ":" not in parts[0]:
        return None
    name, _, after = parts[0].partition(":")
    if name not in fams:
        return None
    if after:  # a literal rank: "ranks:0:rest..."
        rank, sep, rest = after.partition(":")
        if not sep or not rank.isdigit():
            return None
        return name, rank, [rest, *parts[1:]] if rest else parts[1:]
    if len(parts) < 3 or not isinstance(parts[1], A.Capture) or not isinstance(parts[2], str):
        return None
    if not parts[2].startswith(":"):
        return None
    tail = parts[2][1:]
    return name, parts[1], [tail, *parts[3:]] if tail else parts[3:]


def _invert_gather(r: A.Rule, fams: frozenset[str]) -> list[A.Rule] | None:
    """The inverse of a rule that reads a family's members, or None for any other rule:

    * ``merge "ranks:{r:int}:X" dim d -> "Y"`` (equal parts, one per rank) becomes
      ``chunk "Y" dim d into ranks_count -> "ranks:{r}:X"``;
    * ``rename "ranks:0:X" -> "Y"`` (a tensor every rank holds, taken from rank 0), and
      ``merge "ranks:{r:int}:X" same -> "Y"`` (the same, checked), become
      ``rename "Y" -> "ranks:*:X"``, written into every member;
    * ``drop "ranks:{r:int}:X"`` (the other ranks' copies of such a tensor) becomes nothing:
      the ``*`` above writes them. A tensor dropped from every rank and taken from none does
      not come back, which ``invert(..., check=)`` reports.
    """
    heads = [_family_head(p, fams) for p in r.patterns]
    if not fams or not any(heads):
        return None
    if not all(heads):
        raise _Refuse("it reads a family's members and other tensors together")
    caps = {c.name: c for p in r.patterns for c in p.captures}
    if r.op == "drop":
        if any(not isinstance(h[1], A.Capture) for h in heads if h is not None):
            raise _Refuse("dropped tensors of one rank cannot be brought back")
        return []
    family, rank, rest = heads[0]  # type: ignore[misc]
    if r.op == "merge" and r.same and len(r.patterns) == 1:
        if not isinstance(rank, A.Capture) or rank.name in template_names(r.outputs[0]):
            raise _Refuse("only a `merge ... same` over the rank capture inverts")
        new_p, subst = _to_pattern(r.outputs[0], caps)
        out = _to_template(_pattern([f"{family}:*:", *rest]), subst)
        where = _subst(r.where, subst, template_names(r.outputs[0])) if r.where else None
        return [A.Rule(op="rename", optional=r.optional, patterns=(new_p,), outputs=(out,),
                       where=where, loc=r.loc)]  # fmt: skip
    if r.op == "merge" and r.sizes is None and len(r.patterns) == 1:
        if not isinstance(rank, A.Capture) or rank.name in template_names(r.outputs[0]):
            raise _Refuse("only a merge over the rank capture (one part per rank) inverts")
        new_p, subst = _to_pattern(r.outputs[0], caps)
        member = _pattern([f"{family}:", rank, ":", *rest])
        out = _to_template(member, {**subst, rank.name: A.Name(id=rank.name)})
        where = _subst(r.where, subst, template_names(r.outputs[0])) if r.where else None
        return [
            A.Rule(op="chunk", optional=r.optional, patterns=(new_p,), outputs=(out,),
                   dim=r.dim, parts=A.Name(id=count_param(family)), where=where, loc=r.loc)
        ]  # fmt: skip
    if r.op == "rename" and isinstance(rank, str) and rank.isdigit():
        new_p, subst = _to_pattern(r.outputs[0], caps)
        if set(caps) - template_names(r.outputs[0]):
            raise _Refuse("the output drops a capture")
        out = _to_template(_pattern([f"{family}:*:", *rest]), subst)
        where = _subst(r.where, subst, set(caps)) if r.where is not None else None
        return [dataclasses.replace(r, patterns=(new_p,), outputs=(out,), where=where)]
    raise _Refuse(
        "of the rules that read a family's members, only a merge over the rank capture, a "
        "rename of one rank's tensor and a drop of the ranks' copies invert"
    )


def _invert_config_edit(st: A.CfgStmt) -> A.CfgStmt:
    """The edit that undoes ``st``: a ``move`` moves back; ``if config.f == OLD { f = NEW }``
    (a field changed from one known value to another, as the stale-dtype warning advises)
    becomes ``if config.f == NEW { f = OLD }``. Any other edit loses what the field held.

    The swap undoes the edit exactly where the field did not already hold NEW before the
    conversion (then the forward edit left it, and the inverse would change it):
    ``invert(..., check=checkpoint)`` sees that case.
    """
    if isinstance(st, A.CfgMove):
        return A.CfgMove(src=st.dst, dst=st.src, loc=st.loc)
    swap = _value_swap(st)
    if swap is None:
        raise _Refuse(
            "config edits other than `move` and `if config.f == OLD { f = NEW }` cannot be "
            "undone (the inverse cannot know what a field held before)"
        )
    field, edit, old, new = swap
    return A.CfgIf(
        cond=A.BinOp(op="==", left=field, right=A.Lit(value=new.value, loc=new.loc)),
        then=(A.CfgSet(path=edit.path, value=A.Lit(value=old.value, loc=old.loc), loc=edit.loc),),
        orelse=(),
        loc=st.loc,
    )


def _value_swap(st: A.CfgStmt) -> tuple[A.Expr, A.CfgSet, A.Lit, A.Lit] | None:
    """``(config.<path>, the set, OLD, NEW)`` of ``if config.<path> == OLD { <path> = NEW }``
    with literal values and no ``else``; None for any other edit."""
    if not isinstance(st, A.CfgIf) or st.orelse or len(st.then) != 1:
        return None
    cond, edit = st.cond, st.then[0]
    if not (isinstance(cond, A.BinOp) and cond.op == "==" and isinstance(edit, A.CfgSet)):
        return None
    if not (isinstance(cond.right, A.Lit) and isinstance(edit.value, A.Lit)):
        return None
    if _config_path(cond.left) != edit.path:
        return None
    return cond.left, edit, cond.right, edit.value


def _config_path(expr: A.Expr) -> tuple[str, ...] | None:
    """``config.a.b`` -> ``("a", "b")``; None for anything else."""
    names: list[str] = []
    while isinstance(expr, A.Attr):
        names.append(expr.name)
        expr = expr.obj
    return tuple(reversed(names)) if isinstance(expr, A.ConfigRef) and names else None


def _kind(st: A.Stmt) -> str:
    if isinstance(st, A.FilesBlock):
        return "files block"
    if isinstance(st, A.ConfigFrom):
        return "config from"
    if isinstance(st, A.InputDecl):
        return "input"
    if isinstance(st, A.ConfigBlock):
        return "config block"
    return st.op if isinstance(st, A.Rule) else type(st).__name__.lower()


def invert_program(program: A.Program) -> A.Program:
    """The inverse program; MappingError listing every statement that does not invert."""
    problems: list[str] = []
    fams = frozenset(
        st.name for st in program.stmts if isinstance(st, A.InputDecl) and st.files is not None
    )
    stmts = _invert_stmts(program.stmts, problems, _makers(program.stmts) > 1, fams)
    if problems:
        raise MappingError("mapping is not invertible:\n  " + "\n  ".join(problems))
    return A.Program(version=program.version, stmts=stmts, file=program.file)


def invert(mapping: Mapping) -> Mapping:
    """A mapping that undoes ``mapping``, or MappingError naming each rule that cannot be undone.

    Its ``text`` is generated source that parses back to it. See docs/language.md
    ("Inversion") for which rules invert and how.

    >>> from weightmap.language.mapping import load_mapping
    >>> print(invert(load_mapping('weightmap 1\\nrename "a.{x}" -> "b.{x}"')).text.strip())
    weightmap 1
    rename "b.{x}" -> "a.{x}"
    """
    program = invert_program(mapping.program)
    text = unparse(program)
    name = f"{mapping.name} (inverse)"
    return from_program(name, text, parse_program(text, f"{mapping.name}.inverse"))


def round_trip_problems(plan: Plan, inverse: Mapping, limit: int = 20) -> list[str]:
    """How compiling ``inverse`` against ``plan``'s output fails to give back its input: each
    tensor missing, made in excess, or of another dtype or shape, and each config.json field
    that differs. Empty when names, dtypes, shapes and config come back; values are not
    compared (no tensor data is read). The inverse is compiled with the params the plan was
    made with (an inverse keeps its mapping's params).

    ``invert`` reads a mapping alone, so what only a checkpoint shows escapes it: a cast
    ``"**" from bf16 to f32`` inverts to one from f32 to bf16, which would also narrow
    tensors that were f32 before; a rename between two captures (``"{a}.{b}" -> "{a}_{b}"``)
    reads ``x_y_z`` back one way only. This is the check against a checkpoint.
    """
    from weightmap.compiler.compile import compile_plan  # (compile imports this module's peers)
    from weightmap.inputs.diff import config_diff

    params = plan.params
    for decl in inverse.outputs:  # an inverted gather: as many ranks as the forward read
        ranks = {s.name.split(":", 2)[1] for s in plan.inputs if s.name.startswith(f"{decl.name}:")}
        params.setdefault(count_param(decl.name), len(ranks))
    try:
        back = compile_plan(inverse, plan.output_specs(), plan.config, params=params)
    except MappingError as err:
        return [f"the inverse does not compile against the output: {err}"]
    want = {s.name: s for s in plan.inputs}
    got = {s.name: s for s in back.output_specs()}
    problems = [f"{n}: not given back" for n in sorted(want.keys() - got.keys())]
    problems += [f"{n}: made, but no input has that name" for n in sorted(got.keys() - want.keys())]
    for name in sorted(want.keys() & got.keys()):
        a, b = want[name], got[name]
        if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
            problems.append(
                f"{name}: {a.dtype}{list(a.shape)} comes back as {b.dtype}{list(b.shape)}"
            )
    if plan.input_config is not None or back.config is not None:
        problems += [f"config.json {d}" for d in config_diff(plan.input_config, back.config)]
    if len(problems) > limit:
        problems = [*problems[:limit], f"... and {len(problems) - limit} more"]
    return problems
