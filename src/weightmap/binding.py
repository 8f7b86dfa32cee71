"""Several inputs: the checkpoints a mapping declares (``input NAME``), bound and joined.

A mapping of several inputs reads one namespace of tensors: the main input's under their own
names, input ``adapter``'s as ``adapter:NAME``, and a family's (``input ranks files
"consolidated.{rank}.pth"``) as ``ranks:RANK:NAME``. The join is one :class:`Checkpoint`
whose headers carry the prefixed names, so the compiler, both executors and the Ray tasks
read it as they read any checkpoint of several files: nothing downstream knows that the files
came from several folders.

Why a namespace and not a rule keyword per input: every rule (a merge over ranks, a product of
an adapter's two matrices, a sum of two models' tensors) already pairs tensors by their names'
captures; with the input in the name, a rank is a capture like an expert number, and every
rule, check and plan line works across inputs unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightmap.compiler.pattern import compile_pattern
from weightmap.errors import CheckpointError, MappingError
from weightmap.format.names import CONFIG_NAME
from weightmap.fs.cancel import CancelToken
from weightmap.inputs.checkpoint import Checkpoint, refuse_escape
from weightmap.inputs.join import join
from weightmap.inputs.opening import read_folder_json
from weightmap.inputs.resolve import ResolvedInput
from weightmap.language import ast as A

__all__ = ["Bound", "bind_inputs", "check_bindings", "main_is_family_folder"]

PathLike = str | os.PathLike[str]

# A family of more ranks than this is a mistake (a folder of unrelated files matched).
MAX_RANKS = 4096


@dataclass
class Bound:
    """The main input joined with the mapping's declared inputs.

    ``ckpt`` holds every tensor under its name in the namespace; ``values`` are what the
    mapping's expressions see under each input's name (``adapter.config.r``,
    ``ranks.count``); ``parts`` are the opened checkpoints, closed with :meth:`close`.
    """

    ckpt: Checkpoint
    values: dict[str, Any]
    parts: list[Checkpoint] = field(default_factory=list)

    def close(self) -> None:
        for part in self.parts:
            part.close()
        self.ckpt.close()


def check_bindings(
    decls: tuple[A.InputDecl, ...], given: Mapping[str, PathLike] | None, mapping: str
) -> dict[str, PathLike]:
    """The caller's bindings, checked against the declarations: every plain input bound
    (a family defaults to the main input's folder), no name the mapping does not declare."""
    bindings = dict(given or {})
    names = {d.name for d in decls}
    unknown = sorted(set(bindings) - names)
    if unknown:
        declared = ", ".join(sorted(names)) or "none"
        raise MappingError(
            f"{mapping} declares no input {unknown[0]!r} (it declares: {declared}); "
            "bind only the inputs its `input` statements name"
        )
    missing = [d for d in decls if d.files is None and d.name not in bindings]
    if missing:
        d = missing[0]
        raise MappingError(
            f"{d.loc}: {mapping} reads input {d.name!r}: bind it, "
            f'remap(..., inputs={{"{d.name}": PATH}}) or --input {d.name}=PATH '
            "(a folder, a file or a Hub id)"
        )
    return bindings


def main_is_family_folder(decls: tuple[A.InputDecl, ...], bindings: Mapping[str, Any]) -> bool:
    """Whether a family reads its members from the main input's folder (no binding given):
    the main input then holds no tensors of its own, only its config and side files."""
    return any(d.files is not None and d.name not in bindings for d in decls)


@dataclass(frozen=True)
class FolderFamilies:
    """The families a mapping reads from one folder, as ``ResolvedInput.resolve`` asks of a
    Hub repository's top: their members (each family's ranks checked as for a local folder,
    before anything is fetched) and the config files they read."""

    decls: tuple[A.InputDecl, ...]

    @property
    def configs(self) -> tuple[str, ...]:
        return tuple(d.config_file for d in self.decls if d.config_file is not None)

    def members(self, names: list[str], where: str) -> list[str]:
        return [name for decl in self.decls for _, name in _ranked(names, decl, where)]


def main_family(
    decls: tuple[A.InputDecl, ...], given: Mapping[str, PathLike] | None
) -> FolderFamilies | None:
    """The families read from the main input's folder (a Hub id's members to fetch), or
    None where there is none (checked again, with the bindings, later)."""
    bound = given if isinstance(given, Mapping) else {}
    families = tuple(d for d in decls if d.files is not None and d.name not in bound)
    return FolderFamilies(families) if families else None


def _config(root: Path, decl: A.InputDecl, default: dict[str, Any] | None) -> Any:
    if decl.config_file is None:
        return default
    path = root / decl.config_file
    if not path.is_file():
        raise CheckpointError(
            f"input {decl.name!r} has no {decl.config_file}, which the mapping reads as its "
            f"config ({decl.loc})",
            path=root,
            rule="missing-config",
        )
    return read_folder_json(root, path, decl.config_file)


def _members(folder: Path, decl: A.InputDecl) -> list[tuple[int, Path]]:
    """A family's members in ``folder``: the entries its pattern matches, by rank."""
    assert decl.files is not None
    if not folder.is_dir():
        raise CheckpointError(
            f"input {decl.name!r} is a family of files ({decl.files.text}): bind it to the "
            "folder that holds them",
            path=folder,
            rule="layout",
        )
    members = [(rank, folder / name) for rank, name in _ranked(os.listdir(folder), decl, folder)]
    for _rank, path in members:
        # A member is an entry of the folder: a link (to a file or a folder) that leaves it
        # would read another checkpoint's weights as this family's.
        refuse_escape(folder, path)
    return members


def _ranked(names: Iterable[str], decl: A.InputDecl, folder: str | Path) -> list[tuple[int, str]]:
    """Of the entries ``names`` of ``folder``, the family's members by rank: a number each,
    one member a rank, ranks 0..n-1 (the errors name the entries)."""
    assert decl.files is not None
    rx = compile_pattern(decl.files)
    (cap,) = decl.files.captures
    ranks: dict[int, str] = {}
    for entry in sorted(names):
        m = rx.fullmatch(entry)
        if m is None:
            continue
        text = m.group(cap.name)
        if not text.isascii() or not text.isdigit():
            raise CheckpointError(
                f"{entry} matches input {decl.name!r}'s {decl.files.text!r}, but its rank "
                f"{text!r} is no number; move the file away or make the pattern stricter",
                path=folder,
                rule="rank",
            )
        rank = int(text)
        if rank in ranks:
            raise CheckpointError(
                f"{ranks[rank]} and {entry} are both rank {rank} of input {decl.name!r}",
                path=folder,
                rule="rank",
            )
        ranks[rank] = entry
    if not ranks:
        raise CheckpointError(
            f"no file or folder here matches input {decl.name!r}'s {decl.files.text!r}",
            path=folder,
            rule="missing",
        )
    if len(ranks) > MAX_RANKS or sorted(ranks) != list(range(len(ranks))):
        gap = next((r for r in range(len(ranks)) if r not in ranks), max(ranks))
        raise CheckpointError(
            f"input {decl.name!r} has ranks {_spans(sorted(ranks))}: rank {gap} is missing "
            f"(ranks are 0..n-1, one member each)",
            path=folder,
            rule="rank",
        )
    return sorted(ranks.items())


def _spans(ranks: list[int]) -> str:
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("..")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('..')[0]}..{r}"
        else:
            out.append(str(r))
    return ", ".join(out[:8]) + (" ..." if len(out) > 8 else "")


