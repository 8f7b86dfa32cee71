"""The mapping language's syntax tree: immutable values with source locations.

The parser (``syntax.py``) builds these from text; the compiler (``compile.py``) reads them;
``unparse.py`` writes them back as text (used by ``invert``). Every node carries a
:class:`Loc` so that any later error can point at the rule that caused it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal, Union

# Loc lives with the errors that carry it, so that errors.py imports nothing above it.
from weightmap.errors import Loc

__all__ = [
    "Alt",
    "Attr",
    "BinOp",
    "Call",
    "Capture",
    "CfgDelete",
    "CfgIf",
    "CfgLift",
    "CfgMove",
    "CfgNest",
    "CfgSet",
    "CfgStmt",
    "Comp",
    "ConfigBlock",
    "ConfigFrom",
    "ConfigRef",
    "DictExpr",
    "Exists",
    "Expr",
    "FilePattern",
    "FileRule",
    "FilesBlock",
    "Glob",
    "If",
    "IfExp",
    "Include",
    "Index",
    "InputDecl",
    "ListExpr",
    "Lit",
    "Loc",
    "Name",
    "OutputDecl",
    "Param",
    "Pattern",
    "Program",
    "Require",
    "Rule",
    "Stmt",
    "Template",
    "Unary",
    "Unmatched",
    "Warn",
]


NOWHERE = Loc("<generated>", 0, 0)

# ---------------------------------------------------------------- expressions


@dataclass(frozen=True, kw_only=True)
class Lit:
    """A literal: int, float, string, bool or null (None)."""

    value: int | float | str | bool | None
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Name:
    """A bare name: a capture, a tensor property, a parameter, a local or a dtype alias."""

    id: str
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class ConfigRef:
    """The word ``config``: the whole config object."""

    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Attr:
    """``obj.name``: a field of a config object."""

    obj: Expr
    name: str
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Index:
    """``obj[index]``: a list element or an object field by string key."""

    obj: Expr
    index: Expr
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Call:
    """``func(args)``: one of the built-in functions (see ``expr.FUNCTIONS``)."""

    func: str
    args: tuple[Expr, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Unary:
    """``-x`` or ``not x``."""

    op: Literal["-", "not"]
    operand: Expr
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class BinOp:
    """A binary operator: arithmetic, comparison, ``in``/``not in``, ``and``/``or``."""

    op: str
    left: Expr
    right: Expr
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class IfExp:
    """``then if cond else orelse``."""

    cond: Expr
    then: Expr
    orelse: Expr
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class ListExpr:
    """``[a, b, c]``."""

    items: tuple[Expr, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class DictExpr:
    """``{"key": value, ...}``: an object literal for config values."""

    items: tuple[tuple[str, Expr], ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Comp:
    """``[elt for var in iterable if cond]``."""

    elt: Expr
    var: str
    iterable: Expr
    cond: Expr | None
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Exists:
    """``exists "pattern"``: true when at least one input tensor matches the pattern.

    ``exists file "pattern"`` (a :class:`FilePattern`): a side file carried from the input
    folder matches it.
    """

    pattern: Pattern
    loc: Loc = field(default=NOWHERE, compare=False)


Expr = Union[  # noqa: UP007  # an alias spelled the same way as the others below
    Lit, Name, ConfigRef, Attr, Index, Call, Unary, BinOp, IfExp, ListExpr, DictExpr, Comp, Exists
]

# ---------------------------------------------------------------- patterns and templates

CaptureKind = Literal["seg", "multi", "int", "alt"]


@dataclass(frozen=True)
class Capture:
    """A named hole in a pattern: ``{x}`` seg, ``{x*}`` multi, ``{x:int}``, ``{x:a,b}`` alt."""

    name: str
    kind: CaptureKind
    alts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Alt:
    """An anonymous alternative ``{a,b}``: matches one of the words, captured by no name."""

    alts: tuple[str, ...]


@dataclass(frozen=True)
class Glob:
    """``*`` (within one dotted segment) or ``**`` (across segments)."""

    multi: bool


PatPart = Union[str, Capture, Alt, Glob]  # noqa: UP007


@dataclass(frozen=True, kw_only=True)
class Pattern:
    """A tensor-name pattern; ``parts`` alternates literal text and holes."""

    text: str
    parts: tuple[PatPart, ...]
    loc: Loc = field(default=NOWHERE, compare=False)
    # The declared inputs (``input NAME``) whose tensors this pattern does not see: every one,
    # for a pattern that does not start with ``NAME:`` (mapping.py sets it once the program's
    # inputs are known), so that `cast "**"` casts the main input's tensors, not an adapter's.
    others: tuple[str, ...] = ()

    @property
    def is_literal(self) -> bool:
        """True when the pattern names exactly one tensor (no holes)."""
        return all(isinstance(p, str) for p in self.parts)

    @property
    def captures(self) -> tuple[Capture, ...]:
        """The named captures, in order of appearance."""
        return tuple(p for p in self.parts if isinstance(p, Capture))


@dataclass(frozen=True, kw_only=True)
class FilePattern(Pattern):
    """A side-file pattern (``"*.md"``, ``"tokenizer/{f}"``): the syntax of tensor patterns,
    over paths: ``*`` and ``{x}`` stay within one path component (they stop at ``/``, not at
    dots), ``**`` and ``{x*}`` cross them."""


@dataclass(frozen=True, kw_only=True)
class Template:
    """An output name or message: literal text and ``{expression}`` holes."""

    text: str
    parts: tuple[str | Expr, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


# ---------------------------------------------------------------- statements


@dataclass(frozen=True, kw_only=True)
class Param:
    """``param name = default``."""

    name: str
    default: Expr
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Include:
    """``include "preset-or-file"``: the named program's statements are spliced in here."""

    target: str
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Unmatched:
    """``unmatched error|keep|drop``: the fate of inputs that no rule consumed."""

    policy: Literal["error", "keep", "drop"]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Require:
    """``require cond else "message"``: the mapping refuses inputs where cond is false."""

    cond: Expr
    message: Template
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class Warn:
    """``warn if cond "message"``: a non-fatal message recorded in the plan."""

    cond: Expr | None
    message: Template
    loc: Loc = field(default=NOWHERE, compare=False)


