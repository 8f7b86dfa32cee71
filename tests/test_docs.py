"""Every ```bash and ```python block in the README and docs/ runs, in order, per file, and
every ```weightmap block parses (a whole program, or a fragment under `weightmap 1`).

Blocks tagged ``console`` or ``text`` are shown, not run (installation commands, output).
In README commands joined by ``&&``, the environment and install steps are skipped: CI runs
exactly those itself, and a test must not reinstall the project.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from weightmap.language.parse import parse_program

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
MAPPING_BLOCK = re.compile(r"^```weightmap\n(.*?)^```", re.M | re.S)
# Environment and install steps (CI runs them itself), the tests themselves, and the benchmark
# (minutes long; tests never time anything) are shown, not run.
SKIP = (
    "python3 -m venv",
    ". .venv/bin/activate",
    "pip install",
    "python -m pytest",
    "python bench/",
)


def _bash(code: str) -> str:
    lines = []
    for line in code.splitlines():
        parts = [p for p in line.split(" && ") if not p.strip().startswith(SKIP)]
        lines.append(" && ".join(parts) if parts else ":")
    return "\n".join(lines)


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_doc_examples_run(doc: Path, tmp_path: Path) -> None:
    blocks = BLOCK.findall(doc.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip(f"{doc.name} has no runnable examples")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for i, (lang, code) in enumerate(blocks):
        if lang == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", _bash(code)]
        else:
            cmd = [sys.executable, "-c", code]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{doc.name} block {i + 1} ({lang}) failed:\n{code}\n{r.stderr}"


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_doc_mappings_parse(doc: Path) -> None:
    blocks = MAPPING_BLOCK.findall(doc.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip(f"{doc.name} has no mapping examples")
    for code in blocks:
        text = code if code.startswith("weightmap 1") else "weightmap 1\n" + code
        parse_program(text, f"{doc.name} example")
