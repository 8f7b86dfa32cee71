"""Golden files: tests/data/lang/valid/*.wm compile to *.plan.json; invalid/*.wm fail with *.err.

Each program is compiled against the fake headers (and config, params) in its ``.in.json``.
Set WEIGHTMAP_UPDATE_GOLDEN=1 to rewrite the expected files, then review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from weightmap.compiler.compile import compile_plan
from weightmap.errors import MappingError, MappingSyntaxError
from weightmap.format.dtypes import TensorSpec
from weightmap.language.mapping import load_mapping
from weightmap.plan.plan import Plan

DATA = Path(__file__).parent / "data" / "lang"
UPDATE = os.environ.get("WEIGHTMAP_UPDATE_GOLDEN") == "1"


def _inputs(program: Path) -> tuple[list[TensorSpec], Any, dict[str, Any]]:
    spec = program.with_suffix(".in.json")
    if not spec.exists():
        return [], None, {}
    d = json.loads(spec.read_text())
    tensors = [TensorSpec(n, dt, tuple(shape)) for n, dt, shape in d["tensors"]]
    return tensors, d.get("config"), d.get("params", {})


def _compile(program: Path) -> Plan:
    mapping = load_mapping(program, name=program.name)
    tensors, config, params = _inputs(program)
    return compile_plan(mapping, tensors, config, params=params)


def _check(expected: Path, actual: str) -> None:
    if UPDATE:
        expected.write_text(actual)
    assert expected.exists(), f"{expected} is missing (run with WEIGHTMAP_UPDATE_GOLDEN=1)"
    assert actual == expected.read_text()


@pytest.mark.parametrize("program", sorted((DATA / "valid").glob("*.wm")), ids=lambda p: p.stem)
def test_valid(program: Path) -> None:
    plan = _compile(program)
    _check(program.with_suffix(".plan.json"), plan.to_json() + "\n")
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.explain()


@pytest.mark.parametrize("program", sorted((DATA / "invalid").glob("*.wm")), ids=lambda p: p.stem)
def test_invalid(program: Path) -> None:
    with pytest.raises(
        MappingError if not program.stem.startswith("syntax") else MappingSyntaxError
    ) as info:
        _compile(program)
    _check(program.with_suffix(".err"), str(info.value) + "\n")
