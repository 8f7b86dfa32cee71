"""The physical limits: a checkpoint of many small tensors, and copy-on-write filesystems.

``measure_many`` renames the MoE-shaped checkpoint (18,624 tensors in 48 shards) into a new
folder against ``cp -r``. ``measure_cow`` does that and the drafter's ``eagle3-sglang``
conversion on a loop-mounted XFS (reflink) and a btrfs image, where a conversion that changes
no data can share the input's extents: besides the time it records the disk space each output
took and how many of its bytes sit in extents the filesystem marks shared (FIEMAP).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cowfs
from checkpoints import (
    MOE_LAYERS,
    MOE_RENAME,
    PRESET,
    Filler,
    dims_for,
    make_config,
    moe_layer,
    write_checkpoint,
    write_moe_checkpoint,
)
from common import log
from jobs import SOURCES, Launcher, Runner, Samples
from measure import checker, expect_names

FS_NAMES = {"xfs": "XFS (reflink)", "btrfs": "btrfs"}


@dataclass
class LimitResult:
    """One checkpoint converted on one filesystem by every tool."""

    fs: str
    what: str
    nbytes: int
    samples: dict[str, Samples]


@dataclass
class CowResults:
    """Everything measured on copy-on-write filesystems, and why a filesystem was skipped."""

    results: list[LimitResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def moe_tensors() -> int:
    return sum(len(moe_layer(i)) for i in range(MOE_LAYERS))


def _probe(out: Path) -> dict[str, Any]:
    shared, size, headers = cowfs.folder_shared(out)
    return {"shared": shared, "size": size, "headers": headers}


def _tools(runner: Runner, src: Path, args: list[str]) -> dict[str, Callable[[], list[str]]]:
    out = str(runner.out)
    tools = {"weightmap": ["weightmap", str(src), out, *args]}
    if "before" in SOURCES:
        tools["before"] = ["weightmap", str(src), out, *args]
    tools["cp"] = ["cp", str(src), out]
    tools["cp+fsync"] = ["cp", str(src), out, "--fsync"]
    return {name: (lambda a=a: a) for name, a in tools.items()}


def measure_many(
    runner: Runner, repeat: int, mapping: Path, filler: Filler, fs: str, cow: bool
) -> LimitResult:
    """The MoE-shaped checkpoint renamed (every tensor) into a new folder, against cp -r."""
    src = runner.workdir / "moe"
    log(f"{fs}: writing the {moe_tensors():,}-tensor, {MOE_LAYERS}-shard checkpoint")
    nbytes = write_moe_checkpoint(src, filler)
    log(f"{fs}: many-tensor rename, {repeat} runs each")
    samples = runner.compare(
        _tools(runner, src, ["--mapping", str(mapping)]),
        [src],
        repeat,
        check=checker(expect_names(src, MOE_RENAME, None)),
        probe=_probe if cow else None,
    )
    shutil.rmtree(src)
    return LimitResult(fs, "many", nbytes, samples)


def measure_cow(
    launcher: Launcher,
    workdir: Path,
    repeat: int,
    mapping: Path,
    filler: Filler,
    size_gb: float,
    kinds: tuple[str, ...] = cowfs.KINDS,
) -> CowResults:
    """The drafter's conversion and the many-tensor rename on each copy-on-write filesystem."""
    found = CowResults()
    for kind in kinds:
        fs = FS_NAMES[kind]
        try:
            with cowfs.mounted(kind, workdir / "cow") as mnt:
                runner = Runner(mnt, launcher)
                src = mnt / "drafter"
                dims = dims_for(size_gb)
                log(f"{fs}: writing the {size_gb:g} GB drafter")
                nbytes = write_checkpoint(src, dims.tensors("BF16"), make_config(dims), filler)
                log(f"{fs}: {PRESET} conversion, {repeat} runs each")
                samples = runner.compare(
                    _tools(runner, src, ["--preset", PRESET]),
                    [src],
                    repeat,
                    check=checker(expect_names(src, None, PRESET)),
                    probe=_probe,
                )
                shutil.rmtree(src)
                found.results.append(LimitResult(fs, "drafter", nbytes, samples))
                found.results.append(measure_many(runner, repeat, mapping, filler, fs, True))
        except cowfs.Unavailable as exc:
            log(f"{fs}: skipped ({exc})")
            found.skipped[fs] = str(exc)
    return found
