"""The streaming executor: a plan over an open checkpoint, into a new checkpoint.

Each output tensor takes one of two paths:

- **bytes**: where the output's bytes are a sequence of input byte ranges (rename, keep,
  reshape, slices and concatenations whose outer dimensions allow it, casts to the same dtype,
  permutes that only move size-1 dimensions), the writer lays them out so that they keep their
  input offsets modulo the filesystem block, and the ranges are moved by the kernel: cloned
  (extents shared with the input) where the filesystem can, copied with ``copy_file_range``
  otherwise. They never pass through Python objects;
- **chunks**: everything else is computed in slices along one output dimension over
  memory-mapped views (``compute.py``), in bounded memory, and written at its offset.

Work is scheduled in pieces of a few MiB, not per tensor: the copies of adjacent ranges are
coalesced and cut into pieces, small computed tensors are batched, and a small pool of threads
takes the pieces in turn.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from weightmap.errors import Cancelled, CheckpointError, ExecutionError, FormatError
from weightmap.execute.compute import Computer
from weightmap.execute.options import DEFAULT_CHUNK_BYTES, check_workers, default_workers
from weightmap.execute.sources import plan_writer
from weightmap.format.options import Layouts
from weightmap.format.writer import COPY_PIECE, CheckpointWriter, Piece
from weightmap.fs.cancel import CancelToken
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.plan import OutputTensor, Plan

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ExecutionStats",
    "check_inputs",
    "check_unchanged",
    "check_workers",
    "crc_of_ranges",
    "default_workers",
    "execute",
]

# A clone moves no data: as work, it weighs like a copy of this many bytes.
_CLONE_WEIGHT = 64 * 1024

ProgressFn = Callable[[int], None]
T = TypeVar("T")


@dataclass
class ExecutionStats:
    """What an execution did: output bytes by path, and per-tensor checksums.

    ``bytes_cloned`` were shared with the input by the filesystem (extents cloned, no data
    moved), ``bytes_copied`` were copied by the kernel, ``bytes_computed`` were computed.
    """

    bytes_cloned: int = 0
    bytes_copied: int = 0
    bytes_computed: int = 0
    checksums: dict[str, int] | None = None


def check_inputs(plan: Plan, ckpt: Checkpoint) -> None:
    """Refuse to run a plan against a checkpoint that differs from the one it was compiled for."""
    if plan.inputs is ckpt.specs():  # (compiled from this very checkpoint's table of specs)
        check_unchanged(ckpt)
        return
    current = {s.name: s for s in ckpt.specs()}
    # A plan compiled from this very checkpoint holds its specs themselves: `is` settles
    # those without comparing fields (100,000 tensors and more).
    changed = [
        spec.name
        for spec in plan.inputs
        if (now := current.get(spec.name)) is not spec and now != spec
    ]
    if changed:
        raise ExecutionError(
            f"{ckpt.root}: the checkpoint differs from the one the plan was compiled for "
            f"(first: {changed[0]!r}); compile the plan again"
        )
    check_unchanged(ckpt)


def check_unchanged(ckpt: Checkpoint) -> None:
    """Refuse if any file's size or modification time differs from when its header was read:
    through the descriptor it was read through (the file itself, whatever its name leads to
    now), or, for a file the checkpoint holds none of, by its name."""
    held = ckpt.descriptors
    for path, header in ckpt.headers.items():
        try:
            fd = held.get(path)
            st = os.fstat(fd) if fd is not None else path.stat()
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


class _Stats:
    """Thread-safe counters behind ExecutionStats, and the progress callback.

    Every chunk computed and every piece moved is counted here as it ends: the boundary where
    a run that was asked to stop (``halt``) stops.
    """

    def __init__(self, checksum: bool, progress: ProgressFn | None, halt: CancelToken) -> None:
        self.stats = ExecutionStats(checksums={} if checksum else None)
        self.progress = progress
        self.halt = halt
        self._lock = threading.Lock()

    def add(self, n: int, kind: str) -> None:
        with self._lock:
            name = f"bytes_{kind}"
            setattr(self.stats, name, getattr(self.stats, name) + n)
        if self.progress is not None:
            self.progress(n)
        self.halt.check()


def _batches(items: Iterable[T], weight: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive items in lists of about ``limit`` weight (a heavier item alone)."""
    batch: list[T] = []
    total = 0
    for item in items:
        batch.append(item)
        total += weight(item)
        if total >= limit:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def _compute(computer: Computer, outputs: list[OutputTensor], halt: CancelToken) -> None:
    for out in outputs:
        halt.check()
        computer.run(out.name, out.node)


