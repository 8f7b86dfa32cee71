"""Syntax tree -> source text that parses back to an equal tree (used for inverse mappings)."""

from __future__ import annotations

import json
import re

from weightmap.language import ast as A

__all__ = ["pattern_text", "template_text", "unparse", "unparse_expr"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_WORDS = (
    "weightmap param include unmatched require else warn if rename keep drop copy split chunk "
    "merge stack unstack transpose permute reshape cast add sub mul quantize mask block size plus "
    "matmul gather lookup unpack pack bits order round floor ceil clamp amax amin sum group "
    "index dim dims sizes over to from where config "
    "delete when move lift nest except overwrite and or not in for exists true false null error "
    "files file input output count into same"
)
_KEYWORDS = frozenset(_WORDS.split())
_BINARY = {"or": 1, "and": 2, "==": 4, "!=": 4, "<": 4, "<=": 4, ">": 4, ">=": 4, "in": 4,
           "not in": 4, "+": 5, "-": 5, "*": 6, "//": 6, "/": 6, "%": 6}  # fmt: skip


def _s(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _prec(e: A.Expr) -> int:
    if isinstance(e, A.BinOp):
        return _BINARY[e.op]
    if isinstance(e, A.Unary):
        return 3 if e.op == "not" else 7
    return 9


def unparse_expr(e: A.Expr, min_prec: int = 0) -> str:
    """An expression's source, parenthesised only where precedence requires."""
    text = _expr(e)
    return f"({text})" if _prec(e) < min_prec else text


def _expr(e: A.Expr) -> str:
    if isinstance(e, A.Lit):
        v = e.value
        if v is None or isinstance(v, bool):
            return {None: "null", True: "true", False: "false"}[v]
        if isinstance(v, str):
            return _s(v)
        if isinstance(v, float):
            text = repr(v)
            return text if ("." in text or "e" in text) else text + ".0"
        return str(v)
    if isinstance(e, A.Name):
        return e.id
    if isinstance(e, A.ConfigRef):
        return "config"
    if isinstance(e, A.Attr):
        return f"{unparse_expr(e.obj, 8)}.{e.name}"
    if isinstance(e, A.Index):
        return f"{unparse_expr(e.obj, 8)}[{unparse_expr(e.index)}]"
    if isinstance(e, A.Call):
        return f"{e.func}({', '.join(unparse_expr(a) for a in e.args)})"
    if isinstance(e, A.Unary):
        return (
            f"not {unparse_expr(e.operand, 3)}"
            if e.op == "not"
            else f"-{unparse_expr(e.operand, 7)}"
        )
    if isinstance(e, A.BinOp):
        p = _BINARY[e.op]
        right_min = p + 1
        left_min = p + 1 if p == 4 else p
        return f"{unparse_expr(e.left, left_min)} {e.op} {unparse_expr(e.right, right_min)}"
    if isinstance(e, A.IfExp):
        # Always parenthesised: the grammar only reads a conditional inside parentheses.
        then, cond = unparse_expr(e.then, 1), unparse_expr(e.cond, 1)
        return f"({then} if {cond} else {unparse_expr(e.orelse)})"
    if isinstance(e, A.ListExpr):
        return "[" + ", ".join(unparse_expr(x) for x in e.items) + "]"
    if isinstance(e, A.DictExpr):
        return "{" + ", ".join(f"{_s(k)}: {unparse_expr(v)}" for k, v in e.items) + "}"
    if isinstance(e, A.Comp):
        cond = f" if {unparse_expr(e.cond)}" if e.cond is not None else ""
        return f"[{unparse_expr(e.elt)} for {e.var} in {unparse_expr(e.iterable)}{cond}]"
    if isinstance(e, A.Exists):
        word = "exists file" if isinstance(e.pattern, A.FilePattern) else "exists"
        return f"{word} {_s(e.pattern.text)}"
    raise TypeError(e)  # pragma: no cover


def _braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def pattern_text(parts: tuple[A.PatPart, ...]) -> str:
    """A pattern's source text from its parts."""
    out = []
    for p in parts:
        if isinstance(p, str):
            out.append(_braces(p))
        elif isinstance(p, A.Glob):
            out.append("**" if p.multi else "*")
        elif isinstance(p, A.Alt):
            out.append("{" + ",".join(p.alts) + "}")
        elif p.kind == "alt":
            out.append(f"{{{p.name}:{','.join(p.alts)}}}")
        else:
            out.append("{" + p.name + {"seg": "", "multi": "*", "int": ":int"}[p.kind] + "}")
    return "".join(out)


def template_text(parts: tuple[str | A.Expr, ...]) -> str:
    """A template's source text from its parts."""
    return "".join(_braces(p) if isinstance(p, str) else "{" + unparse_expr(p) + "}" for p in parts)


def _path(path: tuple[str, ...]) -> str:
    return ".".join(s if _IDENT.match(s) and s not in _KEYWORDS else _s(s) for s in path)


# Values, blocks and mask sizes are read at the `+`/`-` level (so `in bf16` after them is the
# compute dtype): anything looser is written in parentheses.
_ARITH = 5
_REDUCTIONS = ("amax", "amin", "sum")


def _value_rule(r: A.Rule, pats: str, outs: str) -> str:
    """add / sub / mul / quantize / mask / matmul / clamp / the reductions, in their
    grammar's order."""
    words = [r.op + ("?" if r.optional else ""), pats]
    if r.op == "quantize":
        words.append(f"to {r.to_dtype}")
    if r.op == "mask" and r.size is not None:
        words.append(f"size {unparse_expr(r.size, _ARITH)}")
    if r.plus_index:
        words.append("plus index")
    if r.op in _REDUCTIONS and r.dim is not None:
        words.append(f"dim {unparse_expr(r.dim, _ARITH)}")
    if r.group is not None:
        words.append(f"group {unparse_expr(r.group, _ARITH)}")
    if r.value is not None:
        words.append(unparse_expr(r.value, _ARITH))
    if r.block is not None:
        words.append(f"block {unparse_expr(r.block, _ARITH)}")
    if r.compute:
        words.append(f"in {r.compute}")
    if r.to_dtype and r.op != "quantize":
        words.append(f"to {r.to_dtype}")
    if outs:
        words.append(f"-> {outs}")
    if r.where is not None:
        words.append(f"where {unparse_expr(r.where)}")
    return " ".join(words)


def _rule(r: A.Rule) -> str:
    pats = ", ".join(_s(p.text) for p in r.patterns)
    outs = ", ".join(_s(t.text) for t in r.outputs)
    if r.op in ("add", "sub", "mul", "quantize", "mask", "matmul", "clamp", *_REDUCTIONS):
        return _value_rule(r, pats, outs)
    words = [r.op + ("?" if r.optional else "")]
    words.append(pats)
    if r.from_dtype:
        words.append(f"from {r.from_dtype}")
    if r.from_shape is not None:
        words.append(f"from {unparse_expr(r.from_shape)}")
    if r.over:
        words.append(f"over {r.over}")
    for key in ("dim", "sizes", "dims"):
        value = getattr(r, key)
        if value is not None:
            words.append(f"{key} {unparse_expr(value)}")
    if r.parts is not None:
        words.append(f"into {unparse_expr(r.parts)}")
    if r.same:
        words.append("same")
    for key in ("bits", "order"):  # read at the `+`/`-` level, as values are
        value = getattr(r, key)
        if value is not None:
            words.append(f"{key} {unparse_expr(value, _ARITH)}")
    if r.to_shape is not None:
        words.append(f"to {unparse_expr(r.to_shape)}")
    if r.to_dtype:
        words.append(f"to {r.to_dtype}")
    if outs:
        words.append(f"-> {outs}")
    if r.where is not None:
        words.append(f"where {unparse_expr(r.where)}")
    return " ".join(words)


def _cfg(st: A.CfgStmt, ind: str) -> list[str]:
    if isinstance(st, A.CfgSet):
        return [f"{ind}{_path(st.path)} = {unparse_expr(st.value)}"]
    if isinstance(st, A.CfgDelete):
        cond = f" when {unparse_expr(st.cond)}" if st.cond is not None else ""
        paths = ", ".join(_path(p) for p in st.paths)
        return [f"{ind}delete{'?' if st.optional else ''} {paths}{cond}"]
    if isinstance(st, A.CfgMove):
        return [f"{ind}move {_path(st.src)} -> {_path(st.dst)}"]
    if isinstance(st, A.CfgLift):
        return [f"{ind}lift {_path(st.path)}{' overwrite' if st.overwrite else ''}"]
    if isinstance(st, A.CfgNest):
        keep = f" except {', '.join(_path((k,)) for k in st.keep)}" if st.keep else ""
        return [f"{ind}nest {_path(st.path)}{keep}"]
    lines = [f"{ind}if {unparse_expr(st.cond)} {{"]
    for x in st.then:
        lines += _cfg(x, ind + "    ")
    if st.orelse:
        lines.append(f"{ind}}} else {{")
        for x in st.orelse:
            lines += _cfg(x, ind + "    ")
    return [*lines, f"{ind}}}"]


def _file(r: A.FileRule) -> str:
    word = r.op + ("?" if r.optional else "")
    if r.op == "add":
        assert r.name is not None and r.value is not None
        return f"add {_s(r.name)} = {unparse_expr(r.value)}"
    pats = ", ".join(_s(p.text) for p in r.patterns)
    return f"{word} {pats}" + (f" -> {_s(r.output.text)}" if r.output is not None else "")


def _stmt(st: A.Stmt, ind: str) -> list[str]:
    if isinstance(st, A.Param):
        return [f"{ind}param {st.name} = {unparse_expr(st.default)}"]
    if isinstance(st, A.Include):
        return [f"{ind}include {_s(st.target)}"]
    if isinstance(st, A.Unmatched):
        return [f"{ind}unmatched {st.policy}"]
    if isinstance(st, A.Require):
        return [f"{ind}require {unparse_expr(st.cond)} else {_s(st.message.text)}"]
    if isinstance(st, A.Warn):
        cond = f"if {unparse_expr(st.cond)} " if st.cond is not None else ""
        return [f"{ind}warn {cond}{_s(st.message.text)}"]
    if isinstance(st, A.Rule):
        return [ind + _rule(st)]
    if isinstance(st, A.ConfigFrom):
        return [f"{ind}config from {_s(st.file)}"]
    if isinstance(st, A.InputDecl):
        files = f" files {_s(st.files.text)}" if st.files is not None else ""
        config = f" config from {_s(st.config_file)}" if st.config_file is not None else ""
        return [f"{ind}input {st.name}{files}{config}"]
    if isinstance(st, A.OutputDecl):
        return [f"{ind}output {st.name} files {_s(st.files.text)} count {unparse_expr(st.count)}"]
    if isinstance(st, A.FilesBlock):
        return [f"{ind}files {{", *(f"{ind}    {_file(x)}" for x in st.stmts), f"{ind}}}"]
    if isinstance(st, A.ConfigBlock):
        lines = [f"{ind}config {{"]
        for x in st.stmts:
            lines += _cfg(x, ind + "    ")
        return [*lines, f"{ind}}}"]
    lines = [f"{ind}if {unparse_expr(st.cond)} {{"]
    for y in st.then:
        lines += _stmt(y, ind + "    ")
    if st.orelse:
        lines.append(f"{ind}}} else {{")
        for y in st.orelse:
            lines += _stmt(y, ind + "    ")
    return [*lines, f"{ind}}}"]


def unparse(program: A.Program) -> str:
    """A program's source text."""
    lines = [f"weightmap {program.version}"]
    for st in program.stmts:
        lines += _stmt(st, "")
    return "\n".join(lines) + "\n"
