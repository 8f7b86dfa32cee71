"""How a checkpoint is laid out on disk: file names, shard plans, header bytes and copies.

Pure functions of names, dtypes, shapes and where each output's bytes come from: the writer
plans every shard and header from these before any data arrives, either exactly as the
reference writer lays them out, or (the default) so that unchanged bytes keep their input
offsets modulo the filesystem block and a copy-on-write filesystem can share them.
"""

from __future__ import annotations

import json
import operator
import re
from array import array
from bisect import bisect_left
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, compress, islice
from json.encoder import encode_basestring  # what json.dumps(ensure_ascii=False) uses
from typing import NamedTuple

from weightmap.format.dtypes import DTYPES, SpecTable, TensorSpec
from weightmap.format.names import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME, SINGLE_NAME
from weightmap.format.options import (
    DEFAULT_MAX_SHARD_SIZE,
    LAYOUTS,
    Layouts,
    check_layout,
    parse_size,
)

__all__ = [
    "CLONE_BLOCK",
    "CONFIG_NAME",
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "JOURNAL_NAME",
    "LAYOUTS",
    "SINGLE_NAME",
    "Copy",
    "Extent",
    "Layout",
    "Layouts",
    "LazyHeader",
    "Offsets",
    "Origin",
    "ShardPlan",
    "WholeOrigins",
    "aligned_middle",
    "build_header",
    "check_layout",
    "parse_size",
    "plan_layout",
    "plan_members",
    "plan_shards",
]


def _layout_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    # The reference writer's order: descending dtype rank, then name.
    return sorted(specs, key=lambda s: (-DTYPES[s.dtype].rank, s.name))


def _header_text(
    order: Sequence[TensorSpec], sizes: Sequence[int], metadata: Mapping[str, str] | None
) -> bytes:
    """The header JSON (unpadded) of tensors stored back to back in ``order``, ``sizes[i]``
    bytes each, from the start of the data buffer.

    Written entry by entry: the same bytes as ``json.dumps`` of the whole header with compact
    separators, without building a dict per tensor (a checkpoint may hold 100,000 of them).
    """
    parts: list[str] = []
    meta = _metadata_part(metadata)
    if meta is not None:
        parts.append(meta)
    position = 0
    # The text between a name and its offsets, by dtype and shape: the layers and experts of
    # a model repeat a few shapes many times over. (A plain loop of f-strings: faster here
    # than joining the pieces through map and chain, measured.)
    middles: dict[tuple[str, tuple[int, ...]], str] = {}
    table = order if isinstance(order, SpecTable) else None
    rows = (
        zip(table.names, table.dtypes, table.shapes, sizes, strict=True)
        if table is not None
        else ((s.name, s.dtype, s.shape, size) for s, size in zip(order, sizes, strict=True))
    )
    for name, dtype, shape, size in rows:
        end = position + size
        key = (dtype, shape)
        middle = middles.get(key)
        if middle is None:
            middle = middles[key] = _middle(dtype, shape)
        parts.append(f"{encode_basestring(name)}{middle}{position},{end}]}}")
        position = end
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def _middle(dtype: str, shape: tuple[int, ...]) -> str:
    """The text of an entry between its name and its offsets."""
    dims = ",".join(map(str, shape))
    return f':{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":['


def _metadata_part(metadata: Mapping[str, str] | None) -> str | None:
    """The header's ``__metadata__`` entry (keys sorted), or None without metadata."""
    if not metadata:
        return None
    meta = {k: metadata[k] for k in sorted(metadata)}
    return '"__metadata__":' + json.dumps(meta, separators=(",", ":"), ensure_ascii=False)


# A name that JSON writes as it is, between quotes: no quote, backslash or control character.
_PLAIN_NAMES = re.compile(r'[^"\\\x00-\x1f]*')


def _digits(values: Sequence[int]) -> int:
    """The decimal digits of ``values`` (non-negative, never decreasing), all together: by
    bisection at each power of ten, not a string per value."""
    count = len(values)
    total = count
    power = 10
    while count and values[-1] >= power:
        total += count - bisect_left(values, power)
        power *= 10
    return total


