"""Regenerate docs/benchmarks.md: weightmap against the naive script and ``cp``.

    python bench/run.py                      # the full run (sizes 0.5, 1, 2, 4.3 GB)
    python bench/run.py --quick              # one small size, 3 runs, into /tmp
    python bench/run.py --sizes 1,2 --repeat 5 --workdir /scratch --out /tmp/b.md

Synthetic checkpoints with the tensor names of a speculators EAGLE-3 drafter and the shapes of
the Kimi-K2.5 drafter are built in a scratch folder (deleted afterwards). Every measured
operation runs in a fresh process (``bench/_job.py``), tools interleaved run by run; outputs are
deleted and dirty pages flushed (untimed) between runs, and inputs are read once before each
run so that every warm-cache figure starts from the same state.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB = HERE / "_job.py"
COMPILE_BENCH = HERE / "bench_compile.py"
EXAMPLE_CONFIG = ROOT / "examples" / "eagle3-speculators" / "config.json"
DEFAULT_OUT = ROOT / "docs" / "benchmarks.md"
PRESET = "eagle3-sglang"
GB = 10**9
MIB = 2**20

# The Kimi-K2.5 EAGLE-3 drafter: one Llama decoder layer at the verifier's hidden size.
HIDDEN = 7168
HEAD_DIM = 128
FULL = {"vocab": 163840, "draft_vocab": 32000, "heads": 64, "kv_heads": 8, "inter": 18432}
LAYER = "layers.0."
SPLIT_NAME = LAYER + "self_attn.qkv_proj.weight"
TRANSPOSE_NAME = "fc.weight"

RENAME_FORWARD = """weightmap 1
rename "layers.0.{rest*}" -> "midlayer.{rest}"
keep "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"
"""
RENAME_BACK = """weightmap 1
rename "midlayer.{rest*}" -> "layers.0.{rest}"
keep "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"
"""
CAST_TO_F32 = """weightmap 1
cast "{name*}" to F32 where dtype == "BF16"
keep "{name*}"
"""
CAST_TO_BF16 = """weightmap 1
cast "{name*}" to BF16 where dtype == "F32"
keep "{name*}"
"""
SPLIT = f"""weightmap 1
split "{SPLIT_NAME}" dim 0 sizes [{HIDDEN}, {HIDDEN}, {HIDDEN}] -> "{LAYER}self_attn.q_proj.weight", "{LAYER}self_attn.k_proj.weight", "{LAYER}self_attn.v_proj.weight"
"""  # noqa: E501
TRANSPOSE = f"""weightmap 1
transpose "{TRANSPOSE_NAME}"
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- synthetic checkpoints -----------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    vocab: int
    draft_vocab: int
    heads: int
    kv_heads: int
    inter: int

    def tensors(self, float_dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (safetensors dtype, shape), in the speculators EAGLE-3 layout."""
        h, f = HIDDEN, float_dtype
        q, kv = self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM
        return {
            "d2t": ("I64", (self.draft_vocab,)),
            "t2d": ("BOOL", (self.vocab,)),
            "embed_tokens.weight": (f, (self.vocab, h)),
            "fc.weight": (f, (h, 3 * h)),
            "lm_head.weight": (f, (self.draft_vocab, h)),
            "norm.weight": (f, (h,)),
            LAYER + "input_layernorm.weight": (f, (h,)),
            LAYER + "hidden_norm.weight": (f, (h,)),
            LAYER + "post_attention_layernorm.weight": (f, (h,)),
            # The attention input is [embeddings; hidden state], hence 2 * hidden.
            LAYER + "self_attn.q_proj.weight": (f, (q, 2 * h)),
            LAYER + "self_attn.k_proj.weight": (f, (kv, 2 * h)),
            LAYER + "self_attn.v_proj.weight": (f, (kv, 2 * h)),
            LAYER + "self_attn.o_proj.weight": (f, (h, q)),
            LAYER + "mlp.gate_proj.weight": (f, (self.inter, h)),
            LAYER + "mlp.up_proj.weight": (f, (self.inter, h)),
            LAYER + "mlp.down_proj.weight": (f, (h, self.inter)),
        }

    def nbytes(self, float_dtype: str = "BF16") -> int:
        return sum(_nbytes(d, s) for d, s in self.tensors(float_dtype).values())


_ITEMSIZE = {"BF16": 2, "F32": 4, "I64": 8, "BOOL": 1}


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return _ITEMSIZE[dtype] * math.prod(shape)


def dims_for(size_gb: float) -> Dims:
    """The full drafter at 4.3 GB; smaller sizes scale every row count but the hidden size.

    Scaling the vocabulary alone cannot go below the ~2 GB of the other tensors, so the draft
    vocabulary, heads and intermediate size shrink by the same factor, and the vocabulary
    absorbs the rounding so the checkpoint lands on the requested size.
    """
    full = Dims(**FULL)
    target = size_gb * GB
    if abs(target - full.nbytes()) < 0.05 * GB:
        return full
    fixed = _nbytes("BF16", (HIDDEN, 3 * HIDDEN))
    g = max(1e-3, (target - fixed) / (full.nbytes() - fixed))
    kv_heads = max(1, round(FULL["kv_heads"] * g))
    heads = max(kv_heads, round(FULL["heads"] * g / kv_heads) * kv_heads)
    rest = Dims(
        vocab=0,
        draft_vocab=max(64, round(FULL["draft_vocab"] * g / 64) * 64),
        heads=heads,
        kv_heads=kv_heads,
        inter=max(128, round(FULL["inter"] * g / 128) * 128),
    )
    per_row = 2 * HIDDEN + 1  # an embedding row plus its t2d entry
    vocab = max(64, round((target - rest.nbytes()) / per_row / 64) * 64)
    return Dims(vocab, rest.draft_vocab, rest.heads, rest.kv_heads, rest.inter)


def make_config(d: Dims) -> dict[str, Any]:
    """The example's speculators config.json with this drafter's sizes."""
    config: dict[str, Any] = json.loads(EXAMPLE_CONFIG.read_text())
    config["draft_vocab_size"] = d.draft_vocab
    layer = config["transformer_layer_config"]
    layer.update(
        head_dim=HEAD_DIM,
        hidden_size=HIDDEN,
        intermediate_size=d.inter,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        vocab_size=d.vocab,
    )
    return config


class Filler:
    """Plausible values fast: a 64 MiB block of normal floats, repeated."""

    def __init__(self, seed: int = 0) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        f32 = (rng.standard_normal(16 * MIB, dtype=np.float32) * 0.02).astype(np.float32)
        self.block = {
            "F32": f32.tobytes(),
            # bf16 is the top half of an f32, rounded to nearest even.
            "BF16": (
                ((f32.view(np.uint32) + 0x7FFF + ((f32.view(np.uint32) >> 16) & 1)) >> 16)
                .astype(np.uint16)
                .tobytes()
            ),
        }
        self.rng: np.random.Generator = rng

    def write(self, fd: int, dtype: str, shape: tuple[int, ...]) -> None:
        import numpy as np

        n = _nbytes(dtype, shape)
        if dtype == "I64":
            data = self.rng.integers(0, 4096, n // 8, dtype=np.int64).tobytes()
            os.write(fd, data)
            return
        if dtype == "BOOL":
            os.write(fd, (self.rng.random(n) < 0.2).astype(np.uint8).tobytes())
            return
        block = memoryview(self.block[dtype])
        start = int(self.rng.integers(0, 1024)) * 64
        while n:
            chunk = block[start : start + n]
            start = 0
            n -= os.write(fd, chunk)
            if n and len(chunk) == 0:
                raise RuntimeError("empty fill block")


def write_checkpoint(
    folder: Path,
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    config: dict[str, Any] | None,
    filler: Filler,
) -> int:
    """A one-file safetensors checkpoint (and config.json); returns the file's size."""
    folder.mkdir(parents=True)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for name, (dtype, shape) in tensors.items():
        end = position + _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, end]}
        position = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = folder / "model.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, struct.pack("<Q", len(text)) + text)
        for dtype, shape in tensors.values():
            filler.write(fd, dtype, shape)
        os.fsync(fd)
    finally:
        os.close(fd)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path.stat().st_size


