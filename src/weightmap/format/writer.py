"""Writing a sharded safetensors checkpoint atomically, from bytes that arrive in any order.

The writer is told every output tensor (name, dtype, shape) up front, so it can plan the
shards and write each header before any data, exactly as the reference writer lays them out.
Data then arrives in chunks at planned offsets, from several threads, either as bytes or as a
byte range of another file copied in the kernel. Everything is written inside a temporary
sibling folder that is moved into place only after every byte is written and fsynced.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from weightmap.errors import ExecutionError, OutputExistsError
from weightmap.format.atomic import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    TMP_MARKER,
    fsync_dir,
    is_within,
    removal_problem,
    remove_path,
    renameat2,
    stale_temporaries,
)
from weightmap.format.dtypes import TensorSpec
from weightmap.format.layout import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    plan_shards,
)

__all__ = ["CheckpointWriter"]

_COPY_CHUNK = 64 * 1024 * 1024


class CheckpointWriter:
    """Write a checkpoint into ``dest`` atomically.

    Use as a context manager: on a clean exit the output is committed (moved into place); on an
    exception everything temporary is removed and ``dest`` is left as it was.

    >>> specs = [TensorSpec("w", "F32", (2,))]
    >>> with CheckpointWriter(tmp / "out", specs) as w:       # doctest: +SKIP
    ...     w.write("w", b"\\0" * 8)
    """

    def __init__(
        self,
        dest: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        *,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        metadata: Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        protect: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        self.dest = Path(dest)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"output tensor names repeat: {', '.join(dup[:10])}")
        for p in protect:
            if is_within(Path(p), self.dest):
                raise OutputExistsError(
                    f"{self.dest}: the destination holds the input ({p}); choose another folder "
                    "(in-place mode rewrites headers without a destination)"
                )
        if self.dest.is_symlink() and not self.dest.exists() and not overwrite:
            # Refused now, not after converting in full: the commit's rename would refuse it.
            raise OutputExistsError(
                f"{self.dest} is a symbolic link (to {os.readlink(self.dest)}, which does not "
                "exist); remove it, or pass overwrite=True (--overwrite) to replace the link"
            )
        if self.dest.exists() and not overwrite:
            raise OutputExistsError(
                f"{self.dest} already exists; pass overwrite=True (--overwrite) to replace it"
            )
        if self.dest.exists() and (why := removal_problem(self.dest)) is not None:
            # Checked now: after the swap the new output would be in place and the old one
            # stuck beside it under a temporary name.
            raise ExecutionError(
                f"{self.dest} cannot be replaced: {why}, so the old output could not be "
                "removed; nothing was written. Make it removable (chmod u+w; chattr -i for an "
                "immutable file) or choose another destination"
            )
        if self.dest.parent.exists() and not self.dest.parent.is_dir():
            raise ExecutionError(f"{self.dest.parent}: the destination's parent is not a folder")
        self.overwrite = overwrite
        self.config = None if config is None else dict(config)
        self.shards = plan_shards(specs, max_shard_size, metadata)
        self._specs = {s.name: s for s in specs}
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (shard idx, begin, end)
        for i, shard in enumerate(self.shards):
            for name, (b, e) in shard.offsets.items():
                self._where[name] = (i, b, e)
        self._written = dict.fromkeys(self._specs, 0)
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self._files: dict[str, bytes] = {}
        self.tmp: Path | None = None
        self.committed = False
        # Called with the finished temporary folder just before it is moved into place; an
        # exception from it discards the output (used to verify before committing).
        self.before_move: Callable[[Path], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> CheckpointWriter:
        self.open()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def open(self) -> None:
        """Create the temporary folder and every shard with its header, sized in full."""
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExecutionError(f"{self.dest.parent}: cannot create the folder ({exc})") from exc
        # What a killed earlier run into the same destination left behind goes first.
        for stale in stale_temporaries(self.dest.parent, self.dest.name):
            with contextlib.suppress(OSError):
                remove_path(stale)
        token = secrets.token_hex(4)
        self.tmp = self.dest.parent / f".{self.dest.name}{TMP_MARKER}{os.getpid()}-{token}"
        try:
            self.tmp.mkdir()
            for shard in self.shards:
                fd = os.open(self.tmp / shard.filename, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._fds.append(fd)
                self._pwrite_all(fd, shard.header, 0)
                # Reserve the space now so a full disk fails here, before minutes of copying.
                try:
                    os.posix_fallocate(fd, 0, shard.size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    os.ftruncate(fd, shard.size)
        except OSError as exc:
            self.abort()
            raise ExecutionError(f"{self.dest}: cannot create the output ({exc})") from exc

    def abort(self) -> None:
        """Close and remove everything temporary; ``dest`` is untouched."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        if self.tmp is not None and self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None

    # -- data ----------------------------------------------------------------------------------

    def target(self, name: str) -> tuple[int, int, int]:
        """``(fd, file offset, length)`` of tensor ``name`` in its output shard."""
        shard, begin, end = self._where[name]
        return self._fds[shard], begin, end - begin

    def _check(self, name: str, offset: int, length: int) -> tuple[int, int]:
        fd, begin, size = self.target(name)
        if offset < 0 or offset + length > size:
            raise ValueError(
                f"write of {length} bytes at {offset} falls outside tensor {name!r} ({size} bytes)"
            )
        return fd, begin + offset

    def _done(self, name: str, length: int) -> None:
        with self._lock:
            self._written[name] += length

    @staticmethod
    def _pwrite_all(fd: int, data: bytes | memoryview, position: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(fd, view, position)
            view = view[n:]
            position += n

    def write(self, name: str, data: bytes | memoryview, offset: int = 0) -> None:
        """Write ``data`` into tensor ``name`` starting ``offset`` bytes into it."""
        length = memoryview(data).nbytes
        fd, position = self._check(name, offset, length)
        self._pwrite_all(fd, data, position)
        self._done(name, length)

    def copy_range(
        self, name: str, src_fd: int, src_offset: int, length: int, offset: int = 0
    ) -> None:
        """Copy ``length`` bytes of another file into tensor ``name``, in the kernel if possible."""
        fd, position = self._check(name, offset, length)
        remaining = length
        use_kernel = hasattr(os, "copy_file_range")
        while remaining:
            n = 0
            if use_kernel:
                try:
                    n = os.copy_file_range(src_fd, fd, remaining, src_offset, position)
                except OSError as exc:
                    if exc.errno not in (
                        errno.EXDEV,
                        errno.ENOSYS,
                        errno.EOPNOTSUPP,
                        errno.EINVAL,
                        errno.EBADF,
                    ):
                        raise
                    use_kernel = False
            if not use_kernel:
                # Bounded chunks through user space, where the kernel copy is unavailable.
                chunk = os.pread(src_fd, min(remaining, _COPY_CHUNK), src_offset)
                self._pwrite_all(fd, chunk, position)
                n = len(chunk)
            if n == 0:
                raise ExecutionError(
                    f"source ended early while copying tensor {name!r}: the input changed or is "
                    "truncated"
                )
            remaining -= n
            src_offset += n
            position += n
        self._done(name, length)

    def add_file(self, name: str, data: bytes) -> None:
        """Add a small extra file (written at commit), e.g. a copied tokenizer file."""
        if (
            "/" in name
            or name in (".", "..", INDEX_NAME, CONFIG_NAME)
            or name.endswith(".safetensors")
        ):
            raise ValueError(f"cannot add file {name!r} to the output")
        self._files[name] = data

    # -- commit ----------------------------------------------------------------------------------

    def _write_small(self, name: str, data: bytes) -> None:
        assert self.tmp is not None
        fd = os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            self._pwrite_all(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> Path:
        """Check every byte arrived, fsync, and move the output into place."""
        if self.tmp is None:
            raise ExecutionError(f"{self.dest}: the writer is not open")
        try:
            short = [n for n, w in self._written.items() if w != self._specs[n].nbytes]
            if short:
                raise ExecutionError(
                    f"{self.dest}: {len(short)} tensor(s) were not written in full "
                    f"(first: {short[0]!r}); nothing was committed"
                )
            for fd in self._fds:
                os.fsync(fd)
                os.close(fd)
            self._fds.clear()
            if len(self.shards) > 1:
                weight_map = {
                    name: shard.filename for shard in self.shards for name in shard.offsets
                }
                index = {
                    "metadata": {"total_size": sum(s.nbytes for s in self._specs.values())},
                    "weight_map": weight_map,
                }
                data = json.dumps(index, indent=2, sort_keys=True) + "\n"
                self._write_small(INDEX_NAME, data.encode())
            if self.config is not None:
                # Strict JSON: Python would write NaN, which no JSON reader takes.
                text = json.dumps(self.config, indent=2, ensure_ascii=False, allow_nan=False)
                text += "\n"
                self._write_small(CONFIG_NAME, text.encode("utf-8"))
            for name, blob in self._files.items():
                self._write_small(name, blob)
            fsync_dir(self.tmp)
            if self.before_move is not None:
                self.before_move(self.tmp)
            self._move_into_place(self.tmp)
        except BaseException:
            self.abort()
            raise
        self.tmp = None
        self.committed = True
        return self.dest

    def _move_into_place(self, tmp: Path) -> None:
        dest = self.dest
        try:
            if not dest.exists() and not dest.is_symlink():
                # NOREPLACE: a run that finished first into the same destination wins; we refuse.
                if not renameat2(tmp, dest, RENAME_NOREPLACE):
                    if dest.exists():
                        raise FileExistsError(errno.EEXIST, "exists", str(dest))
                    os.rename(tmp, dest)
            elif not self.overwrite:
                raise FileExistsError(errno.EEXIST, "exists", str(dest))
            elif renameat2(tmp, dest, RENAME_EXCHANGE):
                # The old destination now sits at the temporary name; remove it.
                self.tmp = None
                self._remove_old(tmp)
            else:
                old = dest.parent / f".{dest.name}{TMP_MARKER}old-{secrets.token_hex(4)}"
                os.rename(dest, old)
                os.rename(tmp, dest)
                self.tmp = None
                self._remove_old(old)
        except FileExistsError:
            raise OutputExistsError(
                f"{dest} appeared while this conversion ran (another run into the same "
                "destination?); it was left as it is and this output was discarded"
            ) from None
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise OutputExistsError(
                    f"{dest} appeared while this conversion ran; it was left as it is"
                ) from None
            raise
        fsync_dir(dest.parent)

    def _remove_old(self, old: Path) -> None:
        """Remove the replaced output; if that fails, say exactly where both outputs are."""
        try:
            remove_path(old)
        except OSError as exc:
            fsync_dir(self.dest.parent)
            raise ExecutionError(
                f"{self.dest} holds the new output, complete, but the old output it replaced "
                f"could not be removed ({exc.strerror}: {exc.filename}); what is left of it is "
                f"at {old}: remove it once it can be (chmod u+w; chattr -i for an immutable "
                "file)"
            ) from exc
