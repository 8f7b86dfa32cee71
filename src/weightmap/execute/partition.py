"""The work split of a distributed conversion: units of work, packed into tasks.

The work that fills the output's shards is cut into units, each a fixed byte range of one
shard: copy pieces (input byte ranges the kernel clones or copies), row ranges of computed
tensors (the chunks of the compute path are independent), and the checksums of copied
tensors. A unit done twice writes the same bytes at the same offsets, so a task that is run
again after its worker died needs no undoing.

``partition`` groups the units by shard, cuts a shard worth more than one task's share into
byte ranges (a huge tensor by rows), and packs the groups into tasks of about equal estimated
cost: copies cost their bytes, computed bytes two to six times more (arithmetic the most),
clones almost nothing.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from weightmap.execute.chunks import chunk_plan, tree_nodes
from weightmap.execute.sources import Sources
from weightmap.format.dtypes import nbytes
from weightmap.format.header import Header, TensorInfo
from weightmap.format.writer import CheckpointWriter, Piece
from weightmap.inputs.pickles import PickleHeader
from weightmap.plan.nodes import (
    Arith,
    Binary,
    Clamp,
    Gather,
    Lookup,
    Mask,
    Matmul,
    Node,
    Pack,
    Quantize,
    Reduce,
    Round,
    Unpack,
)
from weightmap.plan.plan import Plan

__all__ = [
    "ChecksumUnit",
    "ComputeUnit",
    "InputFile",
    "TaskReport",
    "TaskSpec",
    "code_digest",
    "partition",
]

# Estimated cost of the work, in bytes copied by the kernel, per output byte. Measured on one
# core (docs/benchmarks.md, "Past one machine"): a kernel copy moves 2-3 GB/s, a cast 1.9 GB/s
# of output, fp8 dequantization (arithmetic over blocks) 0.38 GB/s. A clone moves no data and
# costs a system call; a checksum reads its bytes once more.
MOVE_COST = 2  # computed without arithmetic: casts, transposes, gathers
ARITH_COST = 6  # add, mul, block (de)quantization, masks
CLONE_COST = 64 * 1024
CHECKSUM_COST = 1
# Tasks per worker slot: more than one, so that a slow node or a late start evens out, few
# enough that per-task costs (a round trip, opening files, a worker's first import of torch)
# stay small next to the work.
TASKS_PER_SLOT = 4
# The least work worth a task of its own (in copied bytes).
MIN_TASK_COST = 64 * 2**20


@dataclass(frozen=True)
class InputFile:
    """An input file as the driver read it: a task refuses one that differs on its node."""

    path: str
    header_size: int
    file_size: int
    mtime_ns: int
    # A PyTorch checkpoint: the task reads its tensors through torch, as the driver does.
    pickle: bool = False
    # The prefix its tensors carry in the driver's namespace (one of a mapping's several
    # inputs: ``adapter:``), given to a PyTorch file's names as the task reads them.
    prefix: str = ""


@dataclass(frozen=True)
class ComputeUnit:
    """Output ``name`` (computed from ``node``), indices ``rows`` of the dimension it is
    chunked along (None: all of it), which are ``length`` bytes from ``offset`` in the tensor."""

    name: str
    node: Node
    rows: tuple[int, int] | None
    offset: int
    length: int


@dataclass(frozen=True)
class ChecksumUnit:
    """The CRC-32 of ``length`` bytes of copied output ``name`` from byte ``offset``, read
    from input ranges ``(file number, absolute offset, length)``."""

    name: str
    offset: int
    length: int
    ranges: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class TaskSpec:
    """One task: the units it runs and what it needs to run them on any node.

    ``folder`` is the temporary output folder, ``shards`` its files by shard number;
    ``inputs`` are the input files by number, ``tensors`` the input tensors the computed units
    read (file number, header entry), ``targets`` where each computed output goes (shard,
    absolute ``[begin, end)``). ``planned`` is the data bytes the task writes into each shard.
    ``direct_io``: the driver's ``WEIGHTMAP_DIRECT_IO`` (large computed chunks past the page
    cache), which a node's own environment does not override.
    """

    index: int
    folder: str
    dest: str
    code: str
    shards: tuple[str, ...]
    inputs: tuple[InputFile, ...]
    copies: tuple[Piece, ...] = ()
    computes: tuple[ComputeUnit, ...] = ()
    checksums: tuple[ChecksumUnit, ...] = ()
    tensors: Mapping[str, tuple[int, TensorInfo]] = field(default_factory=dict)
    targets: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    planned: Mapping[int, int] = field(default_factory=dict)
    chunk_bytes: int = 32 * 2**20
    checksum: bool = False
    cost: int = 0
    direct_io: bool = False
    # Each shard's inode as the driver made it: a task opens the shards by name, and refuses
    # one that is another file (the temporary folder moved and replaced by a link).
    shard_inodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class TaskReport:
    """What a task wrote: data bytes by shard and by kind, and ``crcs`` (output name, offset,
    length, CRC-32) of the ranges it computed or read, when checksums were asked for."""

    index: int
    host: str
    written: Mapping[int, int]
    cloned: int = 0
    copied: int = 0
    computed: int = 0
    crcs: tuple[tuple[str, int, int, int], ...] = ()
    seconds: float = 0.0


@cache
def code_digest() -> str:
    """A digest of weightmap's own source files: a task refuses to run on a node whose
    weightmap differs from the driver's (other code could compute other bytes)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# A unit, where it lands (shard, absolute offset: the order within a shard) and its cost.
