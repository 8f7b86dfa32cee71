"""The measurements: what runs at each size, the split and transpose cases, compile speed.

Each returns the raw samples (``SizeResult``, ``OpResult``); the report turns them into text.
The first output of each tool (``cp`` aside) is checked against the names, dtypes and shapes
of weightmap's own plan, so that a fast but wrong run cannot pass for a figure.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpoints import (
    CAST_TO_BF16,
    CAST_TO_F32,
    HIDDEN,
    PRESET,
    RENAME_FORWARD,
    SPLIT,
    SPLIT_NAME,
    TRANSPOSE,
    TRANSPOSE_NAME,
    Dims,
    Filler,
    dims_for,
    make_config,
    read_header,
    write_checkpoint,
)
from common import HERE, ROOT, log
from jobs import SOURCES, Runner, Samples

COMPILE_BENCH = HERE / "bench_compile.py"


@dataclass
class SizeResult:
    size_gb: float
    nbytes: int
    dims: Dims
    rename: dict[str, Samples]
    inplace: Samples
    to_f32: dict[str, Samples]
    to_bf16: dict[str, Samples]
    cold: dict[str, Samples] | None = None
    # The in-place runs of the --baseline commit, interleaved with this checkout's.
    inplace_before: Samples | None = None


def rename_source() -> tuple[str, list[str]]:
    """The out-of-place rename: the preset when it compiles here, else the explicit mapping."""
    import weightmap

    return ("preset", ["--preset", PRESET]) if PRESET in weightmap.presets() else ("mapping", [])


def expect_names(src: Path, mapping: str | None, preset: str | None) -> dict[str, Any]:
    import weightmap

    plan = (
        weightmap.compile(src, preset=preset) if preset else weightmap.compile(src, mapping=mapping)
    )
    return {s.name: (s.dtype, list(s.shape)) for s in plan.output_specs()}


def checker(expected: dict[str, Any]) -> Callable[[str, Path], None]:
    def check(tool: str, out: Path) -> None:
        if tool.startswith("cp"):
            return
        got = {k: (v["dtype"], v["shape"]) for k, v in read_header(out).items()}
        if got != expected:
            missing = sorted(set(expected) - set(got))[:3]
            extra = sorted(set(got) - set(expected))[:3]
            raise RuntimeError(
                f"{tool}: output differs from the plan (missing {missing}, extra {extra})"
            )

    return check


def measure_size(
    runner: Runner, size_gb: float, repeat: int, files: dict[str, Path], filler: Filler, cold: bool
) -> SizeResult:
    """Every per-size measurement, on a bf16 checkpoint of ``size_gb`` and then an f32 one."""
    dims = dims_for(size_gb)
    base = runner.workdir / f"size-{size_gb:g}"
    src = base / "bf16"
    log(f"{size_gb:g} GB: writing the bf16 checkpoint ({dims})")
    nbytes = write_checkpoint(src, dims.tensors("BF16"), make_config(dims), filler)
    kind, preset_args = rename_source()
    rename_args = preset_args or ["--mapping", str(files["forward"])]
    expected = expect_names(src, RENAME_FORWARD, PRESET if kind == "preset" else None)

    log(f"{size_gb:g} GB: rename, {repeat} runs each")
    rename_tools = _rename_tools(runner, src, rename_args)
    rename = runner.compare(rename_tools, [src], repeat, check=checker(expected))

    log(f"{size_gb:g} GB: in-place rename, {repeat} runs")
    inplace, inplace_before = _measure_inplace(runner, src, dims, files, repeat)

    cold_samples = None
    if cold:
        log(f"{size_gb:g} GB: rename from a cold page cache, 3 runs each")
        cold_samples = runner.compare(rename_tools, [src], 3, cold=True)

    log(f"{size_gb:g} GB: cast bf16 -> f32, {repeat} runs each")
    to_f32 = _measure_cast(runner, src, files["to_f32"], "to-f32", CAST_TO_F32, repeat)
    # Gone before the f32 checkpoint (twice its size) is written, to keep the scratch folder small.
    shutil.rmtree(src)

    src32 = base / "f32"
    log(f"{size_gb:g} GB: writing the f32 checkpoint")
    write_checkpoint(src32, dims.tensors("F32"), make_config(dims), filler)
    log(f"{size_gb:g} GB: cast f32 -> bf16, {repeat} runs each")
    to_bf16 = _measure_cast(runner, src32, files["to_bf16"], "to-bf16", CAST_TO_BF16, repeat)
    shutil.rmtree(base)
    return SizeResult(
        size_gb, nbytes, dims, rename, inplace, to_f32, to_bf16, cold_samples, inplace_before
    )


def _rename_tools(
    runner: Runner, src: Path, rename_args: list[str]
) -> dict[str, Callable[[], list[str]]]:
    """The out-of-place rename by each tool, ``cp`` (with and without fsync) as the floor."""
    out = str(runner.out)
    return {
        "weightmap": _fixed(["weightmap", str(src), out, *rename_args]),
        **_before(["weightmap", str(src), out, *rename_args]),
        "naive": _fixed(["naive", str(src), out, "rename"]),
        "cp": _fixed(["cp", str(src), out]),
        "cp+fsync": _fixed(["cp", str(src), out, "--fsync"]),
    }


def _before(args: list[str]) -> dict[str, Callable[[], list[str]]]:
    """The same weightmap job at the --baseline commit, when one was given."""
    return {"before": _fixed(args)} if "before" in SOURCES else {}


def _measure_inplace(
    runner: Runner, src: Path, dims: Dims, files: dict[str, Path], repeat: int
) -> tuple[Samples, Samples | None]:
    """Rename ``src`` in place and back, ``repeat`` times, leaving it as it was; with a
    --baseline, that commit's runs too, alternating with this checkout's."""
    inplace = Samples()
    before = Samples() if "before" in SOURCES else None
    runner.clean()
    job = ["inplace", str(src), "--mapping", str(files["forward"]), "--back", str(files["back"])]
    for i in range(repeat + 1):
        result = runner.job(job)
        if i:  # the first is an untimed warm-up
            inplace.runs.append(result)
        if before is not None:
            result = runner.job(job, tool="before")
            if i:
                before.runs.append(result)
    # The casts that follow read the same checkpoint, so it must have its names back.
    if set(read_header(src)) != set(dims.tensors("BF16")):
        raise RuntimeError("the in-place runs did not leave the checkpoint as it was")
    return inplace, before


def _measure_cast(
    runner: Runner, src: Path, mapping: Path, naive_op: str, mapping_text: str, repeat: int
) -> dict[str, Samples]:
    """One whole-checkpoint cast by weightmap (``mapping``) and by the naive script."""
    out = str(runner.out)
    # weightmap's job imports torch before the clock starts, as the naive script does.
    wm_args = ["weightmap", str(src), out, "--mapping", str(mapping), "--torch"]
    return runner.compare(
        {
            "weightmap": _fixed(wm_args),
            **_before(wm_args),
            "naive": _fixed(["naive", str(src), out, naive_op]),
        },
        [src],
        repeat,
        check=checker(expect_names(src, mapping_text, None)),
    )


@dataclass
class OpResult:
    name: str
    what: str
    nbytes: int
    samples: dict[str, Samples]


def measure_ops(
    runner: Runner, repeat: int, files: dict[str, Path], filler: Filler
) -> list[OpResult]:
    results = []
    out = str(runner.out)
    cases = [
        (
            "split",
            f"fused qkv BF16[{3 * HIDDEN}, {HIDDEN}] -> q, k, v along dim 0",
            {SPLIT_NAME: ("BF16", (3 * HIDDEN, HIDDEN))},
            SPLIT,
        ),
        (
            "transpose",
            f"fc BF16[{HIDDEN}, {3 * HIDDEN}] -> [{3 * HIDDEN}, {HIDDEN}]",
            {TRANSPOSE_NAME: ("BF16", (HIDDEN, 3 * HIDDEN))},
            TRANSPOSE,
        ),
    ]
    for name, what, tensors, mapping in cases:
        src = runner.workdir / f"op-{name}"
        nbytes = write_checkpoint(src, tensors, None, filler)
        log(f"{name}: {repeat} runs each")
        wm_args = ["weightmap", str(src), out, "--mapping", str(files[name])]
        wm_args += ["--torch"] if name == "transpose" else []
        naive_args = ["naive", str(src), out, name]
        samples = runner.compare(
            {"weightmap": _fixed(wm_args), "naive": _fixed(naive_args)},
            [src],
            repeat,
            check=checker(expect_names(src, mapping, None)),
        )
        shutil.rmtree(src)
        results.append(OpResult(name, what, nbytes, samples))
    return results


def _fixed(args: list[str]) -> Callable[[], list[str]]:
    return lambda: args


def compile_speed() -> str | None:
    """The output of bench/bench_compile.py, when it exists."""
    if not COMPILE_BENCH.exists():
        return None
    log("compile speed: bench/bench_compile.py")
    proc = subprocess.run(
        [sys.executable, str(COMPILE_BENCH)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=900,
    )
    text = proc.stdout.strip()
    if proc.returncode != 0:
        text += f"\n(exit status {proc.returncode})\n{proc.stderr.strip()[-2000:]}"
    return text
