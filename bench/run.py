"""Regenerate docs/benchmarks.md: weightmap against the naive script and ``cp``.

    python bench/run.py                      # the full run (sizes 0.5, 1, 2, 4.3 GB)
    python bench/run.py --quick              # one small size, 3 runs, into /tmp
    python bench/run.py --sizes 1,2 --repeat 5 --workdir /scratch --out /tmp/b.md

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
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from checkpoints import (
    CAST_TO_BF16,
    CAST_TO_F32,
    RENAME_BACK,
    RENAME_FORWARD,
    SPLIT,
    TRANSPOSE,
    Filler,
)
from common import ROOT, log
from jobs import Launcher, Runner, can_drop_caches
from measure import OpResult, SizeResult, compile_speed, measure_ops, measure_size, rename_source
from report import machine, render

DEFAULT_OUT = ROOT / "docs" / "benchmarks.md"

# The mapping files the jobs read, under the keys measure_size and measure_ops look them up by.
MAPPINGS = {
    "forward": RENAME_FORWARD,
    "back": RENAME_BACK,
    "to_f32": CAST_TO_F32,
    "to_bf16": CAST_TO_BF16,
    "split": SPLIT,
    "transpose": TRANSPOSE,
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
    workdir = Path(tempfile.mkdtemp(prefix="weightmap-bench-", dir=args.workdir))
    log(f"scratch folder {workdir}")
    cold_ok = not args.quick and not args.no_cold and can_drop_caches()
    cold_note = _cold_note(args, cold_ok)
    try:
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
    )
    args.out.write_text(text)
    _write_raw(results, ops)
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


def _write_raw(results: list[SizeResult], ops: list[OpResult]) -> None:
    """Every sample of the run as JSON, for a look behind the medians."""
    raw = Path(tempfile.gettempdir()) / "weightmap-bench-raw.json"
    raw.write_text(
        json.dumps({"sizes": [asdict(r) for r in results], "ops": [asdict(o) for o in ops]})
    )
    log(f"raw samples in {raw}")


if __name__ == "__main__":
    main()