def _header_length(
    table: SpecTable, sizes: Sequence[int], metadata: Mapping[str, str] | None
) -> int:
    """``len(_header_text(table, sizes, metadata))``, counted from the columns without making
    the text: the names' encoded lengths, each distinct middle's times its count, the offsets'
    digits, and the punctuation."""
    names = table.names
    joined = "".join(names)
    if joined.isascii() and _PLAIN_NAMES.fullmatch(joined):
        name_bytes = len(joined) + 2 * len(names)  # (each between quotes, as it is)
    else:
        name_bytes = sum(len(encode_basestring(n).encode("utf-8")) for n in names)
    keys = list(zip(table.dtypes, table.shapes, strict=True))
    lengths = {key: len(_middle(*key)) for key in set(keys)}
    middles = sum(map(lengths.__getitem__, keys))
    bounds = list(accumulate(sizes, initial=0))
    offsets = _digits(bounds[:-1]) + _digits(bounds[1:]) + 3 * len(names)  # (",", "]}")
    meta = _metadata_part(metadata)
    parts = len(names) + (meta is not None)
    meta_bytes = 0 if meta is None else len(meta.encode("utf-8"))
    return 2 + meta_bytes + name_bytes + middles + offsets + max(0, parts - 1)


_NAME = operator.attrgetter("name")
_DTYPE = operator.attrgetter("dtype")
# A spec's byte size as kept (None where not yet counted), without the property's frame.
_KEPT_NBYTES = operator.attrgetter("_nbytes")


def _offsets(
    order: Sequence[TensorSpec], sizes: Sequence[int], start: int
) -> dict[str, tuple[int, int]]:
    """Each tensor's ``[begin, end)`` when stored back to back in ``order`` from ``start``."""
    # Made by C calls alone (no Python frame per tensor): a shard may hold thousands.
    bounds = list(accumulate(sizes, initial=start))
    # (bounds holds one more than the tensors: each begin with the next one's, its end.)
    pairs = zip(bounds, islice(bounds, 1, None), strict=False)
    return dict(zip(map(_NAME, order), pairs, strict=True))


