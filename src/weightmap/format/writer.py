"""Writing a sharded safetensors checkpoint atomically, from bytes that arrive in any order.

The writer is told every output tensor (name, dtype, shape) up front, and where the bytes of
those that are unchanged input bytes come from, so it can plan the shards and write each
header before any data (``layout.py``). Data then arrives at planned offsets, from several
threads, either as bytes or as input byte ranges moved by the kernel: shared with the input
(cloned) where the filesystem can, copied otherwise. Everything is written inside a temporary
sibling folder that is moved into place only after every byte is written and fsynced.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from json.encoder import encode_basestring_ascii  # what json.dumps uses by default
from pathlib import Path
from typing import Any

from weightmap.errors import CheckpointError, ExecutionError, OutputExistsError
from weightmap.format.dtypes import SpecTable, TensorSpec
from weightmap.format.layout import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    Copy,
    Layouts,
    LazyHeader,
    Origin,
    aligned_middle,
    plan_members,
)
from weightmap.format.transfer import (
    DIRECT_ALIGN,
    DirectWrites,
    clone,
    copy,
    fallocate,
    fsyncing,
    pwrite_all,
    start_writeback,
)
from weightmap.fs.atomic import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    fsync_dir,
    is_within,
    removal_problem,
    remove_path,
    renameat2,
    stale_temporaries,
    temporary_path,
)
from weightmap.fs.cancel import CancelToken, keep_open_elsewhere
from weightmap.fs.safeopen import fd_path

__all__ = [
    "CheckpointWriter",
    "Piece",
    "check_destination",
    "destination_path",
    "transfer_piece",
]

# Copies go in pieces of this size: threads share the work, and each piece is handed to the
# disk as soon as it is written. Clones move no data and go in pieces of up to _CLONE_PIECE.
COPY_PIECE = 8 * 2**20
_CLONE_PIECE = 2**30
# What the probe clones: one block of the common size (a clone must cover whole blocks).
_PROBE_BYTES = 4096
# Space held in the temporary folder, from the start, for the files written after the shards
# (the side files): released just before they are written.
RESERVE_NAME = ".side-files.reserve"


@dataclass(frozen=True)
class Piece:
    """Part of a :class:`Copy`: ``length`` bytes from ``src`` of input ``file`` to ``dst`` of
    output shard ``shard``, to be cloned (``clone``) or copied."""

    file: int
    src: int
    shard: int
    dst: int
    length: int
    clone: bool


# The longest file name most filesystems take, in bytes; and what a temporary's name may add
# beyond the one made now (an in-place rename's suffix).
_NAME_MAX = 255
_SUFFIX_ROOM = 16


def _check_name_room(dest: Path) -> None:
    """Refuse a destination name too long to have its temporary beside it (that name adds the
    writer's pid, host and a token): said now, not as ENAMETOOLONG after the plan is made."""
    extra = len(temporary_path(dest).name.encode("utf-8", "surrogateescape")) - len(
        dest.name.encode("utf-8", "surrogateescape")
    )
    longest = _NAME_MAX - extra - _SUFFIX_ROOM
    size = len(dest.name.encode("utf-8", "surrogateescape"))
    if size > longest:
        raise ExecutionError(
            f"{dest}: the destination's name is {size} bytes; weightmap writes the output "
            f"beside it under a temporary name {extra} bytes longer, and a file name holds at "
            f"most {_NAME_MAX}: give a name of at most {longest} bytes; nothing was written"
        )


def destination_path(dest: Path) -> Path:
    """``dest`` as the writer uses it, or an ExecutionError for a name it cannot commit to.

    Refused: a destination whose last part is ``..`` or ``.`` (or ``/``): it names a folder
    that already holds others, the input perhaps, by a name that no rename can take (EBUSY),
    and ``in/..`` reads as if it were inside ``in``. Then the folders that do not exist yet
    are made plain folders by the writer, which the kernel would pass through as written:
    ``e/y/../z`` with no ``e/y`` is ``e/z``, so the ``..`` is taken lexically there, and no
    ``e/y`` is left behind. The part that exists is left to the kernel (a link in it is
    followed, then ``..`` taken from its target).
    """
    if dest.name in ("", ".", ".."):
        try:
            real = os.path.realpath(dest)  # (never raises for a loop of links, unlike resolve)
        except (OSError, ValueError):
            real = os.path.abspath(dest)
        raise ExecutionError(
            f"{dest}: a destination ending in `..` or `.` names an existing folder ({real}), "
            "not an output folder of its own; nothing was written. Give the output folder by "
            f"its name, e.g. {os.path.join(real, 'converted')}"
        )
    _check_name_room(dest)
    parts = dest.parts
    for i in range(len(parts)):
        if not os.path.lexists(Path(*parts[: i + 1])):
            break
    else:
        return dest
    tail = parts[i:]
    if ".." not in tail:
        return dest
    # normpath collapses only what follows the last existing folder: it has no links.
    rest = os.path.normpath(os.path.join(*tail))
    return Path(*parts[:i], rest) if i else Path(rest)


def check_destination(
    dest: Path, overwrite: bool, protect: Iterable[str | os.PathLike[str]] = ()
) -> None:
    """Refuse a destination the writer cannot commit to, before any work (a dry run asks too):
    one that holds a file of ``protect`` (the input), exists without ``overwrite``, is no
    folder, cannot be removed, or whose parent is no folder."""
    for p in protect:
        # The file where it leads, and the folder its name is in: a hub cache snapshot's
        # files are links into blobs/, and replacing the snapshot deletes the input all the
        # same.
        if is_within(Path(p), dest) or is_within(Path(p).parent, dest):
            raise OutputExistsError(
                f"{dest}: the destination holds the input ({p}); choose another folder "
                "(in-place mode rewrites headers without a destination)"
            )
    if dest.is_symlink() and not dest.exists() and not overwrite:
        # Refused now, not after converting in full: the commit's rename would refuse it.
        # A loop of links (a link to itself) leads nowhere either, and is said so.
        target = os.readlink(dest)
        what = "which does not exist" if _dangling(dest) else "a loop of links"
        raise OutputExistsError(
            f"{dest} is a symbolic link (to {target}, {what}); remove it, or pass "
            "overwrite=True (--overwrite) to replace the link"
        )
    if dest.exists() and not dest.is_symlink() and not dest.is_dir():
        # overwrite replaces an old output, which is a folder; a file, FIFO or device
        # under the name is something else (as root, /dev/null would be replaced). Said
        # first, with or without overwrite: suggesting it would only lead here.
        kind = "file" if dest.is_file() else "special file (a FIFO, socket or device)"
        raise OutputExistsError(
            f"{dest} is a {kind}, not a folder: the output is a folder, and overwrite=True "
            "(--overwrite) replaces an old output folder only; remove it yourself or choose "
            "another destination"
        )
    if dest.exists() and not overwrite:
        raise OutputExistsError(
            f"{dest} already exists; pass overwrite=True (--overwrite) to replace it"
        )
    if dest.exists() and (why := removal_problem(dest)) is not None:
        # Checked now: after the swap the new output would be in place and the old one
        # stuck beside it under a temporary name.
        raise ExecutionError(
            f"{dest} cannot be replaced: {why}, so the old output could not be "
            "removed; nothing was written. Make it removable (chmod u+w; chattr -i for an "
            "immutable file) or choose another destination"
        )
    if dest.parent.exists() and not dest.parent.is_dir():
        raise ExecutionError(f"{dest.parent}: the destination's parent is not a folder")


# A file of the temporary folder: made new, never opened through a link planted there.
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class CheckpointWriter:
    """Write a checkpoint into ``dest`` atomically.

    Use as a context manager: on a clean exit the output is committed (moved into place); on an
    exception everything temporary is removed and ``dest`` is left as it was. ``members``
    (``(name prefix, file name)``, see ``layout.plan_members``) puts the tensors named with a
    prefix into a file of their own, committed with the rest.

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
        origins: Mapping[str, Origin] | None = None,
        inputs: Sequence[str | os.PathLike[str]] = (),
        layout: Layouts = "clone",
        members: Sequence[tuple[str, str]] = (),
        held: Mapping[Path, int] | None = None,
    ) -> None:
        self.dest = destination_path(Path(dest))
        names = specs.names if isinstance(specs, SpecTable) else [s.name for s in specs]
        if len(set(names)) != len(specs):
            counts = Counter(names)
            dup = sorted(n for n, c in counts.items() if c > 1)
            raise ValueError(f"output tensor names repeat: {', '.join(dup[:10])}")
        check_destination(self.dest, overwrite, protect)
        self.overwrite = overwrite
        self.config = None if config is None else dict(config)
        planned, self._main = plan_members(
            specs, members, max_shard_size, metadata, origins, layout
        )
        self.shards = list(planned.shards)
        self.copies = planned.copies
        self._inputs = [Path(p) for p in inputs]
        # The inputs as their checkpoint opened them once (its own, looked up as they are
        # needed: read, never closed here). Without a checkpoint's (``held`` None: a writer
        # used on its own), an input is opened by name, and closed once copied from.
        self._input_fds = held
        # (The index lists the main checkpoint's shards, which come first; not the members'.)
        # Where each shard's data starts: the headers themselves (a hundred bytes per tensor)
        # are let go once open() has written them (``shards`` then hold empty ones).
        self.data_starts = [len(s.header) for s in self.shards]
        main = zip(self.shards[: self._main], self.data_starts, strict=False)
        self._total = sum(s.size - start for s, start in main)
        # name -> (shard idx, begin, end), for the tensors written by name: made on the first
        # such write, as a conversion that only moves input bytes never asks.
        self._where_map: dict[str, tuple[int, int, int]] | None = None
        self._written = [0] * len(self.shards)  # data bytes written, by shard
        self._lock = threading.Lock()
        self._fds: list[int] = []
        # Chunks past the page cache, opt-in: on the disk measured, neither way won every time,
        # and the first writes through the page cache after direct ones were slow
        # (docs/benchmarks.md). Read here, by the driver of a Ray run too: its tasks are told.
        self.direct_io = os.environ.get("WEIGHTMAP_DIRECT_IO", "0") == "1"
        self._directs = DirectWrites(self.direct_io)
        self._src: dict[int, int] = {}  # input file number -> read-only fd
        self._clones: dict[int, bool] = {}  # input file number -> may clone into the output
        self._src_size: dict[int, int] = {}
        self._pieces: list[Piece] = []
        self._files: dict[str, bytes] = {}
        self._index_written = False  # (see prepare_index)
        # Headers made only when written (a whole rename's) may be written after the copies
        # into their shards have begun, by write_headers (the copies touch none of their
        # bytes); the commit writes any left.
        self.defer_headers = False
        self._pending: list[tuple[int, LazyHeader]] = []
        self.tmp: Path | None = None
        # The run's token (the executor sets it): the move into place is shielded on it, and
        # marks it committed.
        self.token: CancelToken | None = None
        # The temporary folder as opened once made (see _hold_folder): its descriptor, device
        # and inode, and the path that reaches it through the descriptor.
        self._folder_fd = -1
        self._folder_id = (0, 0)
        self.held = Path()
        self._tmp_mode = 0o700  # the temporary folder's mode as made, given back at commit
        self.committed = False
        # Called with the finished temporary folder just before it is moved into place; an
        # exception from it discards the output (used to verify before committing).
        self.before_move: Callable[[Path], None] | None = None
        # Bytes of disk the files written into the temporary folder after the shards need
        # (the side files), reserved with the shards' (see _reserve).
        self.reserve_after = 0

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
        """Create the temporary folder and every shard with its header, its space reserved."""
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExecutionError(f"{self.dest.parent}: cannot create the folder ({exc})") from exc
        # What a killed earlier run into the same destination left behind goes first.
        for stale in stale_temporaries(self.dest.parent, self.dest.name):
            with contextlib.suppress(OSError):
                remove_path(stale)
        self.tmp = temporary_path(self.dest)
        try:
            # Private while it is written (tasks on other machines reopen its files by path:
            # with a group-writable umask, a member of the group could swap one for a link),
            # given back the mode it was made with (umask, default ACL) once complete.
            self.tmp.mkdir()
            self._hold_folder(self.tmp)
            for i, shard in enumerate(self.shards):
                fd = os.open(self.held / shard.filename, _CREATE, 0o644)
                self._fds.append(fd)
                if self.defer_headers and isinstance(shard.header, LazyHeader):
                    self._pending.append((fd, shard.header))  # (see write_headers)
                else:
                    pwrite_all(fd, bytes(shard.header), 0)  # (a LazyHeader is made now)
                os.ftruncate(fd, shard.size)
                self.shards[i] = replace(shard, header=b"")  # (written: see data_starts)
            for number in sorted({c.file for c in self.copies}):
                path = self._inputs[number]
                if self._input_fds is None:
                    self._src[number] = os.open(path, os.O_RDONLY)
                elif (src_fd := self._input_fds.get(path)) is not None:
                    self._src[number] = src_fd
                else:
                    raise CheckpointError.closed(path)
            self._probe_clones()
            self._pieces = self._cut_copies()
            self._reserve()
        except OSError as exc:
            self.abort()
            raise ExecutionError(f"{self.dest}: cannot create the output ({exc})") from exc
        except BaseException:
            # An interrupt while the shards are made (a KeyboardInterrupt): a failed __enter__
            # gets no __exit__, so what was made goes here.
            self.abort()
            raise

    def _probe_clones(self) -> None:
        """Find out, once per input filesystem, whether its blocks can be shared with ours.

        A whole block of the input is cloned into a scratch file beside the shards: success
        means every aligned clone from that filesystem will share extents; any refusal means
        none will, and those bytes are copied.
        """
        stats = {number: os.fstat(fd) for number, fd in self._src.items()}
        by_device: dict[int, bool] = {}
        for number, st in sorted(stats.items(), key=lambda kv: -kv[1].st_size):
            if st.st_dev not in by_device:
                # The largest input of each filesystem: one with a whole block, if any has.
                by_device[st.st_dev] = st.st_size >= _PROBE_BYTES and self._probe(self._src[number])
            self._clones[number] = by_device[st.st_dev]
            self._src_size[number] = st.st_size

    def shard_inodes(self) -> tuple[int, ...]:
        """Each shard's inode (a task on another node opens the shards by name, and checks it
        opened these)."""
        return tuple(os.fstat(fd).st_ino for fd in self._fds)

    def _hold_folder(self, tmp: Path) -> None:
        """Open the temporary folder just made, once, and reach it through that descriptor
        from now on (``held``): in a shared folder another user may rename it and put a link
        to a folder of yours under its name, which writes by name would then go into."""
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        # Another user's folder put in its place between the mkdir and the open would get
        # the output. (Not asked of root: an NFS export that squashes root makes root's
        # folders nobody's.)
        if st.st_uid != os.geteuid() and os.geteuid() != 0:
            os.close(fd)
            raise ExecutionError(f"{tmp}: the temporary folder was replaced as it was made")
        self._folder_fd, self._folder_id = fd, (st.st_dev, st.st_ino)
        self._tmp_mode = stat.S_IMODE(st.st_mode)
        os.fchmod(fd, 0o700)
        # Linux names the folder itself here, whatever its name has become.
        self.held = fd_path(fd, tmp)

    def _release_folder(self) -> None:
        if self._folder_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._folder_fd)
        self._folder_fd = -1

    def _check_folder(self, tmp: Path) -> None:
        """Refuse to move ``tmp`` into place unless it is still the folder written: moved and
        replaced (by a link, say), what is under its name is not this output."""
        try:
            st = os.stat(tmp, follow_symlinks=False)
            same = stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == self._folder_id
        except OSError:
            same = False
        if not same:
            raise ExecutionError(
                f"{self.dest}: the temporary folder {tmp.name} was moved or replaced while the "
                "output was written (by another user of the folder?); nothing was committed"
            )

    def _probe(self, src_fd: int) -> bool:
        assert self.tmp is not None
        probe = self.held / ".clone-probe"
        fd = os.open(probe, _CREATE, 0o600)
        try:
            return clone(src_fd, 0, fd, 0, _PROBE_BYTES)
        finally:
            os.close(fd)
            probe.unlink()

    def _reserve(self) -> None:
        """Reserve the space of every byte that will not be cloned, so that a full disk fails
        here, before minutes of copying (cloned blocks are the input's and need none)."""
        shared: list[list[tuple[int, int]]] = [[] for _ in self.shards]
        for piece in self._pieces:
            if piece.clone:
                shared[piece.shard].append((piece.dst, piece.dst + piece.length))
        for fd, shard, skip in zip(self._fds, self.shards, shared, strict=True):
            position = 0
            for begin, end in [*sorted(skip), (shard.size, shard.size)]:
                if begin > position and not fallocate(fd, position, begin - position):
                    break  # the filesystem cannot reserve space; the writes will allocate it
                position = max(position, end)
        if self.reserve_after > 0:
            # Counted with the rest before the first byte is copied: a disk too small for the
            # side files fails here, not after minutes of tensors.
            assert self.tmp is not None
            fd = os.open(self.held / RESERVE_NAME, _CREATE, 0o600)
            try:
                fallocate(fd, 0, self.reserve_after)
            finally:
                os.close(fd)

    def abort(self) -> None:
        """Close and remove everything temporary; ``dest`` is untouched."""
        self._close_inputs()
        self._directs.close()
        keep_open_elsewhere(self._fds)  # (only once a signal stopped the command line)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._pending.clear()  # (their descriptors are closed)
        if self.tmp is not None and self._folder_fd >= 0:
            # What is under the name only if it is the folder written (rmtree follows no
            # link); a folder moved away by someone else is theirs to find.
            with contextlib.suppress(ExecutionError):
                self._check_folder(self.tmp)
                shutil.rmtree(self.tmp, ignore_errors=True)
        self._release_folder()
        self.tmp = None

    # -- data ----------------------------------------------------------------------------------

    def _where(self, name: str) -> tuple[int, int, int]:
        where = self._where_map
        if where is None:
            with self._lock:  # written by several threads: made once
                if self._where_map is None:
                    self._where_map = {
                        tensor: (i, b, e)
                        for i, shard in enumerate(self.shards)
                        for tensor, (b, e) in shard.offsets.items()
                    }
                where = self._where_map
        return where[name]

    def target(self, name: str) -> tuple[int, int, int]:
        """``(fd, file offset, length)`` of tensor ``name`` in its output shard."""
        shard, begin, end = self._where(name)
        return self._fds[shard], begin, end - begin

    def _check(self, name: str, offset: int, length: int) -> tuple[int, int]:
        fd, begin, size = self.target(name)
        if offset < 0 or offset + length > size:
            raise ValueError(
                f"write of {length} bytes at {offset} falls outside tensor {name!r} ({size} bytes)"
            )
        return fd, begin + offset

    def _done(self, shard: int, length: int) -> None:
        with self._lock:
            self._written[shard] += length

    def record(self, shard: int, length: int) -> None:
        """Count ``length`` data bytes of shard number ``shard`` as written by another process
        (a task that opened the shard in the temporary folder itself)."""
        self._done(shard, length)

    def write(self, name: str, data: bytes | memoryview, offset: int = 0) -> None:
        """Write ``data`` into tensor ``name`` starting ``offset`` bytes into it.

        With ``WEIGHTMAP_DIRECT_IO=1``, chunks of a megabyte or more go to the disk directly
        (O_DIRECT), past the page cache: a computed tensor's bytes are written once and not
        read again, and where copying them into the cache is what limits the write (a fast
        disk, a busy CPU) that copy is saved. Where the filesystem refuses, through the cache.
        """
        length = memoryview(data).nbytes
        fd, position = self._check(name, offset, length)
        shard = self._where(name)[0]

        def path() -> Path:
            # The very file of the shard's descriptor, not whatever its name holds now.
            assert self.tmp is not None  # (a shard's descriptor exists once open() made it)
            return fd_path(self._fds[shard], self.held / self.shards[shard].filename)

        self._directs.write(shard, fd, path, data, position)
        self._done(shard, length)

    def phase(self, name: str, offset: int) -> int:
        """Where in its disk block byte ``offset`` of tensor ``name`` lands: memory holding a
        chunk that starts there at the same place in a block of memory goes to the disk
        without a copy (``pwrite_direct``)."""
        return (self._where(name)[1] + offset) % DIRECT_ALIGN

    def copy_range(
        self, name: str, src_fd: int, src_offset: int, length: int, offset: int = 0
    ) -> None:
        """Copy ``length`` bytes of another file into tensor ``name``, in the kernel if possible."""
        fd, position = self._check(name, offset, length)
        copy(src_fd, src_offset, fd, position, length, name)
        self._done(self._where(name)[0], length)

    def pieces(self) -> list[Piece]:
        """The planned copies cut into pieces (once the writer is open): whole blocks at
        congruent offsets are cloned where the input's filesystem can share them, in pieces of
        up to 1 GiB; everything else is copied in pieces of up to 8 MiB cut at block
        boundaries."""
        return list(self._pieces)

    def _cut_copies(self) -> list[Piece]:
        out: list[Piece] = []
        for c in self.copies:
            head, middle = aligned_middle(c.src, c.dst, c.length)
            if not self._clones.get(c.file) or not middle:
                out += _cut(c, 0, c.length, False)
                continue
            if head + middle < c.length and self._at_both_ends(c):
                middle = c.length - head  # up to the end of both files: the last block too
            out += _cut(c, 0, head, False)
            out += _cut(c, head, middle, True)
            out += _cut(c, head + middle, c.length - head - middle, False)
        return out

    def _at_both_ends(self, c: Copy) -> bool:
        end = c.src + c.length
        return end == self._src_size[c.file] and c.dst + c.length == self.shards[c.shard].size

    def transfer(self, piece: Piece) -> bool:
        """Move one piece into the output; True if it was cloned (its extents now shared).

        A clone the filesystem refuses after all falls back to a copy.
        """
        fd = self._fds[piece.shard]
        cloned = transfer_piece(self._src[piece.file], fd, piece, self.shards[piece.shard].filename)
        self._done(piece.shard, piece.length)
        return cloned

    def _close_inputs(self) -> None:
        if self._input_fds is not None:  # (the checkpoint's own: it closes them)
            self._src.clear()
            return
        for fd in self._src.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._src.clear()

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

    def _write_small(self, name: str, data: bytes | Iterable[bytes]) -> None:
        """Write a small file of the output (``data``: its bytes, or its bytes in parts, made
        as they are written) and fsync it."""
        assert self.tmp is not None
        fd = os.open(self.held / name, _CREATE, 0o644)
        try:
            position = 0
            for part in [data] if isinstance(data, bytes) else data:
                pwrite_all(fd, part, position)
                position += len(part)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _index_lines(self) -> Iterator[bytes]:
        """The index's text, in parts of ``_INDEX_LINES`` names, made as they are asked for."""
        # Shard by shard at C speed: an index lists every tensor.
        weight_map: dict[str, str] = {}
        for shard in self.shards[: self._main]:
            weight_map.update(dict.fromkeys(shard.offsets, shard.filename))
        return map(str.encode, _index_parts(self._total, weight_map, _INDEX_LINES))

    def write_headers(self, check: Callable[[], None] = lambda: None) -> None:
        """Make and write the headers ``open`` left for later (``defer_headers``), one at a
        time; ``check()`` is called before each (it raises to stop)."""
        while self._pending:
            check()
            fd, header = self._pending[0]
            pwrite_all(fd, bytes(header), 0)
            del self._pending[0]

    def prepare_index(self, check: Callable[[], None] = lambda: None) -> None:
        """Write the index into the temporary folder now, rather than at :meth:`commit`:
        called while the workers copy, it takes none of the time after them (an index of
        100,000 names takes a tenth of a second to sort and write out). ``check()`` is called
        before each part (it raises to stop)."""
        if self.tmp is None:
            raise ExecutionError(f"{self.dest}: the writer is not open")
        if self._main > 1 and not self._index_written:
            self._write_small(INDEX_NAME, _checked(self._index_lines(), check))
            self._index_written = True

    def commit(self) -> Path:
        """Check every byte arrived, fsync, and move the output into place."""
        if self.tmp is None:
            raise ExecutionError(f"{self.dest}: the writer is not open")
        try:
            for shard, start, written in zip(
                self.shards, self.data_starts, self._written, strict=True
            ):
                expected = shard.size - start
                if written != expected:
                    raise ExecutionError(
                        f"{self.dest}: {shard.filename} got {written:,} of its {expected:,} "
                        "data bytes: tensors were not written in full; nothing was committed"
                    )
            self.write_headers()
            self._close_inputs()
            self._directs.close()  # (the shards' own descriptors fsync what went through them)
            # The small files are made and written while the shards' fsyncs wait on the disk
            # (an index of 100,000 names takes a while to write out).
            with fsyncing(self._fds, self.token):
                self.prepare_index()  # (unless written as the copies ran)
                if self.config is not None:
                    # Strict JSON: Python would write NaN, which no JSON reader takes.
                    text = json.dumps(self.config, indent=2, ensure_ascii=False, allow_nan=False)
                    text += "\n"
                    self._write_small(CONFIG_NAME, text.encode("utf-8"))
                for name, blob in self._files.items():
                    self._write_small(name, blob)
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
            os.fchmod(self._folder_fd, self._tmp_mode)
            os.fsync(self._folder_fd)
            if self.before_move is not None:
                self.before_move(self.held)
            # (Released by whoever wrote the side files; never part of the output.)
            (self.held / RESERVE_NAME).unlink(missing_ok=True)
            # From the first rename to the old output's removal, one stretch that a signal
            # does not cut (it is honoured once the output is in place): cut between two
            # renames, an overwrite could leave the destination missing, the old output
            # stranded under a temporary name, or report an output in place as not committed.
            with self.token.shielded() if self.token is not None else contextlib.nullcontext():
                self._check_folder(self.tmp)
                self._move_into_place(self.tmp)
                self.committed = True
                if self.token is not None:
                    self.token.mark_committed()
        except BaseException:
            self.abort()
            raise
        self._release_folder()
        self.tmp = None
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
                # Named as ours, so that no other run takes it for stale and removes it while
                # it may still have to go back.
                old = temporary_path(dest, "-old")
                os.rename(dest, old)
                try:
                    os.rename(tmp, dest)
                except BaseException:
                    # The old output goes back under its name: a failed overwrite must leave
                    # the destination as it was, not missing.
                    with contextlib.suppress(OSError):
                        os.rename(old, dest)
                    raise
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


def _dangling(link: Path) -> bool:
    """True when the link ``link`` points at nothing, False when it is in a loop of links."""
    try:
        os.stat(link)
    except OSError as err:
        return err.errno != errno.ELOOP
    return False


def _checked(parts: Iterable[bytes], check: Callable[[], None]) -> Iterator[bytes]:
    """``parts``, with ``check()`` called before each."""
    for part in parts:
        check()
        yield part


def transfer_piece(src_fd: int, fd: int, piece: Piece, what: str) -> bool:
    """Clone or copy one piece from input ``src_fd`` into shard ``fd`` (named ``what`` in
    errors); True if it was cloned. Idempotent: the same bytes land at the same offsets."""
    cloned = piece.clone and clone(src_fd, piece.src, fd, piece.dst, piece.length)
    if not cloned:
        copy(src_fd, piece.src, fd, piece.dst, piece.length, what)
        start_writeback(fd, piece.dst, piece.length)
    return cloned


def _index_text(total_size: int, weight_map: Mapping[str, str]) -> str:
    """``json.dumps(index, indent=2, sort_keys=True)`` plus a newline (see ``_index_parts``)."""
    return "".join(_index_parts(total_size, weight_map))


# Lines of the index made and written at a time: a few megabytes of text, where the whole
# index of 100,000 names and more, as lines, one string and its bytes, took over 200 bytes of
# memory per tensor at the peak of a conversion.
_INDEX_LINES = 16384


def _index_parts(
    total_size: int, weight_map: Mapping[str, str], lines: int = _INDEX_LINES
) -> Iterator[str]:
    """The text of ``_index_text`` in parts of ``lines`` names, written line by line: json's
    indenting encoder is pure Python, and an index may list 100,000 tensors."""
    yield f'{{\n  "metadata": {{\n    "total_size": {total_size}\n  }},\n  "weight_map": '
    if not weight_map:
        yield "{}\n}\n"
        return
    names = sorted(weight_map)
    # Each shard's name encoded once: they are few, and each is named once per tensor.
    shards = {shard: encode_basestring_ascii(shard) for shard in set(weight_map.values())}
    for start in range(0, len(names), lines):
        part = names[start : start + lines]
        files = map(shards.__getitem__, map(weight_map.__getitem__, part))
        entries = ",\n".join(map(_ENTRY, map(encode_basestring_ascii, part), files))
        yield ("{\n" if start == 0 else ",\n") + entries
    yield "\n  }\n}\n"


# One line of the index's weight map (without its comma), from the encoded name and shard.
_ENTRY = "    {}: {}".format


def _cut(c: Copy, begin: int, length: int, clone: bool) -> list[Piece]:
    """``[begin, begin + length)`` of a copy as pieces ending on piece-size boundaries of the
    output (block boundaries, so the input side stays congruent)."""
    step = _CLONE_PIECE if clone else COPY_PIECE
    out = []
    position, end = c.dst + begin, c.dst + begin + length
    while position < end:
        stop = min(end, (position // step + 1) * step)
        out.append(
            Piece(c.file, c.src + position - c.dst, c.shard, position, stop - position, clone)
        )
        position = stop
    return out