def read_header(folder: Path) -> dict[str, Any]:
    """The tensor entries of every ``*.safetensors`` file in ``folder`` (shards merged)."""
    header: dict[str, Any] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header.update(json.loads(f.read(n)))
    header.pop("__metadata__", None)
    return header


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def warm(folder: Path) -> None:
    """Read every file once so the run starts with its input in the page cache."""
    buf = bytearray(64 * MIB)
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# -- running jobs ----------------------------------------------------------------------------


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
import json, subprocess, sys, time
for line in sys.stdin:
    argv = json.loads(line)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    print(json.dumps({"rc": p.returncode, "out": p.stdout, "err": p.stderr[-4000:],
                      "wall": wall}), flush=True)
"""


class JobFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Launcher:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, argv: Sequence[str]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(list(argv)) + "\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


class Runner:
    def __init__(self, workdir: Path, launcher: Launcher) -> None:
        self.workdir = workdir
        self.out = workdir / "out"
        self.launcher = launcher
        self.jobs = 0

    def job(self, args: Sequence[str], *, drop_caches: bool = False) -> dict[str, Any]:
        if drop_caches:
            drop_page_cache()
        reply = self.launcher.run([sys.executable, str(JOB), *args])
        if reply["rc"] != 0:
            rc = reply["rc"]
            what = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            tail = reply["err"].strip().splitlines()[-1:] or [""]
            raise JobFailed(f"{args[0]} {args[-1]}: {what}; {tail[0]}".strip("; "))
        result: dict[str, Any] = json.loads(reply["out"].strip().splitlines()[-1])
        result["process"] = reply["wall"]
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
    ) -> dict[str, Samples]:
        """Run every tool ``repeat`` times, interleaved and rotated, into ``self.out``."""
        inputs = list(inputs)
        samples = {name: Samples() for name in tools}
        names = list(tools)
        if not cold:
            # One untimed run of each tool first: the first process to touch a freshly
            # written input pays a one-off kernel cost (seconds of system time here).
            for name in names:
                self.clean()
                try:
                    self.job(tools[name]())
                except JobFailed as exc:
                    log(f"{name} (warm-up) failed: {exc.reason}")
        for rep in range(repeat):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                self.clean()
                if not cold:
                    for folder in inputs:
                        warm(folder)
                try:
                    result = self.job(tools[name](), drop_caches=cold)
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
                samples[name].runs.append(result)
        self.clean()
        return samples


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


# -- the measurements ------------------------------------------------------------------------


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
    dims = dims_for(size_gb)
    base = runner.workdir / f"size-{size_gb:g}"
    src = base / "bf16"
    log(f"{size_gb:g} GB: writing the bf16 checkpoint ({dims})")
    nbytes = write_checkpoint(src, dims.tensors("BF16"), make_config(dims), filler)
    out = str(runner.out)
    kind, preset_args = rename_source()
    rename_args = preset_args or ["--mapping", str(files["forward"])]
    expected = expect_names(src, RENAME_FORWARD, PRESET if kind == "preset" else None)

    log(f"{size_gb:g} GB: rename, {repeat} runs each")
    rename = runner.compare(
        {
            "weightmap": lambda: ["weightmap", str(src), out, *rename_args],
            "naive": lambda: ["naive", str(src), out, "rename"],
            "cp": lambda: ["cp", str(src), out],
            "cp+fsync": lambda: ["cp", str(src), out, "--fsync"],
        },
        [src],
        repeat,
        check=checker(expected),
    )

    log(f"{size_gb:g} GB: in-place rename, {repeat} runs")
    inplace = Samples()
    runner.clean()
    job = ["inplace", str(src), "--mapping", str(files["forward"]), "--back", str(files["back"])]
    for i in range(repeat + 1):
        result = runner.job(job)
        if i:  # the first is an untimed warm-up
            inplace.runs.append(result)
    if set(read_header(src)) != set(dims.tensors("BF16")):
        raise RuntimeError("the in-place runs did not leave the checkpoint as it was")

    cold_samples = None
    if cold:
        log(f"{size_gb:g} GB: rename from a cold page cache, 3 runs each")
        cold_samples = runner.compare(
            {
                "weightmap": lambda: ["weightmap", str(src), out, *rename_args],
                "naive": lambda: ["naive", str(src), out, "rename"],
                "cp": lambda: ["cp", str(src), out],
                "cp+fsync": lambda: ["cp", str(src), out, "--fsync"],
            },
            [src],
            3,
            cold=True,
        )

    log(f"{size_gb:g} GB: cast bf16 -> f32, {repeat} runs each")
    to_f32 = runner.compare(
        {
            "weightmap": lambda: [
                "weightmap",
                str(src),
                out,
                "--mapping",
                str(files["to_f32"]),
                "--torch",
            ],
            "naive": lambda: ["naive", str(src), out, "to-f32"],
        },
        [src],
        repeat,
        check=checker(expect_names(src, CAST_TO_F32, None)),
    )
    shutil.rmtree(src)

    src32 = base / "f32"
    log(f"{size_gb:g} GB: writing the f32 checkpoint")
    write_checkpoint(src32, dims.tensors("F32"), make_config(dims), filler)
    log(f"{size_gb:g} GB: cast f32 -> bf16, {repeat} runs each")
    to_bf16 = runner.compare(
        {
            "weightmap": lambda: [
                "weightmap",
                str(src32),
                out,
                "--mapping",
                str(files["to_bf16"]),
                "--torch",
            ],
            "naive": lambda: ["naive", str(src32), out, "to-bf16"],
        },
        [src32],
        repeat,
        check=checker(expect_names(src32, CAST_TO_BF16, None)),
    )
    shutil.rmtree(base)
    return SizeResult(size_gb, nbytes, dims, rename, inplace, to_f32, to_bf16, cold_samples)


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


# -- the report ------------------------------------------------------------------------------


def fmt_s(x: float) -> str:
    if math.isnan(x):
        return "—"
    return f"{x:.2f} s" if x >= 0.995 else f"{x:.3f} s"


def fmt_ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def fmt_mib(x: float) -> str:
    if math.isnan(x):
        return "—"
    return f"{x:,.0f} MiB" if x < 10240 else f"{x / 1024:.1f} GiB"


def ratio(a: float, b: float) -> str:
    return "—" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of y on x (per GB), or nan with fewer than two points."""
    if len(xs) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else math.nan


