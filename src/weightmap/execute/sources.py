"""Planning the output: where each output byte comes from, and the writer that lays it out.

Every executor (threads on one machine, tasks on a cluster) plans the output here, so that
they all write the same shards, headers and bytes.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Mapping, Sequence
from itertools import chain, repeat
from operator import add, attrgetter, itemgetter, sub
from pathlib import Path
from typing import cast

from weightmap.execute.chunks import tree_nodes
from weightmap.execute.kernels import OPAQUE_DTYPES
from weightmap.execute.segments import Segment, byte_segments
from weightmap.execute.sidefiles import side_files_space
from weightmap.format.dtypes import nbytes
from weightmap.format.header import TensorInfo, TensorTable
from weightmap.format.layout import Extent, Layouts, Origin, WholeOrigins
from weightmap.format.slots import make_tuple, shared
from weightmap.format.writer import CheckpointWriter
from weightmap.fs.gcpause import gc_paused
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.nodes import Source, only_sources
from weightmap.plan.parts import OutputTable, output_names
from weightmap.plan.plan import OutputTensor, Plan

__all__ = ["Sources", "plan_writer"]

# Below this average size, many small kernel copies cost more than computing the tensor.
_MIN_SEGMENT = 64 * 1024
_FEW_SEGMENTS = 64


def _copied(out: OutputTensor, ckpt: Checkpoint) -> list[Segment] | None:
    """The input byte ranges an output copies, or None when it is computed."""
    size = nbytes(out.node.dtype, out.node.shape)
    # Computing is faster than many small kernel copies; for a dtype torch cannot compute in
    # it is no way at all. Past the count worth copying, the ranges are not even listed (a
    # join of eight ranks along dim 1 is 32,768 ranges a tensor: a second of the main
    # thread's time, before any work starts, for a list thrown away).
    limit = 1 << 20 if out.node.dtype in OPAQUE_DTYPES else max(_FEW_SEGMENTS, size // _MIN_SEGMENT)
    segments = byte_segments(out.node, limit)
    if segments is None or len(segments) > limit:
        return None
    if not all(ckpt.has_range(s.name) for s in segments):
        return None  # (a PyTorch tensor strided in its storage has no byte range to copy)
    return segments


class Sources:
    """Where the output's bytes come from, as the writer and the executors need it.

    ``origins`` is what the writer lays the shards out by. ``copied`` maps each output that is
    input bytes to those byte ranges (outputs not in it are computed); ``where`` maps each
    input tensor to its file and the absolute ``[begin, end)`` of its bytes. Where every output
    is one input tensor in full (a rename or keep of every tensor), those two are made only
    when first asked for: such a conversion asks for neither unless it checksums, and a
    checkpoint may hold 100,000 tensors.
    """

    def __init__(
        self,
        plan: Plan,
        ckpt: Checkpoint,
        origins: Mapping[str, Origin],
        copied: dict[str, list[Segment]] | None = None,
        where: dict[str, tuple[Path, int, int]] | None = None,
    ) -> None:
        self.origins = origins
        self._plan = plan
        self._ckpt = ckpt
        self._copied = copied  # None: every output is one input tensor in full
        self._where = where

    @property
    def where(self) -> dict[str, tuple[Path, int, int]]:
        """Each input tensor's file and the absolute ``[begin, end)`` of its bytes."""
        if self._where is None:
            self._where = _where(self._ckpt)
        return self._where

    @property
    def copied(self) -> dict[str, list[Segment]]:
        """Each output that is input bytes, to the input byte ranges it is made of."""
        if self._copied is None:
            stored = self._ckpt.stored()
            with gc_paused():
                self._copied = {out.name: [_whole(stored, out)] for out in self._plan.outputs}
        return self._copied

    def computed(self) -> list[OutputTensor]:
        """The outputs that are not input bytes: computed from their inputs' values."""
        if self._copied is None:
            return []  # (every output is an input tensor in full)
        copied = self._copied
        return [out for out in self._plan.outputs if out.name not in copied]

    def ranges(self, name: str) -> list[tuple[Path, int, int]]:
        """The input ranges ``(file, offset, length)`` copied output ``name`` is made of."""
        where = self.where
        return [
            (where[s.name][0], where[s.name][1] + s.offset, s.length) for s in self.copied[name]
        ]


def _whole(stored: Mapping[str, tuple[Path, TensorInfo]], out: OutputTensor) -> Segment:
    """The one segment of an output that is an input tensor in full."""
    name = cast(Source, out.node).name
    info = stored[name][1]
    return make_tuple(Segment, (name, 0, info.end - info.begin))


def _where(ckpt: Checkpoint) -> dict[str, tuple[Path, int, int]]:
    where: dict[str, tuple[Path, int, int]] = {}
    for path, header in ckpt.headers.items():
        start = header.data_start
        for name, info in header.tensors.items():
            where[name] = (path, start + info.begin, start + info.end)
    return where


