"""Making the small values built once per tensor without their Python-level constructors.

A checkpoint of 100,000 tensors and more (a large MoE) makes a few values per tensor in every
stage, and their constructors are Python code: a frozen dataclass's ``__init__`` sets each
field through ``object.__setattr__``, a named tuple's ``__new__`` is a Python function. The hot
ones are made instead from values already known to be right: slotted dataclasses (specs,
source nodes, outputs) through their slots' own setters, one C call per field; named tuples
(header entries, matches, a rename's segments and origins) with :data:`make_tuple`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["make_tuple", "slot_setter"]

# ``make_tuple(Cls, (field, ...))``: the named tuple ``Cls`` of those fields, in one C call.
make_tuple = tuple.__new__


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The setter of slot ``name`` of ``cls`` (a ``slots=True`` dataclass): it sets the field
    even on a frozen instance, so it is only for constructors."""
    descriptor = cls.__dict__[name]
    setter: Callable[[Any, Any], None] = descriptor.__set__
    return setter
