"""Sections 1 to 4 of the report: the measured tables (rename, in place, casts, split/transpose).

Each function returns its section's lines, heading first and a blank line last. The rows
keep their cells in the order of the column headings, which are listed first.
"""

from __future__ import annotations

from common import GB, MIB
from figures import fmt_mib, fmt_ms, fmt_s, ratio, table
from jobs import Samples
from measure import OpResult, SizeResult

# The column headings of each table, in order.
_RENAME_HEADER = (
    "size",
    "weightmap",
    "of which fsync",
    "of which parsing",
    "naive",
    "cp",
    "cp + fsync",
    "weightmap / cp",
    "weightmap / (cp + fsync)",
    "naive / weightmap",
)
_COLD_HEADER = (
    "size",
    "weightmap",
    "naive",
    "cp",
    "cp + fsync",
    "weightmap / cp",
    "weightmap / (cp + fsync)",
    "naive / weightmap",
    "weightmap RSS",
    "naive RSS",
)
_INPLACE_HEADER = (
    "size",
    "runs",
    "first call",
    "of which parsing",
    "of which fsync",
    "slowest first call",
    "second call",
    "slowest second call",
    "peak RSS",
)
_CAST_HEADER = (
    "size (bf16)",
    "cast",
    "weightmap",
    "of which fsync",
    "of which parsing",
    "naive",
    "naive / weightmap",
    "weightmap peak RSS",
    "naive peak RSS",
)
_OPS_HEADER = (
    "operation",
    "size",
    "runs",
    "weightmap",
    "of which fsync",
    "of which parsing",
    "naive",
    "naive / weightmap",
    "weightmap peak RSS",
    "naive peak RSS",
)


def _with_before(header: tuple[str, ...], after: str, sizes: list[SizeResult]) -> list[str]:
    """The column headings, with a **before** column after ``after`` when one was measured."""
    out = list(header)
    if any("before" in r.rename for r in sizes):
        out.insert(out.index(after) + 1, "before")
    return out


_BEFORE_NOTE = [
    "**before** is weightmap at the commit given as `--baseline` (the figures this change is "
    "measured against), run side by side with the others.",
    "",
]


def rename_section(sizes: list[SizeResult]) -> list[str]:
    """Section 1: the out-of-place rename's times against naive and cp, then peak RSS."""
    rows = []
    for r in sizes:
        s = r.rename
        wm, naive, cp, cpf = (
            s[k].median("seconds") for k in ("weightmap", "naive", "cp", "cp+fsync")
        )
        before = [fmt_s(s["before"].median("seconds"))] if "before" in s else []
        rows.append([
            f"{r.nbytes / GB:.2f} GB",
            fmt_s(wm),
            *before,
            fmt_s(s["weightmap"].median("fsync")),
            fmt_s(s["weightmap"].median("parser")),
            fmt_s(naive),
            fmt_s(cp),
            fmt_s(cpf),
            ratio(wm, cp),
            ratio(wm, cpf),
            ratio(naive, wm),
        ])  # fmt: skip
    rss_rows = [
        [
            f"{r.nbytes / GB:.2f} GB",
            _rss(r.rename["weightmap"]),
            _rss(r.rename["naive"]),
            fmt_mib(r.rename["cp"].median("rss_peak")),
        ]
        for r in sizes
    ]
    return [
        "## 1. Rename only, into a new folder",
        "",
        *(_BEFORE_NOTE if any("before" in r.rename for r in sizes) else []),
        *table(_with_before(_RENAME_HEADER, "weightmap", sizes), rows),
        "",
        "Peak RSS (anon / file-backed, sampled):",
        "",
        *table(["size", "weightmap", "naive", "cp"], rss_rows),
        "",
    ]


def cold_section(sizes: list[SizeResult]) -> list[str]:
    """Section 1's cold-cache subsection, for the sizes that have one (none unless asked)."""
    if not any(r.cold for r in sizes):
        return []
    rows = []
    notes: list[str] = []
    for r in sizes:
        if not r.cold:
            continue
        c = r.cold
        notes.append(_cold_note(r, c))
        wm, naive, cp, cpf = (
            c[k].median("seconds") for k in ("weightmap", "naive", "cp", "cp+fsync")
        )
        rows.append([
            f"{r.nbytes / GB:.2f} GB", fmt_s(wm), fmt_s(naive), fmt_s(cp), fmt_s(cpf),
            ratio(wm, cp), ratio(wm, cpf), ratio(naive, wm), _rss(c["weightmap"]),
            _rss(c["naive"]),
        ])  # fmt: skip
    return [
        "### Cold page cache",
        "",
        "The same rename after `sync; echo 3 > /proc/sys/vm/drop_caches` before each run "
        "(3 runs each): the input comes from the disk.",
        "",
        *table(_COLD_HEADER, rows),
        "",
        *notes,
        "",
    ]


