"""One task of a distributed conversion, as it runs on any node: its units into the shards.

The driver has created the temporary output folder with every shard at its full size and its
header written (``distributed.py``). A task opens the shards it writes and the inputs it reads
itself, by path (the same paths on every node: a shared filesystem), moves or computes its
units' bytes to their planned offsets, syncs what it wrote, and reports it. It never creates,
truncates or removes a file, so running it again after a crash writes the same bytes again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from weightmap.errors import ExecutionError
from weightmap.execute.compute import Computer
from weightmap.execute.partition import TaskReport, TaskSpec, code_digest
from weightmap.execute.streaming import check_unchanged, crc_of_ranges
from weightmap.format.header import Header, TensorInfo
from weightmap.format.transfer import DIRECT_ALIGN, DirectWrites
from weightmap.format.writer import transfer_piece
from weightmap.fs.atomic import host_name
from weightmap.fs.safeopen import fd_path
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.inputs.pickles import prefixed_header, read_pickle

if TYPE_CHECKING:
    import torch

__all__ = ["run_task"]

# How often a task reports progress (seconds): often enough for a smooth bar, rarely enough
# that a task of small pieces does not spend its time reporting.
_REPORT_EVERY = 0.2


class _Shards:
    """The temporary folder's shards as this task writes them: opened on first use, counted."""

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.fds: dict[int, int] = {}
        self.written: dict[int, int] = defaultdict(int)
        self.directs = DirectWrites(spec.direct_io)

    def fd(self, shard: int) -> int:
        if shard not in self.fds:
            path = Path(self.spec.folder) / self.spec.shards[shard]
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                raise ExecutionError(
                    f"{self.spec.dest}: {path} is not there on {host_name()}: the output must "
                    "be on a filesystem every node mounts at the same path (or the conversion "
                    "was stopped); nothing was written under that name"
                ) from None
            inodes = self.spec.shard_inodes
            if inodes and os.fstat(fd).st_ino != inodes[shard]:
                # (The inode, not the device: a network filesystem's device number differs
                # from node to node.)
                os.close(fd)
                raise ExecutionError(
                    f"{self.spec.dest}: {path} on {host_name()} is not the shard the driver "
                    "made: the temporary folder was moved or replaced (by another user of the "
                    "folder?); nothing was written under that name"
                )
            self.fds[shard] = fd
        return self.fds[shard]

    def write(self, name: str, data: bytes | memoryview, offset: int = 0) -> None:
        """Write computed bytes of output ``name`` (what ``Computer`` calls)."""
        shard, begin, end = self.spec.targets[name]
        length = memoryview(data).nbytes
        if offset < 0 or begin + offset + length > end:
            raise ValueError(f"write of {length} bytes at {offset} falls outside {name!r}")
        fd = self.fd(shard)
        path = Path(self.spec.folder) / self.spec.shards[shard]
        self.directs.write(shard, fd, lambda: fd_path(fd, path), data, begin + offset)
        self.written[shard] += length

    def phase(self, name: str, offset: int) -> int:
        """Where in its disk block byte ``offset`` of output ``name`` lands (``Computer``
        places its chunks so, and direct writes then need no copy)."""
        return (self.spec.targets[name][1] + offset) % DIRECT_ALIGN

    def sync(self) -> None:
        """fsync every shard written: on a network filesystem another node's fsync would not
        carry this node's writes, so each task makes its own durable before it reports."""
        for fd in self.fds.values():
            os.fsync(fd)

    def close(self) -> None:
        self.directs.close()
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def _inputs(spec: TaskSpec) -> Checkpoint:
    """The input files this task reads, as the driver read them, checked on this node."""
    numbers = {piece.file for piece in spec.copies}
    numbers |= {file for file, _ in spec.tensors.values()}
    numbers |= {r[0] for unit in spec.checksums for r in unit.ranges}
    by_file: dict[int, dict[str, TensorInfo]] = defaultdict(dict)
    for name, (file, info) in spec.tensors.items():
        by_file[file][name] = info
    headers: dict[Path, Header] = {}
    tensors: dict[str, tuple[Path, TensorInfo]] = {}
    # Each file opened once on this node (by its path: the driver's descriptors do not cross
    # machines), and read through that descriptor from the check below to the last copy.
    fds: dict[Path, int] = {}
    loaded: dict[Path, dict[str, torch.Tensor]] = {}
    try:
        for number in sorted(numbers):
            path, fd, header, read = _input(spec, number, by_file[number])
            fds[path], headers[path] = fd, header
            if read is not None:
                loaded[path] = read
            tensors.update((name, (path, info)) for name, info in by_file[number].items())
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    ckpt = Checkpoint(
        next(iter(headers)).parent if headers else Path(spec.folder), headers, tensors, None, None
    )
    for path, fd in fds.items():
        ckpt.adopt(path, fd)
    ckpt._loaded = loaded
    ckpt.prefixes = MappingProxyType(
        {Path(f.path): f.prefix for f in spec.inputs if f.prefix and Path(f.path) in headers}
    )
    # The same check and message as the driver's: a file rewritten since the plan was made,
    # or a node that sees another version of it.
    check_unchanged(ckpt)
    return ckpt


