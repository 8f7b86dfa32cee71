"""Tensor-name patterns as regular expressions, and first-match dispatch over many rules.

Speed matters here (100,000 tensors in well under a second), so every pattern of the rules a
tensor may still meet is joined into one alternation ``(?P<_0>...)|(?P<_1>...)|...``: Python's
regex engine tries the alternatives in order, in C, so one ``fullmatch`` per tensor finds the
first rule whose pattern matches. Only when that rule's ``where`` filter says no do we fall back to
trying the later alternatives one by one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from weightmap.format.dtypes import TensorSpec
from weightmap.language import ast as A

__all__ = ["Alternative", "Matcher", "compile_pattern", "pattern_regex"]

# Canonical integers only, so that "{n}" renders back to the same text; of at most 1024
# digits, the longest name there may be (int() refuses a string of over 4300 digits).
_INT = r"0|[1-9][0-9]{0,1023}"


def pattern_regex(p: A.Pattern, prefix: str = "") -> tuple[str, list[tuple[str, A.CaptureKind]]]:
    """The pattern's regex source (groups named ``prefix + name``) and its captures in order.

    Anonymous alternatives ``{a,b}`` are captured too, as ``_alt0``, ``_alt1``... so that a merge
    can tell its members apart.
    """
    out: list[str] = []
    caps: list[tuple[str, A.CaptureKind]] = []
    n_alt = 0
    # Tensor names are dotted; side-file names are paths, whose dots are not separators.
    sep = "/" if isinstance(p, A.FilePattern) else "."
    if p.others:
        # A pattern of the main input does not see the other inputs' tensors (`NAME:...`).
        out.append(f"(?!(?:{'|'.join(map(re.escape, p.others))}):)")
    for part in p.parts:
        if isinstance(part, str):
            out.append(re.escape(part))
        elif isinstance(part, A.Glob):
            out.append(".*" if part.multi else f"[^{sep}]*")
        elif isinstance(part, A.Alt):
            name = f"_alt{n_alt}"
            n_alt += 1
            out.append(f"(?P<{prefix}{name}>{'|'.join(map(re.escape, part.alts))})")
            caps.append((name, "alt"))
        else:
            body = {"seg": f"[^{sep}]+", "multi": ".+", "int": _INT}.get(part.kind)
            if body is None:
                body = "|".join(map(re.escape, part.alts))
            out.append(f"(?P<{prefix}{part.name}>{body})")
            caps.append((part.name, part.kind))
    return "".join(out), caps


def _captures(
    caps: list[tuple[str, A.CaptureKind]], numbers: tuple[int, ...]
) -> Callable[[re.Match[str]], dict[str, Any]]:
    """The captures of a match of the combined regex, read from the groups ``numbers``
    (``{n:int}`` ones as ints): the hot path of routing, once per tensor, so the common
    counts of captures (none to three) are read without a loop."""
    names = [n for n, _k in caps]
    ints = [kind == "int" for _n, kind in caps]
    if not caps:
        return lambda m: {}
    if len(caps) == 1:
        (n0,), (g0,), (i0,) = names, numbers, ints

        def one(m: re.Match[str]) -> dict[str, Any]:
            v = m.group(g0)
            return {n0: int(v) if i0 else v}

        return one
    if len(caps) == 2:
        (n0, n1), (g0, g1), (i0, i1) = names, numbers, ints

        def two(m: re.Match[str]) -> dict[str, Any]:
            a, b = m.group(g0, g1)
            return {n0: int(a) if i0 else a, n1: int(b) if i1 else b}

        return two

    if len(caps) == 3:  # a layer, an expert and a projection: every expert of a MoE
        (n0, n1, n2), (g0, g1, g2), (i0, i1, i2) = names, numbers, ints

        def three(m: re.Match[str]) -> dict[str, Any]:
            a, b, c = m.group(g0, g1, g2)
            return {
                n0: int(a) if i0 else a,
                n1: int(b) if i1 else b,
                n2: int(c) if i2 else c,
            }

        return three

    as_ints = [n for n, i in zip(names, ints, strict=True) if i]

    def many(m: re.Match[str]) -> dict[str, Any]:
        # The dict made at C speed, then the few int captures converted.
        found = dict(zip(names, m.group(*numbers), strict=True))
        for n in as_ints:
            found[n] = int(found[n])
        return found

    return many


def compile_pattern(p: A.Pattern) -> re.Pattern[str]:
    """One pattern as a compiled regex (use with ``fullmatch``)."""
    return _single(p)


@lru_cache(maxsize=4096)
def _single(p: A.Pattern) -> re.Pattern[str]:
    # Patterns are frozen values: the same pattern is compiled once, however many matchers
    # (one per starting rule, see route.py) include it.
    return re.compile(pattern_regex(p)[0], re.DOTALL)


Filter = Callable[[TensorSpec, dict[str, Any]], bool]
_Captures = Callable[[re.Match[str]], dict[str, Any]]
MatchParts = tuple[
    Callable[[str], "re.Match[str] | None"], dict[int, int], list[_Captures], list[Filter | None]
]


@dataclass
class Alternative:
    """One pattern of one rule; ``accept`` is the rule's filter (where / from dtype), if any."""

    rule: int
    pattern_index: int
    pattern: A.Pattern
    accept: Filter | None = None


