"""How figures are written in the report: seconds, milliseconds, MiB, ratios, Markdown tables.

A missing figure (no finished run) is ``nan`` in the samples and an em dash in the text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def fmt_s(x: float) -> str:
    if math.isnan(x):
        return "—"
    return f"{x:.2f} s" if x >= 0.995 else f"{x:.3f} s"


def fmt_ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def fmt_mib(x: float) -> str:
    if math.isnan(x):
        return "—"
    return f"{x:,.0f} MiB" if x < 10240 else f"{x / 1024:.1f} GiB"


def ratio(a: float, b: float) -> str:
    return "—" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines
