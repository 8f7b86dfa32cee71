"""The safetensors dtype table and the small value types shared by every stage.

Nothing here imports torch: the format layer and the compiler only need names, bit widths
and shapes. ``torch_dtype`` resolves a dtype lazily for the stages that touch data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, eq
from typing import TYPE_CHECKING, Literal, TypeVar, overload

from weightmap.format.slots import make_many, slot_setter

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "DType",
    "SpecTable",
    "TensorSpec",
    "dtype",
    "nbytes",
    "numel",
    "sized_specs",
]

Kind = Literal["bool", "float", "int", "uint", "complex"]
T = TypeVar("T")

# Largest value a u64 can hold: the reference implementation computes sizes in u64 and refuses
# anything that overflows, so a header whose sizes only fit in Python's big ints is malformed.
U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class DType:
    """One safetensors dtype.

    ``rank`` is the dtype's position in the reference implementation's enum; its writer orders
    tensors by descending rank then by name, and so must ours for byte-identical output.
    """

    name: str
    bits: int
    rank: int
    kind: Kind
    torch_name: str | None

    @property
    def itemsize(self) -> int:
        """Bytes per element, rounded up (1 for the sub-byte F4/F6 types)."""
        return max(1, self.bits // 8)

    def torch(self) -> torch.dtype:
        """The torch dtype, or a FormatError-free ``TypeError`` if torch has none."""
        import torch

        if self.torch_name is None or not hasattr(torch, self.torch_name):
            raise TypeError(f"dtype {self.name} has no torch equivalent in this torch build")
        result: torch.dtype = getattr(torch, self.torch_name)
        return result


_TABLE: tuple[tuple[str, int, Kind, str | None], ...] = (
    # In the reference enum's order (rank = index).
    ("BOOL", 8, "bool", "bool"),
    ("F4", 4, "float", "float4_e2m1fn_x2"),
    ("F6_E2M3", 6, "float", None),
    ("F6_E3M2", 6, "float", None),
    ("U8", 8, "uint", "uint8"),
    ("I8", 8, "int", "int8"),
    ("F8_E5M2", 8, "float", "float8_e5m2"),
    ("F8_E4M3", 8, "float", "float8_e4m3fn"),
    ("F8_E8M0", 8, "float", "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "float", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "float", "float8_e5m2fnuz"),
    ("I16", 16, "int", "int16"),
    ("U16", 16, "uint", "uint16"),
    ("F16", 16, "float", "float16"),
    ("BF16", 16, "float", "bfloat16"),
    ("I32", 32, "int", "int32"),
    ("U32", 32, "uint", "uint32"),
    ("F32", 32, "float", "float32"),
    ("C64", 64, "complex", "complex64"),
    ("F64", 64, "float", "float64"),
    ("I64", 64, "int", "int64"),
    ("U64", 64, "uint", "uint64"),
)

DTYPES: dict[str, DType] = {
    name: DType(name, bits, rank, kind, torch_name)
    for rank, (name, bits, kind, torch_name) in enumerate(_TABLE)
}


def dtype(name: str) -> DType:
    """Look up a safetensors dtype by its header name (``"BF16"``); ``KeyError`` if unknown."""
    return DTYPES[name]


def numel(shape: tuple[int, ...]) -> int:
    """Number of elements of a shape (1 for a 0-rank scalar)."""
    n = 1
    for d in shape:
        n *= d
    return n


def nbytes(dtype_name: str, shape: tuple[int, ...]) -> int:
    """Byte size of a tensor; ``ValueError`` if the bits do not fill whole bytes."""
    bits = numel(shape) * DTYPES[dtype_name].bits
    if bits % 8:
        raise ValueError(
            f"{dtype_name} tensor of shape {list(shape)} holds {bits} bits, not a whole byte count"
        )
    return bits // 8


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's name, dtype (safetensors name) and shape: all a plan needs to know of it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    # The byte size once counted (or read from a header): kept outside equality, hashing and
    # repr, which see the three fields above only.
    _nbytes: int | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def sized(cls, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> TensorSpec:
        """A spec whose byte size the caller already knows to be right (a validated header's
        data offsets; another spec of the same dtype and shape): kept as :attr:`nbytes`
        rather than counted again."""
        # The slots filled directly, not through the frozen dataclass's __init__ (one
        # object.__setattr__ per field): one spec is made so per tensor.
        spec = _new(cls)
        _set_name(spec, name)
        _set_dtype(spec, dtype)
        _set_shape(spec, shape)
        _set_nbytes(spec, nbytes)
        return spec

    def named(self, name: str) -> TensorSpec:
        """The same dtype and shape under ``name``, keeping the byte size if it is known."""
        # A size counted (or read from a header) is not counted again, and one not yet needed
        # is not counted now. One spec is made so per rename.
        spec = _new(TensorSpec)
        _set_name(spec, name)
        _set_dtype(spec, self.dtype)
        _set_shape(spec, self.shape)
        _set_nbytes(spec, self._nbytes)
        return spec

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        # Asked for several times per tensor (writer, executor, progress): kept after the
        # first time.
        found = self._nbytes
        if found is None:
            found = nbytes(self.dtype, self.shape)
            _set_nbytes(self, found)
        return found


# The slots' own setters, for the constructors above (format/slots.py).
_new = object.__new__
_set_name = slot_setter(TensorSpec, "name")
_set_dtype = slot_setter(TensorSpec, "dtype")
_set_shape = slot_setter(TensorSpec, "shape")
_set_nbytes = slot_setter(TensorSpec, "_nbytes")


def sized_specs(
    count: int,
    names: Iterable[str],
    dtypes: Iterable[str],
    shapes: Iterable[tuple[int, ...]],
    sizes: Iterable[int | None],
) -> list[TensorSpec]:
    """``count`` specs from columns, as :meth:`TensorSpec.sized` makes each (a size of None is
    counted when first asked for): a checkpoint's or a rename's 100,000 specs at once."""
    fields = ((_set_name, names), (_set_dtype, dtypes), (_set_shape, shapes), (_set_nbytes, sizes))
    return make_many(TensorSpec, count, fields)


class SpecTable(Sequence[TensorSpec]):
    """Tensor specs as columns (names, dtypes, shapes, byte sizes), read as a sequence of
    :class:`TensorSpec`.

    A checkpoint's inputs, and the outputs of a rename of all of them, are 100,000 specs and
    more; the stages that only move bytes read the columns, so no spec is made per tensor.
    Each :class:`TensorSpec` is made when asked for (by index, or by iterating). The dtypes
    and shapes are shared objects (a few distinct ones), and a rename's table shares every
    column but the names with its inputs'.
    """

    __slots__ = ("dtypes", "names", "shapes", "sizes")

    def __init__(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        sizes: Sequence[int],
    ) -> None:
        if not len(names) == len(dtypes) == len(shapes) == len(sizes):
            raise ValueError("the columns of a SpecTable differ in length")
        # Tuples, as a plan's specs are immutable (a checkpoint's table is its plan's inputs).
        self.names: tuple[str, ...] = _frozen(names)
        self.dtypes: tuple[str, ...] = _frozen(dtypes)
        self.shapes: tuple[tuple[int, ...], ...] = _frozen(shapes)
        self.sizes: tuple[int, ...] = _frozen(sizes)

    @classmethod
    def of(cls, specs: Sequence[TensorSpec]) -> SpecTable:
        """The columns of these specs (a table as it is)."""
        if isinstance(specs, SpecTable):
            return specs
        return cls(
            list(map(_NAME, specs)),
            list(map(_DTYPE, specs)),
            list(map(_SHAPE, specs)),
            [s.nbytes for s in specs],
        )

    def renamed(self, names: Sequence[str]) -> SpecTable:
        """The same tensors under ``names`` (one per row)."""
        return SpecTable(names, self.dtypes, self.shapes, self.sizes)

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, index: int) -> TensorSpec: ...

    @overload
    def __getitem__(self, index: slice) -> SpecTable: ...

    def __getitem__(self, index: int | slice) -> TensorSpec | SpecTable:
        if isinstance(index, slice):
            return SpecTable(
                self.names[index], self.dtypes[index], self.shapes[index], self.sizes[index]
            )
        return TensorSpec.sized(
            self.names[index], self.dtypes[index], self.shapes[index], self.sizes[index]
        )

    def __iter__(self) -> Iterator[TensorSpec]:
        return map(TensorSpec.sized, self.names, self.dtypes, self.shapes, self.sizes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SpecTable):
            return (
                self.names == other.names
                and self.dtypes == other.dtypes
                and self.shapes == other.shapes
            )
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(map(eq, self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"SpecTable({len(self.names)} specs)"


_NAME = attrgetter("name")
_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")


def _frozen(column: Sequence[T]) -> tuple[T, ...]:
    return column if isinstance(column, tuple) else tuple(column)