def machine(workdir: Path) -> list[str]:
    import numpy as np
    import safetensors
    import torch

    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    mem, swap = info["MemTotal"], info.get("SwapTotal", 0)
    df = subprocess.run(
        ["df", "-T", str(workdir)], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    fs = df[1].split()[1] if len(df) > 1 else "unknown"
    cp = subprocess.run(["cp", "--version"], capture_output=True, text=True, check=False)
    cp_version = cp.stdout.splitlines()[0].split()[-1] if cp.stdout else "unknown"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    ).stdout.strip()
    return [
        f"- {os.cpu_count()} CPU cores, {mem / 2**20:.1f} GiB RAM, "
        + (f"{swap / 2**20:.1f} GiB swap; " if swap else "no swap; ")
        + f"scratch files on {fs} (`df -T`); a shared virtual machine, so figures are medians; "
        f"vm.dirty_background_ratio {dirty_ratios()[0]}, vm.dirty_ratio {dirty_ratios()[1]}.",
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"safetensors {safetensors.__version__}, numpy {np.__version__}, cp {cp_version}; "
        f"Linux {platform.machine()}.",
        f"- weightmap at commit {commit or 'unknown'}"
        + (" (with uncommitted changes under src/)" if dirty else "")
        + "; writer threads: the default (one per core, at most 8); chunk budget: the default"
        " 64 MiB.",
    ]


@dataclass
class Floor:
    what: str
    met: bool
    figure: str
    cause: str = ""


