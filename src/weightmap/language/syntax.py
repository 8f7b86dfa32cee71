"""Text -> syntax tree. Lark does the parsing; its exceptions never leave this module.

``parse.py`` is the front: it loads a program parsed before from the per-user cache, and
imports this module (and lark, with its parser) only to parse a text it has not seen.

Every syntax error becomes a :class:`MappingSyntaxError` with the line, a caret and a hint
(``hints.py``). Patterns (``"layers.{n:int}.{rest*}"``) and templates (``"layers.{n - 1}"``)
are ordinary strings to the grammar; their holes are parsed here so errors point inside the
string.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from lark import Token, Tree
from lark.exceptions import LarkError, UnexpectedInput

from weightmap.language import ast as A
from weightmap.language import grammar
from weightmap.language.functions import FUNCTIONS
from weightmap.language.hints import lark_error, syntax_error
from weightmap.language.unparse import pattern_text

__all__ = ["LANGUAGE_VERSION", "parse_pattern", "parse_template", "parse_text", "syntax_error"]

LANGUAGE_VERSION = 1
# Hostile-input bounds: far beyond real mappings (a u64 has 20 digits; real expressions nest
# a few levels), well inside Python's int-parsing and recursion limits.
MAX_INT_DIGITS = 100
# The names the compiler gives unnamed alternatives ({a,b}) in a pattern's regex.
_RESERVED_CAPTURE = re.compile(r"_alt[0-9]+")
MAX_EXPR_DEPTH = 100

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# ---------------------------------------------------------------- patterns and templates


def _holes(text: str, loc: A.Loc, source: str) -> list[tuple[str, str, int]]:
    """Split on ``{...}``: ("lit", text, offset) and ("hole", inner, offset) pieces."""
    out: list[tuple[str, str, int]] = []
    buf, i, start = [], 0, 0
    while i < len(text):
        ch = text[i]
        if text.startswith("{{", i) or text.startswith("}}", i):
            buf.append(ch)
            i += 2
        elif ch == "{":
            end = text.find("}", i)
            if end < 0:
                _in_string_error(source, loc, i, "`{` is not closed", "write {{ for a literal {")
            if buf:
                out.append(("lit", "".join(buf), start))
                buf = []
            out.append(("hole", text[i + 1 : end], i))
            i = end + 1
            start = i
        elif ch == "}":
            _in_string_error(source, loc, i, "`}` without `{`", "write }} for a literal }")
        else:
            if not buf:
                start = i
            buf.append(ch)
            i += 1
    if buf:
        out.append(("lit", "".join(buf), start))
    return out


def _in_string_error(source: str, loc: A.Loc, offset: int, msg: str, hint: str) -> NoReturn:
    syntax_error(source, A.Loc(loc.file, loc.line, loc.col + 1 + offset), msg, hint)


def parse_pattern(text: str, loc: A.Loc, source: str = "", sep: str = ".") -> A.Pattern:
    """Parse a tensor-name pattern (``sep="/"``: a side-file pattern, whose ``*`` and ``{x}``
    stop at ``/``); ``loc`` is the position of its opening quote."""
    parts: list[A.PatPart] = []
    names: set[str] = set()
    for kind, piece, off in _holes(text, loc, source):
        if kind == "lit":
            for j, chunk in enumerate(re.split(r"(\*\*|\*)", piece)):
                if j % 2:
                    parts.append(A.Glob(multi=chunk == "**"))
                elif chunk:
                    parts.append(chunk)
            continue
        hole = piece.strip()
        name, _, spec = hole.partition(":")
        multi = name.endswith("*")
        name = name.rstrip("*").strip()
        part: A.PatPart
        if not spec and "," in name:
            alts = tuple(a.strip() for a in name.split(","))
            if multi or not all(alts):
                _in_string_error(source, loc, off, f"bad alternatives {{{piece}}}", "{a,b}")
            part = A.Alt(alts)
        elif not _IDENT.match(name):
            _in_string_error(
                source,
                loc,
                off,
                f"bad capture {{{piece}}}",
                "captures are {name}, {name*}, {name:int}, {name:a,b} or {a,b}",
            )
        elif _RESERVED_CAPTURE.fullmatch(name):
            # The compiler names unnamed alternatives {a,b} so, in the same regex.
            _in_string_error(
                source, loc, off, f"capture name {name} is reserved", "rename it, e.g. {alt0}"
            )
        elif spec.strip() == "int" and not multi:
            part = A.Capture(name, "int")
        elif spec:
            alts = tuple(a.strip() for a in spec.split(","))
            if multi or not all(alts):
                _in_string_error(source, loc, off, f"bad alternatives {{{piece}}}", "{x:a,b}")
            part = A.Capture(name, "alt", alts)
        else:
            part = A.Capture(name, "multi" if multi else "seg")
        if isinstance(part, A.Capture):
            if part.name in names:
                _in_string_error(
                    source, loc, off, f"capture {{{name}}} appears twice", "rename one"
                )
            names.add(part.name)
        parts.append(part)
    steps = match_steps(parts, sep)
    if steps > MAX_MATCH_STEPS:
        shown = ", ".join(pattern_text((part,)) for part in loose_parts(parts, sep)) or "none"
        _in_string_error(
            source,
            loc,
            0,
            f"pattern can take up to {steps:,} steps to match a name of {NAME_CHARS:,} "
            f"characters (at most {MAX_MATCH_STEPS:,}): each of its parts that can end in more "
            f"than one place ({shown}) multiplies the ways tried, and what comes after them "
            "is tried each way",
            "make one of those parts stop where a literal begins, e.g. {x} (one segment) "
            "instead of {x*}, with a dot after it; or fewer or shorter alternatives",
        )
    return A.Pattern(text=text, parts=tuple(parts), loc=loc)


# A pattern is matched by backtracking (Python's re): on a name it does not match, each part
# that can end in several places is tried at each of them, and everything after it once for
# each. ``match_steps`` bounds that work on the longest name a pattern is matched against
# (compiler/compile.py refuses longer input names; side-file paths are held to it too). The
# cap admits two such parts before literals ("{a*}.{b*}.weight_scale_inv": 9.4 million
# steps, 7 ms on names built to make it backtrack) and the presets' patterns, and refuses a
# third ("{a*}{b*}{c}.weight": 1.7 s per name) or a long list of words after two.
NAME_CHARS = 1024
MAX_MATCH_STEPS = 2**25
# A literal's try is charged at most this many steps: it fails at the first character that
# differs, and a name can hold only so many near-misses of it (a long literal is still cheap).
_LITERAL_STEPS = 8


def match_steps(parts: Sequence[A.PatPart], sep: str, n: int = NAME_CHARS) -> int:
    """An upper bound of the steps backtracking takes to match the pattern ``parts`` against
    a name of ``n`` characters: each part is tried once per way the parts before it can end
    (``n`` ways for a part of :func:`loose_parts`, one per word for a loose set of
    alternatives, one otherwise), and a try scans up to ``n`` characters for a wildcard or
    capture, a few per word for alternatives, a few for a literal."""
    loose = {id(part) for part in loose_parts(parts, sep)}
    steps, ways = 0, 1
    for part in parts:
        if isinstance(part, str):
            scan, ends = min(len(part), _LITERAL_STEPS), 1
        elif isinstance(part, A.Alt) or (isinstance(part, A.Capture) and part.kind == "alt"):
            words = part.alts
            scan, ends = min(sum(map(len, words)), _LITERAL_STEPS * len(words)), len(words)
        else:
            scan, ends = n, n
        steps += ways * max(scan, 1)
        if id(part) in loose:
            ways *= ends
    return steps


def loose_parts(parts: Sequence[A.PatPart], sep: str) -> list[A.PatPart]:
    """The parts of a pattern that can end in more than one place, for a name it is matched
    against: all but the last of ``**`` and ``{x*}``; ``*``, ``{x}`` and ``{x:int}`` where
    what follows could go on them (``{x}`` before a dot ends at the dot, ``{n:int}`` before a
    letter at the last digit); alternatives where one is a prefix of another."""
    loose: list[A.PatPart] = []
    for i, part in enumerate(parts):
        after = parts[i + 1] if i + 1 < len(parts) else None
        if isinstance(part, str):
            continue
        if isinstance(part, A.Alt) or (isinstance(part, A.Capture) and part.kind == "alt"):
            alts = part.alts
            if any(a != b and b.startswith(a) for a in alts for b in alts):
                loose.append(part)
            continue
        if after is None:
            continue  # (the name's end is where it ends)
        if (isinstance(part, A.Glob) and part.multi) or (
            isinstance(part, A.Capture) and part.kind == "multi"
        ):
            loose.append(part)
        elif isinstance(part, A.Capture) and part.kind == "int":
            if not isinstance(after, str) or after[0].isdigit():
                loose.append(part)
        elif not isinstance(after, str) or not after.startswith(sep):
            loose.append(part)
    return loose


def parse_template(text: str, loc: A.Loc, source: str = "") -> A.Template:
    """Parse an output name or message: literal text with ``{expression}`` holes."""
    parts: list[str | A.Expr] = []
    for kind, piece, off in _holes(text, loc, source):
        if kind == "lit":
            parts.append(piece)
            continue
        hole_loc = A.Loc(loc.file, loc.line, loc.col + 2 + off)
        try:
            tree = grammar.parser().parse(piece, start="expr")
        except LarkError:
            _in_string_error(
                source, loc, off, f"bad expression {{{piece}}} in template", "e.g. {n - 1}"
            )
        parts.append(_Builder(source, loc.file, hole_loc).expr(tree))
    return A.Template(text=text, parts=tuple(parts), loc=loc)


# ---------------------------------------------------------------- tree -> AST


class _Builder:
    """Turns lark trees into AST nodes. ``origin`` offsets positions (template holes)."""

    def __init__(self, text: str, file: str, origin: A.Loc | None = None) -> None:
        self.text, self.file, self.origin = text, file, origin
        self.depth = 0

    def loc(self, node: Tree[Any] | Token, fallback: A.Loc | None = None) -> A.Loc:
        if self.origin is not None:
            return self.origin
        line = getattr(node, "line", None)
        col = getattr(node, "column", None)
        if isinstance(node, Tree):
            line = None if node.meta.empty else node.meta.line
            col = None if node.meta.empty else node.meta.column
        if line is None or col is None:
            return fallback or A.Loc(self.file, 0, 0)
        return A.Loc(self.file, line, col)

    def string(self, tok: Token) -> str:
        try:
            value = json.loads(str(tok))
        except ValueError:
            syntax_error(self.text, self.loc(tok), "bad escape in string", 'e.g. "\\n" or "\\""')
        if not isinstance(value, str):  # pragma: no cover - the STRING regex guarantees it
            raise TypeError(value)
        return value

    def pattern(self, tok: Token) -> A.Pattern:
        return parse_pattern(self.string(tok), self.loc(tok), self.text)

    def file_pattern(self, tok: Token) -> A.FilePattern:
        p = parse_pattern(self.string(tok), self.loc(tok), self.text, sep="/")
        return A.FilePattern(text=p.text, parts=p.parts, loc=p.loc)

    def template(self, tok: Token) -> A.Template:
        return parse_template(self.string(tok), self.loc(tok), self.text)

    # -- expressions
    def expr(self, t: Tree[Any] | Token, fallback: A.Loc | None = None) -> A.Expr:
        # Building, compiling and evaluating an expression all recurse over its tree; a
        # hostile `1+1+...+1` or `[[[...]]]` would exhaust the Python stack.
        self.depth += 1
        try:
            if self.depth > MAX_EXPR_DEPTH:
                syntax_error(
                    self.text,
                    self.loc(t, fallback),
                    f"expression nests deeper than {MAX_EXPR_DEPTH} levels",
                    "split it into params",
                )
            return self._expr(t, fallback)
        finally:
            self.depth -= 1

    def _expr(self, t: Tree[Any] | Token, fallback: A.Loc | None = None) -> A.Expr:
        loc = self.loc(t, fallback)
        if isinstance(t, Token):  # pragma: no cover - every expression token sits in a tree
            raise TypeError(t)
        c: list[Any] = list(t.children)
        kind = t.data
        if kind == "int":
            if len(c[0]) > MAX_INT_DIGITS:
                syntax_error(self.text, loc, f"integer literal has over {MAX_INT_DIGITS} digits")
            return A.Lit(value=int(c[0]), loc=loc)
        if kind == "float":
            value = float(c[0])
            if not math.isfinite(value):  # 1e999: no JSON value, and no literal to write back
                syntax_error(self.text, loc, f"number {c[0]} is too large for a float")
            return A.Lit(value=value, loc=loc)
        if kind == "string":
            return A.Lit(value=self.string(c[0]), loc=loc)
        if kind in ("true", "false", "null"):
            return A.Lit(value={"true": True, "false": False, "null": None}[kind], loc=loc)
        if kind == "name":
            return A.Name(id=str(c[0]), loc=loc)
        if kind == "config_ref":
            return A.ConfigRef(loc=loc)
        if kind == "exists":
            return A.Exists(pattern=self.pattern(c[0]), loc=loc)
        if kind == "exists_file":
            return A.Exists(pattern=self.file_pattern(c[0]), loc=loc)
        if kind == "attr":
            return A.Attr(obj=self.expr(c[0], loc), name=str(c[1]), loc=loc)
        if kind == "index":
            return A.Index(obj=self.expr(c[0], loc), index=self.expr(c[1], loc), loc=loc)
        if kind == "call":
            args = tuple(self.expr(a, loc) for a in c[1:] if a is not None)
            func = str(c[0])
            # Checked here: the evaluator would only find out when building the call, where
            # its EvalError is not one of ours.
            if func not in FUNCTIONS:
                close = difflib.get_close_matches(func, FUNCTIONS, n=1)
                hint = f"did you mean `{close[0]}`?" if close else None
                syntax_error(
                    self.text,
                    loc,
                    f"unknown function `{func}` (the functions are {', '.join(FUNCTIONS)})",
                    hint,
                )
            fewest, most = FUNCTIONS[func]
            if len(args) < fewest or (most is not None and len(args) > most):
                want = str(fewest) if fewest == most else f"{fewest} to {most or 'any'}"
                syntax_error(self.text, loc, f"{func}() takes {want} argument(s), got {len(args)}")
            return A.Call(func=func, args=args, loc=loc)
        if kind == "ifexp":
            then_e, cond_e, else_e = (self.expr(x, loc) for x in c)
            return A.IfExp(cond=cond_e, then=then_e, orelse=else_e, loc=loc)
        if kind == "neg":
            return A.Unary(op="-", operand=self.expr(c[0], loc), loc=loc)
        if kind == "not_":
            return A.Unary(op="not", operand=self.expr(c[0], loc), loc=loc)
        if kind in ("or_", "and_"):
            op = kind[:-1]
            return A.BinOp(op=op, left=self.expr(c[0], loc), right=self.expr(c[1], loc), loc=loc)
        if kind in ("compare", "binop"):
            lhs, rhs = self.expr(c[0], loc), self.expr(c[2], loc)
            return A.BinOp(op=str(c[1]), left=lhs, right=rhs, loc=loc)
        if kind in ("in_", "not_in"):
            op = "in" if kind == "in_" else "not in"
            return A.BinOp(op=op, left=self.expr(c[0], loc), right=self.expr(c[1], loc), loc=loc)
        if kind == "list":
            return A.ListExpr(items=tuple(self.expr(x, loc) for x in c if x is not None), loc=loc)
        if kind == "comp":
            cond = self.expr(c[3], loc) if len(c) > 3 and c[3] is not None else None
            it = self.expr(c[2], loc)
            return A.Comp(elt=self.expr(c[0], loc), var=str(c[1]), iterable=it, cond=cond, loc=loc)
        if kind == "dict":
            pairs = [x for x in c if x is not None]
            items = tuple(
                (self.string(p.children[0]), self.expr(p.children[1], loc)) for p in pairs
            )
            return A.DictExpr(items=items, loc=loc)
        raise TypeError(f"unknown expression node {kind}")  # pragma: no cover

    # -- statements
    def stmts(self, trees: list[Any]) -> tuple[A.Stmt, ...]:
        return tuple(self.stmt(t) for t in trees if isinstance(t, Tree))

    def stmt(self, t: Tree[Any]) -> A.Stmt:
        loc, kind = self.loc(t), str(t.data)
        c: list[Any] = list(t.children)
        if kind == "param":
            return A.Param(name=str(c[0]), default=self.expr(c[1], loc), loc=loc)
        if kind == "include":
            return A.Include(target=self.string(c[0]), loc=loc)
        if kind == "unmatched":
            return A.Unmatched(policy=str(c[0]), loc=loc)  # type: ignore[arg-type]  # POLICY
        if kind == "require":
            return A.Require(cond=self.expr(c[0], loc), message=self.template(c[1]), loc=loc)
        if kind == "warn":
            cond = self.expr(c[0], loc) if len(c) == 2 else None
            return A.Warn(cond=cond, message=self.template(c[-1]), loc=loc)
        if kind == "if_stmt":
            then = [
                x for x in c[1:] if isinstance(x, Tree) and x.data not in ("else_block", "else_if")
            ]
            return A.If(
                cond=self.expr(c[0], loc), then=self.stmts(then), orelse=self._else(c), loc=loc
            )
        if kind == "config_block":
            return A.ConfigBlock(stmts=tuple(self.cfg(x) for x in c), loc=loc)
        if kind == "config_from":
            return A.ConfigFrom(file=self.string(c[0]), loc=loc)
        if kind == "input_decl":
            files = config_file = None
            for x in c[1:]:
                if x.data == "input_files":
                    files = self.file_pattern(x.children[0])
                else:
                    config_file = self.string(x.children[0])
            return A.InputDecl(name=str(c[0]), files=files, config_file=config_file, loc=loc)
        if kind == "output_decl":
            return A.OutputDecl(
                name=str(c[0]),
                files=self.file_pattern(c[1]),
                count=self.expr(c[2], loc),
                loc=loc,
            )
        if kind == "files_block":
            return A.FilesBlock(stmts=tuple(self.file_rule(x) for x in c), loc=loc)
        return self.rule(t)

    def file_rule(self, t: Tree[Any]) -> A.FileRule:
        loc, kind = self.loc(t), str(t.data)
        optional = any(isinstance(x, Token) and x.type == "OPT" for x in t.children)
        c: list[Any] = [x for x in t.children if not (isinstance(x, Token) and x.type == "OPT")]
        if kind == "file_drop":
            pats = tuple(self.file_pattern(x) for x in c[0].children)
            return A.FileRule(op="drop", optional=optional, patterns=pats, loc=loc)
        if kind == "file_rename":
            return A.FileRule(
                op="rename",
                optional=optional,
                patterns=(self.file_pattern(c[0]),),
                output=self.template(c[1]),
                loc=loc,
            )
        if kind == "file_add":
            name, value = self.string(c[0]), self.expr(c[1], loc)
            return A.FileRule(op="add", optional=False, name=name, value=value, loc=loc)
        raise TypeError(f"unknown files statement {kind}")  # pragma: no cover

    def _else(self, c: list[Any]) -> tuple[A.Stmt, ...]:
        last = c[-1] if c else None
        if isinstance(last, Tree) and last.data == "else_block":
            return self.stmts(last.children)
        if isinstance(last, Tree) and last.data == "else_if":
            return (self.stmt(last.children[0]),)
        return ()

    def cfg(self, t: Tree[Any]) -> A.CfgStmt:
        loc, kind = self.loc(t), str(t.data)
        c: list[Any] = list(t.children)
        if kind == "cfg_set":
            return A.CfgSet(path=self.path(c[0]), value=self.expr(c[1], loc), loc=loc)
        if kind == "cfg_delete":
            optional = isinstance(c[0], Token) and c[0].type == "OPT"
            paths = tuple(self.path(x) for x in c if isinstance(x, Tree) and x.data == "path")
            rest = [x for x in c if isinstance(x, Tree) and x.data != "path"]
            cond = self.expr(rest[0], loc) if rest else None
            return A.CfgDelete(paths=paths, optional=optional, cond=cond, loc=loc)
        if kind == "cfg_move":
            return A.CfgMove(src=self.path(c[0]), dst=self.path(c[1]), loc=loc)
        if kind == "cfg_lift":
            return A.CfgLift(path=self.path(c[0]), overwrite=len(c) > 1, loc=loc)
        if kind == "cfg_nest":
            keep = tuple(self.string(x) if x.type == "STRING" else str(x) for x in c[1:])
            return A.CfgNest(path=self.path(c[0]), keep=keep, loc=loc)
        if kind == "cfg_if":
            body = [x for x in c[1:] if isinstance(x, Tree)]
            then = [x for x in body if x.data not in ("cfg_else", "cfg_else_if")]
            orelse: tuple[A.CfgStmt, ...] = ()
            if body and body[-1].data == "cfg_else":
                orelse = tuple(self.cfg(x) for x in body[-1].children)
            elif body and body[-1].data == "cfg_else_if":
                orelse = (self.cfg(body[-1].children[0]),)
            then_stmts = tuple(self.cfg(x) for x in then)
            return A.CfgIf(cond=self.expr(c[0], loc), then=then_stmts, orelse=orelse, loc=loc)
        raise TypeError(f"unknown config statement {kind}")  # pragma: no cover

    def path(self, t: Tree[Any]) -> tuple[str, ...]:
        children: list[Any] = list(t.children)
        return tuple(self.string(x) if x.type == "STRING" else str(x) for x in children)

    def rule(self, t: Tree[Any]) -> A.Rule:
        loc, op = self.loc(t), str(t.data)
        fields: dict[str, Any] = {}
        strings: list[Token] = []
        optional = False
        children: list[Any] = list(t.children)
        for x in children:
            if isinstance(x, Token):
                if x.type == "OPT":
                    optional = True
                elif x.type == "STRING":
                    strings.append(x)
                else:  # NAME: the cast target dtype
                    fields["to_dtype"] = str(x)
            elif x.data == "strings":
                strings.extend(x.children)
            elif x.data in ("over", "from_dtype"):
                fields[str(x.data)] = str(x.children[0])
            elif x.data == "output":
                strings.append(x.children[0])
            elif x.data == "from_shape":
                fields["from_shape"] = self.expr(x.children[0], loc)
            elif x.data in ("sizes", "dim", "dims", "where", "value", "block", "bits", "order",
                            "group", "parts"):  # fmt: skip
                fields[str(x.data)] = self.expr(x.children[0], loc)
            elif x.data == "reduce_dim":  # a reduction's dim: an arithmetic expression
                fields["dim"] = self.expr(x.children[0], loc)
            elif x.data in ("compute", "to_dtype"):
                fields[str(x.data)] = str(x.children[0])
            elif x.data == "plus_index":
                fields["plus_index"] = True
            elif x.data == "same":
                fields["same"] = True
            else:  # a bare expression child: split's dim/sizes, permute's dims, reshape's to
                fields.setdefault("_exprs", []).append(self.expr(x, loc))
        exprs = fields.pop("_exprs", [])
        if op in ("split", "chunk", "merge") and exprs:  # (`merge ... same` has no dim)
            fields["dim"] = exprs[0]
            if op == "split":
                fields["sizes"] = exprs[1]
        elif op == "permute":
            fields["dims"] = exprs[0]
        elif op == "reshape":
            fields["to_shape"] = exprs[0]
        elif op == "mask":
            fields["size"] = exprs[0]
        n_in = len(strings) if op in ("keep", "drop") else _count_input_strings(t)
        patterns = tuple(self.pattern(s) for s in strings[:n_in])
        outputs = tuple(self.template(s) for s in strings[n_in:])
        if op in ("add", "sub", "mul") and n_in > 1 and not outputs:
            # One tensor may keep its name; the sum or product of several has none to keep.
            syntax_error(
                self.text,
                loc,
                f"`{op}` of {n_in} tensors needs an output name",
                f'e.g. {op} {", ".join(strings[:n_in])} -> "name"',
            )
        rule_op: A.RuleOp = op  # type: ignore[assignment]  # the grammar's rule names
        return A.Rule(
            op=rule_op, optional=optional, patterns=patterns, outputs=outputs, loc=loc, **fields
        )


# The rules whose patterns come as a list (`strings`) before the output.
MULTI_INPUT = frozenset({"merge", "stack", "add", "sub", "mul", "matmul", "gather", "lookup"})


def _count_input_strings(t: Tree[Any]) -> int:
    """Input patterns of a rule: merge/stack and the rules of several tensors (add, sub, mul,
    matmul, gather, lookup) list them first; others have one."""
    if t.data not in MULTI_INPUT:
        return 1
    for x in t.children:
        if isinstance(x, Tree) and x.data == "strings":
            return len(x.children)
    return 1


def parse_text(text: str, file: str) -> A.Program:
    """Parse mapping source text with the grammar's parser (no cache: ``parse.py`` keeps one);
    MappingSyntaxError on any error."""
    try:
        tree = grammar.parser().parse(text, start="start")
    except UnexpectedInput as exc:
        lark_error(text, file, exc)
    except LarkError as exc:  # pragma: no cover - grammar bugs only
        syntax_error(text, A.Loc(file, 1, 1), f"cannot parse: {exc}")
    b = _Builder(text, file)
    header: Any = tree.children[0]
    digits = str(header.children[0])
    # int() refuses over 4300 digits (ValueError); no version needs more than a few.
    version = int(digits) if len(digits) <= MAX_INT_DIGITS else LANGUAGE_VERSION + 1
    if version != LANGUAGE_VERSION:
        syntax_error(
            text,
            b.loc(header),
            f"unsupported language version {digits if len(digits) <= 20 else digits[:20] + '...'}",
            f"this weightmap reads `weightmap {LANGUAGE_VERSION}`",
        )
    return A.Program(version=version, stmts=b.stmts(tree.children[1:]), file=file)
