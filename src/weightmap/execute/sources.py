"""Planning the output: where each output byte comes from, and the writer that lays it out.

Every executor (threads on one machine, tasks on a cluster) plans the output here, so that
they all write the same shards, headers and bytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from weightmap.execute.chunks import tree_nodes
from weightmap.execute.segments import Segment, byte_segments
from weightmap.format.checkpoint import Checkpoint
from weightmap.format.dtypes import nbytes
from weightmap.format.gcpause import gc_paused
from weightmap.format.layout import Extent, Layouts, Origin
from weightmap.format.slots import make_tuple
from weightmap.format.writer import CheckpointWriter
from weightmap.plan.nodes import Source
from weightmap.plan.plan import OutputTensor, Plan

__all__ = ["Sources", "plan_writer"]

# Below this average size, many small kernel copies cost more than computing the tensor.
_MIN_SEGMENT = 64 * 1024
_FEW_SEGMENTS = 64


def _copied(out: OutputTensor, ckpt: Checkpoint) -> list[Segment] | None:
    """The input byte ranges an output copies, or None when it is computed."""
    segments = byte_segments(out.node)
    if segments is None or not all(ckpt.has_range(s.name) for s in segments):
        return None  # (a PyTorch tensor strided in its storage has no byte range to copy)
    size = nbytes(out.node.dtype, out.node.shape)
    if len(segments) <= _FEW_SEGMENTS or size // len(segments) >= _MIN_SEGMENT:
        return segments
    return None


@dataclass(frozen=True)
class Sources:
    """Where the output's bytes come from, as the writer and the executors need it.

    ``where`` maps each input tensor to its file and the absolute ``[begin, end)`` of its
    bytes; ``copied`` each output that is input bytes to those byte ranges (outputs not in it
    are computed); ``origins`` is what the writer lays the shards out by.
    """

    where: dict[str, tuple[Path, int, int]]
    copied: dict[str, list[Segment]]
    origins: dict[str, Origin]

    def ranges(self, name: str) -> list[tuple[Path, int, int]]:
        """The input ranges ``(file, offset, length)`` copied output ``name`` is made of."""
        return [
            (self.where[s.name][0], self.where[s.name][1] + s.offset, s.length)
            for s in self.copied[name]
        ]


def _sources(plan: Plan, ckpt: Checkpoint) -> Sources:
    where: dict[str, tuple[Path, int, int]] = {}
    numbers: dict[str, int] = {}
    for i, (path, header) in enumerate(ckpt.headers.items()):
        start = header.data_start
        for name, info in header.tensors.items():
            where[name] = (path, start + info.begin, start + info.end)
            numbers[name] = i
    copied: dict[str, list[Segment]] = {}
    origins: dict[str, Origin] = {}
    strided = ckpt.strided
    for out in plan.outputs:
        node = out.node
        # A rename or keep: the common case (every tensor of a large checkpoint), made short.
        if type(node) is Source and node.name not in strided:
            _, begin, end = where[node.name]
            file = numbers[node.name]
            # The named tuples made straight from their fields (format/slots.py).
            copied[out.name] = [make_tuple(Segment, (node.name, 0, end - begin))]
            extent = make_tuple(Extent, (file, begin, end - begin))
            origins[out.name] = make_tuple(Origin, ((file, begin), (extent,)))
            continue
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
    return Sources(where, copied, origins)


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
    with gc_paused():  # (format/gcpause.py: many small objects, no cycles)
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
        )
    for fname, blob in extra_files:
        writer.add_file(fname, blob)
    return writer, sources
