"""Mappings: loading a program (from text, a file or a preset), its params, and inversion.

A preset is a file ``mappings/<name>.wm`` shipped with weightmap. ``include "name"`` splices
another program's statements in place: a bare name is a preset, a name with a ``/`` or ending
in ``.wm`` is a file relative to the including file (or to the working directory for text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightmap import _ast as A
from weightmap._dtypes import TensorSpec
from weightmap._expr import (
    TENSOR_NAMES,
    WORK_LIMIT,
    EvalError,
    Scope,
    compile_expr,
    resolve_dtype,
)
from weightmap._parse import parse_program
from weightmap._plan import Plan
from weightmap._resources import data_dir
from weightmap.errors import MappingError

__all__ = ["PRESET_SUFFIX", "Mapping", "load_mapping", "load_preset", "preset_names"]

PRESET_SUFFIX = ".wm"


@dataclass(frozen=True, eq=False)
class Mapping:
    """A parsed, include-resolved mapping program.

    ``text`` is the program's source (for an inverse, generated source that parses back to it);
    ``param_defaults`` are the declared params with their default values.

    >>> m = load_mapping('weightmap 1\\nparam prefix = "model"\\nkeep "**"')
    >>> m.param_defaults
    {'prefix': 'model'}
    """

    name: str
    text: str
    program: A.Program
    param_defaults: dict[str, Any]
    param_locs: dict[str, A.Loc]

    def compile(
        self,
        inputs: Sequence[TensorSpec],
        config: dict[str, Any] | None = None,
        *,
        params: dict[str, Any] | None = None,
    ) -> Plan:
        """Compile against headers and config: ``compile_plan(self, ...)``."""
        from weightmap._compile import compile_plan

        return compile_plan(self, inputs, config, params=params)

    def inverse(self) -> Mapping:
        """A mapping that undoes this one, or MappingError naming the rule that cannot be undone.

        See docs/language.md ("Inversion") for which rules invert and how.
        """
        from weightmap._inverse import invert_program
        from weightmap._unparse import unparse

        program = invert_program(self.program)
        text = unparse(program)
        return _from_program(
            f"{self.name} (inverse)", text, parse_program(text, f"{self.name}.inverse")
        )


# A mapping is a few kilobytes; a larger include is a mistake or an attack (`/dev/zero`).
MAX_INCLUDE_BYTES = 1_000_000


def _read_include(path: Path, target: str, loc: A.Loc) -> str:
    try:
        if not path.is_file():
            raise MappingError(f"{loc}: cannot include {target!r}: not a regular file")
        with path.open("rb") as f:
            data = f.read(MAX_INCLUDE_BYTES + 1)
    except OSError as err:
        raise MappingError(f"{loc}: cannot include {target!r}: {err.strerror}") from None
    if len(data) > MAX_INCLUDE_BYTES:
        raise MappingError(
            f"{loc}: cannot include {target!r}: larger than {MAX_INCLUDE_BYTES:,} bytes"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise MappingError(f"{loc}: cannot include {target!r}: not UTF-8 text") from None


def _resolve_includes(
    program: A.Program, base: Path | None, stack: tuple[str, ...]
) -> tuple[A.Stmt, ...]:
    out: list[A.Stmt] = []
    for st in program.stmts:
        if not isinstance(st, A.Include):
            out.append(st)
            continue
        target = st.target
        if "/" in target or target.endswith(PRESET_SUFFIX):
            path = (base or Path.cwd()) / target
            key = str(path.resolve())
            text = _read_include(path, target, st.loc)
            file, sub_base = target, path.parent  # as written: stable in messages
        else:
            key = f"preset:{target}"
            text = _preset_text(target, st.loc)
            file, sub_base = f"{target}{PRESET_SUFFIX}", None
        if key in stack:
            raise MappingError(f"{st.loc}: include cycle: {' -> '.join([*stack, key])}")
        sub = parse_program(text, file)
        out.extend(_resolve_includes(sub, sub_base, (*stack, key)))
    return tuple(out)


def _params(stmts: tuple[A.Stmt, ...]) -> tuple[dict[str, Any], dict[str, A.Loc]]:
    values: dict[str, Any] = {}
    locs: dict[str, A.Loc] = {}
    problems = []
    # One work budget for all defaults: each may build values up to the limit, and a chain
    # of `param b = a + a` lines would otherwise grow memory far beyond the program's size.
    budget = [WORK_LIMIT]
    for st in stmts:
        if not isinstance(st, A.Param):
            continue
        if st.name in values:
            problems.append(
                f"{st.loc}: param {st.name!r} is declared twice (first at {locs[st.name]})"
            )
            continue
        if st.name in TENSOR_NAMES or resolve_dtype(st.name):
            problems.append(f"{st.loc}: param {st.name!r} would hide a built-in name; rename it")
            continue
        try:
            values[st.name] = compile_expr(st.default)(Scope(dict(values), budget=budget))
        except EvalError as err:
            problems.append(f"{err.loc}: param default: {err.message} (defaults are constants)")
            continue
        locs[st.name] = st.loc
    if problems:
        raise MappingError("\n".join(problems))
    return values, locs


def _from_program(name: str, text: str, program: A.Program, base: Path | None = None) -> Mapping:
    stmts = _resolve_includes(program, base, (name,))
    program = A.Program(version=program.version, stmts=stmts, file=program.file)
    values, locs = _params(stmts)
    return Mapping(name=name, text=text, program=program, param_defaults=values, param_locs=locs)


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # too long for a file name, or a NUL byte: program text
        return False


def load_mapping(path_or_text: str | Path, *, name: str | None = None) -> Mapping:
    """Load a mapping from a file path or from source text.

    A :class:`~pathlib.Path`, or a one-line string naming an existing file, is read from disk;
    any other string is the program itself. ``name`` labels errors and plans (default: the
    file name, or ``<string>``).
    """
    if isinstance(path_or_text, Path) or (
        "\n" not in path_or_text
        and not path_or_text.lstrip().startswith("weightmap")
        and (_is_file(path_or_text) or path_or_text.endswith(PRESET_SUFFIX))
    ):
        path = Path(path_or_text)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise MappingError(f"cannot read mapping {str(path)!r}: {err.strerror}") from None
        label = name or str(path)
        return _from_program(label, text, parse_program(text, label), path.parent)
    label = name or "<string>"
    text = str(path_or_text)
    return _from_program(label, text, parse_program(text, label))


def preset_names() -> list[str]:
    """The names of the presets shipped with weightmap, sorted."""
    try:
        folder = data_dir("mappings")
    except FileNotFoundError:
        return []
    return sorted(
        p.name[: -len(PRESET_SUFFIX)] for p in folder.iterdir() if p.name.endswith(PRESET_SUFFIX)
    )


def _preset_text(name: str, loc: A.Loc | None = None) -> str:
    where = f"{loc}: " if loc else ""
    if not name or not all(ch.isalnum() or ch in "-_" for ch in name):
        raise MappingError(f"{where}bad preset name {name!r}")
    try:
        return data_dir("mappings").joinpath(name + PRESET_SUFFIX).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        known = ", ".join(preset_names()) or "none"
        raise MappingError(f"{where}no preset named {name!r} (presets: {known})") from None


def load_preset(name: str) -> Mapping:
    """Load the preset ``mappings/<name>.wm``; MappingError listing the presets if unknown."""
    text = _preset_text(name)
    return _from_program(name, text, parse_program(text, f"{name}{PRESET_SUFFIX}"))
