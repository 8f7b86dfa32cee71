"""Room for the files a conversion keeps open at once.

A conversion keeps a descriptor open for each input shard it reads (for as long as its
checkpoint is open), one for each map of an input, and one for each output shard it writes.
Many systems start processes with a soft limit of 1,024 open files and a hard limit far above
it; a checkpoint of some hundreds of shards then fails half-way with "Too many open files",
and ``--max-shard-size`` cannot help, as a rename keeps the input's sharding. The soft limit
is the process's own to raise up to the hard one, as ``ulimit -n`` would: it is raised where
a conversion needs more, and never lowered.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["MARGIN", "has_room", "make_room", "open_now"]

# Descriptors beyond the shards: the interpreter's, torch's, a Ray client's, a progress bar's.
MARGIN = 256


def has_room(files: int) -> bool:
    """Whether the soft limit already leaves room for ``files`` open files and the margin."""
    try:
        import resource
    except ImportError:  # (not a POSIX system: no such limit)
        return True
    return _fits(resource.getrlimit(resource.RLIMIT_NOFILE)[0], files + MARGIN)


def _fits(soft: int, needed: int) -> bool:
    import resource

    return soft == resource.RLIM_INFINITY or soft >= needed


def make_room(files: int) -> int:
    """Raise the soft limit on open files to ``files + MARGIN`` where it is lower and the hard
    limit allows; the soft limit in force afterwards (0 where the platform has none)."""
    try:
        import resource
    except ImportError:  # (not a POSIX system: no such limit to raise)
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = files + MARGIN
    if _fits(soft, needed):
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        # A refusal (a sandbox that forbids it) leaves the limit as it was: the conversion
        # then fails where it runs out, with the error the system gives.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_now() -> int:
    """The descriptors this process holds open now (0 where the system cannot say): what
    room for more must be made beside."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