def _cold_note(r: SizeResult, c: dict[str, Samples]) -> str:
    """Where a cold run's time goes, for one size: almost all of it is system time."""
    shares = ", ".join(
        f"{tool} {c[tool].median('cpu') / c[tool].median('seconds'):.0%}"
        for tool in ("weightmap", "naive", "cp")
    )
    return (
        f"At {r.nbytes / GB:.2f} GB, CPU time is {shares} of the wall time, almost all "
        "of it system time: reading into an emptied page cache and taking fresh pages "
        "for the input and the output is kernel work, and on this virtual machine a "
        "costly one (see every run)."
        + (
            " cp + fsync coming out faster than cp, which it cannot really be, shows "
            "how noisy three runs are here."
            if c["cp+fsync"].median("seconds") < c["cp"].median("seconds")
            else ""
        )
    )


def _before_calls(before: Samples | None) -> list[str]:
    """The --baseline commit's first and second call, where it ran."""
    if before is None:
        return []
    return [fmt_ms(before.median("seconds")), fmt_ms(before.median("second"))]


def inplace_section(sizes: list[SizeResult]) -> list[str]:
    """Section 2: renaming in place, first and second call of each process."""
    rows = [
        [
            f"{r.nbytes / GB:.2f} GB",
            str(len(r.inplace.runs)),
            fmt_ms(r.inplace.median("seconds")),
            fmt_ms(r.inplace.median("parser")),
            fmt_ms(r.inplace.median("fsync")),
            fmt_ms(r.inplace.max("seconds")),
            fmt_ms(r.inplace.median("second")),
            fmt_ms(r.inplace.max("second")),
            fmt_mib(r.inplace.median("rss_peak")),
            *_before_calls(r.inplace_before),
        ]
        for r in sizes
    ]
    before = any(r.inplace_before is not None for r in sizes)
    header = (*_INPLACE_HEADER, *(("before: first call", "before: second call") if before else ()))
    return [
        "## 2. Rename in place",
        "",
        "`remap(..., inplace=True)`: the headers are rewritten where they are (journaled and "
        "fsynced); no data byte moves. Each run is a fresh process that renames `layers.0.*` to "
        "`midlayer.*` (**first call**, the figure a command-line user sees) and then back "
        "(**second call**, same process, the rule-language parser already in memory), so every "
        "call renames all 9 layer tensors."
        + (" **before** runs alternate with weightmap's, run by run." if before else ""),
        "",
        *table(header, rows),
        "",
    ]


def cast_section(sizes: list[SizeResult]) -> list[str]:
    """Section 3: the whole checkpoint cast to f32 and back, two rows per size."""
    rows = []
    for r in sizes:
        for label, s, first in (("bf16 -> f32", r.to_f32, True), ("f32 -> bf16", r.to_bf16, False)):
            wm, naive = s["weightmap"].median("seconds"), s["naive"].median("seconds")
            before = (
                [fmt_s(s["before"].median("seconds")), _rss(s["before"])] if "before" in s else []
            )
            rows.append([
                f"{r.nbytes / GB:.2f} GB" if first else "",
                label,
                fmt_s(wm),
                fmt_s(s["weightmap"].median("fsync")),
                fmt_s(s["weightmap"].median("parser")),
                fmt_s(naive),
                ratio(naive, wm),
                _rss(s["weightmap"]),
                _rss(s["naive"]),
                *before,
            ])  # fmt: skip
    return [
        "## 3. Casting the whole checkpoint",
        "",
        "Every bf16 tensor to f32, and back from an f32 checkpoint of the same shapes (`d2t` "
        "and `t2d` are kept as they are). The naive script does `{k: v.to(dtype)}` between "
        "`load_file` and `save_file`. weightmap's job imports torch before the clock starts, as "
        "the naive one does.",
        "",
        *table(
            [*_CAST_HEADER, "before", "before peak RSS"]
            if any("before" in r.to_f32 for r in sizes)
            else _CAST_HEADER,
            rows,
        ),
        "",
    ]


def ops_section(ops: list[OpResult]) -> list[str]:
    """Section 4: the one-tensor split and transpose."""
    rows = []
    for o in ops:
        wm, naive = o.samples["weightmap"].median("seconds"), o.samples["naive"].median("seconds")
        rows.append([
            o.what, f"{o.nbytes / MIB:.0f} MiB", str(len(o.samples["weightmap"].runs)),
            fmt_s(wm), fmt_s(o.samples["weightmap"].median("fsync")),
            fmt_s(o.samples["weightmap"].median("parser")), fmt_s(naive),
            ratio(naive, wm), _rss(o.samples["weightmap"]), _rss(o.samples["naive"]),
        ])  # fmt: skip
    return [
        "## 4. Split and transpose",
        "",
        "One-tensor checkpoints. The split along dim 0 is three byte ranges, copied in the "
        "kernel; the transpose is computed in chunks over the memory-mapped input. The naive "
        "script clones the three views (safetensors refuses tensors that share memory) or "
        "calls `.T.contiguous()`.",
        "",
        *table(_OPS_HEADER, rows),
        "",
    ]


def _rss(s: Samples) -> str:
    peak = s.median("rss_peak")
    if not s.runs:
        return "—"
    if "anon_peak" not in s.runs[0]:
        return fmt_mib(peak)
    return f"{fmt_mib(peak)} ({fmt_mib(s.median('anon_peak'))} / {fmt_mib(s.median('file_peak'))})"
