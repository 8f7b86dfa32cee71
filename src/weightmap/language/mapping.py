"""Mappings: loading a program (from text, a file or a preset) and resolving its params.

A preset is a file ``mappings/<name>.wm`` shipped with weightmap. ``include "name"`` splices
another program's statements in place: a bare name is a preset, a name with a ``/`` or ending
in ``.wm`` is a file relative to the including file (or to the working directory for text).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from weightmap.errors import MappingError, MappingSyntaxError
from weightmap.format.names import CONFIG_NAME
from weightmap.language import ast as A
from weightmap.language.expr import closest, compile_expr, did_you_mean, resolve_dtype
from weightmap.language.parse import parse_program
from weightmap.language.resources import PRESET_SUFFIX, data_dir, preset_names
from weightmap.language.values import TENSOR_NAMES, WORK_LIMIT, EvalError, Scope

__all__ = [
    "PRESET_SUFFIX",
    "Mapping",
    "from_program",
    "load_mapping",
    "load_preset",
    "preset_names",
    "resolve_mapping",
]


@dataclass(frozen=True, eq=False)
class Mapping:
    """A parsed, include-resolved mapping program.

    ``text`` is the program's source (for an inverse, generated source that parses back to it);
    ``param_defaults`` are the declared params with their default values. A mapping is a value:
    compile it with :func:`weightmap.compile` (or the compiler's ``compile_plan``), invert it
    with :func:`weightmap.invert`.

    >>> m = load_mapping('weightmap 1\\nparam prefix = "model"\\nkeep "**"')
    >>> m.param_defaults
    {'prefix': 'model'}
    """

    name: str
    text: str
    program: A.Program
    param_defaults: dict[str, Any]
    param_locs: dict[str, A.Loc]

    @property
    def config_file(self) -> str:
        """The JSON file of the input folder read as its config: ``config.json`` unless a
        ``config from "params.json"`` statement names another."""
        for st in self.program.stmts:
            if isinstance(st, A.ConfigFrom):
                return st.file
        return CONFIG_NAME

    @property
    def inputs(self) -> tuple[A.InputDecl, ...]:
        """The inputs the mapping declares besides the main one (``input NAME ...``), which
        the caller binds (``remap(..., inputs={"adapter": path})``, ``--input NAME=PATH``)."""
        return tuple(st for st in self.program.stmts if isinstance(st, A.InputDecl))

    @property
    def outputs(self) -> tuple[A.OutputDecl, ...]:
        """The families of files the mapping writes besides the main checkpoint (``output
        NAME files "PATTERN" count N``): the tensors it names ``NAME:RANK:tensor``."""
        return tuple(st for st in self.program.stmts if isinstance(st, A.OutputDecl))


# A mapping is a few kilobytes. Everything parsed for one mapping (its own text and every
# include, counted each time it is expanded) is bounded: parsing 1 MB takes seconds and about
# 200 MB, and a larger file is a mistake or an attack (`/dev/zero`, an include fan-out).
MAX_MAPPING_BYTES = 1_000_000
MAX_INCLUDE_BYTES = MAX_MAPPING_BYTES
# Include expansions in one mapping, through every level (30 files that each include the next
# twice would otherwise expand 2**30 times, while cycles alone are caught).
MAX_INCLUDES = 100
# String literals cannot span lines, so this bounds them: matching a string token costs the
# parser about 200 bytes per character.
MAX_LINE_CHARS = 100_000


@dataclass
class _Spent:
    """What one mapping has spent of the bounds above, its includes included."""

    includes: int = 0
    bytes: int = 0


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _read_source(path: Path, what: str) -> str:
    """A mapping file's text: a regular file of at most MAX_MAPPING_BYTES of UTF-8.

    Opened without blocking and checked on the open descriptor, so a FIFO (or a file swapped
    for one) is refused instead of hanging the reader.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:  # a link to itself, or a ring of links: it names nothing
            raise MappingError(
                f"{what}: it is a symbolic link in a loop of links ({err.strerror}); fix or "
                "remove the link"
            ) from None
        raise MappingError(f"{what}: {err.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise MappingError(f"{what}: not a regular file (it is a {_kind(mode)})")
        chunks = []
        left = MAX_MAPPING_BYTES + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as err:
        raise MappingError(f"{what}: {err.strerror}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_MAPPING_BYTES:
        raise MappingError(
            f"{what}: larger than {MAX_MAPPING_BYTES:,} bytes (a mapping is at most that)"
        )
    try:
        # utf-8-sig: a byte order mark, which some editors put first in every file they save,
        # is no part of the text (the file would otherwise not start with `weightmap 1`).
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise MappingError(f"{what}: not UTF-8 text") from None


def _check_size(text: str, file: str) -> int:
    """Refuse program text over the bounds before the parser sees it; its size in bytes."""
    size = len(text) if len(text) > MAX_MAPPING_BYTES else len(text.encode("utf-8", "replace"))
    if size > MAX_MAPPING_BYTES:
        raise MappingError(
            f"{file}: the mapping is {size:,} bytes; a mapping is at most "
            f"{MAX_MAPPING_BYTES:,} bytes, includes included"
        )
    for number, line in enumerate(text.split("\n"), 1):
        if len(line) > MAX_LINE_CHARS:
            # Not quoted: a huge line is no use in a message.
            raise MappingSyntaxError(
                f"{file}:{number}:1: this line is {len(line):,} characters long; a mapping line "
                f"is at most {MAX_LINE_CHARS:,} (no tensor name or message needs more)"
            )
    return size


_VERSION_LINE = re.compile(r"\A(?:[ \t\r\n]*#[^\n]*\n)*[ \t\r\n]*weightmap[ \t]")


def _check_is_mapping(text: str, file: str, what: str | None = None) -> None:
    """Refuse a file that is not a mapping before anything could quote it back.

    Syntax errors show the offending line; for a file that is not a mapping at all (an
    ``include "/proc/self/environ"``, a ``--mapping`` pointing at a key file) that line would
    be someone's secret in a log. Such files are refused by their first line alone, with a
    syntax error at 1:1 that never contains their content.
    """
    if not _VERSION_LINE.match(text):
        where = f"{what}: " if what else ""
        raise MappingSyntaxError(
            f"{where}{file}:1:1: a mapping must start with its language version, and this file "
            "does not: it is not a weightmap mapping (its content is not shown)\n"
            "hint: first line: weightmap 1"
        )


def _read_include(path: Path, target: str, loc: A.Loc) -> str:
    what = f"{loc}: cannot include {target!r}"
    text = _read_source(path, what)
    _check_is_mapping(text, target, what)
    return text


def _resolve_includes(
    program: A.Program, base: Path | None, stack: tuple[str, ...], spent: _Spent
) -> tuple[A.Stmt, ...]:
    out: list[A.Stmt] = []
    for st in program.stmts:
        if not isinstance(st, A.Include):
            out.append(st)
            continue
        spent.includes += 1
        if spent.includes > MAX_INCLUDES:
            raise MappingError(
                f"{st.loc}: more than {MAX_INCLUDES} includes (counted each time a file is "
                "expanded, through every level)"
            )
        target = st.target
        if "/" in target or target.endswith(PRESET_SUFFIX):
            path = (base or Path.cwd()) / target
            text = _read_include(path, target, st.loc)
            try:
                key = str(path.resolve())
            except (OSError, RuntimeError):  # made a loop of links since it was read
                raise MappingError(
                    f"{st.loc}: cannot include {target!r}: it became a loop of symbolic links "
                    "while it was read; fix the link"
                ) from None
            file, sub_base = target, path.parent  # as written: stable in messages
        else:
            key = f"preset:{target}"
            text = _preset_text(target, st.loc)
            file, sub_base = f"{target}{PRESET_SUFFIX}", None
        if key in stack:
            raise MappingError(f"{st.loc}: include cycle: {' -> '.join([*stack, key])}")
        spent.bytes += _check_size(text, file)
        if spent.bytes > MAX_MAPPING_BYTES:
            raise MappingError(
                f"{st.loc}: the mapping and its includes exceed {MAX_MAPPING_BYTES:,} bytes"
            )
        sub = parse_program(text, file)
        out.extend(_resolve_includes(sub, sub_base, (*stack, key), spent))
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


def _check_config_from(stmts: tuple[A.Stmt, ...]) -> None:
    """At most one ``config from``, naming a JSON file inside the input folder."""
    found = [st for st in stmts if isinstance(st, A.ConfigFrom)]
    problems = [
        f"{st.loc}: a second `config from` (the first is at {found[0].loc})" for st in found[1:]
    ]
    for st in found:
        if _relative_file_problem(st.file):
            problems.append(
                f"{st.loc}: `config from {st.file[:80]!r}`: name a JSON file inside the input "
                'folder by its relative path, e.g. `config from "params.json"`'
            )
    if problems:
        raise MappingError("\n".join(problems))


def _relative_file_problem(file: str) -> bool:
    """Whether ``file`` is no relative path inside a folder (absolute, ``..``, control
    characters, backslashes)."""
    parts = file.split("/")
    return (
        not file
        or file.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or any(ord(ch) < 32 for ch in file)
        or "\\" in file
    )


def _name_problem(
    kind: str, name: str, loc: A.Loc, found: dict[str, Any], params: dict[str, Any]
) -> str | None:
    """Why an ``input``/``output`` declaration's name cannot be its name: declared before,
    or a param's or a built-in name, which expressions would read instead."""
    if name in found:
        return f"{loc}: {kind} {name!r} is declared twice (first at {found[name].loc})"
    if name in params or name in TENSOR_NAMES or resolve_dtype(name):
        what = "a param's" if name in params else "a built-in"
        return f"{loc}: {kind} {name!r} takes {what} name; rename it"
    return None


def _check_inputs(stmts: tuple[A.Stmt, ...], params: dict[str, Any]) -> tuple[A.InputDecl, ...]:
    """The ``input`` declarations, each checked: a new name, a family pattern of one file
    name with one capture, a config file inside the input's folder."""
    found: dict[str, A.InputDecl] = {}
    problems = []
    for st in stmts:
        if not isinstance(st, A.InputDecl):
            continue
        why = _name_problem("input", st.name, st.loc, found, params)
        if why:
            problems.append(why)
            continue
        found[st.name] = st
        if st.files is not None:
            caps = st.files.captures
            if "/" in st.files.text or len(caps) != 1 or caps[0].kind not in ("seg", "int"):
                problems.append(
                    f"{st.loc}: `input {st.name} files {st.files.text!r}`: name the member "
                    "files or folders of one folder with one capture for the rank, e.g. "
                    'files "consolidated.{rank}.pth"'
                )
        if st.config_file is not None and _relative_file_problem(st.config_file):
            problems.append(
                f"{st.loc}: `input {st.name} config from {st.config_file[:80]!r}`: name a JSON "
                "file inside the input's folder by its relative path"
            )
    if problems:
        raise MappingError("\n".join(problems))
    return tuple(found.values())


# What an output family's members are: safetensors files (one per rank, beside the main
# checkpoint's files in the output folder).
OUTPUT_SUFFIX = ".safetensors"


def _check_outputs(
    stmts: tuple[A.Stmt, ...], params: dict[str, Any], inputs: tuple[A.InputDecl, ...]
) -> None:
    """The ``output`` declarations, each checked: a new name (no param's, built-in's or
    input's), and a pattern that names one ``.safetensors`` file of the output folder by one
    capture, the rank, so that a mapping cannot write outside the folder it is given."""
    found: dict[str, A.OutputDecl] = {}
    taken = {i.name for i in inputs}
    problems = []
    for st in stmts:
        if not isinstance(st, A.OutputDecl):
            continue
        why = _name_problem("output", st.name, st.loc, found, params)
        if why:
            problems.append(why)
            continue
        if st.name in taken:
            problems.append(
                f"{st.loc}: output {st.name!r} has the name of an input: an input's tensors "
                f"are read as {st.name}:..., so give the output another name"
            )
            continue
        found[st.name] = st
        caps = st.files.captures
        text = st.files.text
        literal = "".join(p for p in st.files.parts if isinstance(p, str))
        if (
            len(caps) != 1
            or caps[0].kind not in ("seg", "int")
            or not text.endswith(OUTPUT_SUFFIX)
            or any(not isinstance(p, (str, A.Capture)) for p in st.files.parts)
            or _relative_file_problem(literal or "x")
            or "/" in text
            or "{{" in text
            or "}}" in text
        ):
            problems.append(
                f"{st.loc}: `output {st.name} files {text[:80]!r}`: name one .safetensors "
                "file of the output folder by one capture for the rank, e.g. "
                'files "consolidated.{rank}.safetensors"'
            )
    if problems:
        raise MappingError("\n".join(problems))


def _scope_patterns(node: Any, names: tuple[str, ...]) -> Any:
    """``node`` with every tensor pattern told which inputs it does not see: a pattern that
    starts with ``NAME:`` sees input ``NAME``'s tensors; any other sees the main input's (and
    the rules' outputs) only."""
    if type(node) is A.Pattern:
        head = node.parts[0] if node.parts else ""
        mine = isinstance(head, str) and head.split(":", 1)[0] in names and ":" in head
        return node if mine else replace(node, others=names)
    if isinstance(node, tuple):
        return tuple(_scope_patterns(x, names) for x in node)
    if is_dataclass(node) and not isinstance(node, (type, A.Loc, A.FilePattern)):
        changes = {}
        for f in fields(node):
            value = getattr(node, f.name)
            new = _scope_patterns(value, names)
            if new is not value:
                changes[f.name] = new
        return replace(node, **changes) if changes else node
    return node


def from_program(name: str, text: str, program: A.Program, base: Path | None = None) -> Mapping:
    """A mapping from a parsed program: includes spliced in, params resolved."""
    spent = _Spent(bytes=_check_size(text, name))
    stmts = _resolve_includes(program, base, (name,), spent)
    _check_config_from(stmts)
    values, locs = _params(stmts)
    inputs = _check_inputs(stmts, values)
    _check_outputs(stmts, values, inputs)
    if inputs:
        stmts = _scope_patterns(stmts, tuple(i.name for i in inputs))
    program = A.Program(version=program.version, stmts=stmts, file=program.file)
    return Mapping(name=name, text=text, program=program, param_defaults=values, param_locs=locs)


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # too long for a file name, or a NUL byte: program text
        return False


def _mode(source: str) -> int | None:
    """The file mode of what ``source`` names, or None when it names nothing."""
    try:
        return os.stat(source).st_mode
    except (OSError, ValueError):
        return None


def _is_text(source: str) -> bool:
    """Program text, as opposed to a file name: several lines, or the version line."""
    return "\n" in source or source.lstrip().startswith("weightmap")


def _looks_like_file(source: str) -> bool:
    return _is_file(source) or source.endswith(PRESET_SUFFIX) or "/" in source or os.sep in source


def _read_file(path: Path, name: str | None) -> Mapping:
    text = _read_source(path, f"cannot read mapping {str(path)!r}")
    label = name or str(path)
    _check_is_mapping(text, label)
    _check_size(text, label)
    return from_program(label, text, parse_program(text, label), path.parent)


def load_mapping(source: str | os.PathLike[str] | Mapping, *, name: str | None = None) -> Mapping:
    """Load a mapping from a file path, a preset name or source text.

    A path-like object, or a one-line string naming an existing file (or ending in ``.wm``),
    is read from disk; else a one-line string naming a preset (``"eagle3-sglang"``, see
    :func:`preset_names`) is that preset; any other string is the program itself (which starts
    with ``weightmap 1``, so no program is taken for a preset's name). A :class:`Mapping` is
    returned as it is. ``name`` labels errors and plans (default: the file name, the preset's
    name, or ``<string>``).

    >>> load_mapping('weightmap 1\nrename "a.{x}" -> "b.{x}"').name
    '<string>'
    """
    if isinstance(source, Mapping):
        return source
    if not isinstance(source, str):
        return _read_file(Path(source), name)
    if not _is_text(source) and (_is_file(source) or source.endswith(PRESET_SUFFIX)):
        return _read_file(Path(source), name)
    if not _is_text(source) and source in preset_names():
        preset = load_preset(source)
        return preset if name is None else from_program(name, preset.text, preset.program)
    label = name or "<string>"
    _check_size(source, label)
    return from_program(label, source, parse_program(source, label))


def resolve_mapping(
    preset: str | None = None, mapping: str | os.PathLike[str] | Mapping | None = None
) -> Mapping:
    """The one place that decides what a caller meant: a preset name, a file or program text.

    Exactly one of ``preset`` (a name from :func:`preset_names`) and ``mapping`` (a file path,
    rule text or a loaded :class:`Mapping`) is given. Each points at the other where the caller
    seems to have mixed them up (a file given as a preset, a preset name given as a mapping).
    """
    if (preset is None) == (mapping is None):
        raise MappingError(
            "give exactly one of preset= (--preset NAME, a name from `weightmap presets`) or "
            "mapping= (--mapping FILE, a mapping file or rule text)"
        )
    if preset is not None:
        if preset not in preset_names() and _looks_like_file(preset):
            what = "is a mapping file" if _is_file(preset) else "looks like a mapping file"
            raise MappingError(
                f"{preset!r} {what}, not a preset name: pass it as mapping= "
                "(--mapping FILE); presets are: " + (", ".join(preset_names()) or "none")
            )
        return load_preset(preset)
    assert mapping is not None
    if isinstance(mapping, str) and not _is_text(mapping) and not _is_file(mapping):
        mode = _mode(mapping)
        if mode is not None:
            raise MappingError(
                f"mapping {mapping!r} is not a regular file (it is a {_kind(mode)}); a mapping "
                "is read from a file or given as rule text"
            )
        if mapping in preset_names():
            raise MappingError(
                f"{mapping!r} is a preset, not a mapping file: pass it as preset= "
                f"(--preset {mapping})"
            )
        if _looks_like_file(mapping) or (mapping.strip() == mapping and " " not in mapping):
            close = closest(mapping, preset_names())
            hint = f"; did you mean the preset {close!r} (--preset {close})?" if close else ""
            raise MappingError(
                f"mapping file {mapping!r} does not exist{hint} (rule text starts with "
                "`weightmap 1`)"
            )
    return load_mapping(mapping)


def _preset_text(name: str, loc: A.Loc | None = None) -> str:
    where = f"{loc}: " if loc else ""
    if not name or not all(ch.isalnum() or ch in "-_" for ch in name):
        raise MappingError(f"{where}bad preset name {name!r}")
    try:
        return data_dir("mappings").joinpath(name + PRESET_SUFFIX).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        known = ", ".join(preset_names()) or "none"
        hint = did_you_mean(name, preset_names(), quote="'")
        raise MappingError(f"{where}no preset named {name!r}{hint} (presets: {known})") from None


def load_preset(name: str) -> Mapping:
    """Load the preset ``mappings/<name>.wm``; MappingError listing the presets if unknown."""
    text = _preset_text(name)
    return from_program(name, text, parse_program(text, f"{name}{PRESET_SUFFIX}"))
