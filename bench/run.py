"""Regenerate docs/benchmarks.md: weightmap against the naive script and ``cp``.

    python bench/run.py                      # the full run (sizes 0.5, 1, 2, 4.3 GB)
    python bench/run.py --quick              # one small size, 3 runs, into /tmp
    python bench/run.py --sizes 1,2 --repeat 5 --workdir /scratch --out /tmp/b.md
    python bench/run.py --baseline 55a6c2b   # add "before" columns: weightmap at that commit

Synthetic checkpoints with the tensor names of a speculators EAGLE-3 drafter and the shapes of
the Kimi-K2.5 drafter are built in a scratch folder (deleted afterwards). Every measured
operation runs in a fresh process (``bench/_job.py``), tools interleaved run by run; outputs are
deleted and dirty pages flushed (untimed) between runs, and inputs are read once before each
run so that every warm-cache figure starts from the same state.

The pieces, one module per concern, all beside this file: ``checkpoints`` (the synthetic
checkpoints and mappings), ``jobs`` (running and timing a job), ``measure`` (what is measured),
``report``, ``tables``, ``growth``, ``floors`` and ``figures`` (the document), ``common``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from checkpoints import (
    CAST_TO_BF16,
    CAST_TO_F32,
    MOE_RENAME,
    RENAME_BACK,
    RENAME_FORWARD,
    SPLIT,
    TRANSPOSE,
    Filler,
)
from common import ROOT, log, scratch
from jobs import SOURCES, Launcher, Runner, can_drop_caches
from limits import CowResults, LimitResult, measure_cow, measure_many
from measure import OpResult, SizeResult, compile_speed, measure_ops, measure_size, rename_source
from report import machine, render
from sections import kept_sections

DEFAULT_OUT = ROOT / "docs" / "benchmarks.md"

# The mapping files the jobs read, under the keys measure_size and measure_ops look them up by.
MAPPINGS = {
    "forward": RENAME_FORWARD,
    "back": RENAME_BACK,
    "to_f32": CAST_TO_F32,
    "to_bf16": CAST_TO_BF16,
    "split": SPLIT,
    "transpose": TRANSPOSE,
    "moe": MOE_RENAME,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=None, help="checkpoint sizes in GB (default 0.5,1,2,4.3)"
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="runs per tool (default: 7 up to 1 GB, 5 above)"
    )
    parser.add_argument("--quick", action="store_true", help="one small size, 3 runs, into /tmp")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch parent folder")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache rows")
    parser.add_argument(
        "--no-limits",
        action="store_true",
        help="skip the many-tensor checkpoint and the copy-on-write filesystems",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="COMMIT",
        help='also run weightmap at this commit ("before" columns), side by side',
    )
    args = parser.parse_args(argv)
    if args.out is None:
        # A quick run is a smoke test: it must not overwrite the committed document.
        args.out = (
            Path(tempfile.gettempdir()) / "weightmap-benchmarks-quick.md"
            if args.quick
            else DEFAULT_OUT
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = [float(s) for s in (args.sizes or ("0.5" if args.quick else "0.5,1,2,4.3")).split(",")]
    start = time.perf_counter()
    load_start = os.getloadavg()[0]
    # Before anything heavy is imported, so that the jobs' peak RSS is their own (see jobs.py).
    launcher = Launcher()
    workdir = scratch("weightmap-bench-", args.workdir)
    log(f"scratch folder {workdir}")
    cold_ok = not args.quick and not args.no_cold and can_drop_caches()
    cold_note = _cold_note(args, cold_ok)
    many: LimitResult | None = None
    cow: CowResults | None = None
    try:
        if args.baseline:
            SOURCES["before"] = _checkout(args.baseline, workdir)
        paths = _write_mappings(workdir)
        machine_lines = machine(workdir)
        runner = Runner(workdir, launcher)
        filler = Filler()
        results = [
            measure_size(
                runner, size, _repeat(args, size), paths, filler, cold_ok and size == max(sizes)
            )
            for size in sizes
        ]
        ops = measure_ops(runner, 3 if args.quick else int(args.repeat or 7), paths, filler)
        if not args.no_limits:
            repeat = _repeat(args, 1)
            many = measure_many(runner, repeat, paths["moe"], filler, "ext4", False)
            cow = measure_cow(launcher, workdir, repeat, paths["moe"], filler, max(sizes))
    finally:
        launcher.close()
        shutil.rmtree(workdir, ignore_errors=True)
    compile_text = compile_speed()
    seconds = time.perf_counter() - start
    text = render(
        results,
        ops,
        compile_text,
        _command(argv),
        seconds,
        _repeat_note(args, sizes),
        rename_source()[0],
        cold_note,
        (load_start, os.getloadavg()[0]),
        machine_lines,
        many,
        cow,
    )
    if args.out.exists():
        # The sections other scripts write (bench/sections.py) are carried over as they were.
        text = text.rstrip("\n") + "\n" + kept_sections(args.out.read_text())
    args.out.write_text(text)
    _write_raw(results, ops, many, cow)
    log(f"wrote {args.out} in {seconds / 60:.1f} min ({runner.jobs} jobs)")


def _repeat(args: argparse.Namespace, size: float) -> int:
    """Runs per tool at ``size``: fewer above 1 GB, where each run takes longer."""
    if args.repeat is not None:
        return int(args.repeat)
    return 3 if args.quick else 7 if size <= 1 else 5


def _repeat_note(args: argparse.Namespace, sizes: list[float]) -> str:
    repeats = sorted({_repeat(args, s) for s in sizes})
    return (
        f"Each figure is the median of {' or '.join(map(str, repeats))} runs per tool "
        "(7 up to 1 GB, 5 above, unless `--repeat` says otherwise)."
    )


def _cold_note(args: argparse.Namespace, cold_ok: bool) -> str:
    """What the report says about cold-cache runs, for the Method section."""
    if args.quick or args.no_cold:
        return "No cold-cache runs in this report (`--quick` or `--no-cold`)."
    if cold_ok:
        return (
            "One cold-cache table (largest size) drops the page cache before every run; "
            "everything else is warm."
        )
    return (
        "Dropping the page cache (`/proc/sys/vm/drop_caches`) is not permitted here, so "
        "every figure is warm-cache."
    )


def _checkout(commit: str, workdir: Path) -> Path:
    """This repository's ``src/`` (and its package data) at ``commit``, unpacked in the
    scratch folder."""
    target = workdir / f"baseline-{commit}"
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "src", "grammars", "mappings"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    log(f"baseline: {commit} unpacked in {target}")
    return target / "src"


def _write_mappings(workdir: Path) -> dict[str, Path]:
    """Each mapping text as ``<key>.wm`` in the scratch folder, where the jobs read it."""
    paths = {}
    for key, text in MAPPINGS.items():
        paths[key] = workdir / f"{key}.wm"
        paths[key].write_text(text)
    return paths


def _command(argv: list[str] | None) -> str:
    """The command line as the report shows it, to be run again as it stands."""
    return "python bench/run.py" + (
        " " + shlex.join(argv if argv is not None else sys.argv[1:])
        if (argv or sys.argv[1:])
        else ""
    )


def _write_raw(
    results: list[SizeResult],
    ops: list[OpResult],
    many: LimitResult | None,
    cow: CowResults | None,
) -> None:
    """Every sample of the run as JSON, for a look behind the medians."""
    raw = Path(tempfile.gettempdir()) / "weightmap-bench-raw.json"
    doc = {
        "sizes": [asdict(r) for r in results],
        "ops": [asdict(o) for o in ops],
        "many": asdict(many) if many else None,
        "cow": asdict(cow) if cow else None,
    }
    raw.write_text(json.dumps(doc))
    log(f"raw samples in {raw}")


if __name__ == "__main__":
    main()
