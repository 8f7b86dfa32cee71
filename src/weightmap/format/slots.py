"""Filling a frozen, slotted dataclass without its ``__init__``.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, a Python
call per field. The few value types made once per tensor (100,000 and more for a large MoE
checkpoint: specs, source nodes, outputs) are filled instead through their slots' own
setters, one C call per field, by constructors that take values already known to be right.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["slot_setter"]


def slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The setter of slot ``name`` of ``cls`` (a ``slots=True`` dataclass): it sets the field
    even on a frozen instance, so it is only for constructors."""
    descriptor = cls.__dict__[name]
    setter: Callable[[Any, Any], None] = descriptor.__set__
    return setter
