"""The parts of a plan: its output tensors, the inputs it drops and its side files.

Apart from ``plan.py`` so that ``explain.py``, which renders them, needs nothing of the Plan
class itself (``plan.py`` imports ``explain.py``, never the other way round).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, eq
from typing import Any, overload

from weightmap.errors import Loc
from weightmap.format.dtypes import SpecTable, TensorSpec
from weightmap.format.slots import make_many, slot_setter
from weightmap.plan.nodes import Node, Source

__all__ = [
    "CODE_SUFFIXES",
    "Dropped",
    "OutputTable",
    "OutputTensor",
    "SideFile",
    "is_code_file",
    "loc_dict",
    "loc_from_dict",
    "output_names",
]

# Files that a loader runs as code when it loads the folder: Python source and compiled modules
# (transformers' ``trust_remote_code`` imports ``*.py``; ``python`` started in the folder imports
# any of these before the standard library's modules of the same name). A plan lists them; a
# mapping adds or renames into them only when the caller allows it (docs/safety.md).
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pyd", ".so")


def is_code_file(name: str) -> bool:
    """Whether the side file ``name`` (a relative path) is one a loader runs as code.

    >>> is_code_file("modeling_eagle.py"), is_code_file("tokenizer.json")
    (True, False)
    """
    # Compared as case-insensitive file systems (and Windows, which drops trailing dots and
    # spaces) would open it: `Model.PY.` is `model.py` there.
    return name.rsplit("/", 1)[-1].rstrip(". ").lower().endswith(CODE_SUFFIXES)


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputTensor:
    """One tensor of the output checkpoint and the rule (``origin``) that produced it."""

    name: str
    node: Node
    origin: Loc
    # The output's spec once made: kept outside equality, hashing and repr.
    _spec: TensorSpec | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def spec(self) -> TensorSpec:
        """The output tensor's name, dtype and shape."""
        # Kept after the first time (as TensorSpec.nbytes): the writer, the executor and the
        # progress bar all ask.
        found = self._spec
        if found is None:
            found = TensorSpec(self.name, self.node.dtype, self.node.shape)
            _set_spec(self, found)
        return found

    @classmethod
    def of(cls, spec: TensorSpec, node: Node, origin: Loc) -> OutputTensor:
        """The output ``spec`` computed by ``node``, keeping ``spec`` (with its byte size, if
        known) as :attr:`spec` instead of making another; ``spec`` is ``node``'s dtype and
        shape under the output's name, as the compiler's are."""
        # The slots filled directly, as TensorSpec.sized does: one output is made so per
        # tensor.
        out = _new(cls)
        _set_name(out, spec.name)
        _set_node(out, node)
        _set_origin(out, origin)
        _set_spec(out, spec)
        return out

    @classmethod
    def many(
        cls, count: int, specs: Sequence[TensorSpec], nodes: Iterable[Node], origin: Loc
    ) -> list[OutputTensor]:
        """``count`` outputs from columns, as :meth:`of` makes each, all from the rule at
        ``origin``: a rename of a whole checkpoint's, at once."""
        fields = (
            (_set_name, map(_NAME, specs)),
            (_set_node, nodes),
            (_set_origin, repeat(origin)),
            (_set_spec, specs),
        )
        return make_many(cls, count, fields)


_NAME = attrgetter("name")
# The slots' own setters, for OutputTensor.of and .many (format/slots.py).
_new = object.__new__
_set_name = slot_setter(OutputTensor, "name")
_set_node = slot_setter(OutputTensor, "node")
_set_origin = slot_setter(OutputTensor, "origin")
_set_spec = slot_setter(OutputTensor, "_spec")