def _transfer(writer: CheckpointWriter, pieces: list[Piece], counts: _Stats) -> None:
    for piece in pieces:
        counts.halt.check()
        counts.add(piece.length, "cloned" if writer.transfer(piece) else "copied")


def crc_of_ranges(ranges: Sequence[tuple[Path, int, int]], fds: Mapping[Path, int]) -> int:
    """CRC-32 of input byte ranges ``(file, offset, length)`` in order, read with pread
    (nothing mapped) through ``fds``: each file's descriptor as its checkpoint opened it
    (``Checkpoint.descriptors``), never its name opened again."""
    buf = bytearray(min(COPY_PIECE, max((r[2] for r in ranges), default=0)))
    view = memoryview(buf)
    crc = 0
    for path, offset, length in ranges:
        fd = fds.get(path)
        if fd is None:
            raise CheckpointError.closed(path)
        end = offset + length
        while offset < end:
            n = os.preadv(fd, [view[: min(len(buf), end - offset)]], offset)
            if n == 0:
                raise ExecutionError(f"{path}: the input ended early; it changed")
            crc = zlib.crc32(view[:n], crc)
            offset += n
    return crc


def _checksum(
    names: list[tuple[str, list[tuple[Path, int, int]]]],
    into: dict[str, int],
    halt: CancelToken,
    held: Mapping[Path, int],
) -> None:
    """CRC-32 of copied tensors, read from their input ranges (through ``held``)."""
    for name, ranges in names:
        halt.check()
        into[name] = crc_of_ranges(ranges, held)


