"""Several outputs: the families of files a mapping writes beside the main checkpoint.

``output shards files "consolidated.{rank}.safetensors" count n`` declares ``n`` files of the
output folder. An output tensor named ``shards:RANK:NAME`` is written into member ``RANK`` as
``NAME``: the output side of the namespace the inputs use (``ranks:RANK:NAME``), so that a
scatter is the rules a gather's inverse needs (a ``chunk ... into n`` naming each piece by its
rank) and every check, plan line and executor sees one list of outputs. ``shards:*:NAME`` is
one tensor written into every member (a norm that each tensor-parallel rank holds whole).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence

from weightmap.compiler.names import bad_name
from weightmap.compiler.ops import RuleProblem, as_int, evaluate
from weightmap.format.names import SINGLE_NAME
from weightmap.language import ast as A
from weightmap.language.values import Scope
from weightmap.plan.parts import OutputFamily, OutputTensor

__all__ = ["MAX_MEMBERS", "check_member_files", "families", "place"]

# More members than this is a mistake (a count read from the wrong config field), and each is
# a file open while the output is written.
MAX_MEMBERS = 4096

# The main checkpoint's shard names: a member must not take one.
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors\Z")

Report = Callable[[A.Loc, str], None]


def families(decls: Sequence[A.OutputDecl], scope: Scope, report: Report) -> list[OutputFamily]:
    """Each declared output family with its count evaluated (params, config, inputs)."""
    found = []
    for decl in decls:
        try:
            count = as_int(evaluate(decl.count, scope), f"output {decl.name}'s count")
        except RuleProblem as err:
            report(err.loc or decl.loc, err.message)
            continue
        if not 1 <= count <= MAX_MEMBERS:
            how = f"--set {decl.count.id}=N" if isinstance(decl.count, A.Name) else "its count"
            report(
                decl.loc,
                f"output {decl.name} has count {count}: a family writes 1 to {MAX_MEMBERS} "
                f"files; say how many ({how})",
            )
            continue
        parts = decl.files.parts
        at = next(i for i, p in enumerate(parts) if isinstance(p, A.Capture))
        before = "".join(p for p in parts[:at] if isinstance(p, str))
        after = "".join(p for p in parts[at + 1 :] if isinstance(p, str))
        found.append(OutputFamily(name=decl.name, before=before, after=after, count=count))
    return found


def place(
    outputs: Sequence[OutputTensor],
    fams: Sequence[OutputFamily],
    report: Report,
    locs: Mapping[str, A.Loc],
) -> Sequence[OutputTensor]:
    """``outputs`` with each ``NAME:*:tensor`` written into every member of family ``NAME``,
    and every name of a family checked: a rank in range, a tensor name after it, no name
    twice, and no member left without a tensor (an empty rank is a wrong count or a rule that
    missed)."""
    if not fams:
        return outputs
    by_name = {f.name: f for f in fams}
    head = re.compile(f"({'|'.join(map(re.escape, by_name))}):")
    placed: list[OutputTensor] = []
    wrong = False  # (a name reported: its member's emptiness would only repeat it)
    filled: dict[str, set[int]] = {f.name: set() for f in fams}
    for out in outputs:
        m = head.match(out.name)
        if m is None:
            placed.append(out)
            continue
        family = by_name[m.group(1)]
        rank_text, sep, rest = out.name[m.end() :].partition(":")
        if not sep or not rest:
            report(
                out.origin,
                f"output {out.name[:80]!r} names family {family.name!r} without a rank and a "
                f'tensor name: write "{family.name}:RANK:NAME", or "{family.name}:*:NAME" for '
                "every rank",
            )
            wrong = True
            continue
        why = bad_name(rest)
        if why is not None:  # (the member's own name: "__metadata__" there is the header's key)
            report(out.origin, f"output {out.name[:80]!r}: the member's tensor name {why}")
            wrong = True
            continue
        if rank_text == "*":
            for rank in range(family.count):
                placed.append(dataclasses.replace(out, name=family.prefix(rank) + rest))
            filled[family.name].update(range(family.count))
            continue
        canonical = rank_text.isascii() and rank_text.isdigit() and str(int(rank_text)) == rank_text
        if not canonical or int(rank_text) >= family.count:
            report(
                out.origin,
                f"output {out.name[:80]!r}: rank {rank_text[:20]!r} is not one of family "
                f"`{family.name}`'s ranks 0..{family.count - 1} (its count)",
            )
            wrong = True
            continue
        filled[family.name].add(int(rank_text))
        placed.append(out)
    _check_unique(placed, report)
    for family in () if wrong else fams:
        empty = [r for r in range(family.count) if r not in filled[family.name]]
        if empty:
            more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
            report(
                locs[family.name],
                f"output family {family.name!r}: member {family.filename(empty[0])} (rank "
                f"{empty[0]}){more} gets no tensor; check its count ({family.count}) against "
                f"the rules that name {family.name}:RANK:...",
            )
    return placed


def _check_unique(outputs: list[OutputTensor], report: Report) -> None:
    if len({o.name for o in outputs}) == len(outputs):
        return
    seen: dict[str, OutputTensor] = {}
    for out in outputs:
        first = seen.setdefault(out.name, out)
        if first is not out:
            report(
                out.origin,
                f"output {out.name[:80]!r} is written twice (also by the rule at "
                f"{first.origin}); a family's `*` rank already writes every member",
            )
            return


def check_member_files(
    fams: Sequence[OutputFamily], locs: Mapping[str, A.Loc], report: Report
) -> None:
    """Report a member file name that another file of the output takes: the main
    checkpoint's weights or shards, or another member. (A member is a .safetensors name,
    which config.json, the index and every side file are not: the files blocks refuse a
    side file of that suffix.)"""
    taken = {SINGLE_NAME: "the main weights"}
    for family in fams:
        for rank in range(family.count):
            name = family.filename(rank)
            what = taken.get(name) or ("a main shard" if _SHARD.match(name) else None)
            if what is not None:
                report(
                    locs[family.name],
                    f"output family {family.name!r} would write {name}, which is {what} of "
                    "the output: rename the family's files",
                )
                return
            taken[name] = f"member {rank} of family {family.name!r}"