def build_header(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Lay out one file: the padded JSON header and each tensor's data offsets.

    The layout is the reference writer's (descending dtype rank, then name; header padded with
    spaces to a multiple of 8), so the same tensors and metadata give the same bytes. Metadata
    keys are written sorted, where the reference writer's order varies from run to run.
    """
    order = _layout_order(specs)
    sizes = [s.nbytes for s in order]
    text = _header_text(order, sizes, metadata)
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, _offsets(order, sizes, 0)


class Offsets(Mapping[str, tuple[int, int]]):
    """Each tensor's absolute ``[begin, end)`` in a shard, for tensors stored back to back:
    ``names[i]`` spans ``bounds[i]`` to ``bounds[i + 1]``.

    Two columns, where a dict keeps a pair and an entry per tensor (a hundred bytes more per
    tensor, for the whole of a conversion of 100,000 of them); the bounds may be an int64
    ``array``, 8 bytes each where a list holds an int object of 32. Looking a name up builds an
    index of the names once; iterating over the names or the items builds nothing.
    """

    __slots__ = ("_bounds", "_index", "_names")

    def __init__(self, names: Sequence[str], bounds: Sequence[int]) -> None:
        if len(bounds) != len(names) + 1:
            raise ValueError("Offsets needs one bound more than names")
        self._names = names
        self._bounds = bounds
        self._index: dict[str, int] | None = None

    def __getitem__(self, name: str) -> tuple[int, int]:
        if self._index is None:
            self._index = dict(zip(self._names, range(len(self._names)), strict=True))
        i = self._index[name]
        return self._bounds[i], self._bounds[i + 1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def items(self) -> ItemsView[str, tuple[int, int]]:
        """The ``(name, (begin, end))`` pairs in file order, made as they are read."""
        return _OffsetItems(self)

    def prefixed(self, prefix: str) -> Offsets:
        """The same offsets, every name with ``prefix`` before it."""
        return Offsets([prefix + n for n in self._names], self._bounds)

    def __repr__(self) -> str:
        return f"Offsets({dict(self.items())!r})"


class _OffsetItems(ItemsView[str, tuple[int, int]]):
    """``Offsets.items()``: iterated by C calls over the columns."""

    _mapping: Offsets

    def __iter__(self) -> Iterator[tuple[str, tuple[int, int]]]:
        bounds = self._mapping._bounds
        pairs = zip(bounds, islice(bounds, 1, None), strict=False)
        return zip(self._mapping._names, pairs, strict=False)


class LazyHeader:
    """A shard's header bytes, made when written (``bytes(header)``), of a length counted
    before (``len(header)``), as the layout needs it to place the data.

    A rename of every tensor lays out headers as large as the names they list (100 bytes and
    more a tensor), every shard's before the first is written: held at once, they would be the
    conversion's peak memory; made one at a time as each is written, one shard's is."""

    __slots__ = ("_make", "_size")

    def __init__(self, size: int, make: Callable[[], bytes]) -> None:
        self._size = size
        self._make = make

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        data = self._make()
        if len(data) != self._size:  # (never: the count is tested against the text)
            raise RuntimeError(
                f"a header of {len(data)} bytes was made where {self._size} were laid out"
            )
        return data


@dataclass(frozen=True)
class ShardPlan:
    """One output file: its name, header bytes, and each tensor's absolute file offset.

    (The writer keeps a copy with empty header bytes once it has written them.)"""

    filename: str
    header: bytes | LazyHeader
    offsets: Mapping[str, tuple[int, int]]  # absolute [begin, end) in the file
    size: int


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _group(
    specs: Sequence[TensorSpec],
    sizes: Mapping[str, int],
    limit: int,
    origins: Mapping[str, Origin] | None = None,
) -> list[list[TensorSpec]]:
    """Greedy shards in the given order: a new one where the next tensor would pass ``limit``,
    and (given ``origins``) where the next copied tensor reads another input file than the one
    copied before it, so that no shard copies bytes from two input files. A tensor larger than
    the limit gets a shard of its own."""
    group: list[TensorSpec] = []
    groups = [group]
    current = 0
    file: int | None = None  # the input file of the last copied tensor
    get = origins.get if origins is not None else None
    for spec in specs:
        size = sizes[spec.name]
        brk = False
        if get is not None and (origin := get(spec.name)) is not None and origin.extents:
            first = origin.extents[0].file
            brk = file is not None and first != file
            file = first
        if group and (brk or current + size > limit):
            group = []
            groups.append(group)
            current = 0
        group.append(spec)
        current += size
    return groups


def plan_shards(
    specs: Sequence[TensorSpec],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
) -> list[ShardPlan]:
    """Split tensors into shards greedily, in the given order, up to ``max_shard_size``.

    A tensor larger than the limit gets a shard of its own. One shard is named
    ``model.safetensors``; several are ``model-00001-of-0000N.safetensors``. Each shard is laid
    out as the reference writer lays out one file.
    """
    return list(plan_layout(specs, max_shard_size, metadata, layout="reference").shards)


# -- the clone-friendly layout -------------------------------------------------------------------

# Copy-on-write filesystems share extents only between ranges that start on a block boundary
# in both files. 4096 bytes is the block size of XFS, btrfs, bcachefs and ext4 as created by
# default (and the page size of x86-64 and most arm64 kernels); a fixed value keeps the output
# the same bytes wherever it is written.
CLONE_BLOCK = 4096


class Extent(NamedTuple):
    """``length`` bytes at absolute offset ``offset`` of input file number ``file``."""

    file: int
    offset: int
    length: int


class Origin(NamedTuple):
    """Where an output tensor's bytes come from.

    ``anchor`` is the (input file number, absolute offset) of the first input byte the tensor
    reads; ``extents`` are its bytes in order when they are input bytes unchanged, None when
    the tensor is computed.
    """

    anchor: tuple[int, int]
    extents: tuple[Extent, ...] | None = None


class Copy(NamedTuple):
    """One copy of input bytes into the output, adjacent ranges coalesced: ``length`` bytes of
    input file ``file`` at ``src`` to offset ``dst`` of output shard ``shard``."""

    file: int
    src: int
    shard: int
    dst: int
    length: int


class WholeOrigins(Mapping[str, Origin]):
    """The origins of a plan whose every output is one input range in full (a rename or keep
    of every tensor), as columns: output ``names[i]`` is ``lengths[i]`` bytes at absolute
    offset ``offsets[i]`` of input file ``files[i]``.

    Made and read by C calls alone (``map`` over the columns), where a dict of origins takes
    two named tuples and a Python step per tensor: a checkpoint may hold 100,000 of them. Read
    as a mapping, it makes each origin when asked for.
    """

    __slots__ = ("_index", "files", "lengths", "names", "offsets")

    def __init__(
        self, names: Sequence[str], files: list[int], offsets: Sequence[int], lengths: list[int]
    ) -> None:
        if not len(names) == len(files) == len(offsets) == len(lengths):
            raise ValueError("the columns of WholeOrigins differ in length")
        self.names = names
        self.files = files
        self.offsets = offsets
        self.lengths = lengths
        self._index: dict[str, int] | None = None

    def __getitem__(self, name: str) -> Origin:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        i = self._index[name]
        file, offset = self.files[i], self.offsets[i]
        return Origin((file, offset), (Extent(file, offset, self.lengths[i]),))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def as_dict(self) -> dict[str, Origin]:
        """Every origin, made now: for the passes that look them up one by one."""
        return dict(zip(self.names, map(self.__getitem__, self.names), strict=True))


@dataclass(frozen=True)
class Layout:
    """Every output shard, and the copies that fill the shards' copied tensors."""

    shards: tuple[ShardPlan, ...]
    copies: tuple[Copy, ...]