class Matcher:
    """Finds, for a tensor, the first (rule, pattern) that matches its name and accepts it."""

    def __init__(self, alternatives: Sequence[Alternative]) -> None:
        self.alternatives = list(alternatives)
        # (rule, pattern index) of each alternative, for the routing's hot path.
        self.owners = [(a.rule, a.pattern_index) for a in self.alternatives]
        sources, self._groups, self._singles = [], [], []
        self._outer: dict[int, int] = {}
        self._fast: list[_Captures] = []
        group_count = 0
        for k, alt in enumerate(self.alternatives):
            body, caps = pattern_regex(alt.pattern, prefix=f"_{k}_")
            sources.append(f"(?P<_{k}>{body})")
            self._outer[group_count + 1] = k
            group_count += 1 + len(caps)
            self._groups.append([(name, f"_{k}_{name}", kind == "int") for name, kind in caps])
            numbers = tuple(range(group_count - len(caps) + 1, group_count + 1))
            self._fast.append(_captures(caps, numbers))
            self._singles.append(_single(alt.pattern))
        self._combined = re.compile("|".join(sources) or "(?!)", re.DOTALL)
        self._accepts = [a.accept for a in self.alternatives]

    def parts(self) -> MatchParts:
        """What ``match`` does, in parts, for a caller that matches many names in one loop:
        ``(fullmatch, alternative of each outer group, captures of each alternative, filter
        of each alternative)``. The first alternative that matches the name is the match
        where it has no filter; where it has one, ``match`` says which is."""
        return self._combined.fullmatch, self._outer, self._fast, self._accepts

    def capture_groups(self, k: int) -> dict[str, int]:
        """The group number, in a match of the combined regex, of each capture of alternative
        ``k``."""
        index = self._combined.groupindex
        return {name: index[group] for name, group, _is_int in self._groups[k]}

    def match(self, spec: TensorSpec) -> tuple[int, dict[str, Any]] | None:
        """``(alternative, captures)`` for the tensor ``spec``, or None.

        ``accept`` filters may raise (an expression error); the caller reports it.
        """
        name = spec.name
        m = self._combined.fullmatch(name)
        if m is None:
            return None
        k = self._outer[m.lastindex or 0]
        caps = self._fast[k](m)
        accept = self.alternatives[k].accept
        if accept is None or accept(spec, caps):
            return k, caps
        for j in range(k + 1, len(self.alternatives)):
            mj = self._singles[j].fullmatch(name)
            if mj is None:
                continue
            caps = {
                n: int(mj.group(n)) if is_int else mj.group(n) for n, _g, is_int in self._groups[j]
            }
            accept = self.alternatives[j].accept
            if accept is None or accept(spec, caps):
                return j, caps
        return None