def _run_all(
    tasks: Sequence[Callable[[], None]],
    workers: int,
    halt: CancelToken,
    meanwhile: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Run the tasks on ``workers`` threads, and ``meanwhile(check)`` in this one as they run;
    the first failure (a task's error, ``Cancelled``, ``meanwhile``'s error, or a
    ``KeyboardInterrupt`` in this thread) stops the others at their next chunk. While the
    threads run, a signal only cancels ``halt`` (``CancelToken.polled``); Python's own SIGINT
    handler's KeyboardInterrupt is raised once they have ended.

    ``meanwhile`` calls ``check()`` between its steps, which raises once the run is cancelled
    or a task has failed; a task's error is the one raised then, not ``meanwhile``'s.

    Leaving a ``ThreadPoolExecutor`` block waits for every task queued, which on a large
    conversion is minutes: once ``halt`` is cancelled, the queued ones end as they start and
    the running ones at their next boundary, so that the caller sees the failure within one
    chunk. This thread never takes a future's lock (see ``_Tasks``).
    """
    if workers == 1:
        if meanwhile is not None:
            meanwhile(halt.check)
        for task in tasks:
            halt.check()
            task()
        return
    # From the pool's first thread to the last one's end, a signal only cancels ``halt``
    # (see CancelToken.polled): this thread shares the pool's locks with the workers.
    with halt.polled():
        pool = ThreadPoolExecutor(workers, thread_name_prefix="weightmap")
        # No task starts before every worker has: ``Thread.start`` waits for the new thread,
        # and a KeyboardInterrupt there (raised by a handler of the caller's own, which the
        # stretch cannot hold back) leaves a worker the pool never learnt of, which its
        # shutdown does not wait for.
        go = _Gate()
        tracked = _Tasks(len(tasks))

        def gated(task: Callable[[], None]) -> None:
            failed: BaseException | None = None
            try:
                go.wait()
                halt.check()  # (queued when the run stopped, or the submission failed: dropped)
                task()
            except BaseException as exc:
                failed = exc
                raise
            finally:
                tracked.ended(failed)

        try:
            try:
                for task in tasks:
                    halt.check()  # (a stop asked as they are queued: no more are)
                    pool.submit(gated, task)
            except BaseException:
                halt.cancel()  # (before the gate opens)
                raise
            finally:
                go.set()
            if meanwhile is not None:
                _meanwhile(meanwhile, tracked, halt)
            # Woken by the first failure, not by the first task in order (which may be the
            # largest tensor, still running); in slices, so that a signal's handler runs
            # within one whatever thread the signal reached (a signal the kernel hands to a
            # worker wakes no one, and its handler runs only when this thread next runs
            # Python code).
            while not tracked.finished.wait(_WAKE_EVERY):
                pass
            failed = tracked.first()
            if failed is not None:
                raise failed
        except BaseException:
            halt.cancel()
            raise
        finally:
            _shut_down(pool, halt, go)


class _Tasks:
    """What the tasks have done, as their workers tell it: how many are left, their errors,
    and ``finished``, set once all have ended or one has failed.

    Told in the worker threads and read in the calling thread without taking any lock a
    worker takes: a KeyboardInterrupt in the calling thread may land anywhere, and one that
    lands inside a lock it holds leaves it held. A future's lock (``done()``, ``result()``,
    ``add_done_callback``, ``cancel()``: ``concurrent.futures.wait`` takes them all) left so
    blocks the next worker that takes it, and the shutdown that waits for that worker, for
    ever; so the futures are never looked at."""

    def __init__(self, count: int) -> None:
        self.finished = threading.Event()
        self.failed = threading.Event()
        self._left = count
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()  # (taken in the workers only)
        if count == 0:
            self.finished.set()

    def ended(self, failed: BaseException | None) -> None:
        with self._lock:
            self._left -= 1
            if failed is not None:
                self._errors.append(failed)
            done = self._left == 0
        if failed is not None:
            self.failed.set()
        if done or failed is not None:
            self.finished.set()

    def first(self) -> BaseException | None:
        """The first error that is a task's own (not a stop because another failed or the run
        was cancelled), else the first, else None."""
        errors = list(self._errors)  # (a copy: a worker may add one meanwhile)
        own = [e for e in errors if not isinstance(e, Cancelled)]
        found = own or errors
        return found[0] if found else None


def _meanwhile_writes(writer: CheckpointWriter, check: Callable[[], None]) -> None:
    """What the main thread writes while the workers copy: the headers left for then, and
    the index."""
    writer.write_headers(check)
    writer.prepare_index(check)


class _TaskFailed(Exception):
    """A task failed while ``meanwhile`` ran: the task's error is raised instead."""


def _meanwhile(
    meanwhile: Callable[[Callable[[], None]], None], tracked: _Tasks, halt: CancelToken
) -> None:
    """Run ``meanwhile`` as the tasks run, stopping it at its next check once one fails; a
    failed task's error wins over ``meanwhile``'s (which may only be that it was stopped)."""

    def check() -> None:
        halt.check()
        if tracked.failed.is_set():
            raise _TaskFailed

    try:
        meanwhile(check)
    except Exception:
        # (The tasks' errors are looked at before the run is stopped: once it is, the others
        # end with Cancelled, which is no one's error.)
        failed = tracked.first()
        halt.cancel()
        if failed is not None:
            raise failed from None
        raise


def _shut_down(pool: ThreadPoolExecutor, halt: CancelToken, go: threading.Event) -> None:
    """Wait for the workers: once ``halt`` is cancelled, the queued tasks end as they start
    and the running ones at their next chunk (the queued ones are not cancelled here, which
    would take each one's lock in this thread: see ``_Tasks``). A KeyboardInterrupt during the
    wait (a second Ctrl-C) cancels ``halt`` and is raised once every worker has ended, never
    leaving one running. The gate is opened on every try: an interrupt inside ``go.set()``
    may have left it shut, and the workers waiting at it would never end."""
    interrupted: KeyboardInterrupt | None = None
    while True:
        try:
            go.set()
            pool.shutdown(wait=True)
            break
        except KeyboardInterrupt as exc:
            halt.cancel()
            interrupted = exc
    if interrupted is not None:
        raise interrupted


# The gate's type (a seam: the tests interrupt its opening).
_Gate = threading.Event