def aligned_middle(src: int, dst: int, length: int) -> tuple[int, int]:
    """``(head, middle)``: of a copy from ``src`` to ``dst``, the bytes before the first block
    boundary and the whole blocks after them, which a clone can share; (length, 0) unless the
    two offsets are congruent modulo ``CLONE_BLOCK``."""
    block = CLONE_BLOCK
    if (src - dst) % block:
        return length, 0
    head = min(length, -src % block)
    return head, (length - head) // block * block


def plan_layout(
    specs: Sequence[TensorSpec],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    origins: Mapping[str, Origin] | None = None,
    layout: Layouts = "clone",
) -> Layout:
    """Plan every output shard and the copies of its unchanged tensors.

    ``layout="reference"`` lays the shards out as the reference writer does (greedy shards in
    the given order, each file in descending dtype rank then name, header padded to a multiple
    of 8): the bytes ``safetensors.save_file`` writes. ``layout="clone"`` (see
    docs/safety.md) keeps the input's arrangement wherever output tensors are input bytes:
    tensors follow the input's order, no shard takes copied bytes from two input files, and the
    header is padded with spaces (less than one ``CLONE_BLOCK``) so that the copied bytes sit
    at their input offsets modulo the block size, which lets a copy-on-write filesystem share
    them. A shard where that gains no whole block is laid out as the reference writer does.
    """
    check_layout(layout)
    limit = parse_size(max_shard_size)
    origins = origins or {}
    whole = None
    if isinstance(origins, WholeOrigins):
        if layout == "clone":
            whole = _whole_columns(specs, origins, limit)
        if whole is None:  # (the passes below look origins up one by one)
            origins = origins.as_dict()
    if whole is None and layout == "clone" and origins:
        whole = _whole_copies(specs, origins, limit)
    placed = (
        _place(specs, limit, metadata, origins, layout)
        if whole is None
        else [_place_whole(group, sizes, runs, metadata, origins) for group, sizes, runs in whole]
    )
    shards: list[ShardPlan] = []
    copies: list[Copy] = []
    for index, (name, (text, order, sizes, runs)) in enumerate(
        zip(_shard_names(len(placed)), placed, strict=True)
    ):
        header: bytes | LazyHeader = (
            len(text).to_bytes(8, "little") + text
            if isinstance(text, bytes)
            else LazyHeader(8 + len(text), partial(_prefixed, text))
        )
        base = len(header)
        names = order.names if isinstance(order, SpecTable) else list(map(_NAME, order))
        offsets = Offsets(names, array("q", accumulate(sizes, initial=base)))
        shards.append(ShardPlan(name, header, offsets, base + sum(sizes)))
        copies += [Copy(c.file, c.src, index, base + c.dst, c.length) for c in runs]
    return Layout(tuple(shards), tuple(copies))


