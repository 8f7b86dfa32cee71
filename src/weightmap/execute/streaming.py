"""The streaming executor: a plan over an open checkpoint, into a new checkpoint.

Each output tensor takes one of two paths:

- **bytes**: where the output's bytes are a sequence of input byte ranges (rename, keep,
  reshape, slices and concatenations whose outer dimensions allow it, casts to the same dtype,
  permutes that only move size-1 dimensions), the ranges are copied in the kernel with
  ``copy_file_range`` and never pass through Python objects;
- **chunks**: everything else is computed in slices along one output dimension over
  memory-mapped views, each slice small enough that the intermediates stay within the chunk
  budget, and written at its offset.

Tensors are spread over a small pool of threads; each tensor is handled by one thread, in order,
so its checksum can be computed as it is written.
"""

from __future__ import annotations

import ctypes
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weightmap.errors import ExecutionError, FormatError
from weightmap.execute.chunks import chunk_plan, region, tree_nodes
from weightmap.execute.kernels import OPAQUE_DTYPES, evaluate, tensor_bytes
from weightmap.execute.nans import settle, strategy
from weightmap.execute.segments import Segment, byte_segments
from weightmap.format.checkpoint import Checkpoint
from weightmap.format.dtypes import DTYPES, nbytes, numel
from weightmap.format.writer import CheckpointWriter
from weightmap.plan.nodes import Cast, Node, int_cast_fits
from weightmap.plan.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ExecutionStats",
    "check_inputs",
    "check_unchanged",
    "default_workers",
    "execute",
]

DEFAULT_CHUNK_BYTES = 64 * 2**20
# Below this average size, many small kernel copies cost more than computing the tensor.
_MIN_SEGMENT = 64 * 1024
_FEW_SEGMENTS = 64
# Large copies go in pieces of this size, each handed to the disk as soon as it is written.
_PIECE = 64 * 2**20
_SYNC_FILE_RANGE_WRITE = 2

ProgressFn = Callable[[int], None]


def default_workers() -> int:
    """A sensible thread count: the cores, at most 8 (the disk is the limit beyond that)."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class ExecutionStats:
    """What an execution did: bytes moved by each path and per-tensor checksums."""

    bytes_copied: int = 0
    bytes_computed: int = 0
    checksums: dict[str, int] | None = None


def check_inputs(plan: Plan, ckpt: Checkpoint) -> None:
    """Refuse to run a plan against a checkpoint that differs from the one it was compiled for."""
    current = {s.name: s for s in ckpt.specs()}
    changed = [spec.name for spec in plan.inputs if current.get(spec.name) != spec]
    if changed:
        raise ExecutionError(
            f"{ckpt.root}: the checkpoint differs from the one the plan was compiled for "
            f"(first: {changed[0]!r}); compile the plan again"
        )
    check_unchanged(ckpt)


def check_unchanged(ckpt: Checkpoint) -> None:
    """Refuse if any file's size or modification time differs from when its header was read."""
    for path, header in ckpt.headers.items():
        try:
            st = path.stat()
        except FileNotFoundError:
            raise FormatError(
                "file disappeared while the conversion ran", path=path, rule="changed"
            ) from None
        if st.st_size != header.file_size or st.st_mtime_ns != header.mtime_ns:
            raise FormatError(
                "file changed while the conversion ran (or since its header was read); nothing "
                "was written: run the conversion again",
                path=path,
                rule="changed",
            )


