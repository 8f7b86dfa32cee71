"""Reading and validating safetensors headers without touching tensor data.

A header is validated completely before any offset in it is trusted: the size cap, UTF-8,
strict JSON (no NaN, no duplicate keys, bounded nesting), string-only metadata, known dtypes,
whole byte sizes, sizes that fit in a u64, and a data buffer that is indexed exactly (tensors
back to back from 0, no holes, no overlaps, no trailing bytes). Each violation raises a
:class:`~weightmap.errors.FormatError` whose ``rule`` names the broken rule.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from array import array
from collections.abc import ItemsView, Iterator, Mapping, Sequence, ValuesView
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, repeat
from operator import attrgetter, eq, lt, sub
from types import MappingProxyType
from typing import Any, NamedTuple, cast

from weightmap.errors import FormatError
from weightmap.format.dtypes import DTYPES, U64_MAX, TensorSpec
from weightmap.format.slots import make_tuple
from weightmap.format.text import is_utf8, nesting_exceeds, unique_object
from weightmap.fs.safeopen import kind, read_at

__all__ = [
    "MAX_HEADER_SIZE",
    "Header",
    "TensorInfo",
    "TensorTable",
    "parse_header",
    "read_header",
    "read_header_fd",
]

# The reference implementation refuses larger headers; so do we, before allocating anything.
MAX_HEADER_SIZE = 100_000_000
# JSON nesting a valid header needs is 3 (object -> entry -> list); anything deeper is hostile.
_MAX_DEPTH = 8
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})


class TensorInfo(NamedTuple):
    """One tensor of a validated header. ``begin``/``end`` are relative to the data buffer.

    A named tuple, not a dataclass: made once per tensor of every header read (100,000 and
    more in a large MoE checkpoint), at a third of a frozen dataclass's cost."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.begin

    @property
    def spec(self) -> TensorSpec:
        """The tensor's name, dtype and shape (a new one each time: ``Checkpoint.specs`` keeps
        them)."""
        return TensorSpec(self.name, self.dtype, self.shape)


class TensorTable(Mapping[str, TensorInfo]):
    """A header's tensors as columns (names, dtypes, shapes, begins, ends), read as a mapping of
    name to :class:`TensorInfo` in data order.

    A header may list 100,000 tensors and more, and a conversion that only moves bytes reads
    its columns and never an entry: each :class:`TensorInfo` is made when asked for (by name,
    or by a pass over ``values()``/``items()``), and the names' positions only when a name is
    first looked up. The dtypes are the table's own strings and the shapes one tuple per
    distinct shape; begins and ends are int64 columns (8 bytes each, where an int object takes
    32). The columns are read-only: a checkpoint's specs share their strings.
    """

    __slots__ = ("_rows", "begins", "dtypes", "ends", "names", "shapes")

    def __init__(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[tuple[int, ...]],
        begins: Sequence[int],
        ends: Sequence[int],
    ) -> None:
        if not len(names) == len(dtypes) == len(shapes) == len(begins) == len(ends):
            raise ValueError("the columns of a TensorTable differ in length")
        self.names = names
        self.dtypes = dtypes
        self.shapes = shapes
        self.begins = begins
        self.ends = ends
        self._rows: dict[str, int] | None = None

    @classmethod
    def of(cls, infos: Sequence[TensorInfo]) -> TensorTable:
        """The table of these entries (in this order)."""
        return cls(
            list(map(_NAME, infos)),
            list(map(_DTYPE, infos)),
            list(map(_SHAPE, infos)),
            list(map(_BEGIN, infos)),
            list(map(_END, infos)),
        )

    def _row(self, name: str) -> int:
        if self._rows is None:
            self._rows = {n: i for i, n in enumerate(self.names)}
        return self._rows[name]

    def __getitem__(self, name: str) -> TensorInfo:
        i = self._row(name)
        row = (self.names[i], self.dtypes[i], self.shapes[i], self.begins[i], self.ends[i])
        return make_tuple(TensorInfo, row)

    def __contains__(self, name: object) -> bool:
        try:
            self._row(name)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def infos(self) -> Iterator[TensorInfo]:
        """Every entry in data order, each made now (by C calls: no Python step per entry)."""
        rows = zip(self.names, self.dtypes, self.shapes, self.begins, self.ends, strict=True)
        return map(make_tuple, repeat(TensorInfo), rows)

    def values(self) -> ValuesView[TensorInfo]:
        return _TableValues(self)

    def items(self) -> ItemsView[str, TensorInfo]:
        return _TableItems(self)

    def sizes(self) -> list[int]:
        """Each tensor's byte size, in data order."""
        return list(map(sub, self.ends, self.begins))

    def __repr__(self) -> str:
        return f"TensorTable({len(self.names)} tensors)"