def render(
    sizes: list[SizeResult],
    ops: list[OpResult],
    compile_text: str | None,
    command: str,
    seconds: float,
    repeat_note: str,
    rename_kind: str,
    cold_note: str,
    load: tuple[float, float],
    machine_lines: list[str],
) -> str:
    lines: list[str] = ["# Benchmarks", ""]
    lines += [
        "weightmap against the two ways people convert a checkpoint today: the naive script "
        "(`safetensors.torch.load_file`, change the dict, `save_file`) and, for renames, a plain "
        "`cp` of the same folder, which is as fast as a conversion that moves bytes can be. "
        "Generated by `bench/run.py`; do not edit by hand.",
        "",
        "```bash",
        command,
        "```",
        "",
        f"The run took {seconds / 60:.1f} minutes; the 1-minute load average was "
        f"{load[0]:.2f} when it started and {load[1]:.2f} when it ended (other work shares the "
        f"machine). {repeat_note}",
        "",
        "## Machine",
        "",
        *machine_lines,
        "",
        "## Method",
        "",
        "- Checkpoints are synthetic, with the tensor names of a speculators EAGLE-3 drafter "
        f"and, at the largest size, the shapes of the Kimi-K2.5 drafter: hidden size {HIDDEN}, "
        f"embed_tokens [{FULL['vocab']}, {HIDDEN}] and fc [{HIDDEN}, {3 * HIDDEN}] in bf16, "
        f"{FULL['heads']} attention heads and {FULL['kv_heads']} KV heads of {HEAD_DIM}, "
        f"intermediate size {FULL['inter']}, draft vocabulary {FULL['draft_vocab']} (these layer "
        "sizes are plausible choices, not read from the released model). The smaller sizes keep "
        "the hidden size and fc and scale every other row count (vocabulary, draft vocabulary, "
        "heads, intermediate size) by one factor: the vocabulary alone cannot shrink the model "
        "below the ~2 GB of the other tensors. One `model.safetensors` per checkpoint, filled "
        "with normal bf16 values (a repeated 64 MiB random block).",
        "- Every measured operation runs in a fresh Python process (`bench/_job.py`) that "
        "imports what it needs first and times only the operation; `cp` is timed as a child "
        "process from a fresh wrapper. The tools run interleaved, in a rotating order, run by "
        "run, after one untimed warm-up run of each. Between runs the output is deleted and "
        "`sync` flushes dirty pages (untimed).",
        f"- Warm page cache: the input is read once before every run. {cold_note}",
        "- weightmap fsyncs its output before moving it into place (atomic, durable). "
        "`cp` and the naive script do not; their data may still be in the page cache when the "
        "clock stops. The **cp + fsync** column is `cp` followed by an fsync of each copied file "
        "and the folder, the like-for-like reference for weightmap; **of which fsync** is the "
        "time weightmap spent in fsync.",
        "- Peak RSS is `ru_maxrss` of the job process. Linux carries a parent's peak into "
        "its children's `ru_maxrss`, so the jobs are started by a small launcher process "
        "(about 10 MiB) rather than by `bench/run.py`. For `cp` it is the child's own peak "
        "(VmHWM), sampled from /proc, as `RUSAGE_CHILDREN` would count the wrapper too. "
        "`ru_maxrss` counts the pages of a memory-mapped input that the process touched, which "
        "are page cache the kernel can reclaim; a sampling thread (every 5 ms) splits the peak "
        "into anonymous (private) and file-backed memory, shown as *(anon / file)*. A fresh "
        "process that imports torch is at about 220 MiB before doing anything; weightmap's "
        "rename path does not import torch.",
        "- weightmap builds the tables of its rule-language parser once and keeps them in a "
        "per-user cache (`~/.cache/weightmap`); "
        + (
            "`WEIGHTMAP_PARSER_CACHE=0` was set, so every run built them."
            if os.environ.get("WEIGHTMAP_PARSER_CACHE", "1") == "0"
            else "the warm-up runs fill it, so the figures are for a warm cache, as after a "
            "user's first conversion. **of which parser** is the time spent getting the parser "
            "(loading it, here)."
        ),
        "- The out-of-place rename uses "
        + (
            f"the `{PRESET}` preset (the nine `layers.0.` tensors renamed to `midlayer.`, "
            "config.json rewritten); the naive script renames the same tensors and copies "
            "config.json."
            if rename_kind == "preset"
            else "the rename mapping below (the `eagle3-sglang` preset was not in mappings/ at "
            "run time)."
        ),
    ]
    lines += [
        "",
        "The mappings (the in-place runs use the first and its reverse; the cast back to bf16 "
        "swaps the dtypes):",
        "",
    ]
    for text in (RENAME_FORWARD, CAST_TO_F32, SPLIT, TRANSPOSE):
        lines += ["```weightmap", text.strip(), "```", ""]

    # 1. rename
    lines += ["## 1. Rename only, into a new folder", ""]
    rows = []
    for r in sizes:
        s = r.rename
        wm, naive, cp, cpf = (
            s[k].median("seconds") for k in ("weightmap", "naive", "cp", "cp+fsync")
        )
        rows.append([
            f"{r.nbytes / GB:.2f} GB",
            fmt_s(wm),
            fmt_s(s["weightmap"].median("fsync")),
            fmt_s(s["weightmap"].median("parser")),
            fmt_s(naive),
            fmt_s(cp),
            fmt_s(cpf),
            ratio(wm, cp),
            ratio(wm, cpf),
            ratio(naive, wm),
        ])  # fmt: skip
    lines += table(
        ["size", "weightmap", "of which fsync", "of which parser", "naive", "cp",
         "cp + fsync", "weightmap / cp", "weightmap / (cp + fsync)", "naive / weightmap"],
        rows,
    )  # fmt: skip
    lines += ["", "Peak RSS (anon / file-backed, sampled):", ""]
    rows = []
    for r in sizes:
        s = r.rename
        rows.append([
            f"{r.nbytes / GB:.2f} GB",
            _rss(s["weightmap"]),
            _rss(s["naive"]),
            fmt_mib(s["cp"].median("rss_peak")),
        ])  # fmt: skip
    lines += table(["size", "weightmap", "naive", "cp"], rows)
    lines += [""]

    if any(r.cold for r in sizes):
        lines += ["### Cold page cache", ""]
        lines += [
            "The same rename after `sync; echo 3 > /proc/sys/vm/drop_caches` before each run "
            "(3 runs each): the input comes from the disk.",
            "",
        ]
        rows = []
        notes: list[str] = []
        for r in sizes:
            if not r.cold:
                continue
            c = r.cold
            shares = ", ".join(
                f"{tool} {c[tool].median('cpu') / c[tool].median('seconds'):.0%}"
                for tool in ("weightmap", "naive", "cp")
            )
            notes.append(
                f"At {r.nbytes / GB:.2f} GB, CPU time is {shares} of the wall time, almost all "
                "of it system time: reading into an emptied page cache and taking fresh pages "
                "for the input and the output is kernel work, and on this virtual machine a "
                "costly one (see every run)."
                + (
                    " cp + fsync coming out faster than cp, which it cannot really be, shows "
                    "how noisy three runs are here."
                    if c["cp+fsync"].median("seconds") < c["cp"].median("seconds")
                    else ""
                )
            )
            wm, naive, cp, cpf = (
                c[k].median("seconds") for k in ("weightmap", "naive", "cp", "cp+fsync")
            )
            rows.append([
                f"{r.nbytes / GB:.2f} GB", fmt_s(wm), fmt_s(naive), fmt_s(cp), fmt_s(cpf),
                ratio(wm, cp), ratio(wm, cpf), ratio(naive, wm), _rss(c["weightmap"]),
                _rss(c["naive"]),
            ])  # fmt: skip
        lines += table(
            ["size", "weightmap", "naive", "cp", "cp + fsync", "weightmap / cp",
             "weightmap / (cp + fsync)", "naive / weightmap", "weightmap RSS", "naive RSS"],
            rows,
        )  # fmt: skip
        lines += ["", *notes, ""]

    # 2. in place
    lines += ["## 2. Rename in place", ""]
    lines += [
        "`remap(..., inplace=True)`: the headers are rewritten where they are (journaled and "
        "fsynced); no data byte moves. Each run is a fresh process that renames `layers.0.*` to "
        "`midlayer.*` (**first call**, the figure a command-line user sees) and then back "
        "(**second call**, same process, the rule-language parser already in memory), so every "
        "call renames all 9 layer tensors.",
        "",
    ]
    rows = [
        [
            f"{r.nbytes / GB:.2f} GB",
            str(len(r.inplace.runs)),
            fmt_ms(r.inplace.median("seconds")),
            fmt_ms(r.inplace.median("parser")),
            fmt_ms(r.inplace.median("fsync")),
            fmt_ms(r.inplace.max("seconds")),
            fmt_ms(r.inplace.median("second")),
            fmt_ms(r.inplace.max("second")),
            fmt_mib(r.inplace.median("rss_peak")),
        ]
        for r in sizes
    ]
    lines += table(
        ["size", "runs", "first call", "of which parser", "of which fsync",
         "slowest first call", "second call", "slowest second call", "peak RSS"],
        rows,
    )  # fmt: skip
    lines += [""]

    # 3. casts
    lines += ["## 3. Casting the whole checkpoint", ""]
    lines += [
        "Every bf16 tensor to f32, and back from an f32 checkpoint of the same shapes (`d2t` "
        "and `t2d` are kept as they are). The naive script does `{k: v.to(dtype)}` between "
        "`load_file` and `save_file`. weightmap's job imports torch before the clock starts, as "
        "the naive one does.",
        "",
    ]
    rows = []
    for r in sizes:
        for label, s, in_gb in (
            ("bf16 -> f32", r.to_f32, r.nbytes),
            ("f32 -> bf16", r.to_bf16, None),
        ):
            wm, naive = s["weightmap"].median("seconds"), s["naive"].median("seconds")
            rows.append([
                f"{r.nbytes / GB:.2f} GB" if in_gb else "",
                label,
                fmt_s(wm),
                fmt_s(s["weightmap"].median("fsync")),
                fmt_s(s["weightmap"].median("parser")),
                fmt_s(naive),
                ratio(naive, wm),
                _rss(s["weightmap"]),
                _rss(s["naive"]),
            ])  # fmt: skip
    lines += table(
        ["size (bf16)", "cast", "weightmap", "of which fsync", "of which parser", "naive",
         "naive / weightmap",
         "weightmap peak RSS", "naive peak RSS"],
        rows,
    )  # fmt: skip
    lines += [""]

    # 4. split / transpose
    lines += ["## 4. Split and transpose", ""]
    lines += [
        "One-tensor checkpoints. The split along dim 0 is three byte ranges, copied in the "
        "kernel; the transpose is computed in chunks over the memory-mapped input. The naive "
        "script clones the three views (safetensors refuses tensors that share memory) or "
        "calls `.T.contiguous()`.",
        "",
    ]
    rows = []
    for o in ops:
        wm, naive = o.samples["weightmap"].median("seconds"), o.samples["naive"].median("seconds")
        rows.append([
            o.what, f"{o.nbytes / MIB:.0f} MiB", str(len(o.samples["weightmap"].runs)),
            fmt_s(wm), fmt_s(o.samples["weightmap"].median("fsync")),
            fmt_s(o.samples["weightmap"].median("parser")), fmt_s(naive),
            ratio(naive, wm), _rss(o.samples["weightmap"]), _rss(o.samples["naive"]),
        ])  # fmt: skip
    lines += table(
        ["operation", "size", "runs", "weightmap", "of which fsync", "of which parser",
         "naive",
         "naive / weightmap", "weightmap peak RSS", "naive peak RSS"],
        rows,
    )  # fmt: skip
    lines += [""]

    lines += ["## How time and memory grow with size", ""]
    lines += growth(sizes)
    lines += [""]

    lines += ["## Floors", ""]
    floors = evaluate_floors(sizes)
    lines += table(
        ["floor", "status", "measured", "cause"],
        [[f.what, "met" if f.met else "**not met**", f.figure, f.cause or ""] for f in floors],
    )
    lines += [""]

    failures = [
        f"- {label}: {tool} failed {len(samples.failures)} of "
        f"{len(samples.failures) + len(samples.runs)} runs ({samples.failures[0]})"
        for label, group in _groups(sizes, ops)
        for tool, samples in group.items()
        if samples.failures
    ]
    if failures:
        lines += ["## Failed runs", "", "Medians above are over the runs that finished.", ""]
        lines += [*failures, ""]

    lines += ["## Every run", ""]
    lines += [
        "Wall seconds of each run, in the order they ran, so the spread behind each median is "
        "visible. On this machine some runs take several times longer than the rest, with the "
        "extra time spent in the kernel: the same number of page faults and page allocations "
        "(read from /proc/vmstat around each run) costs 3 to 10 times more system time in "
        "some runs than in others, for every tool alike, which points at the virtual "
        "machine's host rather than at the tools.",
        "",
    ]
    rows = [
        [*label.split(": ", 1), tool, ", ".join(f"{x['seconds']:.3f}" for x in samples.runs)]
        for label, group in _groups(sizes, ops)
        for tool, samples in group.items()
    ]
    lines += table(["size", "measurement", "tool", "seconds, run by run"], rows)
    lines += [""]

    lines += ["## Compile speed", ""]
    if compile_text is None:
        lines += [
            "`bench/bench_compile.py` (compiling a plan for 100,000 tensors) was not present when "
            "this file was generated; `bench/run.py` runs it and puts its output here when it is.",
        ]
    else:
        lines += ["Output of `python bench/bench_compile.py`:", "", "```text", compile_text, "```"]
    lines += [""]
    return "\n".join(lines)


