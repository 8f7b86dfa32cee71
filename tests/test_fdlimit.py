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


def _needs_room(files: int) -> None:
    """Skip where the hard limit leaves no room to raise the soft one to ``files`` and the
    margin."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < files + fdlimit.MARGIN:
        pytest.skip(f"the hard limit on open files ({hard}) leaves no room to raise the soft one")


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
    _needs_room(2 * SHARDS)
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
    _needs_room(SHARDS)
    (tmp_path / "src").mkdir()
    save_file(
        {f"w.{i}": torch.full((4,), float(i)) for i in range(SHARDS)},
        tmp_path / "src" / "model.safetensors",
    )
    r = _child(_CHILD_OUT, tmp_path)
    assert int(r.stdout) == SHARDS


_CHILD_HELD = """
import resource, sys, weightmap
src, out, soft = sys.argv[1], sys.argv[2], int(sys.argv[3])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
cast = 'weightmap 1\\ncast "w.{i}" to bf16\\n'
# Each input held open, and mapped (a descriptor of its own) for the computed outputs.
kept = dict(weightmap.iter_tensors(src, mapping=cast))
r = weightmap.remap(src, out, mapping=cast, progress=False, max_shard_size=16, verify=True)
print(len(kept), len(r.paths))
"""


def test_held_inputs_their_maps_and_outputs_fit_past_a_low_soft_limit(tmp_path: Path) -> None:
    """Every input file stays open while its checkpoint is, and each map holds a descriptor of
    its own: room is made for both beside what is open, and for every output shard."""
    _needs_room(4 * SHARDS)
    _sharded(tmp_path / "src")
    r = _child(_CHILD_HELD, tmp_path)
    kept, paths = map(int, r.stdout.split())
    assert kept == SHARDS and paths >= SHARDS // 2  # (two bf16 tensors of 8 bytes a shard)


def test_a_family_of_many_rank_files_past_a_low_soft_limit(tmp_path: Path) -> None:
    """Each member of a family is a checkpoint of its own, opened one after another: the room
    each makes counts what the ones before hold open."""
    _needs_room(4 * SHARDS)
    src = tmp_path / "src"
    src.mkdir()
    for r in range(SHARDS):
        save_file({"w": torch.full((4,), float(r))}, src / f"rank.{r:03d}.safetensors")
    code = """
import resource, sys, weightmap
src, out, soft = sys.argv[1], sys.argv[2], int(sys.argv[3])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
m = 'weightmap 1\\ninput ranks files "rank.{r}.safetensors"\\n'
m += 'cast "ranks:{r:int}:w" to bf16 -> "w.{r}"\\n'
n = sum(1 for _ in weightmap.iter_tensors(src, mapping=m))
weightmap.remap(src, out, mapping=m, progress=False)
print(n)
"""
    assert int(_child(code, tmp_path).stdout) == SHARDS