def _whole_origins(plan: Plan, ckpt: Checkpoint) -> WholeOrigins | None:
    """The origins of a plan whose every output is one input tensor in full, a byte range of
    its file; None for any other plan."""
    # Column by column through C calls (no Python step per tensor): a checkpoint may hold
    # 100,000 tensors, and a rename of all of them is the commonest plan.
    outputs = plan.outputs
    if isinstance(outputs, OutputTable):
        if not outputs:
            return None
        every = _every_input(outputs, ckpt) if outputs.sources is ckpt.specs() else None
        if every is not None:
            return every
        inputs: Sequence[str] = outputs.sources.names
    else:
        nodes = tuple(map(_NODE, outputs))
        if not only_sources(nodes):
            return None
        inputs = list(map(_NAME, nodes))
    if not ckpt.strided.isdisjoint(inputs):
        return None  # (a PyTorch tensor strided in its storage has no byte range to copy)
    stored = list(map(ckpt.stored().__getitem__, inputs))
    headers = ckpt.headers
    numbers = {path: i for i, path in enumerate(headers)}
    files = list(map(numbers.__getitem__, map(_FIRST, stored)))
    infos = list(map(_SECOND, stored))
    starts = [header.data_start for header in headers.values()]
    # (int64: the offsets are distinct, an int object of 32 bytes each in a list)
    offsets = array("q", map(add, map(starts.__getitem__, files), map(_BEGIN, infos)))
    lengths = shared(list(map(sub, map(_END, infos), map(_BEGIN, infos))))
    return WholeOrigins(list(output_names(outputs)), files, offsets, lengths)


def _every_input(outputs: OutputTable, ckpt: Checkpoint) -> WholeOrigins | None:
    """The origins of a table of outputs that reads every input of ``ckpt`` in its order (a
    rename or keep of a whole checkpoint), from the headers' columns: no lookup per tensor."""
    tables = [header.tensors for header in ckpt.headers.values()]
    if not all(isinstance(t, TensorTable) for t in tables) or ckpt.strided:
        return None
    columns = cast(list[TensorTable], tables)
    files = list(chain.from_iterable(repeat(i, len(t)) for i, t in enumerate(columns)))
    starts = [header.data_start for header in ckpt.headers.values()]
    offsets = array(
        "q",
        chain.from_iterable(
            map(add, repeat(start), t.begins) for start, t in zip(starts, columns, strict=True)
        ),
    )
    # (Each input's size is its specs' own column: the checkpoint's specs are the sources.)
    return WholeOrigins(outputs.specs.names, files, offsets, list(outputs.sources.sizes))


_NODE = attrgetter("node")
_NAME = attrgetter("name")
_BEGIN = attrgetter("begin")
_END = attrgetter("end")
_FIRST = itemgetter(0)
_SECOND = itemgetter(1)


def _sources(plan: Plan, ckpt: Checkpoint) -> Sources:
    whole = _whole_origins(plan, ckpt)
    if whole is not None:
        return Sources(plan, ckpt, whole)
    where = _where(ckpt)
    numbers: dict[str, int] = {}
    for i, header in enumerate(ckpt.headers.values()):
        numbers.update(dict.fromkeys(header.tensors, i))  # (at C speed)
    copied: dict[str, list[Segment]] = {}
    origins: dict[str, Origin] = {}
    for out in plan.outputs:
        segments = _copied(out, ckpt)
        if segments is not None:
            copied[out.name] = segments
            extents = tuple(
                Extent(numbers[s.name], where[s.name][1] + s.offset, s.length) for s in segments
            )
            first = segments[0].name if segments else out.node.sources()[0].name
            anchor = (numbers[first], where[first][1] + (segments[0].offset if segments else 0))
            origins[out.name] = Origin(anchor, extents)
        else:
            first = next(n.name for n in tree_nodes(out.node) if isinstance(n, Source))
            origins[out.name] = Origin((numbers[first], where[first][1]))
    return Sources(plan, ckpt, origins, copied, where)


def plan_writer(
    plan: Plan,
    ckpt: Checkpoint,
    dest: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    metadata: dict[str, str] | None = None,
    extra_files: Sequence[tuple[str, bytes]] = (),
    layout: Layouts = "clone",
) -> tuple[CheckpointWriter, Sources]:
    """The writer of ``plan``'s output and where its bytes come from: every executor plans the
    output here, so that they all write the same bytes."""
    with gc_paused():  # (fs/gcpause.py: many small objects, no cycles)
        sources = _sources(plan, ckpt)
        files = ckpt.files
        writer = CheckpointWriter(
            dest,
            plan.output_specs(),
            max_shard_size=max_shard_size,
            metadata={"format": "pt"} if metadata is None else metadata,
            config=plan.config,
            overwrite=overwrite,
            protect=files,
            origins=sources.origins,
            inputs=files,
            layout=layout,
            members=plan.members(),
            held=ckpt.descriptors,
        )
    for fname, blob in extra_files:
        writer.add_file(fname, blob)
    writer.reserve_after = side_files_space(plan.files, ckpt.root)
    return writer, sources
