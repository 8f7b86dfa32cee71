"""Start-up and exit: how long `weightmap --help`, `weightmap presets`, `weightmap inspect` and
a small computed `weightmap convert` take, against the bare interpreter and a baseline commit,
side by side.

    python bench/bench_startup.py [--baseline COMMIT] [--repeat 21] [--no-write]

Each command is a fresh process that runs what the installed ``weightmap`` script runs
(``weightmap.__main__.main`` with ``sys.argv`` set), with ``PYTHONPATH`` set to the tree
under test, so both trees start the same way; each tree is compiled to bytecode first, as an
installed package is. The runs are interleaved, commands rotated, and the medians reported,
with ``python -c pass`` in the same rotation as the floor. ``inspect`` reads the example
drafter in ``examples/``; ``convert`` casts 8 MiB of float32 to float16 (torch loaded) into a
scratch folder, ``--overwrite``. Writes the section "Start-up" of docs/benchmarks.md
(``--no-write``: print it only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import compile_tree
from sections import write_section

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Start-up"
STDLIB_MODULES = "argparse, json, re, pathlib, typing, dataclasses"
STDLIB = f"`python -c 'import {STDLIB_MODULES}'`"
COMMANDS = {
    "`weightmap --help`": ["--help"],
    "`weightmap presets`": ["presets"],
    "`weightmap inspect` (example drafter)": ["inspect", str(ROOT / "examples/eagle3-speculators")],
}
CONVERT = "`weightmap convert` (a cast of 8 MiB, torch loaded)"


def _convert_args(scratch: Path) -> list[str]:
    """A float32 checkpoint of 8 MiB and a cast to float16 of it, into ``scratch``."""
    folder = scratch / "small"
    folder.mkdir()
    code = (
        "import sys, numpy as np\n"
        "from safetensors.numpy import save_file\n"
        "block = np.ones((256, 1024), dtype=np.float32)\n"
        "save_file({f'layers.{i}.weight': block for i in range(8)}, sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(folder / "model.safetensors")], check=True)
    (folder / "config.json").write_text('{"torch_dtype": "float32"}')
    mapping = scratch / "cast.wm"
    mapping.write_text('weightmap 1\ncast "**" to f16\n')
    out = scratch / "out"
    return ["convert", str(folder), str(out), "--mapping", str(mapping), "--overwrite", "--quiet"]


def _checkout(commit: str, workdir: Path) -> Path:
    """``src/``, ``grammars/`` and ``mappings/`` at ``commit``, unpacked (as bench/run.py)."""
    target = workdir / f"baseline-{commit}"
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "src", "grammars", "mappings"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "src"


def _time(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="a commit to compare with (e.g. the last release)")
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args()
    trees = {"now": ROOT / "src"}
    with tempfile.TemporaryDirectory(prefix="weightmap-startup-") as scratch:
        if args.baseline:
            trees["before"] = _checkout(args.baseline, Path(scratch))
        for src in trees.values():
            compile_tree(src)  # (bytecode first, as an installed package has it)
        jobs: dict[tuple[str, str], tuple[list[str], dict[str, str]]] = {}
        bare_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        jobs[("`python -c pass`", "")] = ([sys.executable, "-c", "pass"], bare_env)
        # The standard library the command line cannot do without (argparse, json, re,
        # pathlib) and what weightmap.errors and most modules use (typing, dataclasses):
        # the floor under any import of weightmap, measured in the same rotation.
        jobs[(STDLIB, "")] = ([sys.executable, "-c", f"import {STDLIB_MODULES}"], bare_env)
        commands = {**COMMANDS, CONVERT: _convert_args(Path(scratch))}
        for tree, src in trees.items():
            env = bare_env | {"PYTHONPATH": str(src)}
            for label, cmd in commands.items():
                code = (
                    "import sys; from weightmap.__main__ import main; "
                    f"sys.argv[1:] = {cmd!r}; sys.exit(main())"
                )
                jobs[(label, tree)] = ([sys.executable, "-c", code], env)
        for argv, env in jobs.values():  # warm the page cache and the parser cache
            _time(argv, env)
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in jobs}
        keys = list(jobs)
        for rep in range(args.repeat):
            for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
                samples[key].append(_time(*jobs[key]))
    med = {key: statistics.median(v) * 1000 for key, v in samples.items()}
    floor = med[("`python -c pass`", "")]
    head = "| command | now | now - `python -c pass` |"
    rule = "|---|---|---|"
    if "before" in trees:
        head += " before | before - `python -c pass` | before / now |"
        rule += "---|---|---|"
    blank = " | | |" if "before" in trees else ""
    rows = [head, rule, f"| `python -c pass` | {floor:.0f} ms | |{blank}"]
    rows.append(
        f"| {STDLIB} | {med[(STDLIB, '')]:.0f} ms | {med[(STDLIB, '')] - floor:+.0f} ms |{blank}"
    )
    for label in [*COMMANDS, CONVERT]:
        now = med[(label, "now")]
        row = f"| {label} | {now:.0f} ms | {now - floor:+.0f} ms |"
        if "before" in trees:
            before = med[(label, "before")]
            row += f" {before:.0f} ms | {before - floor:+.0f} ms | {before / now:.2f}x |"
        rows.append(row)
    lines = [
        f"{SECTION}",
        "",
        f"Wall time of a fresh process per command, medians of {args.repeat} runs, interleaved "
        "and rotated with the bare interpreter's start in the same environment (the project's "
        "test environment, with torch, transformers and ray installed). "
        + (f"**before** is commit `{args.baseline}`. " if args.baseline else "")
        + f"`python bench/{Path(__file__).name}` ({time.strftime('%Y-%m-%d')}, "
        f"{os.uname().machine}, {os.cpu_count()} cores).",
        "",
        *rows,
        "",
        "`python -X importtime -c 'from weightmap.cli import main'` shows where the rest goes. "
        "`--help` imports weightmap's errors, text and cancel modules and the command line "
        "itself, nothing of the compiler, the executors, the parser or torch "
        "(`tests/test_cli.py`); `presets` reads the listing kept in the per-user cache (made "
        "once, by loading every preset, and again whenever a preset or the code changes); "
        "`inspect` imports the checkpoint reader, not the layout planner. `convert` computes, "
        "so it loads torch; the script ends the process as the command ends (its files synced, "
        "its output flushed) rather than let the interpreter unload torch first. Each tree is "
        "compiled to bytecode before it is timed, as an installed package is.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
