"""Moving bytes into a file in the kernel: clones, copies, reservations, writeback, fsync.

The system calls the writer is built on, each with the fallbacks it needs where a filesystem
or kernel lacks it: ``FICLONERANGE`` (share extents, or refuse), ``copy_file_range`` (or
``pread``/``pwrite``), ``posix_fallocate``, ``sync_file_range``, and fsyncs that run together.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from weightmap.errors import ExecutionError
from weightmap.fs.cancel import CancelToken

__all__ = [
    "DIRECT_ALIGN",
    "DIRECT_MIN",
    "DirectWrites",
    "clone",
    "copy",
    "fallocate",
    "fsyncing",
    "open_direct",
    "pwrite_all",
    "pwrite_direct",
    "start_writeback",
]

_COPY_CHUNK = 64 * 1024 * 1024
# linux/fs.h: _IOW(0x94, 13, struct file_clone_range)
_FICLONERANGE = 0x4020940D
# Errors of a clone that mean "not here" (not "something broke"): fall back to a copy.
_NO_CLONE = frozenset(
    {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF}
)
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)
# Writes at least this large are handed to the disk at once (see start_writeback).
_WRITEBACK_MIN = 64 * 1024
_SYNC_FILE_RANGE_WRITE = 2


def pwrite_all(fd: int, data: bytes | memoryview, position: int) -> None:
    """Write all of ``data`` at ``position``, however many calls it takes."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, position)
        view = view[n:]
        position += n


# Direct I/O moves whole blocks between the disk and memory aligned to them. 4096 bytes is a
# multiple of every logical block size disks report (512 or 4096) and of the memory
# alignment they ask; a filesystem that wants more refuses the write (EINVAL), and the writer
# then writes through the page cache instead.
DIRECT_ALIGN = 4096
# Writes smaller than this go through the page cache: direct I/O pays off on the chunks of a
# computed tensor (megabytes), not on small tensors.
DIRECT_MIN = 1 << 20


def open_direct(path: str | os.PathLike[str]) -> int | None:
    """A second, write-only descriptor of ``path`` that bypasses the page cache (O_DIRECT), or
    None where the platform or the filesystem has none (tmpfs on older kernels, macOS)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


def pwrite_direct(
    fd: int, direct: int, data: bytes | memoryview, position: int, stage: memoryview
) -> None:
    """Write ``data`` at ``position``: the whole aligned blocks it covers through ``direct``
    (the same file opened with O_DIRECT), the partial blocks at either end through ``fd``.

    A block is then always written one way: whole inside one write, it goes direct; shared by
    two writes (or with a header, or a copied tensor), every write of it goes through the page
    cache, so the cache never holds a stale copy of a block written around it. Memory not
    aligned to a block is copied through ``stage`` (page-aligned, a multiple of the block
    size). Raises OSError(EINVAL) where the filesystem refuses direct I/O of these blocks;
    the caller then writes the whole range again through ``fd``.
    """
    view = memoryview(data).cast("B")
    lead = min(view.nbytes, -position % DIRECT_ALIGN)
    body = (view.nbytes - lead) // DIRECT_ALIGN * DIRECT_ALIGN
    if lead:
        pwrite_all(fd, view[:lead], position)
    if body:
        middle, at = view[lead : lead + body], position + lead
        if _address(middle) % DIRECT_ALIGN == 0:
            pwrite_all(direct, middle, at)
        else:
            for start in range(0, body, stage.nbytes):
                n = min(stage.nbytes, body - start)
                stage[:n] = middle[start : start + n]
                pwrite_all(direct, stage[:n], at + start)
    rest = view[lead + body :]
    if rest:
        pwrite_all(fd, rest, position + lead + body)


# Each writing thread's staging buffer for direct writes of unaligned memory.
_STAGE_BYTES = 8 * 2**20


class DirectWrites:
    """Writes into files a writer holds open: those of a megabyte or more past the page cache
    (``pwrite_direct``) where ``enabled``, the others through it with their writeback started.

    For every thread of one writer (the local writer's, or a Ray task's): each file's O_DIRECT
    descriptor is opened on its first large write (``path()`` names the very file; None where
    the filesystem has none), and a file whose direct write was refused (EINVAL) is written
    through the cache from then on. Each thread stages unaligned memory in a buffer of its own.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._direct: dict[int, int | None] = {}  # file key -> O_DIRECT descriptor, or None
        self._opened: list[int] = []  # every one opened, closed by close()
        self._stage = threading.local()

    def write(
        self,
        key: int,
        fd: int,
        path: Callable[[], str | os.PathLike[str]],
        data: bytes | memoryview,
        position: int,
    ) -> None:
        """Write ``data`` at ``position`` of the file open as ``fd`` (``key`` names it)."""
        length = memoryview(data).nbytes
        direct = self._fd(key, path) if self.enabled and length >= DIRECT_MIN else None
        if direct is not None:
            try:
                pwrite_direct(fd, direct, data, position, self._staging())
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                with self._lock:  # refused: this file is written through the cache from now
                    self._direct[key] = None
                # (Left open until close(): another thread may be writing through it.)
        pwrite_all(fd, data, position)
        start_writeback(fd, position, length)

    def used(self) -> bool:
        """Whether any file got a descriptor for direct writes."""
        with self._lock:
            return any(fd is not None for fd in self._direct.values())

    def _fd(self, key: int, path: Callable[[], str | os.PathLike[str]]) -> int | None:
        with self._lock:
            if key not in self._direct:
                fd = open_direct(path())
                self._direct[key] = fd
                if fd is not None:
                    self._opened.append(fd)
            return self._direct[key]

    def _staging(self) -> memoryview:
        stage: memoryview | None = getattr(self._stage, "view", None)
        if stage is None:
            stage = self._stage.view = memoryview(mmap.mmap(-1, _STAGE_BYTES))
        return stage

    def close(self) -> None:
        """Close every O_DIRECT descriptor (the files' own stay open)."""
        with self._lock:
            fds, self._opened = self._opened, []
            self._direct.clear()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _address(view: memoryview) -> int:
    """The memory address of a buffer's first byte (read-only buffers included)."""
    import numpy as np  # (only computed tensors are written this way: torch has loaded it)

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@contextmanager
def fsyncing(fds: Sequence[int], token: CancelToken | None = None) -> Iterator[None]:
    """fsync every shard while the body runs, and wait for them at its end.

    Several at once: the filesystem's journal then commits them together instead of once per
    file (48 shards took 48 journal commits one after the other). The body runs meanwhile
    (the commit makes the index there): fsync waits on the disk without the interpreter.
    While the threads run, a signal only cancels ``token`` (the run's, or one of its own),
    raised as they end (``CancelToken.polled``): this thread shares the pool's locks.
    """
    if len(fds) <= 1:
        yield
        for fd in fds:
            os.fsync(fd)
        return
    with (
        (token or CancelToken()).polled(),
        ThreadPoolExecutor(min(8, len(fds)), thread_name_prefix="weightmap-fsync") as pool,
    ):
        synced = pool.map(os.fsync, fds)  # every fsync is submitted here
        yield
        list(synced)  # (raises the first that failed)