class OutputTable(Sequence[OutputTensor]):
    """The outputs of one rule that renames or keeps whole inputs, as columns: output ``i`` is
    input ``sources[i]`` read whole, named ``specs.names[i]``, made by the rule at ``origin``.

    A rename of a whole checkpoint is the commonest plan and holds 100,000 outputs and more:
    the compiler, the layout and the writer read the columns, and an :class:`OutputTensor`
    (with its :class:`~weightmap.plan.nodes.Source`) is made only when one is asked for, by
    index or by iterating; each is equal to the one the compiler would otherwise have made.
    """

    __slots__ = ("origin", "sources", "specs")

    def __init__(self, specs: SpecTable, sources: SpecTable, origin: Loc) -> None:
        if len(specs) != len(sources):
            raise ValueError("an OutputTable's outputs and sources differ in number")
        self.specs = specs
        self.sources = sources
        self.origin = origin

    def __len__(self) -> int:
        return len(self.specs)

    @overload
    def __getitem__(self, index: int) -> OutputTensor: ...

    @overload
    def __getitem__(self, index: slice) -> OutputTable: ...

    def __getitem__(self, index: int | slice) -> OutputTensor | OutputTable:
        if isinstance(index, slice):
            return OutputTable(self.specs[index], self.sources[index], self.origin)
        src = self.sources
        node = Source.of(src.names[index], src.dtypes[index], src.shapes[index])
        return OutputTensor.of(self.specs[index], node, self.origin)

    def __iter__(self) -> Iterator[OutputTensor]:
        src = self.sources
        nodes = map(Source.of, src.names, src.dtypes, src.shapes)
        return map(OutputTensor.of, self.specs, nodes, repeat(self.origin))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OutputTable):
            return (
                self.origin == other.origin
                and self.specs == other.specs
                and self.sources == other.sources
            )
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(map(eq, self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"OutputTable({len(self)} outputs of {self.origin})"


def output_names(outputs: Sequence[OutputTensor]) -> Sequence[str]:
    """The outputs' names in order: a table's own column, or listed."""
    if isinstance(outputs, OutputTable):
        return outputs.specs.names
    return list(map(_NAME, outputs))


@dataclass(frozen=True, kw_only=True)
class OutputFamily:
    """A family of files written into the output folder (``output NAME files ... count N``):
    the output tensors named ``NAME:RANK:tensor`` go into member ``RANK``, under ``tensor``.

    A member's file name is the pattern's text around its one capture (``before``,
    ``after``) with the rank between, zero-padded to at least two digits (Meta's
    ``consolidated.07``, Megatron's ``mp_rank_07``) and to as many as the last rank has.
    """

    name: str
    before: str
    after: str
    count: int

    def __post_init__(self) -> None:
        # A plan may be read back from JSON: its members must still be files of the output
        # folder (the language checks the pattern; this checks what reaches the writer).
        if (
            not 1 <= self.count <= 4096
            or not self.after.endswith(".safetensors")
            or any(c in self.before + self.after for c in "/\\\0")
        ):
            raise ValueError(
                f"output family {self.name!r}: {self.before}N{self.after} x {self.count} is not "
                "1 to 4096 .safetensors files of the output folder"
            )

    @property
    def width(self) -> int:
        """The digits of every member's rank in its file name."""
        return max(2, len(str(self.count - 1)))

    def prefix(self, rank: int) -> str:
        """The name prefix of member ``rank``'s tensors (``out:3:``)."""
        return f"{self.name}:{rank}:"

    def filename(self, rank: int) -> str:
        """Member ``rank``'s file name in the output folder."""
        return f"{self.before}{rank:0{self.width}d}{self.after}"

    def members(self) -> list[tuple[str, str]]:
        """``(prefix, file name)`` of every member, by rank."""
        return [(self.prefix(r), self.filename(r)) for r in range(self.count)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_dict`)."""
        return {"name": self.name, "before": self.before, "after": self.after, "count": self.count}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OutputFamily:
        """Rebuild a family written by :meth:`to_dict`."""
        return cls(name=d["name"], before=d["before"], after=d["after"], count=d["count"])


@dataclass(frozen=True, kw_only=True)
class Dropped:
    """An input deliberately left out, and the rule (or ``unmatched drop``) that dropped it."""

    name: str
    origin: Loc


@dataclass(frozen=True, kw_only=True)
class SideFile:
    """A file of the output beside the weights and config.json.

    Carried from the input folder byte for byte (``source``: its path there, relative to the
    folder) or added by the mapping (``text``, written as UTF-8). ``origin`` is the rule that
    renamed or added it; None for a file carried as it is.
    """

    name: str
    size: int
    source: str | None = None
    text: str | None = None
    origin: Loc | None = None

    @property
    def code(self) -> bool:
        """Whether a loader runs this file as code (see :func:`is_code_file`)."""
        return is_code_file(self.name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; keys that are None are left out. ``code`` (true, for a file a
        loader runs as code) is said for whoever reads the plan, and read back from the name."""
        d: dict[str, Any] = {"name": self.name, "size": self.size}
        if self.code:
            d["code"] = True
        if self.source is not None:
            d["source"] = self.source
        if self.text is not None:
            d["text"] = self.text
        if self.origin is not None:
            d["origin"] = loc_dict(self.origin)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SideFile:
        """Read back :meth:`to_dict`."""
        origin = d.get("origin")
        return cls(
            name=d["name"],
            size=d["size"],
            source=d.get("source"),
            text=d.get("text"),
            origin=None if origin is None else loc_from_dict(origin),
        )


def loc_dict(loc: Loc) -> dict[str, Any]:
    """``loc`` as JSON-ready dict."""
    return {"file": loc.file, "line": loc.line, "col": loc.col}


def loc_from_dict(d: dict[str, Any]) -> Loc:
    """Read back :func:`loc_dict`."""
    return Loc(d["file"], d["line"], d["col"])
