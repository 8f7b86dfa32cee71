"""A conversion of more shards than the soft limit on open files allows: the limit is raised
up to the hard one, as ``ulimit -n`` would, instead of failing half-way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightmap.fs import fdlimit

resource = pytest.importorskip("resource")

SHARDS = 300
SOFT = 128  # below the shards: two descriptors each, in and out

_CHILD = """
import resource, sys, weightmap
src, out, soft = sys.argv[1], sys.argv[2], int(sys.argv[3])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
weightmap.remap(src, out, mapping="weightmap 1\\nunmatched keep\\n", progress=False)
n = sum(1 for _ in weightmap.iter_tensors(out, mapping="weightmap 1\\nunmatched keep\\n"))
print(n, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _sharded(folder: Path) -> None:
    folder.mkdir()
    weight_map = {}
    for i in range(SHARDS):
        name = f"model-{i:05d}-of-{SHARDS:05d}.safetensors"
        save_file({f"w.{i}": torch.full((4,), float(i))}, folder / name)
        weight_map[f"w.{i}"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _child(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` on tmp_path/src -> tmp_path/out under a soft limit of SOFT open files."""
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "out"), str(SOFT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_many_shards_past_a_low_soft_limit(tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * SHARDS + fdlimit.MARGIN:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no room to raise the soft one")
    _sharded(tmp_path / "src")
    r = _child(_CHILD, tmp_path)
    count, soft = map(int, r.stdout.split())
    assert count == SHARDS and soft >= 2 * SHARDS + fdlimit.MARGIN


def test_the_soft_limit_is_never_lowered() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fdlimit.make_room(0) == soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


_CHILD_OUT = """
import resource, sys, weightmap
src, out, soft = sys.argv[1], sys.argv[2], int(sys.argv[3])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
r = weightmap.remap(src, out, mapping="weightmap 1\\nunmatched keep\\n", progress=False,
                    max_shard_size=16)
print(len(r.paths))
"""


def test_many_output_shards_of_one_input_past_a_low_soft_limit(tmp_path: Path) -> None:
    # The writer holds every output shard open: they count, not only the inputs.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < SHARDS + fdlimit.MARGIN:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no room to raise the soft one")
    (tmp_path / "src").mkdir()
    save_file(
        {f"w.{i}": torch.full((4,), float(i)) for i in range(SHARDS)},
        tmp_path / "src" / "model.safetensors",
    )
    r = _child(_CHILD_OUT, tmp_path)
    assert int(r.stdout) == SHARDS