def _groups(sizes: list[SizeResult], ops: list[OpResult]) -> list[tuple[str, dict[str, Samples]]]:
    """Every measurement as ``("<size>: <what>", {tool: samples})``, in the order they ran."""
    out: list[tuple[str, dict[str, Samples]]] = []
    for r in sizes:
        size = f"{r.nbytes / GB:.2f} GB"
        out.append((f"{size}: rename", r.rename))
        out.append((f"{size}: in place (first call)", {"weightmap": r.inplace}))
        if r.cold:
            out.append((f"{size}: rename, cold cache", r.cold))
        out.append((f"{size}: bf16 -> f32", r.to_f32))
        out.append((f"{size}: f32 -> bf16", r.to_bf16))
    out += [(f"{o.nbytes / MIB:.0f} MiB: {o.name}", o.samples) for o in ops]
    return out


def _rss(s: Samples) -> str:
    peak = s.median("rss_peak")
    if not s.runs:
        return "—"
    if "anon_peak" not in s.runs[0]:
        return fmt_mib(peak)
    return f"{fmt_mib(peak)} ({fmt_mib(s.median('anon_peak'))} / {fmt_mib(s.median('file_peak'))})"


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


def _trend(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b):
        return "—"
    if b > a * 1.15:
        return f"rises from {a:.2f} to {b:.2f} s/GB"
    if b < a / 1.15:
        return f"falls from {a:.2f} to {b:.2f} s/GB"
    return f"stays at {a:.2f} to {b:.2f} s/GB"