def _input(
    spec: TaskSpec, number: int, infos: dict[str, TensorInfo]
) -> tuple[Path, int, Header, dict[str, torch.Tensor] | None]:
    """Input file ``number`` of the task, opened: its path, its descriptor, its header (of the
    tensors ``infos``) and, of a PyTorch file, the tensors read through that descriptor."""
    f = spec.inputs[number]
    path = Path(f.path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ExecutionError(
            f"{path} is not there on {host_name()}: the input must be on a filesystem every "
            "node mounts at the same path (or it was removed during the conversion); "
            "nothing was written under that name"
        ) from None
    if not f.pickle:
        return path, fd, Header(f.path, f.header_size, infos, None, f.file_size, f.mtime_ns), None
    try:
        # A PyTorch checkpoint's offsets and strides are the archive's, read on this node
        # (its header's own stat is set to the driver's, so that a file that differs here
        # fails the check below with the driver's message). Its tensors are kept: read
        # through the one descriptor, never loaded again by name.
        node_header, read = read_pickle(path, fd=fd)
    except BaseException:
        os.close(fd)
        raise
    if f.prefix:
        node_header = prefixed_header(node_header, f.prefix)
        read = {f.prefix + n: t for n, t in read.items()}
    return path, fd, replace(node_header, file_size=f.file_size, mtime_ns=f.mtime_ns), read


class _Progress:
    """Bytes written so far, passed to ``report`` at most every 0.2 s and at the end."""

    def __init__(self, report: Callable[[int], None] | None) -> None:
        self.report = report
        self.done = 0
        self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        if self.report is not None and time.monotonic() - self.last >= _REPORT_EVERY:
            self.report(self.done)
            self.last = time.monotonic()

    def close(self) -> None:
        if self.report is not None:
            self.report(self.done)


def run_task(spec: TaskSpec, report: Callable[[int], None] | None = None) -> TaskReport:
    """Run one task's units; ``report(bytes_written_so_far)`` is called as it goes."""
    if spec.code != code_digest():
        raise ExecutionError(
            f"{spec.dest}: {host_name()} runs other weightmap code than the driver (its "
            "sources differ); install the same weightmap on every node"
        )
    start = time.perf_counter()
    ckpt = _inputs(spec)
    shards = _Shards(spec)
    progress = _Progress(report)
    counts = {"cloned": 0, "copied": 0, "computed": 0}
    crcs: list[tuple[str, int, int, int]] = []
    try:
        if spec.computes:
            where = {
                name: (path, header.data_start + info.begin, header.data_start + info.end)
                for path, header in ckpt.headers.items()
                for name, info in header.tensors.items()
            }
            checksums: dict[str, int] | None = {} if spec.checksum else None
            computer = Computer(ckpt, shards, where, spec.chunk_bytes, progress.add, checksums)
            for unit in spec.computes:
                crc = computer.run(unit.name, unit.node, unit.rows)
                counts["computed"] += unit.length
                if spec.checksum:
                    crcs.append((unit.name, unit.offset, unit.length, crc))
        held = ckpt.descriptors
        for piece in spec.copies:
            src = Path(spec.inputs[piece.file].path)
            cloned = transfer_piece(
                held[src], shards.fd(piece.shard), piece, spec.shards[piece.shard]
            )
            counts["cloned" if cloned else "copied"] += piece.length
            shards.written[piece.shard] += piece.length
            progress.add(piece.length)
        for check in spec.checksums:
            ranges = [(Path(spec.inputs[f].path), off, n) for f, off, n in check.ranges]
            crcs.append((check.name, check.offset, check.length, crc_of_ranges(ranges, held)))
        shards.sync()
    finally:
        shards.close()
        ckpt.close()
    progress.close()
    return TaskReport(
        index=spec.index,
        host=host_name(),
        written={s: n for s, n in shards.written.items() if n},
        cloned=counts["cloned"],
        copied=counts["copied"],
        computed=counts["computed"],
        crcs=tuple(crcs),
        seconds=time.perf_counter() - start,
    )
