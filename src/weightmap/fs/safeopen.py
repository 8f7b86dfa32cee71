"""Opening an input file once, and reading it through that descriptor only.

Checking a name and then opening it again by the same name reads whatever the name points to
by then: anyone who can write to the folder (a shared models folder) can swap the file for a
link to a credentials file in between. Every input file is therefore opened once, here, and
all later checks and reads use the descriptor:

- :func:`open_resolved` opens a path that ``resolve`` made (no link in it) one folder at a
  time, following no link anywhere (``O_NOFOLLOW`` on the whole path guards its last part
  only): a part swapped for a link since it was resolved fails the open (``ELOOP``,
  ``ENOTDIR``) instead of leading elsewhere;
- the open never blocks: ``O_NONBLOCK`` makes a FIFO put where a file should be open at once
  (and :func:`regular` then refuses it, as every device and socket);
- :func:`read_bounded` reads at most a given number of bytes through the descriptor.

Where a link is allowed (a hub cache's snapshot is a farm of links into ``blobs/``), the caller
resolves the name, checks where it leads, and opens the resolved path with
:func:`open_resolved`: what is read is then the file that was checked.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

__all__ = [
    "FD_PATH",
    "fd_path",
    "kind",
    "open_folder",
    "open_resolved",
    "read_at",
    "read_bounded",
    "regular",
]

# Linux names every open descriptor of the process here; opening the name opens the same
# file again, whatever its old name points to by now.
FD_PATH = Path("/proc/self/fd")


def open_resolved(resolved: Path) -> int:
    """A read-only descriptor of ``resolved`` (a path with no links in it, as ``resolve``
    made it), opened one folder at a time without following a link anywhere.

    Raises ``OSError``: ``ELOOP``/``ENOTDIR`` where a part of the path is a link now,
    ``ENOENT`` where it is gone.
    """
    fd = open_folder(resolved.parent)
    try:
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(resolved.name, flags, dir_fd=fd)
    finally:
        os.close(fd)


def open_folder(resolved: Path, make: tuple[str, ...] = ()) -> int:
    """A descriptor of the folder ``resolved`` (no links in it, as ``resolve`` made it), or
    of its subfolder ``make`` (made where missing, a part at a time), opened one folder at a
    time without following a link anywhere: for the ``*at`` calls (``dir_fd=``) that create
    or rename files in it.

    Raises ``OSError`` as :func:`open_resolved` does.
    """
    # O_PATH (Linux): a folder one may pass through but not list (mode 0711) opens too.
    walk = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
    parts = resolved.parts
    fd = os.open(parts[0], walk)
    try:
        for made, part in [(False, p) for p in parts[1:]] + [(True, p) for p in make]:
            if made:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            child = os.open(part, walk | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def kind(mode: int) -> str:
    """What a file of ``mode`` that is not a regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def regular(fd: int) -> os.stat_result | None:
    """The descriptor's status if it is a regular file, else None (a FIFO, device, socket or
    folder: nothing an input may be)."""
    st = os.fstat(fd)
    return st if stat.S_ISREG(st.st_mode) else None


def read_bounded(fd: int, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of ``fd`` from its start, read through the descriptor.

    One byte past ``limit`` is asked for, so that a caller tells a file of ``limit`` bytes
    from a longer one (or one that grew since it was measured).
    """
    return read_at(fd, limit + 1, 0)


def read_at(fd: int, count: int, start: int) -> bytes:
    """Up to ``count`` bytes of ``fd`` from offset ``start`` (fewer where the file ends
    first), with ``pread``: the descriptor's offset is left as it was, and a ``pread`` that
    returns less than asked (a network file system, past 2 GiB) is asked again."""
    chunks: list[bytes] = []
    done = 0
    while done < count:
        chunk = os.pread(fd, min(count - done, 8 * 2**20), start + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def fd_path(fd: int, fallback: Path) -> Path:
    """A name that opens the very file of ``fd`` again, for a library that takes names only
    (``torch.load(mmap=True)``, ``zipfile``): ``/proc/self/fd/N`` on Linux, else
    ``fallback`` (the file's own name, checked again by the caller afterwards)."""
    candidate = FD_PATH / str(fd)
    return candidate if FD_PATH.is_dir() else fallback
