"""Sections 5 and 6 of the report: many small tensors, and copy-on-write filesystems.

Each function returns its section's lines, heading first and a blank line last.
"""

from __future__ import annotations

import math

from checkpoints import MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_LAYERS, MOE_RENAME, PRESET
from common import GB, MIB
from figures import fmt_s, ratio, table
from jobs import SOURCES, Samples
from limits import CowResults, LimitResult, moe_tensors


def _bytes(x: float) -> str:
    if math.isnan(x):
        return "—"
    return f"{x / MIB:,.1f} MiB" if abs(x) < GB else f"{x / GB:.2f} GB"


def _shared(s: Samples) -> str:
    shared, size = s.median("shared"), s.median("size")
    if math.isnan(shared) or not size:
        return "—"
    return f"{shared / size:.1%}"


def _row(r: LimitResult, first: list[str]) -> list[str]:
    s = r.samples
    wm, cpf = s["weightmap"].median("seconds"), s["cp+fsync"].median("seconds")
    before = [fmt_s(s["before"].median("seconds"))] if "before" in s else []
    return [
        *first,
        fmt_s(wm),
        *before,
        fmt_s(s["cp"].median("seconds")),
        fmt_s(cpf),
        ratio(wm, cpf),
        _bytes(s["weightmap"].median("bytes_cloned")),
    ]


def _whole(r: LimitResult) -> tuple[list[str], list[list[str]]]:
    """The whole command as a user runs it: the job's process from start to exit (the
    interpreter and `import weightmap` included, which the tables above leave out), against
    `cp --fsync`'s own process."""
    tools = ["weightmap", *(["before"] if "before" in r.samples else [])]
    header = ["filesystem", "checkpoint"]
    row = [r.fs, _what(r)]
    for tool in tools:
        s = r.samples[tool]
        process = s.median("process")
        header += [f"{tool}: whole process", f"{tool}: of which starting (imports)"]
        row += [fmt_s(process), fmt_s(s.median("startup"))]
    process = r.samples["weightmap"].median("process")
    cp = r.samples["cp+fsync"].median("seconds")
    header += ["cp + fsync", "weightmap process / (cp + fsync)"]
    row += [fmt_s(cp), ratio(process, cp)]
    return header, [row]


def _whole_table(results: list[LimitResult]) -> list[str]:
    if not results:
        return []
    header: list[str] = []
    rows: list[list[str]] = []
    for r in results:
        header, found = _whole(r)
        rows += found
    return [
        "The whole command, as a user runs it (medians): each weightmap job's process from "
        "start to exit, and of that the time from the job's first line to the conversion's "
        "start (`import weightmap` and the job's own set-up), against the process of `cp` + "
        "fsync:",
        "",
        *table(header, rows),
        "",
    ]


def _header(first: list[str]) -> list[str]:
    before = ["before"] if "before" in SOURCES else []
    return [*first, "weightmap", *before, "cp", "cp + fsync", "weightmap / (cp + fsync)",
            "weightmap cloned"]  # fmt: skip


def _space_rows(results: list[LimitResult]) -> tuple[list[str], list[list[str]]]:
    tools = ["weightmap", *(["before"] if "before" in SOURCES else []), "cp"]
    header = ["filesystem", "checkpoint"]
    header += [f"{t}: in shared extents" for t in tools]
    header += [f"{t}: disk space taken" for t in tools]
    rows = [
        [
            r.fs,
            _what(r),
            *(_shared(r.samples[t]) for t in tools),
            *(_bytes(r.samples[t].median("space")) for t in tools),
        ]
        for r in results
    ]
    return header, rows


def _what(r: LimitResult) -> str:
    if r.what == "many":
        return f"{moe_tensors():,} tensors, {MOE_LAYERS} shards, {r.nbytes / GB:.2f} GB"
    return f"drafter, {r.nbytes / GB:.2f} GB"


def _stages(results: list[LimitResult]) -> list[str]:
    """Where weightmap's time goes on the many-tensor checkpoint: per tensor, not per byte."""
    rows = []
    for r in results:
        if r.what != "many":
            continue
        s = r.samples["weightmap"]
        total, opened, compiled, synced = (
            s.median(k) for k in ("seconds", "open", "compile", "fsync")
        )
        rows.append([
            r.fs, fmt_s(total), fmt_s(opened), fmt_s(compiled), fmt_s(synced),
            fmt_s(max(total - opened - compiled - synced, 0.0)),
        ])  # fmt: skip
    if not rows:
        return []
    return [
        "Where weightmap's time goes in the many-tensor rename (medians): reading and checking "
        "the index and the 48 headers, compiling the plan (the compiler's name checks and "
        "routing, per tensor), waiting in fsync (overlapping waits of the writer's threads "
        "counted once), and the rest (laying out the shards and moving the bytes; medians of "
        "each column, so the parts need not add up exactly):",
        "",
        *table(
            [
                "filesystem",
                "weightmap",
                "of which reading headers",
                "of which compiling",
                "of which fsync",
                "the rest",
            ],
            rows,
        ),
        "",
    ]


def many_section(ext4: LimitResult | None, cow: CowResults | None = None) -> list[str]:
    """Section 5: the MoE-shaped checkpoint of many small tensors, renamed on ext4."""
    if ext4 is None:
        return []
    rename = MOE_RENAME.strip().splitlines()[-1]
    return [
        "## 5. Many small tensors",
        "",
        f"A MoE-shaped checkpoint of {moe_tensors():,} tensors in {MOE_LAYERS} shards of one "
        f"layer each ({MOE_EXPERTS} routed experts and a shared one, each three "
        f"{MOE_INTER}x{MOE_HIDDEN} bf16 projections; q, k, v, o; the router; two norms), "
        f"{ext4.nbytes / GB:.2f} GB, every tensor renamed into a new folder (`{rename}`), "
        "against `cp -r` of the folder. The cost here is per tensor and per shard, not per "
        "byte. Copy-on-write filesystems: section 6.",
        "",
        *table(_header(["filesystem"]), [_row(ext4, ["ext4"])]),
        "",
        *_stages([ext4, *(cow.results if cow else [])]),
        *_whole_table([ext4]),
    ]


def cow_section(cow: CowResults | None) -> list[str]:
    """Section 6: the drafter conversion and the many-tensor rename on XFS and btrfs."""
    if cow is None:
        return []
    lines = [
        "## 6. Copy-on-write filesystems",
        "",
        "The same conversions on a loop-mounted XFS image (`mkfs.xfs -m reflink=1`) and a "
        "btrfs image, made by `bench/run.py` (as root, with `mkfs.xfs` and `mkfs.btrfs`): the "
        f"largest drafter converted with the `{PRESET}` preset, and the many-tensor rename of "
        "section 5. There `cp` (coreutils 9) clones the files, and weightmap clones every "
        "whole block of unchanged data at congruent offsets (**weightmap cloned**: bytes the "
        "filesystem accepted to share through FICLONERANGE). **in shared extents** is the "
        "share of the output's bytes in extents FIEMAP marks shared; **disk space taken** is "
        "how much the filesystem's used space grew (`df`), after a sync.",
        "",
    ]
    for fs, reason in cow.skipped.items():
        lines += [f"- {fs}: not measured ({reason}).", ""]
    if not cow.results:
        return lines
    rows = [_row(r, [r.fs, _what(r)]) for r in cow.results]
    header, space = _space_rows(cow.results)
    return [
        *lines,
        *table(_header(["filesystem", "checkpoint"]), rows),
        "",
        "Disk space and sharing (medians over the runs):",
        "",
        *table(header, space),
        "",
        *_whole_table(cow.results),
    ]