RuleOp = Literal[
    "rename",
    "keep",
    "drop",
    "copy",
    "split",
    "chunk",
    "merge",
    "stack",
    "unstack",
    "transpose",
    "permute",
    "reshape",
    "cast",
    "add",
    "sub",
    "mul",
    "quantize",
    "mask",
    "matmul",
    "gather",
    "lookup",
    "unpack",
    "pack",
    "round",
    "floor",
    "ceil",
    "clamp",
    "amax",
    "amin",
    "sum",
]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A tensor rule. Which optional fields are set depends on ``op``.

    ``dim``: split/chunk/merge/stack/unstack; ``sizes``: split/merge; ``over``: stack;
    ``dims``: transpose/permute; ``from_shape``/``to_shape``: reshape;
    ``from_dtype``/``to_dtype``: cast (``to_dtype`` also the result of add/mul/quantize);
    ``value``, ``block``, ``compute``: add/sub/mul (``block`` also quantize, ``compute`` also
    matmul); ``size``, ``plus_index``: mask; ``dim`` also gather/unpack/pack, with ``bits`` and
    ``order`` for unpack/pack; ``value`` also clamp (``[low, high]``); ``dim``, ``group`` the
    reductions (amax, amin, sum; ``compute`` and ``to_dtype`` also sum); ``parts``: a chunk
    into a number of pieces named by one template's new index (``chunk ... into n``); ``same``:
    a merge of members that must hold the same bytes (``merge ... same``), written once.
    """

    op: RuleOp
    optional: bool
    patterns: tuple[Pattern, ...]
    outputs: tuple[Template, ...]
    where: Expr | None = None
    dim: Expr | None = None
    sizes: Expr | None = None
    over: str | None = None
    dims: Expr | None = None
    from_shape: Expr | None = None
    to_shape: Expr | None = None
    from_dtype: str | None = None
    to_dtype: str | None = None
    value: Expr | None = None
    block: Expr | None = None
    compute: str | None = None
    size: Expr | None = None
    plus_index: bool = False
    bits: Expr | None = None
    order: Expr | None = None
    group: Expr | None = None
    parts: Expr | None = None
    same: bool = False
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class CfgSet:
    """``path = value``: set a field, creating intermediate objects."""

    path: tuple[str, ...]
    value: Expr
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class CfgDelete:
    """``delete a, b.c [if cond]``; ``delete?`` tolerates absent fields."""

    paths: tuple[tuple[str, ...], ...]
    optional: bool
    cond: Expr | None
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class CfgMove:
    """``move a.b -> c``: rename a field (the destination must be free)."""

    src: tuple[str, ...]
    dst: tuple[str, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class CfgLift:
    """``lift obj [overwrite]``: move the fields of a nested object to the top level."""

    path: tuple[str, ...]
    overwrite: bool
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class CfgNest:
    """``nest obj [except a, b]``: move the fields beside ``obj`` into it (the inverse of lift)."""

    path: tuple[str, ...]
    keep: tuple[str, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class CfgIf:
    """``if cond { ... } else { ... }`` inside a config block."""

    cond: Expr
    then: tuple[CfgStmt, ...]
    orelse: tuple[CfgStmt, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


CfgStmt = Union[CfgSet, CfgDelete, CfgMove, CfgLift, CfgNest, CfgIf]  # noqa: UP007


@dataclass(frozen=True, kw_only=True)
class ConfigBlock:
    """``config { ... }``: edits applied in order to the output config."""

    stmts: tuple[CfgStmt, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class If:
    """``if cond { ... } else { ... }`` at the top level (cond over params, config, exists)."""

    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class FileRule:
    """A side-file statement inside ``files { }``.

    ``drop[?] PATTERNS``; ``rename[?] PATTERN -> TEMPLATE``; ``add "NAME" = VALUE`` (a string
    is written as text, any other value as JSON).
    """

    op: Literal["drop", "rename", "add"]
    optional: bool
    patterns: tuple[FilePattern, ...] = ()
    output: Template | None = None
    name: str | None = None
    value: Expr | None = None
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class FilesBlock:
    """``files { ... }``: what happens to the side files carried into the output."""

    stmts: tuple[FileRule, ...]
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class ConfigFrom:
    """``config from "params.json"``: the JSON file read as the input config."""

    file: str
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class InputDecl:
    """``input NAME [files "PATTERN"] [config from "FILE"]``: a checkpoint the caller binds.

    Its tensors are named ``NAME:tensor`` in the working set; with ``files``, the input is a
    family (the rank files or folders of one model) whose members' tensors are
    ``NAME:RANK:tensor``, ``RANK`` the integer the pattern's one capture matched.
    """

    name: str
    files: FilePattern | None = None
    config_file: str | None = None
    loc: Loc = field(default=NOWHERE, compare=False)


@dataclass(frozen=True, kw_only=True)
class OutputDecl:
    """``output NAME files "PATTERN" count N``: a family of files written into the output
    folder, one per rank: the output tensors named ``NAME:RANK:tensor`` go into member
    ``RANK`` as ``tensor`` (the pattern's one capture spelled as the rank, zero-padded).
    """

    name: str
    files: FilePattern
    count: Expr
    loc: Loc = field(default=NOWHERE, compare=False)


Stmt = Union[  # noqa: UP007
    Param,
    Include,
    Unmatched,
    Require,
    Warn,
    Rule,
    ConfigBlock,
    If,
    FilesBlock,
    ConfigFrom,
    InputDecl,
    OutputDecl,
]


@dataclass(frozen=True, kw_only=True)
class Program:
    """A parsed mapping file: its language version and statements in order."""

    version: int
    stmts: tuple[Stmt, ...]
    file: str = "<string>"


def reads_names(node: object, names: Collection[str]) -> bool:
    """Whether an expression (or any part of a statement) reads one of ``names`` as a bare
    name: a param, a capture, ``shape``."""
    if isinstance(node, Name):
        return node.id in names
    if isinstance(node, tuple):
        return any(reads_names(n, names) for n in node)
    fields = getattr(node, "__dataclass_fields__", None)
    return fields is not None and any(reads_names(getattr(node, f), names) for f in fields)