def growth(sizes: list[SizeResult]) -> list[str]:
    if len(sizes) < 2:
        return ["Only one size was measured; run with several `--sizes` to see the trend."]
    first, last = sizes[0], sizes[-1]

    def rate(r: SizeResult, group: dict[str, Samples], tool: str) -> float:
        return group[tool].median("seconds") / (r.nbytes / GB)

    groups: list[tuple[str, str, tuple[str, ...]]] = [
        ("rename", "rename", ("weightmap", "naive", "cp", "cp+fsync")),
        ("bf16 -> f32", "to_f32", ("weightmap", "naive")),
        ("f32 -> bf16", "to_bf16", ("weightmap", "naive")),
    ]
    rows = [
        [label, tool, *(f"{rate(r, getattr(r, attr), tool):.2f}" for r in sizes)]
        for label, attr, tools in groups
        for tool in tools
    ]

    def spread(values: list[float]) -> str:
        lo, hi = fmt_mib(min(values)), fmt_mib(max(values))
        return lo if lo == hi else f"{lo} to {hi}"

    def per_gb(values: list[float]) -> float:
        return slope([r.nbytes / GB for r in sizes], values) / 1024

    wm = _trend(rate(first, first.rename, "weightmap"), rate(last, last.rename, "weightmap"))
    cp = _trend(rate(first, first.rename, "cp"), rate(last, last.rename, "cp"))
    naive = _trend(rate(first, first.rename, "naive"), rate(last, last.rename, "naive"))
    parser = statistics.median(r.rename["weightmap"].median("parser") for r in sizes)
    background, _ = dirty_ratios()
    ip = [r.inplace.median("seconds") * 1000 for r in sizes]
    throttled = rate(last, last.rename, "cp") > 1.3 * rate(first, first.rename, "cp")
    return [
        "Seconds per GB of the bf16 checkpoint (median time / size):",
        "",
        *table(["measurement", "tool", *(f"{r.nbytes / GB:.2f} GB" for r in sizes)], rows),
        "",
        f"From {first.nbytes / GB:.2f} to {last.nbytes / GB:.2f} GB, weightmap's rename {wm} "
        f"(fixed costs, {fmt_s(parser)} of it getting the parser, are spread over more bytes), "
        f"cp's {cp} and "
        f"the naive script's {naive}."
        + (
            " cp and the naive script do not sync, so their writes pile up in the page cache; "
            f"past the kernel's dirty threshold (vm.dirty_background_ratio {background}% of "
            "memory, about 2.3 GB of dirty pages here, where the dirty count was seen to "
            "level off during a 4.3 GB cp) the kernel writes back while they write and holds "
            "them to the disk's pace. weightmap hands each 64 MiB to the disk as soon as it is "
            "written, so it never builds that backlog."
            if throttled
            else ""
        )
        + f" In-place renames do not grow ({min(ip):.0f} to {max(ip):.0f} ms): they rewrite "
        "only the header.",
        "",
        "Memory is where the approaches part. weightmap's peak RSS does not grow with size: "
        f"{spread([r.rename['weightmap'].median('rss_peak') for r in sizes])} for renames (the "
        "bytes never enter the process), "
        f"{spread([r.to_f32['weightmap'].median('anon_peak') for r in sizes])} of anonymous "
        "memory for casts (torch itself, plus two chunk buffers per writer thread). The naive "
        "script's grows with the model: "
        f"{per_gb([r.rename['naive'].median('rss_peak') for r in sizes]):.2f} GiB of peak RSS "
        "per GB for the rename (the whole file, mapped and read), and "
        f"{per_gb([r.to_f32['naive'].median('anon_peak') for r in sizes]):.2f} GiB of "
        "anonymous memory per GB of bf16 for the cast to f32 (the f32 copy of every tensor). "
        "One caveat for casts: weightmap reads its input through a memory map, and the pages "
        "it has read stay mapped until the checkpoint is closed, so its `ru_maxrss` also grows "
        "with the input "
        f"({per_gb([r.to_f32['weightmap'].median('file_peak') for r in sizes]):.2f} GiB of "
        "file-backed pages per GB for bf16 -> f32). Those are page-cache pages, shared and "
        "reclaimable under memory pressure, not memory weightmap allocated.",
    ]