class _Runner:
    def __init__(
        self,
        ckpt: Checkpoint,
        writer: CheckpointWriter,
        chunk_bytes: int,
        checksum: bool,
        progress: ProgressFn | None,
    ) -> None:
        self.ckpt = ckpt
        self.writer = writer
        self.chunk_bytes = chunk_bytes
        self.checksum = checksum
        self.progress = progress
        self.stats = ExecutionStats(checksums={} if checksum else None)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        # One output buffer per thread, reused chunk after chunk: a fresh allocation per chunk
        # costs a page fault per page (and its zeroing) every time.
        self._scratch = threading.local()

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _report(self, n: int, copied: bool) -> None:
        with self._lock:
            if copied:
                self.stats.bytes_copied += n
            else:
                self.stats.bytes_computed += n
        if self.progress is not None:
            self.progress(n)

    def run(self, name: str, node: Node) -> None:
        segments = byte_segments(node)
        if segments is not None and not all(self.ckpt.has_range(s.name) for s in segments):
            segments = None  # a PyTorch tensor strided in its storage: no byte range to copy
        _, _, length = self.writer.target(name)
        if segments is not None and (
            len(segments) <= _FEW_SEGMENTS or length // len(segments) >= _MIN_SEGMENT
        ):
            self._copy(name, segments)
        else:
            self._compute(name, node)

    def _copy(self, name: str, segments: list[Segment]) -> None:
        crc = 0
        position = 0
        for seg in segments:
            loc = self.ckpt.location(seg.name)
            for begin in range(0, seg.length, _PIECE):
                piece = Segment(seg.name, seg.offset + begin, min(_PIECE, seg.length - begin))
                self.writer.copy_range(
                    name, self.fd(loc.path), loc.offset + piece.offset, piece.length, position
                )
                self._start_writeback(name, position, piece.length)
                if self.checksum:
                    # Checksum the source bytes through the page cache the copy just warmed.
                    crc = zlib.crc32(self._raw(piece), crc)
                position += piece.length
                self._report(piece.length, copied=True)
        if self.stats.checksums is not None:
            self.stats.checksums[name] = crc

    def _start_writeback(self, name: str, offset: int, length: int) -> None:
        """Ask the kernel to start writing these output bytes to disk now, without waiting.

        The commit fsyncs every shard; started early, the disk writes overlap the rest of the
        copying instead of all waiting for that fsync.
        """
        if length < _MIN_SEGMENT:
            return
        fd, begin, _ = self.writer.target(name)
        _sync_file_range(fd, begin + offset, length)

    def _raw(self, seg: Segment) -> memoryview:
        import torch

        view = self.ckpt.view(seg.name)
        if view.numel() == 0:
            return memoryview(b"")
        raw = view.reshape(-1).view(torch.uint8)[seg.offset : seg.offset + seg.length]
        return raw.numpy().data

    def _compute(self, name: str, node: Node) -> None:
        opaque = sorted({n.dtype for n in tree_nodes(node)} & OPAQUE_DTYPES)
        if opaque:
            raise ExecutionError(
                f"{name}: {opaque[0]} data can only be renamed, kept, reshaped, or split and "
                "merged along whole bytes; this rule needs arithmetic on it"
            )
        if nbytes(node.dtype, node.shape) == 0:
            if self.stats.checksums is not None:
                self.stats.checksums[name] = 0
            return
        dim, step = chunk_plan(node, self.chunk_bytes)
        extent = node.shape[dim] if node.shape else 1
        crc = 0
        offset = 0
        for start in range(0, max(extent, 1), step):
            stop = min(extent, start + step)
            if node.shape:
                data = self._chunk(node, dim, start, stop, name)
            else:
                data = memoryview(tensor_bytes(evaluate(node, self.ckpt.view, name)))
            if data.nbytes:
                self.writer.write(name, data, offset)
                self._start_writeback(name, offset, data.nbytes)
                if self.checksum:
                    crc = zlib.crc32(data, crc)
            offset += data.nbytes
            self._report(data.nbytes, copied=False)
            del data
        if self.stats.checksums is not None:
            self.stats.checksums[name] = crc

    def _chunk(self, node: Node, dim: int, start: int, stop: int, name: str) -> memoryview:
        """The bytes of ``node`` over ``[start, stop)`` along ``dim``, without a copy to bytes.

        A cast at the top (the common whole-checkpoint cast) converts straight from the
        memory-mapped input into the thread's buffer: ``copy_`` is what ``Tensor.to`` does
        after allocating. Integer casts that may lose values keep the checked path.
        """
        if (
            isinstance(node, Cast)
            and node.src.dtype != node.dtype
            and int_cast_fits(node.src.dtype, node.dtype)
        ):
            src = region(node.src, dim, start, stop, self.ckpt.view, name)
            out = self._buffer(DTYPES[node.dtype].torch(), tuple(src.shape))
            how = strategy(src.dtype, out.dtype)
            if how == "contiguous" and not src.is_contiguous():
                staged = self._buffer(src.dtype, tuple(src.shape), slot=2)
                self._copy_into(staged, src)  # same dtype: moves bytes, converts nothing
                src = staged
            self._copy_into(out, src)
            if how == "settle":
                settle(out, src)
            return _memory(out)
        part = region(node, dim, start, stop, self.ckpt.view, name)
        if part.is_contiguous():
            return _memory(part)
        out = self._buffer(part.dtype, tuple(part.shape))
        self._copy_into(out, part)
        return _memory(out)

    def _copy_into(self, out: torch.Tensor, src: torch.Tensor) -> None:
        """``out.copy_(src)``; a transposed view is first gathered in its own memory order.

        Copied directly, a transposed view reads every element from a different row of the
        input, a cache miss each. Gathering the view's rows into a compact block reads the
        input in order, and the copy out of that block is a permute of a contiguous tensor,
        which torch transposes in cache-sized tiles (2-D). Same elements, same result.
        """
        if src.dim() < 2 or src.stride(-1) == 1:
            out.copy_(src)
            return
        strides = src.stride()
        order = sorted(range(src.dim()), key=lambda d: -strides[d])
        staged = src.permute(order)
        block = self._buffer(src.dtype, tuple(staged.shape), slot=1)
        block.copy_(staged)
        inverse = [0] * len(order)
        for i, d in enumerate(order):
            inverse[d] = i
        out.copy_(block.permute(inverse))

    def _buffer(self, dtype: torch.dtype, shape: tuple[int, ...], slot: int = 0) -> torch.Tensor:
        """This thread's scratch buffer ``slot``, grown as needed, viewed as ``dtype[shape]``."""
        import torch

        nbytes = numel(shape) * dtype.itemsize
        bufs: dict[int, torch.Tensor] = self._scratch.__dict__.setdefault("bufs", {})
        buf = bufs.get(slot)
        if buf is None or buf.numel() < nbytes:
            bufs.pop(slot, None)  # let the old buffer go before allocating the larger one
            buf = bufs[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype).view(shape)


