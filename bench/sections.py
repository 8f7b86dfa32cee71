"""The sections of docs/benchmarks.md, and the ones separate scripts write.

``bench/run.py`` regenerates the document from its own measurements; the sections below come
from scripts of their own (each says which), and ``run.py`` carries them over as they were.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

# The headings of the sections run.py does not measure, in the order the document has them.
KEPT = (
    "## Several inputs",  # bench/bench_several.py
    "## Start-up",  # bench/bench_startup.py
    "## The write path",  # bench/bench_write.py
    "## Direct writes",  # bench/bench_write.py --in-a-row
    "## Many tensors at scale",  # bench/bench_many.py
    "## fp8 dequantization",  # bench/bench_fp8.py
    "## PyTorch checkpoints",  # bench/bench_pickle.py, written from its table
    "## Past one machine",  # bench/bench_ray.py
    "## Stopping a conversion",  # bench/bench_interrupt.py
)


def _pattern(heading: str) -> re.Pattern[str]:
    """A section: its heading line (which ``heading`` begins) up to the next ``## `` or the end."""
    return re.compile(r"^" + re.escape(heading) + r"[^\n]*\n.*?(?=\n## |\Z)", re.S | re.M)


def kept_sections(doc: str) -> str:
    """The sections of ``doc`` that ``KEPT`` names, for run.py to carry over ("" if none)."""
    found = [m.group(0).rstrip("\n") for h in KEPT if (m := _pattern(h).search(doc))]
    return "".join("\n" + text + "\n" for text in found)


def write_section(heading: str, text: str, doc_path: Path = DOC) -> None:
    """Replace the section that begins with ``heading`` by ``text``, or append ``text``."""
    doc = doc_path.read_text() if doc_path.exists() else "# Benchmarks\n"
    pattern = _pattern(heading)
    if pattern.search(doc):
        # (The section ends where "\n## " begins: its own blank line goes back in.)
        doc = pattern.sub(lambda m: text.rstrip("\n") + "\n", doc, count=1)
    else:
        doc = doc.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    doc_path.write_text(doc if doc.endswith("\n") else doc + "\n")