def evaluate_floors(sizes: list[SizeResult]) -> list[Floor]:
    import safetensors

    floors: list[Floor] = []

    def at(values: Iterable[float]) -> str:
        return ", ".join(
            f"{v:.2f}x at {r.nbytes / GB:.2f} GB" for v, r in zip(values, sizes, strict=True)
        )

    parser = statistics.median(r.rename["weightmap"].median("parser") for r in sizes)
    parser_torch = statistics.median(r.to_f32["weightmap"].median("parser") for r in sizes)
    q_cp = [_q(r.rename, "weightmap", "cp") for r in sizes]
    q_cpf = [_q(r.rename, "weightmap", "cp+fsync") for r in sizes]
    cause = ""
    if max(q_cp) > 1.2:
        small = sizes[0]
        cause = (
            "cp returns as soon as its copy sits in the page cache, while weightmap fsyncs the "
            f"output before moving it into place; and every weightmap run spends {fmt_s(parser)} "
            f"getting its rule-language parser (at {small.nbytes / GB:.2f} GB: weightmap "
            f"{fmt_s(_med(small.rename, 'weightmap'))}, cp {fmt_s(_med(small.rename, 'cp'))}, "
            f"cp + fsync {fmt_s(_med(small.rename, 'cp+fsync'))}). Against cp + fsync, the "
            f"like-for-like copy: {at(q_cpf)}."
        )
    floors.append(Floor("rename wall time within 1.2x of cp", max(q_cp) <= 1.2, at(q_cp), cause))

    q_naive = [_q(r.rename, "naive", "weightmap") for r in sizes]
    anon = max(r.rename["naive"].median("anon_peak") for r in sizes)
    cause = ""
    if min(q_naive) < 2:
        cause = (
            f"safetensors {safetensors.__version__} `load_file` maps the file instead of "
            "reading it (the naive script's anonymous memory stays at "
            f"{fmt_mib(anon)}, torch included; the rest of its RSS is the mapped file) and "
            "`save_file` writes from the mapped pages, so on a warm cache the naive rename is "
            "one memory copy, like cp, without an fsync; the 2x assumed a script that reads "
            "the model into memory first. It falls behind only once its unsynced writes pass "
            "the kernel's dirty threshold (see how time grows). Where the floor is missed, "
            f"weightmap's time is mostly the copy, plus {fmt_s(parser)} getting the parser."
        )
    floors.append(
        Floor("rename at least 2x faster than naive", min(q_naive) >= 2, at(q_naive), cause)
    )

    rss = max(r.rename["weightmap"].max("rss_peak") for r in sizes)
    floors.append(
        Floor(
            "weightmap rename peak RSS under 100 MiB at every size",
            rss < 100,
            f"largest peak {fmt_mib(rss)}",
        )
    )

    worst_ip = max(sizes, key=lambda r: r.inplace.median("seconds"))
    ip = worst_ip.inplace.median("seconds")
    second = max(r.inplace.median("second") for r in sizes)
    cause = ""
    if ip >= 0.05:
        cause = (
            f"Of the first call, {fmt_ms(worst_ip.inplace.median('parser'))} is getting the "
            "rule-language parser (building its LALR tables, or loading them from the per-user "
            f"cache) and {fmt_ms(worst_ip.inplace.median('fsync'))} is fsync; the rewrite "
            f"itself takes {fmt_ms(second)} (second call)."
        )
    floors.append(
        Floor(
            "in-place rename under 50 ms at every size",
            ip < 0.05,
            f"first call: largest median {fmt_ms(ip)}; second call: largest median "
            f"{fmt_ms(second)}",
            cause,
        )
    )

    casts = [
        (r, label, group)
        for r in sizes
        for label, group in (("bf16 -> f32", r.to_f32), ("f32 -> bf16", r.to_bf16))
    ]
    slower = [c for c in casts if _q(c[2], "naive", "weightmap") < 1]
    cause = ""
    if slower:
        fast_mode = all(
            g["weightmap"].min("seconds") < g["naive"].min("seconds") for *_, g in slower
        )
        no_parser = all(
            _med(g, "weightmap") - g["weightmap"].median("parser") < _med(g, "naive")
            for *_, g in slower
        )
        sys_times = [x["sys"] for *_, g in slower for x in g["weightmap"].runs if "sys" in x]
        cause = (
            "Slower than naive in "
            + "; ".join(
                f"{label} at {r.nbytes / GB:.2f} GB (medians: weightmap "
                f"{fmt_s(_med(g, 'weightmap'))}, of which {fmt_s(g['weightmap'].median('parser'))}"
                f" getting the parser, naive {fmt_s(_med(g, 'naive'))}; fastest runs: weightmap "
                f"{fmt_s(g['weightmap'].min('seconds'))}, naive {fmt_s(g['naive'].min('seconds'))})"
                for r, label, g in slower
            )
            + ". "
            + (
                "The fastest weightmap run beats the fastest naive one: the runs of both tools "
                "fall into a fast and a slow group on this machine (weightmap's spent "
                f"{min(sys_times):.2f} to {max(sys_times):.2f} s in system time for the same "
                "work), and the medians landed in different groups; see every run."
                if fast_mode and sys_times
                else "Without getting the parser weightmap would be ahead; it takes "
                f"{fmt_s(parser_torch)} in a process that has imported torch against "
                f"{fmt_s(parser)} in one that has not (the garbage collector walks torch's "
                "objects while the parser loads)."
                if no_parser
                else "weightmap is slower here even without getting its parser; see every run."
            )
        )
    floors.append(
        Floor(
            "casts at least as fast as naive",
            not slower,
            "naive / weightmap "
            + ", ".join(
                f"{_q(g, 'naive', 'weightmap'):.2f}x ({label}, {r.nbytes / GB:.2f} GB)"
                for r, label, g in casts
            ),
            cause,
        )
    )
    anon_peaks = [g["weightmap"].median("anon_peak") for _, _, g in casts]
    base = min(r.to_f32["weightmap"].median("rss_base") for r in sizes)
    floors.append(
        Floor(
            "casts in bounded memory",
            max(anon_peaks) - min(anon_peaks) < 64,
            f"anonymous peak {fmt_mib(min(anon_peaks))} to {fmt_mib(max(anon_peaks))} at every "
            f"size (a process with torch imported starts at {fmt_mib(base)} of RSS)",
            "Bounded in allocated memory; `ru_maxrss` also counts the input pages read through "
            "the memory map (see how memory grows).",
        )
    )
    return floors