def clone(src_fd: int, src: int, fd: int, dst: int, length: int) -> bool:
    """FICLONERANGE: share ``length`` bytes of ``src_fd`` at ``src`` into ``fd`` at ``dst``.

    The filesystem either shares the extents or refuses; it never copies. False where it
    refuses (no reflink support, another filesystem, offsets it cannot share).
    """
    arg = struct.pack("qQQQ", src_fd, src, length, dst)
    try:
        fcntl.ioctl(fd, _FICLONERANGE, arg)
    except OSError as exc:
        if exc.errno in _NO_CLONE:
            return False
        raise
    return True


def copy(src_fd: int, src: int, fd: int, dst: int, length: int, what: str) -> None:
    """Copy ``length`` bytes between files, in the kernel where possible."""
    remaining = length
    use_kernel = hasattr(os, "copy_file_range")
    while remaining:
        n = 0
        if use_kernel:
            try:
                n = os.copy_file_range(src_fd, fd, remaining, src, dst)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                use_kernel = False
        if not use_kernel:
            # Bounded chunks through user space, where the kernel copy is unavailable.
            chunk = os.pread(src_fd, min(remaining, _COPY_CHUNK), src)
            pwrite_all(fd, chunk, dst)
            n = len(chunk)
        if n == 0:
            raise ExecutionError(
                f"source ended early while copying into {what}: the input changed or is truncated"
            )
        remaining -= n
        src += n
        dst += n


def fallocate(fd: int, offset: int, length: int) -> bool:
    """Reserve disk space; False where the filesystem cannot (the file is then sparse)."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        return False
    return True


_sync_range: Callable[[int, int, int, int], int] | None = None
_sync_range_missing = False


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these bytes to disk now, without waiting.

    The commit fsyncs every shard; started early, the disk writes overlap the rest of the
    conversion instead of all waiting for that fsync. Only a hint (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so any failure just turns it off.
    """
    global _sync_range, _sync_range_missing
    if _sync_range_missing or length < _WRITEBACK_MIN:
        return
    if _sync_range is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (AttributeError, OSError):
            _sync_range_missing = True
            return
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        _sync_range = fn
    if _sync_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        _sync_range_missing = True
