"""The writer's options, checked before any work: the size that ends a shard and the names of
the layouts. Kept apart from ``layout.py`` (which plans the shards) so that the modes that
write nothing new (a dry run, an in-place rename) check their options without importing it.
"""

from __future__ import annotations

import math
import re
from typing import Literal

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "LAYOUTS", "Layouts", "check_layout", "parse_size"]

LAYOUTS = ("clone", "reference")
Layouts = Literal["clone", "reference"]

DEFAULT_MAX_SHARD_SIZE = "5GB"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


_MAX_SIZE = float(2**63)  # (file sizes and offsets are signed 64-bit in the kernel)


def check_layout(layout: str) -> None:
    """ValueError for a layout name that is none of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")


def parse_size(size: int | str) -> int:
    """Parse a size such as ``"5GB"`` (decimal units, as the hub uses) or ``"512MiB"``.

    >>> parse_size("5GB"), parse_size("1.5KiB"), parse_size(100)
    (5000000000, 1536, 100)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = _SIZE_RE.match(str(size))
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(
                f"cannot parse size {size!r}: use a number with a unit such as 500MB, 5GB or 2GiB"
            )
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number) or number > _MAX_SIZE:
            # float() reads 400 nines as infinity, which int() refuses with an OverflowError.
            raise ValueError(
                f"size {str(size)[:40]!r} is larger than any file can be (at most 2**63 bytes)"
            )
        value = int(number)
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value