class _TableValues(ValuesView[TensorInfo]):
    _mapping: TensorTable

    def __iter__(self) -> Iterator[TensorInfo]:
        return self._mapping.infos()


class _TableItems(ItemsView[str, TensorInfo]):
    _mapping: TensorTable

    def __iter__(self) -> Iterator[tuple[str, TensorInfo]]:
        table = self._mapping
        return zip(table.names, table.infos(), strict=True)


_NAME = attrgetter("name")
_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")


@dataclass(frozen=True)
class Header:
    """A validated safetensors header.

    ``tensors`` maps names to :class:`TensorInfo` in data order. ``data_start`` is the file
    offset of the data buffer (8 + header size); ``file_size`` is the size the header implies,
    which equals the file's size when it was read.
    """

    path: str
    header_size: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str] | None
    file_size: int
    mtime_ns: int = field(default=0, compare=False)

    @property
    def data_start(self) -> int:
        """File offset where tensor data begins."""
        return 8 + self.header_size


def _brief(value: object) -> str:
    """A value from a header, for a message: bounded, since the header may be 100 MB."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _fail(path: str, rule: str, message: str, tensor: str | None = None) -> FormatError:
    return FormatError(message, path=path, tensor=tensor, rule=rule)


def _check_nesting(text: str, path: str) -> None:
    """Refuse brackets nested past _MAX_DEPTH before json sees them (its decoder recurses)."""
    if nesting_exceeds(text, _MAX_DEPTH):
        raise _fail(path, "header-json", f"header JSON nests deeper than {_MAX_DEPTH} levels")


def _decode_text(raw: bytes, path: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(
            path, "header-utf8", f"header is not valid UTF-8 (byte {exc.start} of the header)"
        ) from None


def _decode_json(text: str, path: str) -> Any:
    """The header's JSON, refusing duplicate names and NaN; a header that fails is checked for
    nesting first, so that the error is the one a scan before decoding would give.

    The nesting scan costs as much as the decoding, so it runs only where it can matter: on
    a failure here, or (``_checked_header``) on a header that is not all plain tensor entries.
    The decoder itself is safe on deep nesting: it raises ``RecursionError``.
    """

    def twice(key: str) -> FormatError:
        return _fail(path, "duplicate-name", f"name {_brief(key)} appears twice in the header")

    no_duplicates = partial(unique_object, twice=twice)

    def no_constants(name: str) -> Any:
        raise _fail(path, "header-json", f"header JSON contains {name}, which JSON does not allow")

    try:
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except FormatError:
        _check_nesting(text, path)
        raise
    except (ValueError, RecursionError) as exc:
        _check_nesting(text, path)
        if "int_max_str_digits" in str(exc):
            # Python's own limit on int parsing; its message suggests raising the limit,
            # which is no fix for a hostile file: no dimension or offset needs 4,300 digits.
            raise _fail(
                path,
                "overflow",
                "header holds an integer of thousands of digits: no dimension "
                "or offset fits in 64 bits",
            ) from None
        raise _fail(path, "header-json", f"header is not valid JSON ({exc})") from None


def _int_list(value: object) -> list[int] | None:
    # bool is an int subclass in Python; JSON true is not a dimension.
    if not isinstance(value, list):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return value


def _numel(shape: list[int]) -> int | None:
    """numel as the reference implementation counts it, or None where it overflows.

    Dimensions are u64 and the product is taken in order, each step checked: ``[0, 2**70]``
    and ``[2**32, 2**32, 0]`` are refused there even though they hold no element, so they are
    refused here (an output of ours must never be one the reference refuses). Stopping at the
    first overflow also keeps a long list of huge dimensions from costing quadratic time.
    """
    n = 1
    for d in shape:
        n *= d
        if d > U64_MAX or n > U64_MAX:
            return None
    return n


def _shown(shape: list[int]) -> str:
    """A shape for messages: a hostile one may list 80,000 dimensions."""
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ...]"


def _metadata(entry: object, path: str) -> dict[str, str]:
    if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
        raise _fail(path, "metadata", "__metadata__ must map strings to strings only")
    if not all(is_utf8(k) and is_utf8(v) for k, v in entry.items()):
        raise _fail(path, "header-utf8", "__metadata__ holds a lone surrogate escape")
    return entry


def _entry_keys(entry: dict[str, Any], path: str, name: str) -> None:
    keys = set(entry)
    if keys == _TENSOR_KEYS:
        return
    missing = sorted(_TENSOR_KEYS - keys)
    extra = sorted(keys - _TENSOR_KEYS)
    parts = [f"missing {', '.join(missing)}" if missing else "",
             f"unexpected {', '.join(extra)}" if extra else ""]  # fmt: skip
    detail = "; ".join(part for part in parts if part)
    raise _fail(path, "tensor-entry", f"entry keys are wrong ({detail})", name)


# The shapes met so far in one header, each kept once (see ``_plain_entry``).
_Shapes = dict[tuple[int, ...], tuple[int, ...]]


def _plain_tensor(name: str, entry: object, shapes: _Shapes) -> TensorInfo | None:
    """The common, valid entry (a dict, as the strict decoder gives it) in few steps; None for
    anything else, which ``_tensor`` then checks rule by rule to name what is wrong."""
    if type(entry) is not dict or entry.keys() != _TENSOR_KEYS:
        return None
    return _plain_entry(name, entry["dtype"], entry["shape"], entry["data_offsets"], shapes)


def _plain_entry(
    name: str, dtype_name: object, shape: object, offsets: object, shapes: _Shapes
) -> TensorInfo | None:
    """The tensor of a valid entry's three values, or None for anything else (a header may
    list 100,000 entries). ``shapes`` holds the shapes met so far in the header, each once.

    Accepts exactly what ``_tensor`` accepts: JSON gives plain lists and ints, and
    ``type(x) is int`` leaves out ``true``, as ``_int_list`` does.
    """
    dt = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dt is None or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return None
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end <= U64_MAX:
        return None
    # The dimensions' types and _numel's product in one loop (this runs once per tensor).
    count = 1
    for d in shape:
        if type(d) is not int or d < 0 or d > U64_MAX:
            return None
        count *= d
        if count > U64_MAX:
            return None
    bits = count * dt.bits
    if bits > U64_MAX or bits % 8 or end - begin != bits // 8:
        return None
    # make_tuple: the named tuple's own __new__ is Python code, and this runs per tensor. The
    # dtype's name is the table's own string, and the shape one tuple per distinct shape
    # (``shapes``): the layers and experts of a model repeat a few shapes, and every spec,
    # node and output made from this entry shares them (a third of a kilobyte per tensor less
    # would otherwise be kept for a checkpoint's lifetime, from a string and a tuple each).
    dims = tuple(shape)
    return make_tuple(TensorInfo, (name, dt.name, shapes.setdefault(dims, dims), begin, end))


class _Pairs(list[tuple[str, Any]]):
    """An object of a header's JSON as its ``(name, value)`` pairs in order: what the quick
    decoder makes of every object, at C speed (no Python call per object, as a duplicate check
    would need), and never mistaken for a JSON array (``"shape": {}`` is no ``[]``)."""

    __slots__ = ()


class _NotPlain(Exception):
    """The quick decoder met a constant (NaN, Infinity): the strict one says what is wrong."""


def _constant(name: str) -> Any:
    raise _NotPlain(name)


# The entry of nearly every header: the keys in the order every writer puts them.
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


def _plain_metadata(pairs: _Pairs, escapes: bool) -> dict[str, str] | None:
    """The metadata of a header's ``__metadata__`` object as the quick decoder gives it, or
    None where it is not plain (a key twice, a value that is no string, a lone surrogate from
    an escape, which only ``escapes`` in the text can make)."""
    meta = dict(pairs)
    if len(meta) != len(pairs) or not all(type(v) is str for v in meta.values()):
        return None
    if escapes and not all(is_utf8(k) and is_utf8(v) for k, v in meta.items()):
        return None
    return meta


def _quick_header(
    text: str, escapes: bool
) -> tuple[dict[str, str] | None, list[TensorInfo]] | None:
    """The metadata and tensors of a header that is valid JSON of all plain entries, decoded
    without a Python call per object; None for anything else (not JSON, a constant, a name
    twice, an entry out of the ordinary), which ``_checked_header`` then decodes strictly to
    say what, if anything, is wrong. What it accepts, ``_checked_header`` accepts with the same
    result."""
    try:
        decoded = json.loads(text, object_pairs_hook=_Pairs, parse_constant=_constant)
    except (ValueError, RecursionError, _NotPlain):
        return None
    if type(decoded) is not _Pairs or len(dict(decoded)) != len(decoded):
        return None  # not an object, or a name that comes twice
    metadata: dict[str, str] | None = None
    infos: list[TensorInfo] = []
    append = infos.append
    shapes: _Shapes = {}
    for name, entry in decoded:
        if escapes and not is_utf8(name):
            return None
        if type(entry) is not _Pairs:
            return None
        if name == "__metadata__":
            metadata = _plain_metadata(entry, escapes)
            if metadata is None:
                return None
            continue
        if len(entry) != 3:
            return None
        (k0, v0), (k1, v1), (k2, v2) = entry
        if k0 == "dtype" and k1 == "shape" and k2 == "data_offsets":
            info = _plain_entry(name, v0, v1, v2, shapes)
        else:  # the three keys in another order, or not the three keys
            fields = dict(entry)
            if fields.keys() != _TENSOR_KEYS:
                return None
            info = _plain_entry(
                name, fields["dtype"], fields["shape"], fields["data_offsets"], shapes
            )
        if info is None:
            return None
        append(info)
    return metadata, infos


def _tensor(name: str, entry: object, path: str, shapes: _Shapes) -> TensorInfo:
    """One tensor entry, checked: keys, dtype, shape, offsets, and that they agree."""
    if is_utf8(name) and (plain := _plain_tensor(name, entry, shapes)) is not None:
        return plain
    if not is_utf8(name):
        raise _fail(path, "header-utf8", "name holds a lone surrogate escape", name)
    if not isinstance(entry, dict):
        raise _fail(path, "tensor-entry", "entry is not an object", name)
    _entry_keys(entry, path, name)
    dtype_name = entry["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        known = ", ".join(DTYPES)
        raise _fail(path, "dtype", f"unknown dtype {_brief(dtype_name)} (known: {known})", name)
    shape = _int_list(entry["shape"])
    if shape is None or any(d < 0 for d in shape):
        raise _fail(
            path,
            "shape",
            f"shape {_brief(entry['shape'])} is not a list of non-negative integers",
            name,
        )
    offsets = _int_list(entry["data_offsets"])
    if offsets is None or len(offsets) != 2 or offsets[0] < 0 or offsets[1] < 0:
        raise _fail(
            path,
            "offsets",
            f"data_offsets {_brief(entry['data_offsets'])} is not a pair of non-negative integers",
            name,
        )
    begin, end = offsets
    if begin > end:
        raise _fail(path, "offsets", f"data_offsets [{begin}, {end}] end before they begin", name)
    if begin > U64_MAX or end > U64_MAX:
        raise _fail(path, "overflow", "data_offsets do not fit in 64 bits", name)
    count = _numel(shape)
    if count is None or count * DTYPES[dtype_name].bits > U64_MAX:
        raise _fail(
            path,
            "overflow",
            f"shape {_shown(shape)} has a dimension, or more elements, than 64 bits can count "
            "(the product is checked step by step, as the reference implementation does)",
            name,
        )
    bits = count * DTYPES[dtype_name].bits
    if bits % 8:
        raise _fail(
            path,
            "byte-size",
            f"{dtype_name} shape {_shown(shape)} holds {bits} bits, which is not a whole number "
            "of bytes",
            name,
        )
    if end - begin != bits // 8:
        raise _fail(
            path,
            "byte-size",
            f"data_offsets span {end - begin} bytes but {dtype_name} shape {_shown(shape)} needs "
            f"{bits // 8}",
            name,
        )
    return TensorInfo(name, dtype_name, tuple(shape), begin, end)


_BY_OFFSETS = attrgetter("begin", "end")
_BEGIN = attrgetter("begin")
_END = attrgetter("end")


def _back_to_back(infos: list[TensorInfo]) -> bool:
    """Whether the tensors are stored back to back from 0 in the order listed, none empty: the
    layout of nearly every file, sorted and checked so by C calls over the columns (a header
    may list 100,000 tensors), where ``_check_layout`` takes a Python step per tensor."""
    begins = list(map(_BEGIN, infos))
    ends = list(map(_END, infos))
    return (
        (not begins or begins[0] == 0)
        and all(map(lt, begins, ends))
        and all(map(eq, islice(begins, 1, None), ends))
    )


def _check_layout(infos: list[TensorInfo], header_size: int, file_size: int, path: str) -> None:
    """The data buffer is indexed exactly: back to back from 0, no trailing bytes.

    ``infos`` must be sorted by (begin, end), so empty tensors sit before a non-empty one at
    the same offset.
    """
    position = 0
    for info in infos:
        if info.begin > position:
            raise _fail(
                path,
                "hole",
                f"data starts at {info.begin} but the previous tensor ends at {position}: "
                "the data buffer has a hole",
                info.name,
            )
        if info.begin < position:
            raise _fail(
                path,
                "overlap",
                f"data [{info.begin}, {info.end}) overlaps the previous tensor (ends at "
                f"{position})",
                info.name,
            )
        position = info.end
    expected = 8 + header_size + position
    if expected < file_size:
        raise _fail(
            path,
            "trailing-bytes",
            f"file has {file_size - expected} bytes after the last tensor's data",
        )
    if expected > file_size:
        raise _fail(
            path,
            "truncated",
            f"header describes {expected} bytes but the file has {file_size}: it is truncated",
        )


def _checked_header(text: str, path: str) -> tuple[dict[str, str] | None, list[TensorInfo]]:
    """The metadata and tensors of a header that is not plain, every rule checked in order:
    the first it breaks is the ``FormatError`` raised."""
    decoded = _decode_json(text, path)
    _check_nesting(text, path)
    if not isinstance(decoded, dict):
        raise _fail(path, "header-object", "header JSON is not an object")
    metadata: dict[str, str] | None = None
    infos: list[TensorInfo] = []
    shapes: _Shapes = {}
    for name, entry in decoded.items():
        if name == "__metadata__":
            metadata = _metadata(entry, path)
        else:
            infos.append(_tensor(name, entry, path, shapes))
    return metadata, infos


# A tensor entry as writers put them: compact, the keys in the usual order, a name without
# escapes, canonical integers (at most 20 digits: U64_MAX has 20). ``re.split`` over a header
# gives, per entry, the text before it, then its name, dtype, shape's digits, begin, end and
# the character after it (``,`` between entries, ``}`` closing the header).
_UINT = r"(?:0|[1-9][0-9]{0,19})"
_ENTRY = re.compile(
    r'"([^"\\\x00-\x1f]*)":\{"dtype":"([0-9A-Za-z_]{1,16})",'
    rf'"shape":\[((?:{_UINT}(?:,{_UINT})*)?)\],"data_offsets":\[({_UINT}),({_UINT})\]\}}([,}}])'
)
_PER_ENTRY = 7  # the strings re.split gives per entry
# The table's own string for each dtype name (every spec and output shares them).
_DTYPE_NAMES = {name: name for name in DTYPES}
# What may open a header before its first entry: ``{``, and the metadata as writers put it.
_METADATA_OPEN = '{"__metadata__":'


def _shape_of(digits: str) -> tuple[int, ...]:
    return tuple(map(int, digits.split(","))) if digits else ()


def _entry_bytes(dtype_name: str, shape: tuple[int, ...]) -> int | None:
    """The bytes a tensor of this dtype and shape takes, or None where the reference refuses
    it (a product past 64 bits, a size that is no whole number of bytes)."""
    count = _numel(list(shape))
    if count is None:
        return None
    bits = count * DTYPES[dtype_name].bits
    return None if bits > U64_MAX or bits % 8 else bits // 8


def _column_metadata(opening: str) -> tuple[bool, dict[str, str] | None]:
    """Whether the text before a header's first entry is ``{``, or ``{"__metadata__":{...},``
    with plain metadata, and that metadata (None for ``{``)."""
    if opening == "{":
        return True, None
    if not opening.startswith(_METADATA_OPEN) or not opening.endswith(","):
        return False, None
    try:
        pairs = json.loads(
            opening[len(_METADATA_OPEN) : -1], object_pairs_hook=_Pairs, parse_constant=_constant
        )
    except (ValueError, RecursionError, _NotPlain):
        return False, None
    if type(pairs) is not _Pairs:
        return False, None
    meta = _plain_metadata(pairs, "\\u" in opening)
    return meta is not None, meta


def _column_header(
    text: str, header_size: int, file_size: int
) -> tuple[dict[str, str] | None, TensorTable] | None:
    """The metadata and tensors of a header in the form writers give it (the metadata first,
    if any, then plain entries stored back to back from 0, none empty, spaces after), by C
    calls over the text: one split, then a map per column, where the JSON decoder makes a dict
    or list per entry and a Python step checks each. None for any other header (or one that
    breaks a rule): ``_quick_header`` and ``_checked_header`` decode those, and say what is
    wrong. What it accepts, they accept with the same result."""
    parts = _ENTRY.split(text)
    count = len(parts) // _PER_ENTRY
    if not count:
        return None
    # Nothing between entries; the last closes the header, with spaces (padding) after it.
    if any(islice(parts, _PER_ENTRY, len(parts) - 1, _PER_ENTRY)) or parts[-1].strip(" "):
        return None
    ends_with = parts[_PER_ENTRY - 1 :: _PER_ENTRY]
    if ends_with[-1] != "}" or ends_with.count("}") != 1:
        return None
    plain, metadata = _column_metadata(parts[0])
    if not plain:
        return None
    names = parts[1::_PER_ENTRY]
    if len(set(names)) != count or "__metadata__" in names:
        return None
    found_dtypes = list(map(_DTYPE_NAMES.get, parts[2::_PER_ENTRY]))
    if None in found_dtypes:
        return None
    dtypes = cast(list[str], found_dtypes)
    digits = parts[3::_PER_ENTRY]
    known = {d: _shape_of(d) for d in set(digits)}
    try:
        begins = array("q", map(int, parts[4::_PER_ENTRY]))
        ends = array("q", map(int, parts[5::_PER_ENTRY]))
    except OverflowError:  # past 2**63: no file is that large (the strict path says so)
        return None
    # Back to back from 0, none empty, and the file ends where the last one does.
    if begins[0] != 0 or begins[1:] != ends[:-1] or 8 + header_size + ends[-1] != file_size:
        return None
    pairs = list(zip(dtypes, digits, strict=True))
    size_of = {(d, s): _entry_bytes(d, known[s]) for d, s in set(pairs)}
    sizes = list(map(size_of.__getitem__, pairs))
    if None in sizes or 0 in sizes or list(map(sub, ends, begins)) != sizes:
        return None
    shapes = list(map(known.__getitem__, digits))
    return metadata, TensorTable(names, dtypes, shapes, begins, ends)


def parse_header(
    raw: bytes, *, header_size: int, file_size: int, path: str = "<bytes>", mtime_ns: int = 0
) -> Header:
    """Validate the JSON header bytes of a file of ``file_size`` bytes.

    ``raw`` is exactly the ``header_size`` bytes after the 8-byte length prefix. Raises a
    :class:`FormatError` for the first rule the header breaks.
    """
    text = _decode_text(raw, path)
    # Nearly every header is as writers write it: read as columns. The others are decoded,
    # quickly where they are plain, and checked strictly where they are not.
    columns = _column_header(text, header_size, file_size)
    if columns is not None:
        metadata, table = columns
    else:
        parsed = _quick_header(text, "\\u" in text)
        metadata, infos = parsed if parsed is not None else _checked_header(text, path)
        if not _back_to_back(infos):
            infos.sort(key=_BY_OFFSETS)
            _check_layout(infos, header_size, file_size, path)
        elif 8 + header_size + (infos[-1].end if infos else 0) != file_size:
            _check_layout(infos, header_size, file_size, path)  # (it says what is wrong)
        table = TensorTable.of(infos)
    return Header(
        path=path,
        header_size=header_size,
        tensors=table,
        metadata=None if metadata is None else MappingProxyType(dict(metadata)),
        file_size=file_size,
        mtime_ns=mtime_ns,
    )


def _not_safetensors(prefix: bytes) -> str:
    """A hint for a length prefix that is text: the file is likely no safetensors file at all
    (a JSON file listed as a shard, a git LFS pointer)."""
    if prefix and all(32 <= b < 127 or b in b"\t\n\r" for b in prefix):
        return (
            f"; the file starts with the text {prefix.decode('ascii')!r}: it is not a "
            "safetensors file (a JSON file, or a git LFS pointer not yet downloaded?)"
        )
    return ""


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of a safetensors file, reading no tensor data.

    >>> read_header("examples/eagle3-speculators/model.safetensors").tensors["d2t"].dtype
    'I64'
    """
    p = os.fspath(path)
    try:
        # NONBLOCK: a FIFO swapped in since the folder was listed is refused, not waited on.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(p, "missing", "file does not exist") from None
    try:
        return read_header_fd(fd, p)
    finally:
        os.close(fd)


def read_header_fd(fd: int, path: str | os.PathLike[str]) -> Header:
    """:func:`read_header` of the file open as ``fd`` (named ``path`` in errors), read with
    ``pread``: the descriptor's offset is left as it was, for whoever reads it next."""
    p = os.fspath(path)
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise _fail(p, "not-a-file", "is a directory, not a safetensors file")
    if not stat.S_ISREG(st.st_mode):
        raise _fail(p, "not-a-file", f"is a {kind(st.st_mode)}, not a safetensors file")
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise _fail(
            p,
            "too-small",
            f"file has {len(prefix)} bytes; a safetensors file needs "
            "at least 8 (the header length)",
        )
    (size,) = struct.unpack("<Q", prefix)
    if size > MAX_HEADER_SIZE:
        raise _fail(
            p,
            "header-too-large",
            f"header length {size} exceeds the {MAX_HEADER_SIZE}-byte cap"
            + _not_safetensors(prefix),
        )
    if 8 + size > st.st_size:
        raise _fail(
            p,
            "header-beyond-file",
            f"header length {size} runs past the end of the {st.st_size}-byte file"
            + _not_safetensors(prefix),
        )
    raw = read_at(fd, size, 8)
    if len(raw) != size:
        raise _fail(p, "truncated", "file shrank while its header was being read")
    return parse_header(
        raw, header_size=size, file_size=st.st_size, path=p, mtime_ns=st.st_mtime_ns
    )
