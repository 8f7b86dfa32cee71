"""Syntax errors a person can act on: the line, a caret under the spot, and a hint.

Every syntax error becomes a :class:`MappingSyntaxError` whose message reads::

    file:line:col: what is wrong
        the offending source line
        ^
    hint: what to write instead
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from typing import NoReturn, get_args

from lark import Lark
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from weightmap.errors import MappingSyntaxError
from weightmap.language import ast as A
from weightmap.language import grammar

__all__ = ["CONFIG_KEYWORDS", "STATEMENT_KEYWORDS", "lark_error", "syntax_error"]

STATEMENT_KEYWORDS = [
    *get_args(A.RuleOp),
    "require",
    "warn",
    "param",
    "include",
    "unmatched",
    "config",
    "files",
    "if",
]
CONFIG_KEYWORDS = ("delete", "move", "lift", "nest", "if")
# The words inside statements, for misspellings the lexer splits (`too` reads as `to` + `o`).
INNER_KEYWORDS = ("to", "from", "dim", "dims", "sizes", "over", "where", "else", "when",
                  "except", "overwrite", "exists", "file", "add")  # fmt: skip
_ONE_DIM = ("split", "chunk", "merge", "stack", "unstack")
_DIM_LISTS = ("transpose", "permute")

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def syntax_error(text: str, loc: A.Loc, message: str, hint: str | None = None) -> NoReturn:
    """Raise a MappingSyntaxError showing ``loc``'s line with a caret under its column."""
    lines = text.splitlines()
    out = [f"{loc}: {message}"]
    if 1 <= loc.line <= len(lines):
        src = lines[loc.line - 1].replace("\t", " ")
        out += [f"    {src}", "    " + " " * (max(loc.col, 1) - 1) + "^"]
    if hint:
        out.append(f"hint: {hint}")
    raise MappingSyntaxError("\n".join(out))


_TERMINAL_TEXT = {
    "STRING": "a quoted string",
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "COMP_OP": "a comparison",
    "ADD_OP": "+ or -",
    "MUL_OP": "* // or %",
    "POLICY": "error, keep or drop",
    "OPT": "?",
    "$END": "the end of the file",
}


def _describe_expected(parser: Lark, expected: set[str]) -> str:
    words = set()
    for name in expected:
        if name in _TERMINAL_TEXT:
            words.add(_TERMINAL_TEXT[name])
            continue
        try:
            pattern = parser.get_terminal(name).pattern
        except KeyError:  # pragma: no cover - lark always knows its own terminals
            words.add(name)
            continue
        words.add(f"`{pattern.value}`" if pattern.type == "str" else name)
    if len(words) > 8:
        return ""
    return "; expected " + ", ".join(sorted(words))


def _word_hint(text: str, pos: int) -> str | None:
    """A keyword the lexer took a prefix of (``keeps`` read as ``keep`` + ``s``), or a word
    that belongs to other rules (``dims`` in a merge, ``dim`` in a transpose)."""
    line_start = text.rfind("\n", 0, pos) + 1
    start = pos
    while start > line_start and (text[start - 1].isalnum() or text[start - 1] == "_"):
        start -= 1
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text[line_start:pos])
    keywords = {*STATEMENT_KEYWORDS, *CONFIG_KEYWORDS, *INNER_KEYWORDS}
    if start < pos:  # the error is inside a word: its start was read as a keyword
        whole = re.match(r"[A-Za-z0-9_]+", text[start:])
        prefix = text[start:pos]
        if whole and prefix in keywords:
            return f"`{whole.group()}` is not a keyword here; did you mean `{prefix}`?"
    at = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text[pos:])
    if at is not None and start == pos:
        words.append(at.group())
    if not words:
        return None
    last, first = words[-1], words[0]
    if last == "dims" and first in _ONE_DIM:
        return f"{first} takes one dimension: `dim N` (`dims [a, b]` is for transpose, permute)"
    if last == "dim" and first in _DIM_LISTS:
        return f"{first} takes a list of dimensions: `dims [a, b]`"
    if last not in keywords:
        # A keyword and a letter or two typed on: `too`, `fromm`, not `tokens`.
        split = [k for k in keywords if last.startswith(k) and 0 < len(last) - len(k) <= 2]
        if split:
            return f"did you mean `{max(split, key=len)}`?"
    return None


def _invisible_hint(char: str) -> str | None:
    """A hint for a character that looks like a space or like nothing at all (a no-break
    space pasted from a web page, a zero-width space, a NUL, a BOM), which no other hint fits:
    the line it is on looks right."""
    if len(char) != 1 or char in " \t\n\r":
        return None
    kind = unicodedata.category(char)
    if kind not in ("Zs", "Zl", "Zp", "Cf", "Cc"):
        return None
    name = unicodedata.name(char, "a control character")
    plain = "a line break" if kind in ("Zl", "Zp") else "a plain space"
    return (
        f"U+{ord(char):04X} ({name.lower()}) looks like a space or like nothing, but is not "
        f"one the language reads: delete it, or retype it as {plain}"
    )