_sync_range: Callable[[int, int, int, int], int] | None = None
_sync_range_missing = False


def _sync_file_range(fd: int, offset: int, length: int) -> None:
    """Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing where it is unavailable.

    Only a hint for the kernel's writeback (the commit's fsync is what makes data durable), so
    any failure just turns it off.
    """
    global _sync_range, _sync_range_missing
    if _sync_range_missing:
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


def _memory(t: torch.Tensor) -> memoryview:
    """The row-major bytes of a contiguous tensor, as a view (the bytes ``tensor_bytes`` gives)."""
    import torch

    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().data


def execute(
    plan: Plan,
    ckpt: Checkpoint,
    dest: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    workers: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum: bool = False,
    progress: ProgressFn | None = None,
    metadata: dict[str, str] | None = None,
    extra_files: Sequence[tuple[str, bytes]] = (),
    before_commit: Callable[[Path, ExecutionStats], None] | None = None,
) -> tuple[CheckpointWriter, ExecutionStats]:
    """Write ``plan`` applied to ``ckpt`` into ``dest`` atomically; see the module docstring.

    ``before_commit(folder, stats)`` is called with the finished temporary folder before it is
    moved into place; if it raises, nothing is committed (``remap`` verifies there).
    """
    check_inputs(plan, ckpt)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    n_workers = default_workers() if workers is None else workers
    if n_workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    writer = CheckpointWriter(
        dest,
        plan.output_specs(),
        max_shard_size=max_shard_size,
        metadata={"format": "pt"} if metadata is None else metadata,
        config=plan.config,
        overwrite=overwrite,
        protect=ckpt.files,
    )
    for fname, blob in extra_files:
        writer.add_file(fname, blob)
    runner = _Runner(ckpt, writer, chunk_bytes, checksum, progress)
    if before_commit is not None:
        check = before_commit
        writer.before_move = lambda folder: check(folder, runner.stats)
    try:
        with writer:
            # Biggest tensors first, so one large tensor does not finish last on its own.
            jobs = sorted(plan.outputs, key=lambda o: -o.spec.nbytes)
            if n_workers == 1:
                for out in jobs:
                    runner.run(out.name, out.node)
            else:
                with ThreadPoolExecutor(n_workers, thread_name_prefix="weightmap") as pool:
                    futures = [pool.submit(runner.run, o.name, o.node) for o in jobs]
                    for f in futures:
                        f.result()
            # An input rewritten under us may have fed some tensors old bytes and some new:
            # only an input unchanged from start to end gives an output worth committing.
            check_unchanged(ckpt)
    except OSError as exc:
        if isinstance(exc, ExecutionError):
            raise
        raise ExecutionError(
            f"{dest}: writing failed ({exc}); nothing was written under that name"
        ) from exc
    finally:
        runner.close()
    return writer, runner.stats