# How often the thread waiting on the workers wakes to run pending signal handlers (seconds).
_WAKE_EVERY = 0.05


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
    layout: Layouts = "clone",
    cancel: CancelToken | None = None,
) -> tuple[CheckpointWriter, ExecutionStats]:
    """Write ``plan`` applied to ``ckpt`` into ``dest`` atomically; see the module docstring.

    ``chunk_bytes`` bounds the memory of computed tensors over all ``workers`` threads;
    ``layout`` is the writer's (``"clone"``, or ``"reference"`` for the bytes
    ``safetensors.save_file`` writes). ``ckpt`` is this execution's own: the input pages it
    reads are unmapped as it goes, so it must not have handed out views.
    ``before_commit(folder, stats)`` is called with the finished temporary folder before it is
    moved into place; if it raises, nothing is committed (``remap`` verifies there).
    ``cancel``: once it is cancelled, the run stops at its next chunk with ``Cancelled``, the
    temporary folder removed.
    """
    check_inputs(plan, ckpt)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    check_workers(workers)
    n_workers = default_workers() if workers is None else workers
    writer, sources = plan_writer(
        plan,
        ckpt,
        dest,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        metadata=metadata,
        extra_files=extra_files,
        layout=layout,
    )
    # (Sizes asked of the computed ones only: a rename computes nothing, and asks nothing of
    # where its inputs are beyond the copies the writer planned.)
    computed = sorted(sources.computed(), key=lambda o: -o.spec.nbytes)
    if computed:
        # Imported here, in the caller's thread, not by the first chunk of each writer
        # thread: an import cannot be interrupted in another thread, and torch's takes
        # seconds on a busy machine, during which Ctrl-C would wait for it. Only where a
        # tensor is computed: a split or a join along dim 0 moves bytes, and needs none.
        import torch  # noqa: F401
    # This run's own token: a failed task stops the others through it, without cancelling
    # the caller's.
    halt = CancelToken(cancel)
    counts = _Stats(checksum, progress, halt)
    computer = Computer(
        ckpt,
        writer,
        sources.where if computed else {},
        max(1, chunk_bytes // n_workers),
        lambda n: counts.add(n, "computed"),
        counts.stats.checksums,
    )
    if before_commit is not None:
        check = before_commit
        writer.before_move = lambda folder: check(folder, counts.stats)
    # A plan that only moves bytes starts its copies before the headers are made: they are
    # made and written as the copies run, with the index (nothing computed writes past the
    # page cache, in blocks a header may share).
    writer.defer_headers = not computed
    writer.token = cancel  # (the move into place is one stretch a stop waits for)
    try:
        with writer:
            tasks: list[Callable[[], None]] = []
            # Computed tensors first, biggest first, so one large tensor does not finish last;
            # small ones in batches. The copies follow in output order.
            for batch in _batches(computed, lambda o: o.spec.nbytes, COPY_PIECE):
                tasks.append(partial(_compute, computer, batch, halt))
            for pieces in _batches(
                writer.pieces(), lambda p: _CLONE_WEIGHT if p.clone else p.length, COPY_PIECE
            ):
                tasks.append(partial(_transfer, writer, pieces, counts))
            if counts.stats.checksums is not None:
                ranges = [(name, sources.ranges(name)) for name in sources.copied]
                for group in _batches(ranges, lambda r: sum(x[2] for x in r[1]), COPY_PIECE):
                    checksums = counts.stats.checksums
                    tasks.append(partial(_checksum, group, checksums, halt, ckpt.descriptors))
            _run_all(tasks, n_workers, halt, partial(_meanwhile_writes, writer))
            halt.check()
            # An input rewritten under us may have fed some tensors old bytes and some new:
            # only an input unchanged from start to end gives an output worth committing.
            check_unchanged(ckpt)
    except OSError as exc:
        raise writing_failed(dest, exc) from exc
    return writer, counts.stats


def writing_failed(dest: str | os.PathLike[str], exc: OSError) -> ExecutionError:
    """The one-line error of a write that failed (an ``ExecutionError`` stays as it is)."""
    if isinstance(exc, ExecutionError):
        return exc
    return ExecutionError(f"{dest}: writing failed ({exc}); nothing was written under that name")