def _open(path: Path, rank_file: bool) -> Checkpoint:
    return Checkpoint.open(path, rank_file=rank_file and path.is_file())


def bind_inputs(
    main: Checkpoint,
    decls: tuple[A.InputDecl, ...],
    bindings: Mapping[str, PathLike],
    *,
    progress: bool = False,
    cancel: CancelToken | None = None,
) -> Bound:
    """Open every declared input and join them with ``main`` into one checkpoint."""
    opened: list[tuple[str, Checkpoint]] = []
    values: dict[str, Any] = {}
    parts: list[Checkpoint] = []
    configs: list[tuple[A.InputDecl, Path, Any]] = []
    try:
        for decl in decls:
            src = None
            if decl.name in bindings:
                # A folder or a file, or a Hub id: its checkpoint files fetched, or a family's
                # member files (the cache first).
                src = ResolvedInput.resolve(
                    bindings[decl.name],
                    decl.config_file or CONFIG_NAME,
                    progress=progress,
                    cancel=cancel,
                    family=None if decl.files is None else FolderFamilies((decl,)),
                )
            if decl.files is None:
                assert src is not None  # (check_bindings: every plain input is bound)
                ckpt = Checkpoint.open(src.path)
                parts.append(ckpt)
                opened.append((f"{decl.name}:", ckpt))
                configs.append((decl, ckpt.root, ckpt.config))
                values[decl.name] = {}
                continue
            folder = main.root if src is None else Path(src.path)
            members = _members(folder, decl)
            for rank, path in members:
                ckpt = _open(path, rank_file=True)
                parts.append(ckpt)
                opened.append((f"{decl.name}:{rank}:", ckpt))
            own = main.config if folder == main.root else _read_folder_config(folder)
            configs.append((decl, folder, own))
            values[decl.name] = {"count": len(members)}
        # Joined first: a file bound twice is said as such, not as the config it lacks.
        joined = join(main, opened, tuple(d.name for d in decls))
        for decl, root, own in configs:
            values[decl.name]["config"] = _config(root, decl, own)
        return Bound(joined, values, parts)
    except BaseException:
        for part in parts:
            part.close()
        raise


def _read_folder_config(folder: Path) -> dict[str, Any] | None:
    path = folder / CONFIG_NAME
    if not path.is_file():
        return None
    value = read_folder_json(folder, path, CONFIG_NAME)
    return value if isinstance(value, dict) else None
