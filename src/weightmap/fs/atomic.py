"""Atomic commits: temporary siblings, fsync, and renames that never clobber by accident.

Everything weightmap writes goes first into a temporary sibling named
``.<dest>.weightmap-tmp-<pid>@<where>-<token>`` (recognisable, so a later run or ``weightmap
clean`` can find what a killed run left behind), and is moved into place only when complete.
``<where>`` names the host and its pid namespace (``<host>+<namespace>``): a pid means something
only there, and a folder may be shared between machines (a conversion on a cluster) or between
containers of one machine, each with its own pids.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

__all__ = [
    "RENAME_EXCHANGE",
    "RENAME_NOREPLACE",
    "TMP_MARKER",
    "fsync_dir",
    "host_name",
    "is_within",
    "owner_tag",
    "removal_problem",
    "remove_path",
    "renameat2",
    "replace_at",
    "stale_temporaries",
    "temporaries",
    "temporary_path",
]

TMP_MARKER = ".weightmap-tmp-"


# Process ids are C ``pid_t``s, positive 32-bit ints; ``os.getpid()`` never gives another.
_MAX_PID = 2**31 - 1
_PID = re.compile(r"[0-9]{1,10}")  # ASCII digits: str.isdigit() takes "²", which int() refuses


def _pid(text: str) -> int | None:
    """The process id a temporary's name carries, or None when ``text`` is none that this
    module writes (a pid of 0, or beyond ``pid_t``, no process can have)."""
    if _PID.fullmatch(text) is None:
        return None
    pid = int(text)
    return pid if 0 < pid <= _MAX_PID else None


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` may be running here: anything but a clear "no such process"
    counts as running, so that no live conversion's folder is ever taken for stale."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):  # not ours to signal, or no pid here at all
        return True
    return True


def host_name() -> str:
    """This machine's name as temporary names carry it (no ``-``, ``@`` or ``/``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "_"