# A member file holds one rank whole, as Meta's consolidated.NN.pth do: no size splits it.
_WHOLE = 2**62


def plan_members(
    specs: Sequence[TensorSpec],
    members: Sequence[tuple[str, str]],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
    origins: Mapping[str, Origin] | None = None,
    layout: Layouts = "clone",
) -> tuple[Layout, int]:
    """:func:`plan_layout`, with the tensors whose names start with a member's prefix
    (``(prefix, file name)``, ``out:3:``) written into that member's one file without it.

    Returns the layout and how many of its shards are the main checkpoint's (they come
    first; the index lists those only). The main checkpoint gets no file when every tensor
    is a member's. A member is laid out as ``layout`` says when that keeps it one file, and
    as the reference writer lays out one file otherwise.
    """
    if not members:
        planned = plan_layout(specs, max_shard_size, metadata, origins, layout)
        return planned, len(planned.shards)
    origins = origins or {}
    if isinstance(origins, WholeOrigins):
        origins = origins.as_dict()
    groups: dict[str, list[TensorSpec]] = {prefix: [] for prefix, _ in members}
    main: list[TensorSpec] = []
    for spec in specs:
        name = spec.name
        second = name.find(":", name.find(":") + 1)
        group = groups.get(name[: second + 1]) if second > 0 else None
        (main if group is None else group).append(spec)
    shards: list[ShardPlan] = []
    copies: list[Copy] = []
    if main:
        planned = plan_layout(main, max_shard_size, metadata, origins, layout)
        shards += planned.shards
        copies += planned.copies
    n_main = len(shards)
    for prefix, filename in members:
        cut = len(prefix)
        own = [TensorSpec(s.name[cut:], s.dtype, s.shape) for s in groups[prefix]]
        mine = {s.name[cut:]: origins[s.name] for s in groups[prefix] if s.name in origins}
        planned = plan_layout(own, _WHOLE, metadata, mine, layout)
        if len(planned.shards) > 1:  # (the clone layout keeps each input file's bytes apart)
            planned = plan_layout(own, _WHOLE, metadata, mine, "reference")
        (shard,) = planned.shards
        offsets = shard.offsets
        assert isinstance(offsets, Offsets)
        index = len(shards)
        shards.append(ShardPlan(filename, shard.header, offsets.prefixed(prefix), shard.size))
        copies += [c._replace(shard=index) for c in planned.copies]
    return Layout(tuple(shards), tuple(copies)), n_main


# One shard laid out: its padded header JSON, its tensors in file order with their sizes, and
# the copies that fill it (offsets relative to its data buffer).
_Placed = tuple[bytes | LazyHeader, Sequence[TensorSpec], list[int], list[Copy]]


def _place(
    specs: Sequence[TensorSpec],
    limit: int,
    metadata: Mapping[str, str] | None,
    origins: Mapping[str, Origin],
    layout: Layouts,
) -> list[_Placed]:
    """Every shard of any plan, laid out group by group."""
    sizes = {s.name: s.nbytes for s in specs}
    if layout == "clone":
        groups = _group(_by_anchor(specs, origins), sizes, limit, origins)
    else:
        groups = _group(specs, sizes, limit)
    placed: list[_Placed] = []
    for group in groups:
        clone = _clone_shard(group, sizes, origins, metadata) if layout == "clone" else None
        placed.append(clone or _reference_shard(group, sizes, origins, metadata))
    return placed


