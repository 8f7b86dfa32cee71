"""The "How time and memory grow with size" section: seconds per GB, and what the trend says.

Time per GB that stays flat means a tool is bound by bytes; time that falls means fixed costs
spread over more bytes; time that rises past the kernel's dirty threshold means writeback
throttling. Memory that grows with size is the whole model held in the process.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from common import GB
from figures import fmt_mib, fmt_s, table
from jobs import Samples, dirty_ratios
from measure import SizeResult

# The measurements shown per GB: (label, SizeResult attribute, tools).
_GROUPS: list[tuple[str, str, tuple[str, ...]]] = [
    ("rename", "rename", ("weightmap", "naive", "cp", "cp+fsync")),
    ("bf16 -> f32", "to_f32", ("weightmap", "naive")),
    ("f32 -> bf16", "to_bf16", ("weightmap", "naive")),
]


def growth(sizes: list[SizeResult]) -> list[str]:
    """The section's body (without its heading)."""
    if len(sizes) < 2:
        return ["Only one size was measured; run with several `--sizes` to see the trend."]
    return [*_rate_table(sizes), "", _time_text(sizes), "", _memory_text(sizes)]


def _rate(r: SizeResult, group: dict[str, Samples], tool: str) -> float:
    """Median seconds per GB of the bf16 checkpoint."""
    return group[tool].median("seconds") / (r.nbytes / GB)


def _rate_table(sizes: list[SizeResult]) -> list[str]:
    rows = [
        [label, tool, *(f"{_rate(r, getattr(r, attr), tool):.2f}" for r in sizes)]
        for label, attr, tools in _GROUPS
        for tool in tools
    ]
    return [
        "Seconds per GB of the bf16 checkpoint (median time / size):",
        "",
        *table(["measurement", "tool", *(f"{r.nbytes / GB:.2f} GB" for r in sizes)], rows),
    ]


def _time_text(sizes: list[SizeResult]) -> str:
    first, last = sizes[0], sizes[-1]

    def trend(tool: str) -> str:
        return _trend(_rate(first, first.rename, tool), _rate(last, last.rename, tool))

    parser = statistics.median(r.rename["weightmap"].median("parser") for r in sizes)
    background, _ = dirty_ratios()
    ip = [r.inplace.median("seconds") * 1000 for r in sizes]
    # cp slowing down per GB at the largest size is the sign of writeback throttling.
    throttled = _rate(last, last.rename, "cp") > 1.3 * _rate(first, first.rename, "cp")
    return (
        f"From {first.nbytes / GB:.2f} to {last.nbytes / GB:.2f} GB, weightmap's rename "
        f"{trend('weightmap')} "
        f"(fixed costs, {fmt_s(parser)} of it reading the mapping, are spread over more bytes), "
        f"cp's {trend('cp')} and "
        f"the naive script's {trend('naive')}."
        + (
            " cp and the naive script do not sync, so their writes pile up in the page cache; "
            f"past the kernel's dirty threshold (vm.dirty_background_ratio {background}% of "
            "memory, about 2.3 GB of dirty pages here, where the dirty count was seen to "
            "level off during a 4.3 GB cp) the kernel writes back while they write and holds "
            "them to the disk's pace. weightmap hands what it writes to the disk piece by "
            "piece (copies in 8 MiB pieces, computed tensors chunk by chunk) as soon as it is "
            "written, so it never builds that backlog."
            if throttled
            else ""
        )
        + f" In-place renames do not grow ({min(ip):.0f} to {max(ip):.0f} ms): they rewrite "
        "only the header."
    )


def _memory_text(sizes: list[SizeResult]) -> str:
    def spread(values: list[float]) -> str:
        lo, hi = fmt_mib(min(values)), fmt_mib(max(values))
        return lo if lo == hi else f"{lo} to {hi}"

    def per_gb(values: list[float]) -> float:
        """GiB of memory per GB of checkpoint (the slope is in MiB per GB)."""
        return slope([r.nbytes / GB for r in sizes], values) / 1024

    return (
        "Memory is where the approaches part. weightmap's peak RSS does not grow with size: "
        f"{spread([r.rename['weightmap'].median('rss_peak') for r in sizes])} for renames (the "
        "bytes never enter the process), "
        f"{spread([r.to_f32['weightmap'].median('anon_peak') for r in sizes])} of anonymous "
        "memory for casts (torch itself, plus the chunk buffers, within the chunk budget over all "
        "writer threads). The naive "
        "script's grows with the model: "
        f"{per_gb([r.rename['naive'].median('rss_peak') for r in sizes]):.2f} GiB of peak RSS "
        "per GB for the rename (the whole file, mapped and read), and "
        f"{per_gb([r.to_f32['naive'].median('anon_peak') for r in sizes]):.2f} GiB of "
        "anonymous memory per GB of bf16 for the cast to f32 (the f32 copy of every tensor). "
        "weightmap reads its input through a memory map and unmaps the pages of each chunk "
        "once the chunk is written, so its file-backed pages do not grow with the input either "
        f"({per_gb([r.to_f32['weightmap'].median('file_peak') for r in sizes]):.3f} GiB per GB "
        "for bf16 -> f32)."
    )


def _trend(a: float, b: float) -> str:
    """How seconds per GB went from ``a`` (smallest size) to ``b`` (largest), in words."""
    if math.isnan(a) or math.isnan(b):
        return "—"
    if b > a * 1.15:
        return f"rises from {a:.2f} to {b:.2f} s/GB"
    if b < a / 1.15:
        return f"falls from {a:.2f} to {b:.2f} s/GB"
    return f"stays at {a:.2f} to {b:.2f} s/GB"


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of y on x (per GB), or nan with fewer than two points."""
    if len(xs) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else math.nan
