"""`weightmap inspect`, through the installed console script and `python -m`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXE = shutil.which("weightmap")


def run(*args: str, module: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "weightmap"] if module or EXE is None else [EXE]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


def test_inspect_lists_16_tensors(example: Path) -> None:
    r = run("inspect", str(example))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "dtype", "shape", "bytes", "file"]
    assert len(lines) == 18
    row = next(line for line in lines if line.startswith("layers.0.self_attn.q_proj.weight "))
    assert row.split() == [
        "layers.0.self_attn.q_proj.weight",
        "BF16",
        "[64,",
        "128]",
        "16,384",
        "model.safetensors",
    ]
    assert lines[-1] == "16 tensors, 198,656 bytes (198.7 KB) in 1 file(s)"


def test_inspect_json_via_module(example: Path) -> None:
    r = run("inspect", "--json", str(example), module=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["total_tensors"] == 16
    assert {
        "name": "d2t",
        "dtype": "I64",
        "shape": [128],
        "bytes": 1024,
        "file": "model.safetensors",
    } in doc["tensors"]
    assert doc["config"]["speculators_model_type"] == "eagle3"


def test_inspect_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    r = run("inspect", str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("weightmap: error: ") and "header-beyond-file" in r.stderr


@pytest.mark.parametrize("env_debug", [False, True])
def test_debug_shows_traceback(tmp_path: Path, env_debug: bool) -> None:
    args = ("inspect", str(tmp_path / "missing"))
    if env_debug:
        cmd = [sys.executable, "-m", "weightmap", *args]
        r = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
            env={**__import__("os").environ, "WEIGHTMAP_DEBUG": "1"},
        )
    else:
        r = run("--debug", *args)
    assert r.returncode != 0
    assert "Traceback" in r.stderr


def test_usage_error_exit_code() -> None:
    r = run("frobnicate")
    assert r.returncode == 2
