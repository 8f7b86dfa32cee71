"""Side files: the ``files { }`` blocks applied to the input folder's other files.

By default every side file of the input folder (``inputs/sidefiles.py`` says which) goes into
the output under its own name. Blocks apply in order, statement by statement, to that set:

- ``drop PATTERNS`` removes the files that match (``drop?``: matching nothing is fine);
- ``rename PATTERN -> TEMPLATE`` gives each match a new name from its captures;
- ``add "NAME" = VALUE`` writes a new file: a string as UTF-8 text, any other value as JSON.

Every problem is reported, as for tensor rules: a pattern that matches nothing, two files
given one name, a name the output cannot hold. When side files are not carried
(``side_files=False``), no block applies and ``exists file`` is false.

A mapping is data from a stranger, so the names it gives (by ``add`` or ``rename``) keep the
output folder safe to enter and open (docs/safety.md, "What a mapping may write"): no hidden
component anywhere in the path (``.git/config``, ``tok/.git/config``, ``.envrc``), none of the
other names a tool acts on when it enters or opens a folder, and no code file that loaders run
(``*.py``: see ``plan/parts.py``) unless the caller allows code files. Files carried under their
own name are the input's, downloaded by the user: they are carried, code or not, and the plan
lists the code files among them.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from weightmap.compiler.pattern import compile_pattern
from weightmap.format.text import is_utf8, json_problem
from weightmap.inputs.sidefiles import FileSpec, bad_file_name, replaced_reason
from weightmap.language import ast as A
from weightmap.language.expr import compile_expr, render
from weightmap.language.values import WORK_LIMIT, EvalError, Scope
from weightmap.plan.parts import is_code_file
from weightmap.plan.plan import SideFile

__all__ = ["apply_files_blocks", "file_exists", "written_name_problem"]

Report = Callable[[A.Loc, str], None]


def file_exists(files: Iterable[FileSpec] | None, pattern: A.Pattern) -> bool:
    """``exists file "pattern"``: a carried side file of the input matches."""
    rx = compile_pattern(pattern)
    return any(rx.fullmatch(f.name) for f in files or ())


# Names that a tool acts on when it enters, opens or shows a folder, other than hidden ones
# (`.git`, `.hg`, `.svn`, `.envrc`, `.vscode`, `.idea`, `.direnv`...: every hidden name is
# refused), compared as Windows and macOS file systems compare names: case folded, trailing
# dots and spaces dropped.
_ACTIVE_NAMES = {
    "__pycache__": "Python imports the compiled modules in it in place of the .py files beside it",
    "git~1": "Windows file systems give `.git` this short name",
    "desktop.ini": "Windows Explorer reads it when it shows the folder",
    "autorun.inf": "Windows reads it when it mounts a drive",
}


# Work units per side file of looking for a close match to a pattern that matched none: difflib's
# comparison of two names costs about twenty pattern matches.
_HINT_COST = 20


def _folded(name: str) -> str:
    """``name`` as Windows and macOS file systems compare it: case folded, each component's
    trailing dots and spaces dropped (a folder copied there holds one file of all such names)."""
    return "/".join(part.rstrip(". ").casefold() for part in name.split("/"))


def written_name_problem(name: str, *, allow_code: bool, kept: bool = False) -> str | None:
    """Why a mapping may not give a side file the name ``name``, or None if it may.

    ``kept``: the file keeps the name it had in the input (a rename onto itself), which a
    code file may do without ``allow_code``.

    >>> written_name_problem("tok/.git/config", allow_code=False)[:36]
    "has the hidden component '.git', and"
    """
    for part in name.split("/"):
        if part.startswith("."):
            return (
                f"has the hidden component {part!r}, and a mapping never writes a hidden file or "
                "folder (`.git/config` would make the output a repository whose settings run "
                "a command on the next `git status`): choose a name without a leading dot"
            )
        why = _ACTIVE_NAMES.get(part.rstrip(". ").casefold())
        if why is not None:
            return (
                f"has the component {part!r}, which a mapping never writes ({why}): choose "
                "another name"
            )
    folded = _folded(name)
    if folded != name and replaced_reason(folded) in ("config", "weights", "index"):
        # `Config.json` beside the written config.json: copied to Windows or macOS, one of the
        # two remains, and a config the plan's diff never showed may be the one loaded.
        return (
            f"is {folded!r} where case and trailing dots and spaces are ignored (Windows, "
            "macOS), a file the conversion writes itself: choose another name"
        )
    if is_code_file(name) and not (allow_code or kept):
        return (
            "is a code file that loaders run (transformers' trust_remote_code imports *.py); "
            "a mapping adds or renames into one only when the caller allows it: "
            "--allow-code-files, or allow_code=True"
        )
    return None


@dataclass
class _Entry:
    source: str | None
    size: int
    text: str | None = None
    origin: A.Loc | None = None


class _Files:
    def __init__(
        self, files: Iterable[FileSpec], scope: Scope, report: Report, allow_code: bool
    ) -> None:
        self.set = {f.name: _Entry(f.name, f.size) for f in files}
        self.scope = scope
        self.report = report
        self.allow_code = allow_code
        self.spent = False

    def spend(self, loc: A.Loc, work: int) -> bool:
        """Charge ``work`` to the mapping's one budget; False once it is spent (said once).

        Matching a pattern tries every side file (up to 10,000), so a mapping of many short
        `drop?` statements would otherwise cost its size times the folder's, unbounded.
        """
        if self.spent:
            return False
        try:
            self.scope.charge(work, loc)
        except EvalError:
            self.spent = True
            self.report(
                loc,
                f"files: the mapping's work budget ({WORK_LIMIT:,} units, shared by its "
                "conditions, checks, config and files blocks) is spent: each pattern costs one "
                f"unit per side file it is tried on ({len(self.set):,} here); use fewer "
                "statements, or patterns that match more files at once",
            )
            return False
        return True

    def matches(self, p: A.Pattern) -> list[tuple[str, dict[str, object]]]:
        rx = compile_pattern(p)
        found = []
        for name in self.set:
            m = rx.fullmatch(name)
            if m is not None:
                caps = {k: v for k, v in m.groupdict().items() if not k.startswith("_alt")}
                found.append((name, caps))
        return found

    def nothing(self, rule: A.FileRule, p: A.Pattern) -> None:
        if rule.optional:
            return
        # A close match is looked for at a cost of its own (difflib compares each name).
        hunt = self.spend(p.loc, _HINT_COST * len(self.set))
        close = difflib.get_close_matches(p.text, list(self.set), n=1) if hunt else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        self.report(
            p.loc,
            f'files: pattern "{p.text}" matches no side file (write `{rule.op}?` if that is '
            f"expected){hint}",
        )

    def apply(self, rule: A.FileRule) -> None:
        if rule.op == "add":
            self.add(rule)
            return
        for p in rule.patterns:
            if not self.spend(p.loc, len(self.set)):
                return
            found = self.matches(p)
            if not found:
                self.nothing(rule, p)
            for name, caps in found:
                entry = self.set.pop(name)
                if rule.op == "rename":
                    self.rename(rule, name, caps, entry)

    def rename(self, rule: A.FileRule, name: str, caps: dict[str, object], entry: _Entry) -> None:
        assert rule.output is not None
        s = self.scope
        scope = Scope(s.params, s.config, caps, None, s.exists, budget=s.budget)
        try:
            new = render(rule.output, scope)
        except EvalError as err:
            self.report(err.loc, err.message)
            self.set[name] = entry
            return
        entry.origin = rule.loc
        self.put(rule, new, entry, f"renamed from {name!r}")

    def add(self, rule: A.FileRule) -> None:
        assert rule.name is not None and rule.value is not None
        s = self.scope
        scope = Scope(s.params, s.config, {}, None, s.exists, budget=s.budget)
        try:
            value = compile_expr(rule.value)(scope)
            # The file written counts against the mapping's budget as any built value does:
            # `add "f" = config`, statement after statement, would write the config each time.
            scope.charge_value(value, rule.value.loc)
        except EvalError as err:
            self.report(err.loc, err.message)
            return
        if isinstance(value, str) and not is_utf8(value):
            # Said when planning, not when the file is written after every tensor (json_problem
            # says the same of a string inside a JSON value).
            self.report(
                rule.loc,
                f"files: the value of {rule.name[:80]!r} holds a lone surrogate, which is not "
                "UTF-8",
            )
            return
        if isinstance(value, str):
            text = value
        elif (why := json_problem(value)) is not None:
            self.report(rule.loc, f"files: the value of {rule.name!r} {why}")
            return
        else:
            text = json.dumps(value, indent=2, ensure_ascii=False) + "\n"
        size = len(text.encode("utf-8"))
        self.put(rule, rule.name, _Entry(None, size, text, rule.loc), "added")

    def put(self, rule: A.FileRule, name: str, entry: _Entry, how: str) -> None:
        why = bad_file_name(name) if is_utf8(name) else "holds a lone surrogate escape"
        if why is None:
            kept = entry.source == name
            why = written_name_problem(name, allow_code=self.allow_code, kept=kept)
        if why is not None:
            self.report(rule.loc, f"files: side file name {name[:80]!r} ({how}) {why}")
        elif name in self.set:
            self.report(
                rule.loc,
                f"files: {name!r} ({how}) is already a side file; drop it first (`drop?`)",
            )
        else:
            self.set[name] = entry

    def same_folded(self, names: list[str]) -> None:
        """Report names a mapping gave that differ from another side file's only as
        Windows and macOS ignore (``README.MD`` beside ``README.md``): copied there, the
        folder keeps one of them. The input's own names are carried as they are."""
        groups: dict[str, list[str]] = {}
        for n in names:
            groups.setdefault(_folded(n), []).append(n)
        for same in groups.values():
            given = [loc for n in same if (loc := self.set[n].origin) is not None]
            if len(same) > 1 and given:
                shown = ", ".join(repr(n[:80]) for n in same)
                self.report(
                    given[0],
                    f"files: {shown} differ only in case or trailing dots and spaces, and are "
                    "one file on Windows and macOS (a copy of the output there keeps one): "
                    "choose names that differ otherwise",
                )

    def result(self, report_at: A.Loc) -> tuple[SideFile, ...]:
        names = sorted(self.set)
        folders = {"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)}
        for clash in sorted(folders & set(names)):
            self.report(report_at, f"files: {clash!r} is both a file and a folder")
        self.same_folded(names)
        return tuple(
            SideFile(name=n, size=e.size, source=e.source, text=e.text, origin=e.origin)
            for n in names
            for e in (self.set[n],)
        )


def apply_files_blocks(
    blocks: list[A.FilesBlock],
    files: Iterable[FileSpec] | None,
    scope: Scope,
    report: Report,
    where: A.Loc,
    *,
    allow_code: bool = False,
) -> tuple[SideFile, ...]:
    """The output's side files: the input's ``files`` after every block, sorted by name.

    ``files`` None means side files are not carried: nothing is, and no block applies.
    ``allow_code``: a block may add or rename into code files (see the module docstring).
    ``scope``'s work budget is spent, the mapping's one budget (see ``compile.py``).
    """
    if files is None:
        return ()
    state = _Files(files, scope, report, allow_code)
    for block in blocks:
        for rule in block.stmts:
            state.apply(rule)
    return state.result(blocks[-1].loc if blocks else where)
