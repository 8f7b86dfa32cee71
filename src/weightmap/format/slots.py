"""Making the small values built once per tensor without their Python-level constructors.

A checkpoint of 100,000 tensors and more (a large MoE) makes a few values per tensor in every
stage, and their constructors are Python code: a frozen dataclass's ``__init__`` sets each
field through ``object.__setattr__``, a named tuple's ``__new__`` is a Python function. The hot
ones are made instead from values already known to be right: slotted dataclasses (specs,
source nodes, outputs) through their slots' own setters, one C call per field; named tuples
(header entries, matches, a rename's segments and origins) with :data:`make_tuple`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any, TypeVar

__all__ = ["make_many", "make_tuple", "shared", "slot_setter"]

T = TypeVar("T")

# ``make_tuple(Cls, (field, ...))``: the named tuple ``Cls`` of those fields, in one C call.
make_tuple = tuple.__new__


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The setter of slot ``name`` of ``cls`` (a ``slots=True`` dataclass): it sets the field
    even on a frozen instance, so it is only for constructors."""
    descriptor = cls.__dict__[name]
    setter: Callable[[Any, Any], None] = descriptor.__set__
    return setter


def make_many(
    cls: type[T], count: int, fields: Sequence[tuple[Callable[[Any, Any], None], Iterable[Any]]]
) -> list[T]:
    """``count`` new instances of the slotted dataclass ``cls``, each slot filled from a column:
    ``fields`` pairs a slot's setter (:func:`slot_setter`) with its values, one per instance.

    Column by column, each by one ``map`` of the setter: no Python frame per instance, where a
    constructor (even one that fills the slots itself) runs one per instance. Every column must
    hold ``count`` values or more (the first ``count`` are taken), as ``zip`` would take them.
    """
    made = list(map(object.__new__, repeat(cls, count)))
    for setter, values in fields:
        deque(map(setter, made, values), maxlen=0)  # (runs the map, keeping nothing)
    return made


def shared(values: list[T]) -> list[T]:
    """``values`` (all of one type: ``1 == True``) with one object per distinct value, the first
    of its equals met, by C calls.

    A column of sizes or shapes repeats a few values 100,000 times over, and an int above 256
    is an object of its own each time it is computed (32 bytes apiece).
    """
    first = dict(zip(reversed(values), reversed(values), strict=True))
    return list(map(first.__getitem__, values))