def _reference_shard(
    group: Sequence[TensorSpec],
    sizes: Mapping[str, int],
    origins: Mapping[str, Origin],
    metadata: Mapping[str, str] | None,
) -> _Placed:
    """One shard as the reference writer lays it out (descending dtype rank, then name)."""
    order = _layout_order(group)
    in_order = [sizes[s.name] for s in order]
    text = _header_text(order, in_order, metadata)
    text += b" " * (-len(text) % 8)
    return text, order, in_order, _runs(order, sizes, origins)


def _whole_copies(
    specs: Sequence[TensorSpec], origins: Mapping[str, Origin], limit: int
) -> list[tuple[Sequence[TensorSpec], list[int], list[Copy] | None]] | None:
    """The clone layout's shards of a plan whose every output is one input range in full (a
    rename or keep of every tensor: the commonest plan, and the one with the most tensors),
    found in one pass: each shard's tensors, their sizes, and their copies (None where the
    tensors would not all sit at their natural alignment). None for any other plan, or outputs
    not in input order: ``_place`` lays those out.

    The same shards, in the same order, as ``_place`` makes of such a plan (``_by_anchor``
    keeps them as they are, ``_group`` splits them where the input file changes or the limit
    is reached, ``_clone_shard`` finds every tensor copied, checks the alignment and runs the
    copies), in one loop rather than one per step: a checkpoint may hold 100,000 tensors.
    """
    found: list[tuple[Sequence[TensorSpec], list[int], list[Copy] | None]] = []
    group: list[TensorSpec] = []
    sizes: list[int] = []
    runs: list[Copy] = []
    aligned = True
    position = 0  # where the next tensor goes in the group's data buffer
    last = (-1, -1)  # the previous tensor's anchor: the outputs must come in input order
    file = src = dst = length = -1  # the open run of copies; none while length < 0
    get = origins.get
    alignment = _ALIGNMENT
    for spec in specs:
        origin = get(spec.name)
        if origin is None or origin.extents is None or len(origin.extents) != 1:
            return None
        if origin.anchor < last:
            return None
        last = origin.anchor
        ext_file, offset, ext_length = origin.extents[0]
        size = spec.nbytes
        if ext_length != size:
            return None
        if group and (ext_file != file or position + size > limit):
            if length >= 0:
                runs.append(Copy(file, src, 0, dst, length))
            found.append((group, sizes, runs if aligned else None))
            group, sizes, runs = [], [], []
            aligned, position, src, dst, length = True, 0, -1, -1, -1
        if aligned and position % alignment[spec.dtype]:
            aligned = False
        if ext_length:
            if ext_file == file and src + length == offset and dst + length == position:
                length += ext_length
            else:
                if length >= 0:
                    runs.append(Copy(file, src, 0, dst, length))
                src, dst, length = offset, position, ext_length
        file = ext_file
        group.append(spec)
        sizes.append(size)
        position += size
    if not group:
        return None
    if length >= 0:
        runs.append(Copy(file, src, 0, dst, length))
    found.append((group, sizes, runs if aligned else None))
    return found