def _med(s: dict[str, Samples], tool: str) -> float:
    return s[tool].median("seconds")


def _q(s: dict[str, Samples], a: str, b: str) -> float:
    return s[a].median("seconds") / s[b].median("seconds")


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
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

    sizes = [float(s) for s in (args.sizes or ("0.5" if args.quick else "0.5,1,2,4.3")).split(",")]
    if args.out is None:
        args.out = (
            Path(tempfile.gettempdir()) / "weightmap-benchmarks-quick.md"
            if args.quick
            else DEFAULT_OUT
        )

    def repeat_for(size: float) -> int:
        if args.repeat is not None:
            return int(args.repeat)
        return 3 if args.quick else 7 if size <= 1 else 5

    start = time.perf_counter()
    load_start = os.getloadavg()[0]
    launcher = Launcher()
    workdir = Path(tempfile.mkdtemp(prefix="weightmap-bench-", dir=args.workdir))
    log(f"scratch folder {workdir}")
    cold_ok = not args.quick and not args.no_cold and can_drop_caches()
    if args.quick or args.no_cold:
        cold_note = "No cold-cache runs in this report (`--quick` or `--no-cold`)."
    elif cold_ok:
        cold_note = (
            "One cold-cache table (largest size) drops the page cache before every run; "
            "everything else is warm."
        )
    else:
        cold_note = (
            "Dropping the page cache (`/proc/sys/vm/drop_caches`) is not permitted here, so "
            "every figure is warm-cache."
        )
    try:
        files = {
            "forward": RENAME_FORWARD,
            "back": RENAME_BACK,
            "to_f32": CAST_TO_F32,
            "to_bf16": CAST_TO_BF16,
            "split": SPLIT,
            "transpose": TRANSPOSE,
        }
        paths = {}
        for key, text in files.items():
            paths[key] = workdir / f"{key}.wm"
            paths[key].write_text(text)
        machine_lines = machine(workdir)
        runner = Runner(workdir, launcher)
        filler = Filler()
        results = [
            measure_size(
                runner, size, repeat_for(size), paths, filler, cold_ok and size == max(sizes)
            )
            for size in sizes
        ]
        ops = measure_ops(runner, 3 if args.quick else int(args.repeat or 7), paths, filler)
    finally:
        launcher.close()
        shutil.rmtree(workdir, ignore_errors=True)
    compile_text = compile_speed()
    seconds = time.perf_counter() - start
    command = "python bench/run.py" + (
        " " + shlex.join(argv if argv is not None else sys.argv[1:])
        if (argv or sys.argv[1:])
        else ""
    )
    repeats = sorted({repeat_for(s) for s in sizes})
    repeat_note = (
        f"Each figure is the median of {' or '.join(map(str, repeats))} runs per tool "
        "(7 up to 1 GB, 5 above, unless `--repeat` says otherwise)."
    )
    text = render(
        results,
        ops,
        compile_text,
        command,
        seconds,
        repeat_note,
        rename_source()[0],
        cold_note,
        (load_start, os.getloadavg()[0]),
        machine_lines,
    )
    args.out.write_text(text)
    raw = Path(tempfile.gettempdir()) / "weightmap-bench-raw.json"
    raw.write_text(
        json.dumps({"sizes": [asdict(r) for r in results], "ops": [asdict(o) for o in ops]})
    )
    log(f"raw samples in {raw}")
    log(f"wrote {args.out} in {seconds / 60:.1f} min ({runner.jobs} jobs)")


if __name__ == "__main__":
    main()