def _hint(text: str, pos: int, word: str, expected: set[str]) -> str | None:
    invisible = _invisible_hint(text[pos : pos + 1])
    if invisible is not None:
        return invisible
    hint = _word_hint(text, pos)
    if hint is not None:
        return hint
    rest = text[pos:]
    if rest.startswith("=>"):
        return "the arrow is written `->`"
    if rest.startswith("'"):
        return 'strings are written in double quotes: "..."'
    if rest.startswith('"') and '"' not in rest.split("\n", 1)[0][1:]:
        return "this string is not closed on its line"
    if rest.startswith("=") and "COMP_OP" in expected:
        return "compare with `==`"
    line = text[text.rfind("\n", 0, pos) + 1 : pos]
    if rest.startswith(",") and (m := re.search(r"\b(sizes|dims)\s+([^\[\s][^\n]*)$", line)):
        items = m.group(2) + rest.split("\n", 1)[0].split("->")[0].rstrip()
        return f"a list is written in brackets: `{m.group(1)} [{items}]`"
    if "STRING" in expected and _IDENT.match(word or ""):
        return f'tensor names, patterns and messages are quoted: "{word}"'
    every = [*STATEMENT_KEYWORDS, *CONFIG_KEYWORDS, *INNER_KEYWORDS]
    keywords = [k for k in every if k.upper() in expected]
    if word and keywords:
        close = difflib.get_close_matches(word, keywords, n=1, cutoff=0.6)
        if close:
            return f"did you mean `{close[0]}`?"
    recent = text[:pos].rsplit("\n", 3)[-3:]
    if "LBRACE" in expected and any(re.search(r"\bdelete\b.*\bif\b", x) for x in recent):
        return "a conditional delete is written `delete PATH when CONDITION`"
    if "RBRACE" in expected and not word:
        return "a `{` block is not closed"
    # A misspelt keyword is often taken for a name, so the error comes one word later.
    before = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text[:pos].rsplit("\n", 1)[-1])
    if before:
        close = difflib.get_close_matches(before[-1], every, 1)
        if close and close[0] != before[-1]:
            return f"did you mean `{close[0]}`?"
    return None


_RULE_IF = re.compile(
    r"^[ \t]*(?:" + "|".join(get_args(A.RuleOp)) + r")\b[^\n#]*?[ \t](if)[ \t]+([^\n{]*?)[ \t]*$",
    re.M,
)


def _rule_if(text: str, file: str, pos: int) -> None:
    """A rule with ``if CONDITION`` on its line (`cast "**" to f16 if dtype == bf16`): read
    as the rule, then an ``if`` block without its ``{``, so the error would come on the next
    line. Said at the ``if``, with the rule as it is written."""
    start = text.rfind("\n", 0, max(0, text.rfind("\n", 0, pos))) + 1  # this line, the last
    for m in _RULE_IF.finditer(text, start, pos):
        line = text.count("\n", 0, m.start(1)) + 1
        col = m.start(1) - (text.rfind("\n", 0, m.start(1)) + 1) + 1
        rule = text[m.start(0) : m.start(1)].strip()
        syntax_error(
            text,
            A.Loc(file, line, col),
            "a rule's condition is written with `where`, not `if`",
            f"did you mean `where`? `{rule} where {m.group(2)}` (`if CONDITION {{ ... }}` is a "
            "block of rules)",
        )


def lark_error(text: str, file: str, exc: UnexpectedInput) -> NoReturn:
    parser = grammar.parser()
    line, col = max(exc.line, 1), max(exc.column, 1)
    pos = exc.pos_in_stream if exc.pos_in_stream is not None else len(text)
    expected: set[str] = set()
    if isinstance(exc, UnexpectedToken):
        expected = set(exc.expected)
        tok = exc.token
        word = str(tok) if tok.type != "$END" else ""
        what = "end of file" if tok.type == "$END" else f"`{tok}`"
        if tok.type == "$END":
            body = text.rstrip()
            line = body.count("\n") + 1
            col = len(body.rsplit("\n", 1)[-1]) + 1
            pos = len(text)
    elif isinstance(exc, UnexpectedCharacters):
        expected = set(exc.allowed or ())
        word = text[pos : pos + 1]
        what = f"character {word!r}"
    else:  # UnexpectedEOF
        expected = set(getattr(exc, "expected", ()) or ())
        word, what = "", "end of file"
    if "LBRACE" in expected:
        _rule_if(text, file, pos)
    loc = A.Loc(file, line, col)
    if line == 1 and col == 1 and not text.lstrip().startswith("weightmap"):
        syntax_error(
            text, loc, "a mapping must start with its language version", "first line: weightmap 1"
        )
    message = f"unexpected {what}{_describe_expected(parser, expected)}"
    syntax_error(text, loc, message, _hint(text, pos, word, expected))
