"""Checkpoint folder locks: in-place renames exclusive, readers shared.

An in-place rename rewrites headers, the index and config.json one after the other, so a
reader in between could see new tensor names with the old config, or the journal of a rename
that is still running. Both sides therefore lock the checkpoint's folder with ``flock``:

- ``Checkpoint.open`` holds a shared lock while it reads headers, index and config, and so
  reads the checkpoint wholly before or wholly after a rename;
- an in-place rename and ``weightmap clean`` hold the exclusive lock from before they check
  the checkpoint until the journal is gone, so two renames never interleave, and a journal
  seen under a shared lock belongs to a writer that died.

The lock is on the folder itself (no lock file: a reader needs no write permission and
nothing is left behind), is released by the kernel when its holder exits or is killed, and
is waited for up to :data:`LOCK_WAIT_SECONDS` (renames take well under a second). Where the
file system has no ``flock`` (some network file systems), the folder is used unlocked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from weightmap.errors import CheckpointError

__all__ = ["LOCK_WAIT_SECONDS", "folder_lock"]

LOCK_WAIT_SECONDS = 30.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def _busy(folder: Path, exclusive: bool) -> CheckpointError:
    if exclusive:
        why = (
            "another weightmap process has been using this checkpoint for over "
            f"{LOCK_WAIT_SECONDS:g} s (an in-place rename or clean, or readers opening it)"
        )
    else:
        why = (
            f"an in-place rename of this checkpoint has been running for over "
            f"{LOCK_WAIT_SECONDS:g} s (or a stopped one holds its lock)"
        )
    return CheckpointError(f"{why}; try again when it has finished", path=folder, rule="busy")


@contextlib.contextmanager
def folder_lock(folder: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold ``folder``'s shared (readers) or exclusive (in-place writers) lock.

    Waits up to :data:`LOCK_WAIT_SECONDS`, then raises a ``CheckpointError`` (rule ``busy``).
    A folder that cannot be opened or locked is used without the lock.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield  # unreadable: whatever reads it next fails with its own message
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        delay = 0.002
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _busy(folder, exclusive) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    break
                raise
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
