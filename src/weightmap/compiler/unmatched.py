"""Compact listings of many tensor names: ``layers.{0..31}.mlp.up_proj.weight``.

Used when inputs match no rule: a 100,000-tensor checkpoint must not print 100,000 lines.
Names that differ only in their all-digit segments are listed once, each such segment shown
as a set of ranges.
"""

from __future__ import annotations

__all__ = ["compact_names", "ranges"]

MAX_LINES = 50
# Longer all-digit segments are listed as text: a name is input, and int() refuses a string of
# over 4300 digits (str.isdigit() also says yes to "²", which int() refuses too).
_MAX_DIGITS = 100


def _number(segment: str) -> bool:
    """An all-ASCII-digit segment in canonical form (``0``, ``17``; not ``07``), listed as one
    of a range."""
    return (
        len(segment) <= _MAX_DIGITS
        and segment.isascii()
        and segment.isdigit()
        and (segment == "0" or segment[0] != "0")
    )


def ranges(values: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``0..2,5``."""
    xs = sorted(values)
    out: list[str] = []
    start = prev = xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}..{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def compact_names(names: list[str]) -> list[str]:
    """Group names by their non-numeric shape; one line per group, in first-seen order."""
    # None marks a numeric segment: no segment of a name can be None (a "#" can: `a.#.b`).
    groups: dict[tuple[str | None, ...], list[set[int]]] = {}
    counts: dict[tuple[str | None, ...], int] = {}
    for name in names:
        segs = name.split(".")
        key = tuple(None if _number(s) else s for s in segs)
        nums = [int(s) for s, k in zip(segs, key, strict=True) if k is None]
        slots = groups.setdefault(key, [set() for _ in nums])
        for slot, n in zip(slots, nums, strict=True):
            slot.add(n)
        counts[key] = counts.get(key, 0) + 1
    lines = []
    for key, slots in groups.items():
        it = iter(slots)
        text = ".".join(
            (lambda r: r if "," not in r and ".." not in r else "{" + r + "}")(ranges(next(it)))
            if k is None
            else k
            for k in key
        )
        n = counts[key]
        lines.append(text if n == 1 else f"{text}  ({n} tensors)")
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"... and {len(lines) - MAX_LINES} more groups"]
    return lines