def _whole_columns(
    specs: Sequence[TensorSpec], origins: WholeOrigins, limit: int
) -> list[tuple[Sequence[TensorSpec], list[int], list[Copy] | None]] | None:
    """``_whole_copies`` of origins given as columns, by C calls over them: the same shards
    for the plans it takes (outputs listed as the columns are, in input order, none empty,
    each input file's share within ``limit``); None for the others, which ``_whole_copies``
    then lays out."""
    table = specs if isinstance(specs, SpecTable) else None
    names = list(map(_NAME, specs)) if table is None else table.names
    files, offsets, lengths = origins.files, origins.offsets, origins.lengths
    if not names or (names is not origins.names and names != origins.names) or 0 in lengths:
        return None
    if table is not None:
        sizes = list(table.sizes)
    else:
        sizes = list(map(_KEPT_NBYTES, specs))
        if None in sizes:
            sizes = [s.nbytes for s in specs]
    if sizes != lengths:
        return None
    # Outputs in input order: anchors (file, offset) never decrease. Seen column by column,
    # no pair made per tensor: the files never decrease, nor the offsets within a file (seen
    # for each file's run below).
    if not all(map(operator.le, files, islice(files, 1, None))):
        return None
    ends = array("q", map(operator.add, offsets, lengths))
    # A run of copies breaks where a tensor does not start where the one before it ends.
    joined = list(map(operator.eq, ends, islice(offsets, 1, None)))
    dtypes = map(_DTYPE, specs) if table is None else table.dtypes
    aligns = list(map(_ALIGNMENT.__getitem__, dtypes))
    # One shard per input file (its first tensor found by bisection: files never decrease).
    bounds = [bisect_left(files, f) for f in sorted(set(files))] + [len(files)]
    found: list[tuple[Sequence[TensorSpec], list[int], list[Copy] | None]] = []
    for a, b in zip(bounds, islice(bounds, 1, None), strict=False):
        if not all(map(operator.le, offsets[a : b - 1], offsets[a + 1 : b])):
            return None
        group_sizes = sizes[a:b]
        if b - a > 1 and sum(group_sizes) > limit:
            return None  # the file's tensors take several shards
        positions = list(accumulate(group_sizes, initial=0))
        aligned = not any(map(operator.mod, positions, islice(aligns, a, b)))
        breaks = compress(range(1, b - a), map(operator.not_, joined[a : b - 1]))
        cuts = [0, *breaks, b - a]
        file = files[a]
        runs = [
            Copy(file, offsets[a + c], 0, positions[c], ends[a + d - 1] - offsets[a + c])
            for c, d in zip(cuts, islice(cuts, 1, None), strict=False)
        ]
        group = list(specs[a:b]) if table is None else table[a:b]
        found.append((group, group_sizes, runs if aligned else None))
    return found


def _place_whole(
    group: Sequence[TensorSpec],
    sizes: list[int],
    runs: list[Copy] | None,
    metadata: Mapping[str, str] | None,
    origins: Mapping[str, Origin],
) -> _Placed:
    """A shard of ``_whole_copies``, as ``_clone_shard`` (or, where that shares no block, the
    reference layout) lays it out."""
    if runs is not None:
        gain, residue = _best_residue(runs)
        if gain >= CLONE_BLOCK:
            if isinstance(group, SpecTable):  # (a whole checkpoint's: made when written)
                size = _header_length(group, sizes, metadata)
                pad = (residue - 8 - size) % CLONE_BLOCK
                text: bytes | LazyHeader = LazyHeader(
                    size + pad, partial(_padded_text, group, sizes, metadata, pad)
                )
            else:
                text = _header_text(group, sizes, metadata)
                text += b" " * ((residue - 8 - len(text)) % CLONE_BLOCK)
            return text, group, sizes, runs
    by_name = dict(zip(map(_NAME, group), sizes, strict=True))
    return _reference_shard(group, by_name, origins, metadata)


def _padded_text(
    order: Sequence[TensorSpec], sizes: Sequence[int], metadata: Mapping[str, str] | None, pad: int
) -> bytes:
    return _header_text(order, sizes, metadata) + b" " * pad


def _prefixed(text: LazyHeader) -> bytes:
    return len(text).to_bytes(8, "little") + bytes(text)


def _by_anchor(specs: Sequence[TensorSpec], origins: Mapping[str, Origin]) -> list[TensorSpec]:
    """Tensors in the order of the input bytes they read (stable; unanchored ones last)."""
    far = (1 << 62, 0)
    get = origins.get
    keys = [o.anchor if (o := get(s.name)) else far for s in specs]
    # Outputs mostly come in input order already (one per input): seen so in one pass.
    if all(map(operator.le, keys, keys[1:])):
        return list(specs)
    return [specs[i] for i in sorted(range(len(specs)), key=keys.__getitem__)]