@functools.cache
def _pid_namespace() -> str:
    """This process's pid namespace (its inode number), or "0" where that cannot be known
    (no inode is 0): a name that says so is judged only where it cannot be known either."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # not Linux, or no /proc
        return "0"


def owner_tag() -> str:
    """``<pid>@<host>+<pid namespace>``: who writes a temporary, as its name carries it.

    The host alone does not say where a pid can be checked: containers of one machine often
    share its name (host networking) but each has its own pids, so the namespace goes in too.
    """
    return f"{os.getpid()}@{host_name()}+{_pid_namespace()}"


def temporary_path(dest: Path, suffix: str = "") -> Path:
    """A fresh temporary sibling of ``dest``, named as ``temporaries`` reads it:
    ``.<dest>.weightmap-tmp-<owner>-<random><suffix>``."""
    return dest.with_name(f".{dest.name}{TMP_MARKER}{owner_tag()}-{secrets.token_hex(4)}{suffix}")


def replace_at(folder: int, name: str, data: bytes) -> None:
    """Replace the file ``name`` of the folder open as ``folder`` with ``data`` whole or not at
    all: written and fsynced under a new temporary name, then renamed over it (a link at
    ``name`` is replaced, not followed).

    The temporary file is created, never opened through whatever has its name: a downloaded
    folder (or a shared cache) may hold links named like our temporaries, pointing at files
    outside it, and ``weightmap clean`` replays a journal found in such a folder. Every call
    is relative to the folder's descriptor: a folder renamed and replaced by a link meanwhile
    (by another user of a shared folder) does not lead the writes elsewhere.

    A regular file replaced keeps its permission bits: a config.json kept private (0600)
    must not come back readable by everyone. A new file (or one in place of a link) gets
    the umask's.
    """
    try:
        old = os.stat(name, dir_fd=folder, follow_symlinks=False)
        mode = stat.S_IMODE(old.st_mode) & 0o777 if stat.S_ISREG(old.st_mode) else None
    except OSError:  # absent: a new file
        mode = None
    tmp = temporary_path(Path(name), "-inplace").name
    # Private until its mode is set: never readable by others for a moment, even when the
    # file it replaces is not.
    create = 0o666 if mode is None else 0o600
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, create, dir_fd=folder)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def temporaries(folder: Path, dest_name: str | None = None) -> list[tuple[Path, str | None]]:
    """Every temporary output in ``folder`` (of ``dest_name``'s, if given), each with why it
    must stay, or None for one a run that no longer exists left behind (stale).

    A name carries its writer's pid and where that pid lives
    (``.<dest>.weightmap-tmp-<pid>@<host>+<namespace>-<token>``, see ``owner_tag``): it is
    stale only where that is here, once that process is gone. A live process's temporary,
    and one from another host or another container's pid namespace, whose process cannot be
    checked from here, stay. Names written by earlier versions carry a pid alone
    (``<pid>-<token>``) or with a host alone, and are judged by those; their overwrite
    leftovers (``old-<token>``) by nothing, they are stale. A name whose pid no process can
    have (not ASCII digits, 0, beyond ``pid_t``) was written by none of these: it is not
    ours to remove, and stays (named, so that ``clean`` says why).
    """
    prefix = f".{dest_name}{TMP_MARKER}" if dest_name is not None else "."
    here = owner_tag().partition("@")[2]
    bare = host_name()  # what names written before namespaces carry
    found: list[tuple[Path, str | None]] = []
    for entry in folder.iterdir() if folder.is_dir() else ():
        name = entry.name
        if not name.startswith(prefix) or TMP_MARKER not in name:
            continue
        # The last marker: a destination's own name may hold one.
        owner = name.rsplit(TMP_MARKER, 1)[1].split("-", 1)[0]
        pid_text, at, where = owner.partition("@")
        if at and where not in (here, bare):
            why = (
                f"written by process {pid_text} on {where.replace('+', ' in pid namespace ')}, "
                "which cannot be checked from here; remove it by hand once no conversion runs "
                "there"
            )
            found.append((entry, why))
        elif pid_text == "old" and not at:
            found.append((entry, None))  # an overwrite's leftover, before pids were written
        elif (pid := _pid(pid_text)) is None:
            # Planted or foreign: removing it would delete what no run of ours made, and
            # signalling its "pid" would fail (os.kill overflows past a C long).
            why = (
                f"its name carries {pid_text[:40]!r}, which is no process id, so no weightmap "
                "run made it; remove it by hand if it is yours"
            )
            found.append((entry, why))
        elif _pid_alive(pid):
            found.append((entry, f"its conversion (process {pid}) is still running"))
        else:
            found.append((entry, None))
    return sorted(found, key=lambda item: item[0])


def stale_temporaries(folder: Path, dest_name: str | None = None) -> list[Path]:
    """The temporary outputs in ``folder`` that runs which no longer exist left behind (see
    ``temporaries``)."""
    return [path for path, why in temporaries(folder, dest_name) if why is None]


def remove_path(path: Path) -> None:
    """Remove a file, link or folder tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# Linux inode flags (FS_IOC_GETFLAGS): an immutable or append-only file cannot be removed, not
# even by root, and neither can anything in an immutable or append-only folder.
_FS_IOC_GETFLAGS = 0x80086601
_FS_IMMUTABLE_FL = 0x10
_FS_APPEND_FL = 0x20


def _pinned(path: Path) -> bool:
    """True when ``path`` is marked immutable or append-only (False where that is unknown)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # a link, or unreadable: its flags cannot be read, and need not be
        return False
    try:
        buf = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0" * 8)
    except OSError:  # not Linux, or a file system without these flags
        return False
    finally:
        os.close(fd)
    return bool(int.from_bytes(buf[:4], "little") & (_FS_IMMUTABLE_FL | _FS_APPEND_FL))


def removal_problem(path: Path) -> str | None:
    """Why ``path`` (a file, link or folder tree) could not be removed, or None if it can.

    Checked before an overwrite swaps the old output out, so that a destination that cannot
    be removed is refused before any work instead of being left beside the new one: every
    folder in the tree must be readable, writable and searchable (``os.access``, which also
    says no for an immutable folder, even to root), and no entry may be immutable or
    append-only.
    """
    if path.is_symlink() or not path.is_dir():
        return f"{path} is immutable or append-only" if _pinned(path) else None
    if _pinned(path):
        return f"{path} is immutable or append-only"
    for folder, dirs, files in os.walk(path):
        if not os.access(folder, os.R_OK | os.W_OK | os.X_OK):
            return f"folder {folder} is not writable"
        for name in files + dirs:
            if _pinned(Path(folder) / name):
                return f"{Path(folder) / name} is immutable or append-only"
    return None


RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any | None:
    """libc's renameat2, looked up once: None where the C library has none.

    The symbols the interpreter already has loaded (libc among them) are searched first:
    ``ctypes.util.find_library`` runs ``ldconfig`` in a subprocess, a few milliseconds that
    every commit would otherwise pay again.
    """
    fn = _symbol(None, "renameat2")
    if fn is None:
        libc = ctypes.util.find_library("c")
        fn = _symbol(libc, "renameat2") if libc is not None else None
    return fn


def _symbol(library: str | None, name: str) -> Any | None:
    """``name`` in ``library`` (None: what the process has loaded), or None."""
    try:
        return getattr(ctypes.CDLL(library, use_errno=True), name, None)
    except OSError:  # no such library
        return None


def renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2; False where unavailable (other systems, old kernels, some filesystems)."""
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def fsync_dir(path: Path) -> None:
    """fsync a folder, so a rename or a new file in it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_within(child: Path, parent: Path) -> bool:
    """Whether ``child`` lies in ``parent`` once both are resolved. A path that cannot be
    resolved (a loop of links: Python before 3.13 raises RuntimeError, later ones OSError)
    leads nowhere, so it neither holds nor is held by anything."""
    try:
        child.resolve().relative_to(parent.resolve())
    except (ValueError, RuntimeError, OSError):
        return False
    return True
