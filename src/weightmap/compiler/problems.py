"""Compile problems, each said once: the same problem of one rule for many tensors is one line.

A rule applied to 32 layers fails 32 times for one reason (an unknown name in its template, a
config field the config lacks, a shape it cannot take). Problems are collected with the tensor
being worked on, then grouped by location and by message with that tensor's name taken out:

    m.wm:2:35: unknown name `m` (in 18 tensors: layers.{0..17}.attn.w)
    m.wm:2:1: cannot reshape `layers.{0..17}.attn.w` [4, 4] (16 elements) to [3, 5] (18 tensors)

Merge and stack problems name their group (``group i=3: ...``) and are grouped the same way.
Past ``PER_RULE_LIMIT`` lines for one location, the rest is summarised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from weightmap.compiler.unmatched import compact_names, ranges
from weightmap.errors import Problem
from weightmap.language import ast as A

__all__ = ["PER_RULE_LIMIT", "Problems"]

PER_RULE_LIMIT = 20  # past this, one rule's problems are summarised
# "group K: why" and "group K is incomplete: why" (group.py), K the group's captures.
_GROUP = re.compile(r"group (?P<key>[^:]+?)(?P<how> is incomplete)?: (?P<rest>.*)", re.S)
_PLACE = "\0"


def _names(names: list[str]) -> str:
    lines = [line.split("  (")[0] for line in compact_names(names)]
    return ", ".join(lines[:3]) + (f" and {len(lines) - 3} more" if len(lines) > 3 else "")


def _group_keys(keys: list[str]) -> str:
    """``["n=0", "n=1", "n=5"]`` -> ``n={0,1,5}`` (or ``n=0..1,5``): captures with ranges."""
    try:
        split = [dict(part.split("=", 1) for part in k.split(", ")) for k in keys]
    except ValueError:  # a captured value holding ", " (names may): listed as they are
        split = []
    if not split or not all(s.keys() == split[0].keys() for s in split):
        return ", ".join(keys[:3]) + (" ..." if len(keys) > 3 else "")
    parts = []
    for cap in split[0]:
        values = [s[cap] for s in split]
        if all(v.isdigit() for v in values):
            shown = ranges({int(v) for v in values})
        else:
            shown = ",".join(dict.fromkeys(values))
        parts.append(
            f"{cap}={shown}" if "," not in shown and ".." not in shown else f"{cap}={{{shown}}}"
        )
    return ", ".join(parts)


@dataclass
class Problems:
    """Problems as reported, with the tensor (or merge group) each is about."""

    raw: list[tuple[A.Loc, str, str | None]] = field(default_factory=list)
    tensor: str | None = None  # the tensor a rule is working on, set by the compiler

    def report(self, loc: A.Loc, message: str) -> None:
        self.raw.append((loc, message, self.tensor))

    def __bool__(self) -> bool:
        return bool(self.raw)

    def grouped(self) -> list[Problem]:
        """Each problem once, in the order first seen; repeats of one rule capped."""
        groups: dict[tuple[A.Loc, str], list[str | None]] = {}
        for loc, message, tensor in self.raw:
            about: str | None = tensor
            if (m := _GROUP.fullmatch(message)) is not None:
                how = m["how"] or ""
                message, about = f"group {_PLACE}{how}: {m['rest']}", m["key"]
            elif tensor is not None and f"`{tensor}`" in message:
                message = message.replace(f"`{tensor}`", f"`{_PLACE}`")
            groups.setdefault((loc, message), []).append(about)
        out: list[Problem] = []
        counts: dict[A.Loc, int] = {}
        for (loc, message), abouts in groups.items():
            n = counts[loc] = counts.get(loc, 0) + 1
            if n > PER_RULE_LIMIT + 1:
                continue
            if n == PER_RULE_LIMIT + 1:
                out.append(Problem(loc, "... more problems like these (first 20 shown)"))
                continue
            out.append(Problem(loc, _text(message, abouts)))
        return out


def _text(message: str, abouts: list[str | None]) -> str:
    if message.startswith("group " + _PLACE):
        keys = [a for a in abouts if a is not None]
        head = _group_keys(keys)
        return message.replace(_PLACE, head, 1) + (
            f" ({len(keys)} groups)" if len(keys) > 1 else ""
        )
    names = [a for a in abouts if a is not None]
    if _PLACE in message:
        return message.replace(_PLACE, _names(names)) + (
            f" ({len(names)} tensors)" if len(names) > 1 else ""
        )
    if len(abouts) == 1:
        return message
    if names:
        return f"{message} (in {len(names)} tensors: {_names(names)})"
    return f"{message} ({len(abouts)} times)"
