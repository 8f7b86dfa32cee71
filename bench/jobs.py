"""Running jobs: each measured operation in a fresh process, timed, tools interleaved.

``Runner.compare`` is the measuring loop: every tool once untimed, then run by run in a
rotating order, output deleted and dirty pages flushed between runs, inputs read beforehand
(warm) or the page cache dropped (cold). Also here: the page-cache knobs of the kernel.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoints import warm
from common import HERE, ROOT, compile_tree, log

JOB = HERE / "_job.py"


@dataclass
class Samples:
    """The runs of one tool on one input."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def median(self, key: str) -> float:
        values = [float(r[key]) for r in self.runs if key in r]
        return statistics.median(values) if values else math.nan

    def max(self, key: str) -> float:
        values = [float(r[key]) for r in self.runs if key in r]
        return max(values) if values else math.nan

    def min(self, key: str) -> float:
        values = [float(r[key]) for r in self.runs if key in r]
        return min(values) if values else math.nan


# Linux carries a process's peak RSS (ru_maxrss) over fork and exec into its children, so a
# job started by this process (which holds numpy, torch and weightmap) would report at least
# this process's peak. Jobs are started instead by a small launcher, itself started before
# anything heavy is imported.
_LAUNCHER = """
import json, os, subprocess, sys, time
for line in sys.stdin:
    argv, env = json.loads(line)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, check=False, env={**os.environ, **env})
    wall = time.perf_counter() - t0
    print(json.dumps({"rc": p.returncode, "out": p.stdout, "err": p.stderr[-4000:],
                      "wall": wall}), flush=True)
"""


class JobFailed(Exception):
    """A job exited non-zero or was killed; ``reason`` is one line for the log and the report."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Launcher:
    """The launcher process (``_LAUNCHER``): one job per line of JSON in, one reply out."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([list(argv), env or {}]) + "\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


# A job's tool name may carry a source tree to import weightmap from: "before" runs the
# commit given as --baseline. Every other job imports this checkout's src/.
SOURCES: dict[str, Path] = {}


class Runner:
    """Jobs run through a launcher, writing into ``out`` (default ``workdir/out``); counts
    the jobs run."""

    def __init__(self, workdir: Path, launcher: Launcher, out: Path | None = None) -> None:
        self.workdir = workdir
        self.out = workdir / "out" if out is None else out
        self.launcher = launcher
        self.jobs = 0

    def job(
        self, args: Sequence[str], *, drop_caches: bool = False, tool: str = ""
    ) -> dict[str, Any]:
        if drop_caches:
            drop_page_cache()
        src = SOURCES.get(tool, ROOT / "src")
        compile_tree(src)
        reply = self.launcher.run([sys.executable, str(JOB), *args], {"PYTHONPATH": str(src)})
        if reply["rc"] != 0:
            rc = reply["rc"]
            what = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            tail = reply["err"].strip().splitlines()[-1:] or [""]
            raise JobFailed(f"{args[0]} {args[-1]}: {what}; {tail[0]}".strip("; "))
        result: dict[str, Any] = json.loads(reply["out"].strip().splitlines()[-1])
        result["process"] = reply["wall"]
        module = result.get("module")
        if module is not None and not Path(module).is_relative_to(src):
            raise SystemExit(f"{tool or args[0]} imported weightmap from {module}, not {src}")
        self.jobs += 1
        return result

    def clean(self) -> None:
        if self.out.exists():
            shutil.rmtree(self.out)
        # Flush what the run left dirty, so its writeback does not land on the next run.
        os.sync()

    def compare(
        self,
        tools: dict[str, Callable[[], list[str]]],
        inputs: Iterable[Path],
        repeat: int,
        *,
        check: Callable[[str, Path], None] | None = None,
        cold: bool = False,
        probe: Callable[[Path], dict[str, Any]] | None = None,
    ) -> dict[str, Samples]:
        """Run every tool ``repeat`` times, interleaved and rotated, into ``self.out``.

        ``probe(out)`` (untimed, after a sync) adds figures about each run's output, such as
        the disk space it took; ``space`` is the growth of the filesystem's used bytes.
        """
        inputs = list(inputs)
        samples = {name: Samples() for name in tools}
        names = list(tools)
        if not cold:
            # One untimed run of each tool first: the first process to touch a freshly
            # written input pays a one-off kernel cost (seconds of system time here).
            for name in names:
                self.clean()
                try:
                    self.job(tools[name](), tool=name)
                except JobFailed as exc:
                    log(f"{name} (warm-up) failed: {exc.reason}")
        for rep in range(repeat):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                self.clean()
                if not cold:
                    for folder in inputs:
                        warm(folder)
                used = used_bytes(self.out.parent) if probe is not None else 0
                try:
                    result = self.job(tools[name](), drop_caches=cold, tool=name)
                except JobFailed as exc:
                    # Recorded and reported (a naive run may be killed for memory at 4.3 GB).
                    log(f"{name} failed: {exc.reason}")
                    samples[name].failures.append(exc.reason)
                    continue
                if check is not None and not samples[name].runs:
                    try:
                        check(name, self.out)
                    except (OSError, ValueError, RuntimeError) as exc:
                        log(f"{name}: wrong output: {exc}")
                        samples[name].failures.append(f"wrong output: {exc}")
                        continue
                if probe is not None:
                    os.sync()
                    result["space"] = used_bytes(self.out.parent) - used
                    result.update(probe(self.out))
                samples[name].runs.append(result)
        self.clean()
        return samples


def used_bytes(folder: Path) -> int:
    """Bytes in use on ``folder``'s filesystem (``df``)."""
    st = os.statvfs(folder)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def can_drop_caches() -> bool:
    try:
        drop_page_cache()
    except OSError:
        return False
    return True


def dirty_ratios() -> tuple[int, int]:
    """The kernel's vm.dirty_background_ratio and vm.dirty_ratio (percent of memory)."""
    try:
        with (
            open("/proc/sys/vm/dirty_background_ratio") as f,
            open("/proc/sys/vm/dirty_ratio") as g,
        ):
            return int(f.read()), int(g.read())
    except (OSError, ValueError):
        return 0, 0