_Unit = Piece | ComputeUnit | ChecksumUnit


@dataclass
class _Placed:
    shard: int
    at: int
    cost: int
    unit: _Unit


def _cost(unit: _Unit) -> int:
    if isinstance(unit, Piece):
        return CLONE_COST if unit.clone else unit.length
    if isinstance(unit, ComputeUnit):
        return unit.length * _per_byte(unit.node)
    return unit.length * CHECKSUM_COST


def _per_byte(node: Node) -> int:
    """The estimated cost of one computed output byte of ``node``."""
    computes = (Arith, Binary, Quantize, Mask, Matmul, Unpack, Pack, Gather, Lookup, Round, Clamp,
                Reduce)  # fmt: skip
    arith = any(isinstance(n, computes) for n in tree_nodes(node))
    return ARITH_COST if arith else MOVE_COST


def _compute_units(name: str, node: Node, chunk_bytes: int, target: int) -> list[ComputeUnit]:
    """A computed output, whole or in row ranges worth about ``target`` each. Ranges start at
    multiples of the chunk step, so they are made of the chunks the whole tensor is made of."""
    size = nbytes(node.dtype, node.shape)
    dim, step = chunk_plan(node, chunk_bytes)
    extent = node.shape[dim] if node.shape else 1
    per_byte = _per_byte(node)
    if size * per_byte <= target or extent <= step or size % extent:
        return [ComputeUnit(name, node, None, 0, size)]
    row = size // extent
    rows = max(step, target // (row * per_byte) // step * step)
    return [
        ComputeUnit(
            name, node, (a, min(extent, a + rows)), a * row, (min(extent, a + rows) - a) * row
        )
        for a in range(0, extent, rows)
    ]


def _cut_piece(piece: Piece, target: int) -> list[Piece]:
    """A copy piece in parts of at most ``target`` bytes; a clone only at block boundaries."""
    if piece.clone or piece.length <= target:
        return [piece]
    return [
        Piece(
            piece.file,
            piece.src + d,
            piece.shard,
            piece.dst + d,
            min(target, piece.length - d),
            False,
        )
        for d in range(0, piece.length, target)
    ]


def _checksum_units(
    name: str, ranges: Sequence[tuple[int, int, int]], target: int
) -> list[ChecksumUnit]:
    """The checksum of a copied output, in parts of about ``target`` bytes."""
    units: list[ChecksumUnit] = []
    part: list[tuple[int, int, int]] = []
    offset = size = 0
    for file, src, length in ranges:
        while length:
            take = min(length, max(1, target - size))
            part.append((file, src, take))
            size += take
            src += take
            length -= take
            if size >= target:
                units.append(ChecksumUnit(name, offset, size, tuple(part)))
                offset, size, part = offset + size, 0, []
    if part:
        units.append(ChecksumUnit(name, offset, size, tuple(part)))
    return units


def partition(
    plan: Plan,
    sources: Sources,
    writer: CheckpointWriter,
    headers: Mapping[Path, Header],
    *,
    slots: int,
    chunk_bytes: int,
    checksum: bool,
    task_cost: int | None = None,
    prefixes: Mapping[Path, str] | None = None,
) -> list[TaskSpec]:
    """The tasks that fill the open ``writer``'s shards, most costly first.

    ``slots`` is how many tasks run at once; ``task_cost`` (in bytes copied) overrides the
    share of work a task gets (at least 64 MiB, else the total over ``4 * slots``);
    ``prefixes``: each input file's name prefix (``Checkpoint.prefixes``).
    """
    assert writer.tmp is not None, "the writer must be open"
    files = list(headers)
    number = {p: i for i, p in enumerate(files)}
    located: dict[str, tuple[int, int, int]] = {}
    for i, plan_of_shard in enumerate(writer.shards):
        for name, (b, e) in plan_of_shard.offsets.items():
            located[name] = (i, b, e)
    computed = [o for o in sources.computed() if o.spec.nbytes]
    pieces = writer.pieces()
    total = sum(_cost(p) for p in pieces)
    total += sum(o.spec.nbytes * _per_byte(o.node) for o in computed)
    if checksum:
        total += sum(
            o.spec.nbytes * CHECKSUM_COST for o in plan.outputs if o.name in sources.copied
        )
    target = task_cost or max(MIN_TASK_COST, -(-total // (slots * TASKS_PER_SLOT)))

    placed: list[_Placed] = []
    for piece in pieces:
        for cut in _cut_piece(piece, target):
            placed.append(_Placed(cut.shard, cut.dst, _cost(cut), cut))
    for out in computed:
        shard, begin, _ = located[out.name]
        for unit in _compute_units(out.name, out.node, chunk_bytes, target):
            placed.append(_Placed(shard, begin + unit.offset, _cost(unit), unit))
    if checksum:
        for name in sources.copied:
            shard, begin, _ = located[name]
            ranges = [(number[p], off, n) for p, off, n in sources.ranges(name) if n]
            for part in _checksum_units(name, ranges, target):
                placed.append(_Placed(shard, begin + part.offset, _cost(part), part))

    groups = _groups(placed, target)
    # Absolute paths: a task runs in its worker's folder (where its node's Ray started), not
    # in the driver's, so a path relative to the driver's folder names another file there.
    inputs = tuple(
        InputFile(
            str(p.absolute()),
            h.header_size,
            h.file_size,
            h.mtime_ns,
            isinstance(h, PickleHeader),
            (prefixes or {}).get(p, ""),
        )
        for p, h in headers.items()
    )
    where = {n: (number[p], info) for p, h in headers.items() for n, info in h.tensors.items()}
    common = TaskSpec(
        index=-1,
        folder=str(writer.tmp.absolute()),
        dest=str(writer.dest),
        code=code_digest(),
        shards=tuple(s.filename for s in writer.shards),
        shard_inodes=writer.shard_inodes(),
        inputs=inputs,
        chunk_bytes=chunk_bytes,
        checksum=checksum,
        direct_io=writer.direct_io,
    )
    bins = _pack(groups, max(1, -(-sum(g[0] for g in groups) // target)))
    tasks = [_task(common, i, units, located, where) for i, units in enumerate(bins)]
    return sorted(tasks, key=lambda t: -t.cost)


def _groups(placed: list[_Placed], target: int) -> list[tuple[int, list[_Placed]]]:
    """Units grouped by shard; a shard worth more than ``target`` is cut into byte ranges."""
    by_shard: dict[int, list[_Placed]] = defaultdict(list)
    for p in placed:
        by_shard[p.shard].append(p)
    groups: list[tuple[int, list[_Placed]]] = []
    for shard in sorted(by_shard):
        units = sorted(by_shard[shard], key=lambda p: p.at)
        current: list[_Placed] = []
        cost = 0
        for p in units:
            if current and cost + p.cost > target:
                groups.append((cost, current))
                current, cost = [], 0
            current.append(p)
            cost += p.cost
        if current:
            groups.append((cost, current))
    return groups


def _pack(groups: list[tuple[int, list[_Placed]]], n: int) -> list[list[_Placed]]:
    """Longest processing time first: each group, costliest first, to the lightest bin."""
    heap = [(0, i) for i in range(n)]
    bins: list[list[_Placed]] = [[] for _ in range(n)]
    for cost, units in sorted(groups, key=lambda g: -g[0]):
        load, i = heapq.heappop(heap)
        bins[i] += units
        heapq.heappush(heap, (load + cost, i))
    return [b for b in bins if b]


def _task(
    common: TaskSpec,
    index: int,
    units: list[_Placed],
    located: Mapping[str, tuple[int, int, int]],
    where: Mapping[str, tuple[int, TensorInfo]],
) -> TaskSpec:
    copies = [p.unit for p in units if isinstance(p.unit, Piece)]
    computes = [p.unit for p in units if isinstance(p.unit, ComputeUnit)]
    checksums = [p.unit for p in units if isinstance(p.unit, ChecksumUnit)]
    planned: dict[int, int] = defaultdict(int)
    for p in units:
        if not isinstance(p.unit, ChecksumUnit):
            planned[p.shard] += p.unit.length
    read = {s.name for c in computes for s in c.node.sources()}
    return replace(
        common,
        index=index,
        copies=tuple(copies),
        # The largest first, so that one large tensor does not finish last.
        computes=tuple(sorted(computes, key=lambda c: -c.length)),
        checksums=tuple(checksums),
        tensors={n: where[n] for n in sorted(read)},
        targets={c.name: located[c.name] for c in computes},
        planned=dict(planned),
        cost=sum(p.cost for p in units),
    )
