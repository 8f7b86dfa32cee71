"""The driver of a distributed conversion: the output planned and opened, tasks run, commit.

The driver plans the output exactly as the local executor does (``sources.plan_writer``: the
same shards, headers and layout, so the same bytes) and opens the writer, which creates the
temporary folder with every shard's header and size. ``partition`` splits the work into
tasks; a runner (Ray's, ``cluster.py``; or any other) runs them where it likes (``task.py``)
and returns their reports. ``collect`` checks that every task wrote exactly its share of every
shard and puts the counts and the per-tensor checksums together; the writer then checks every
byte arrived, fsyncs, verifies and commits as it does for the local executor.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from weightmap.errors import ExecutionError
from weightmap.execute.partition import TaskReport, TaskSpec, partition
from weightmap.execute.sources import plan_writer
from weightmap.execute.streaming import (
    DEFAULT_CHUNK_BYTES,
    ExecutionStats,
    ProgressFn,
    check_inputs,
    check_unchanged,
    writing_failed,
)
from weightmap.format.layout import Layouts
from weightmap.format.writer import CheckpointWriter
from weightmap.fs.cancel import CancelToken
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.plan import Plan

__all__ = ["Runner", "collect", "crc32_combine", "execute_tasks"]


def collect(
    tasks: Sequence[TaskSpec],
    reports: Sequence[TaskReport],
    writer: CheckpointWriter,
    plan: Plan,
    into: ExecutionStats,
) -> None:
    """Check each task wrote exactly its share of each shard, count it into ``writer`` (whose
    commit then checks every byte of every shard arrived), and fill ``into``: bytes by kind,
    and each output's CRC-32 when checksums were taken."""
    by_index = {r.index: r for r in reports}
    for task in tasks:
        report = by_index.get(task.index)
        if report is None:
            raise ExecutionError(
                f"{writer.dest}: task {task.index} did not report; nothing was committed"
            )
        if dict(report.written) != {s: n for s, n in task.planned.items() if n}:
            raise ExecutionError(
                f"{writer.dest}: task {task.index} (on {report.host}) wrote other byte counts "
                "than planned; nothing was committed"
            )
        for shard, n in report.written.items():
            writer.record(shard, n)
        into.bytes_cloned += report.cloned
        into.bytes_copied += report.copied
        into.bytes_computed += report.computed
    if into.checksums is not None:
        into.checksums.update(_checksums(reports, plan, writer))


def _checksums(
    reports: Sequence[TaskReport], plan: Plan, writer: CheckpointWriter
) -> dict[str, int]:
    """Each output's CRC-32, from the CRCs of its ranges (every byte exactly once)."""
    parts: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for report in reports:
        for name, offset, length, crc in report.crcs:
            parts[name].append((offset, length, crc))
    out: dict[str, int] = {}
    for spec in plan.output_specs():
        crc = position = 0
        for offset, length, part in sorted(parts.get(spec.name, [])):
            if offset != position:
                break
            crc = crc32_combine(crc, part, length)
            position += length
        if position != spec.nbytes:
            raise ExecutionError(
                f"{writer.dest}: the checksum of {spec.name!r} covers {position:,} of its "
                f"{spec.nbytes:,} bytes; nothing was committed"
            )
        out[spec.name] = crc
    return out


Runner = Callable[[list[TaskSpec], ProgressFn | None], list[TaskReport]]


def execute_tasks(
    plan: Plan,
    ckpt: Checkpoint,
    dest: str | os.PathLike[str],
    *,
    run: Runner,
    slots: int,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    checksum: bool = False,
    progress: ProgressFn | None = None,
    metadata: dict[str, str] | None = None,
    extra_files: Sequence[tuple[str, bytes]] = (),
    before_commit: Callable[[Path, ExecutionStats], None] | None = None,
    layout: Layouts = "clone",
    task_cost: int | None = None,
    cancel: CancelToken | None = None,
) -> tuple[CheckpointWriter, ExecutionStats]:
    """Write ``plan`` applied to ``ckpt`` into ``dest`` as tasks that ``run`` runs.

    The driver's part of a distributed conversion: check the inputs, plan and open the output
    (the temporary folder with every shard's header and size), split the work for ``slots``
    tasks at once (``task_cost``: see ``partition``), have ``run(tasks, progress)`` run them
    anywhere and return their reports, check every byte arrived, and commit through the
    writer (fsync, ``before_commit``, the atomic move) as ``streaming.execute`` does, with
    the same arguments. On any error the temporary folder is removed.
    """
    check_inputs(plan, ckpt)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
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
    stats = ExecutionStats(checksums={} if checksum else None)
    writer.token = cancel  # (the move into place is one stretch a stop waits for)
    if before_commit is not None:
        check = before_commit
        writer.before_move = lambda folder: check(folder, stats)
    try:
        with writer:
            tasks = partition(
                plan,
                sources,
                writer,
                ckpt.headers,
                slots=slots,
                chunk_bytes=chunk_bytes,
                checksum=checksum,
                task_cost=task_cost,
                prefixes=ckpt.prefixes,
            )
            collect(tasks, run(tasks, progress), writer, plan, stats)
            # As the local executor: only an input unchanged from start to end is committed.
            check_unchanged(ckpt)
    except OSError as exc:
        raise writing_failed(dest, exc) from exc
    return writer, stats


# CRC-32 of a concatenation from the CRCs of its parts (zlib's crc32_combine, which Python's
# zlib does not expose): multiply the first CRC by x^(8 * len2) modulo the polynomial.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial, in the reflected bit order."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()  # x^(2^k) modulo the polynomial


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of A, ``crc2`` of B and B's length.

    >>> import zlib
    >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cde"), 3) == zlib.crc32(b"abcde")
    True
    """
    p = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 * len2) = x^(len2 * 2^3)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2