def _alignment(dtype: str) -> int:
    """The offset alignment the reference layout gives a tensor: its element size, at most 8."""
    bits = DTYPES[dtype].bits
    return min(8, bits // 8) if bits % 8 == 0 else 1


# By dtype name: looked up once per tensor of every shard laid out.
_ALIGNMENT = {name: _alignment(name) for name in DTYPES}


def _clone_shard(
    group: Sequence[TensorSpec],
    sizes: Mapping[str, int],
    origins: Mapping[str, Origin],
    metadata: Mapping[str, str] | None,
) -> _Placed | None:
    """One shard in the clone layout (copies' offsets relative to the data buffer), or None
    where no whole block could be shared (the shard is then laid out as the reference writer
    does).

    The copied tensors go back to back in input order, the computed ones before or after them
    in reference order (whichever keeps every tensor at its natural alignment and shares more).
    The data buffer then starts at the offset, modulo the block size and a multiple of 8, that
    puts the most copied bytes at their input offsets modulo the block size.
    """
    copied = [s for s in group if (o := origins.get(s.name)) is not None and o.extents]
    if not copied:
        return None
    # Every tensor copied (a rename): no set of names to make, nothing to sort.
    if len(copied) == len(group):
        computed = []
    else:
        copied_names = {s.name for s in copied}
        computed = _layout_order([s for s in group if s.name not in copied_names])
    best: tuple[int, int, list[TensorSpec], list[Copy]] | None = None
    for order in (copied + computed, computed + copied) if computed else (copied,):
        if not _aligned(order, sizes):
            continue
        runs = _runs(order, sizes, origins)
        gain, residue = _best_residue(runs)
        if gain >= CLONE_BLOCK and (best is None or gain > best[0]):
            best = (gain, residue, order, runs)
    if best is None:
        return None
    _, residue, order, runs = best
    in_order = [sizes[s.name] for s in order]
    text = _header_text(order, in_order, metadata)
    # The data starts at 8 + len(header) = residue modulo the block: pad the header with spaces.
    text += b" " * ((residue - 8 - len(text)) % CLONE_BLOCK)
    return text, order, in_order, runs


def _aligned(order: Sequence[TensorSpec], sizes: Mapping[str, int]) -> bool:
    """Whether tensors stored back to back in ``order`` from a multiple of 8 each start at a
    multiple of their natural alignment, as in the reference layout."""
    position = 0
    for spec in order:
        if position % _ALIGNMENT[spec.dtype]:
            return False
        position += sizes[spec.name]
    return True


def _runs(
    order: Sequence[TensorSpec], sizes: Mapping[str, int], origins: Mapping[str, Origin]
) -> list[Copy]:
    """The copies of tensors stored back to back in ``order``, offsets relative to the data
    buffer: one per run of ranges adjacent both in the input and in the output."""
    # Coalesced in the same loop that places the tensors, the open run in locals: this runs
    # once per tensor of every shard laid out.
    runs: list[Copy] = []
    file = src = dst = length = -1  # the open run; none while length < 0
    get = origins.get
    position = 0
    for spec in order:
        origin = get(spec.name)
        if origin is not None and origin.extents:
            at = position
            for ext_file, offset, ext_length in origin.extents:
                if not ext_length:
                    continue
                if ext_file == file and src + length == offset and dst + length == at:
                    length += ext_length
                else:
                    if length >= 0:
                        runs.append(Copy(file, src, 0, dst, length))
                    file, src, dst, length = ext_file, offset, at, ext_length
                at += ext_length
        position += sizes[spec.name]
    if length >= 0:
        runs.append(Copy(file, src, 0, dst, length))
    return runs


def _best_residue(runs: Sequence[Copy]) -> tuple[int, int]:
    """``(bytes shareable, data start modulo the block)`` for copies at these offsets of the
    data buffer: the start that puts the most whole blocks at congruent offsets."""
    gains: dict[int, int] = {}
    for run in runs:
        residue = (run.src - run.dst) % CLONE_BLOCK
        gains[residue] = gains.get(residue, 0) + aligned_middle(run.src, run.src, run.length)[1]
    # The data buffer starts at a multiple of 8, as the reference writer's does.
    usable = [(gain, -residue) for residue, gain in gains.items() if residue % 8 == 0]
    if not usable:
        return 0, 0
    gain, neg = max(usable)
    return gain, -neg
