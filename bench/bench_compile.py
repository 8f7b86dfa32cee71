"""Compile speed: a plan for a 100,000-tensor MoE-like checkpoint must take under a second.

Run ``python bench/bench_compile.py`` (add ``--write`` to record the figure in
docs/benchmarks.md under "## Compile speed"; ``--against COMMIT`` to run that commit side by
side, in fresh processes taking turns). Only headers are involved: no tensor data.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sections import write_section
from weightmap.compiler.compile import compile_plan
from weightmap.format.dtypes import TensorSpec
from weightmap.language.mapping import load_mapping

LAYERS, EXPERTS = 64, 512
MAPPING = """weightmap 1
# A fused-expert MoE export: stack per-expert weights, split fused qkv, rename the rest.
stack "model.layers.{i:int}.mlp.experts.{e:int}.{w:gate_proj,up_proj,down_proj}.weight" over e
    -> "model.layers.{i}.mlp.experts.{w}"
split "model.layers.{i:int}.self_attn.qkv_proj.weight" dim 0
    sizes [config.num_attention_heads * config.head_dim,
           config.num_key_value_heads * config.head_dim,
           config.num_key_value_heads * config.head_dim]
    -> "layers.{i}.attn.q.weight", "layers.{i}.attn.k.weight", "layers.{i}.attn.v.weight"
rename "model.layers.{i:int}.{rest*}" -> "layers.{i}.{rest}"
cast "model.norm.weight" from bf16 to f32
keep "model.embed_tokens.weight", "lm_head.weight"
"""
RENAME_ALL = """weightmap 1
# Every tensor renamed: the worst case for per-output work (one output per input).
rename "model.layers.{i:int}.{rest*}" -> "layers.{i}.{rest}"
keep "**"
"""
CONFIG = {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"


def headers() -> list[TensorSpec]:
    """About 100,000 tensors: 64 layers x 512 experts x 3 projections, plus the rest."""
    out = [TensorSpec("model.embed_tokens.weight", "BF16", (151936, 4096))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out.append(TensorSpec(f"{p}.self_attn.qkv_proj.weight", "BF16", (6144, 4096)))
        out.append(TensorSpec(f"{p}.self_attn.o_proj.weight", "BF16", (4096, 4096)))
        out.append(TensorSpec(f"{p}.input_layernorm.weight", "BF16", (4096,)))
        out.append(TensorSpec(f"{p}.post_attention_layernorm.weight", "BF16", (4096,)))
        out.append(TensorSpec(f"{p}.mlp.gate.weight", "BF16", (EXPERTS, 4096)))
        for e in range(EXPERTS):
            for w, shape in (("gate_proj", (1536, 4096)), ("up_proj", (1536, 4096)),
                             ("down_proj", (4096, 1536))):  # fmt: skip
                out.append(TensorSpec(f"{p}.mlp.experts.{e}.{w}.weight", "BF16", shape))
    out += [
        TensorSpec("model.norm.weight", "BF16", (4096,)),
        TensorSpec("lm_head.weight", "BF16", (151936, 4096)),
    ]
    return out


def measure(text: str, specs: list[TensorSpec], repeat: int = 5) -> tuple[int, int, float]:
    """(inputs, outputs, best seconds) over ``repeat`` compiles."""
    mapping = load_mapping(text, name="bench.wm")
    best, n_out = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = compile_plan(mapping, specs, CONFIG)
        best = min(best, time.perf_counter() - t0)
        n_out = len(plan.outputs)
    return len(specs), n_out, best


def _commit() -> str:
    """This checkout's commit (with ``+changes`` where the tree differs from it)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+changes" if dirty else "")


ROWS = (("MoE (stack, split, rename)", MAPPING), ("rename every tensor", RENAME_ALL))
_FIGURE = re.compile(r"^(.*?): \d+ input tensors -> \d+ outputs in (\d+) ms", re.M)


def _run_in(src: Path) -> dict[str, int]:
    """One fresh process of this script (``--one``) importing weightmap from ``src``: each
    row's best-of-5 milliseconds."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one"],
        env=env, capture_output=True, text=True, check=False, timeout=900,
    ).stdout  # fmt: skip
    return {label: int(ms) for label, ms in _FIGURE.findall(out)}


def _against(commit: str, rounds: int) -> list[str]:
    """This checkout and ``commit`` side by side: ``rounds`` fresh processes each, taking
    turns (ABBA); each row's median (of the processes' best of 5) and the ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(base), commit], cwd=ROOT, check=True
        )
        try:
            runs: dict[str, list[list[int]]] = {label: [[], []] for label, _ in ROWS}
            sides = [(0, ROOT / "src"), (1, base / "src")]
            for r in range(rounds):
                # Who goes first alternates: the second of a pair may find the machine warmer.
                for side, src in sides if r % 2 == 0 else sides[::-1]:
                    for label, ms in _run_in(src).items():
                        runs[label][side].append(ms)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT)
    lines = []
    for label, (now, before) in runs.items():
        a, b = statistics.median(now), statistics.median(before)
        lines.append(
            f"{label}: {a:.0f} ms against {b:.0f} ms at {commit} ({a / b:.2f}x); medians of "
            f"{rounds} fresh processes each, taking turns (each the best of 5 compiles): "
            f"{now} against {before}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="record the figure in docs/benchmarks.md")
    ap.add_argument("--against", metavar="COMMIT", help="also run COMMIT, side by side")
    ap.add_argument("--rounds", type=int, default=5, help="processes per side with --against")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    specs = headers()
    lines, worst = [], 0.0
    for label, text in ROWS:
        n_in, n_out, secs = measure(text, specs)
        worst = max(worst, secs)
        lines.append(
            f"{label}: {n_in} input tensors -> {n_out} outputs in {secs * 1000:.0f} ms (best of 5)"
        )
        print(lines[-1], flush=True)
    if args.one:
        return
    if args.against:
        lines += _against(args.against, args.rounds)
        for line in lines[len(ROWS) :]:
            print(line)
    if args.write:
        write_section(
            "## Compile speed",
            "## Compile speed\n\n"
            "`python bench/bench_compile.py"
            + (f" --against {args.against}`" if args.against else "`")
            + ": compiling a plan for a MoE-like header set\n"
            f"({LAYERS} layers x {EXPERTS} experts x 3 projections, stacked per layer; fused qkv\n"
            "split; everything else renamed). Target: under 1 s.\n\n"
            + "".join(f"- {x}\n" for x in lines)
            + f"- target {'met' if worst < 1.0 else '**not met**'} by this process's slowest "
            f"row ({worst:.2f} s); the machine is shared, and its runs spread widely (the lists "
            "above)\n"
            + f"- weightmap at commit {_commit()}, {time.strftime('%Y-%m-%d')}; machine: "
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        )
    if worst >= 1.0:
        raise SystemExit(f"too slow: {worst:.2f} s (target < 1 s)")


if __name__ == "__main__":
    main()
