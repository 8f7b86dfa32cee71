"""Writing a plan's side files into the output's temporary folder, and checking them.

Side files go into the same temporary folder as the weights, before it is moved into place,
so they are committed (or discarded) with them: a converted folder never exists without its
tokenizer. Carried files are copied in the kernel (``inputs/sidefiles.copy_file``); each
source is checked again when it is opened (still inside the folder, still a regular file of
the planned size), so a folder that changed since the plan was made fails the conversion.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from weightmap.format.writer import RESERVE_NAME
from weightmap.fs.atomic import fsync_dir
from weightmap.inputs.sidefiles import (
    allocated,
    copy_file,
    open_side_file,
    resolve_path,
    same_bytes,
)
from weightmap.plan.plan import SideFile

__all__ = ["check_side_files", "side_files_space", "write_side_files"]


def _make_parents(folder: Path, name: str, made: set[Path]) -> Path:
    target = folder / name
    for parent in reversed(target.relative_to(folder).parents[:-1]):
        sub = folder / parent
        if sub not in made:
            sub.mkdir(exist_ok=True)
            made.add(sub)
    return target


def write_side_files(
    files: Sequence[SideFile],
    root: Path,
    folder: Path,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write every side file into ``folder`` (the output's temporary folder) and fsync them.

    ``root`` is the input folder that carried files are read from. Returns the paths written,
    under ``folder``.
    """
    # The space reserved for them with the shards' (format/writer.py), given back to be used.
    (folder / RESERVE_NAME).unlink(missing_ok=True)
    made: set[Path] = set()
    written = []
    for f in files:
        target = _make_parents(folder, f.name, made)
        if f.source is None:
            data = (f.text or "").encode("utf-8")
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            src = open_side_file(root, f.source, f.size)
            try:
                copy_file(src, target, f.size, root / f.source)
            finally:
                os.close(src)
        written.append(target)
        if progress is not None:
            progress(f.size)
    for sub in sorted(made, key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    if files:
        fsync_dir(folder)
    return written


def side_files_space(files: Sequence[SideFile], root: Path) -> int:
    """The bytes of disk the side files will take: a carried file's allocated blocks (a
    sparse file's holes stay holes in the copy), or its planned size where it cannot be
    looked at yet (a Hub file not downloaded); an added file's text."""
    total = 0
    for f in files:
        if f.source is None:
            total += len((f.text or "").encode("utf-8"))
            continue
        try:
            st = os.stat(resolve_path(root / f.source))
        except OSError:  # checked, and named, when it is opened to be copied
            total += f.size
            continue
        total += min(allocated(st), f.size)
    return total


def check_side_files(files: Sequence[SideFile], folder: Path, root: Path | None) -> list[str]:
    """How the side files in ``folder`` differ from the plan's (empty if they do not).

    Added files are compared with the text the plan holds; carried files with their source in
    ``root`` byte for byte (read in bounded chunks), or by size alone when ``root`` is None.
    """
    problems = []
    for f in files:
        target = folder / f.name
        if not target.is_file() or target.is_symlink():
            problems.append(f"side file {f.name!r} is missing")
        elif target.stat().st_size != f.size:
            problems.append(
                f"side file {f.name!r} is {target.stat().st_size:,} bytes, planned {f.size:,}"
            )
        elif f.source is None:
            if target.read_bytes() != (f.text or "").encode("utf-8"):
                problems.append(f"side file {f.name!r} differs from the text the plan adds")
        elif root is not None:
            src = open_side_file(root, f.source, f.size)
            try:
                if not same_bytes(src, target, f.size):
                    problems.append(f"side file {f.name!r} differs from {f.source!r} in the input")
            finally:
                os.close(src)
    return problems
