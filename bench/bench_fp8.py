"""fp8 block dequantization of a ~4 GB checkpoint: weightmap's fp8-dequant preset against the
load-everything script people write from DeepSeek-V3's fp8_cast_bf16.py, side by side.

    python bench/bench_fp8.py                    # 4 GB, 3 runs each, into a scratch folder
    python bench/bench_fp8.py --gb 0.5 --repeat 1 --workdir /tmp/x --no-write

Each run is a fresh process; the clock covers the conversion only (imports before it), and
peak RSS is the child's own ``VmHWM`` (not ``ru_maxrss``, which a forked child inherits from
its parent: the checkpoint is also built in a process of its own, so this one stays small).
The checkpoint has DeepSeek-V3's layout at its real shapes: float8_e4m3fn expert weights
(2048 x 7168 and 7168 x 2048) with float32 ``weight_scale_inv`` per 128x128 block, one
``kv_a_proj_with_mqa`` (576 x 7168, partial blocks), bf16 norms. With ``--write`` (the
default) the figures replace the section "## fp8 dequantization" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import scratch
from sections import write_section

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "benchmarks.md"
SECTION = "## fp8 dequantization: a 4 GB DeepSeek-V3-shaped checkpoint"

# The naive script: everything loaded, each weight dequantized, everything saved.
NAIVE = """
import sys, time, torch
from safetensors.torch import load_file, save_file
t0 = time.perf_counter()
state = load_file(sys.argv[1] + "/model.safetensors")
out = {}
for name, w in state.items():
    if name.endswith("_scale_inv"):
        continue
    s = state.get(name + "_scale_inv")
    if s is None:
        out[name] = w
        continue
    m, n = w.shape
    scale = s.repeat_interleave(128, 0)[:m].repeat_interleave(128, 1)[:, :n]
    out[name] = (w.to(torch.float32) * scale).to(torch.bfloat16)
save_file(out, sys.argv[2] + "/model.safetensors")
print(time.perf_counter() - t0)
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) / 1024)
"""
WEIGHTMAP = """
import sys, time, weightmap
t0 = time.perf_counter()
weightmap.remap(sys.argv[1], sys.argv[2], preset="fp8-dequant", progress=False, overwrite=True)
print(time.perf_counter() - t0)
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) / 1024)
"""


def make_checkpoint(root: Path, gb: float) -> int:
    """A DeepSeek-V3-shaped fp8 checkpoint of about ``gb`` GB; returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    size, e = 0, 0
    target = gb * 1e9

    def add(name: str, m: int, n: int) -> None:
        nonlocal size
        w = (torch.randn(m, n, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(-(-m // 128), -(-n // 128), generator=gen) * 1e-3
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = w, s
        size += w.numel() + s.numel() * 4

    add("model.layers.0.self_attn.kv_a_proj_with_mqa", 576, 7168)
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(7168, dtype=torch.bfloat16)
    while size < target:
        prefix = f"model.layers.0.mlp.experts.{e}"
        add(f"{prefix}.gate_proj", 2048, 7168)
        add(f"{prefix}.down_proj", 7168, 2048)
        e += 1
    save_file(tensors, root / "model.safetensors")
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    }
    (root / "config.json").write_text(json.dumps(config))
    return (root / "model.safetensors").stat().st_size


def run(code: str, src: Path, dst: Path) -> tuple[float, float]:
    """Seconds (as the child timed them) and the child's peak RSS (VmHWM) in MiB."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    subprocess.run(["sync"], check=True)
    out = subprocess.run(
        [sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True, check=True
    ).stdout
    seconds, peak = out.strip().splitlines()[-2:]
    return float(seconds), float(peak)


def check(src: Path, a: Path, b: Path) -> None:
    """The two outputs hold the same tensors, bit for bit."""
    import torch
    from safetensors import safe_open

    with safe_open(b / "model.safetensors", "pt") as naive:
        names = set(naive.keys())
        from weightmap.inputs.checkpoint import Checkpoint

        with Checkpoint.open(a) as ours:
            assert set(ours.tensors) == names, set(ours.tensors) ^ names
            for name in names:
                assert torch.equal(ours.view(name), naive.get_tensor(name)), name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make is not None:
        print(make_checkpoint(args.make, args.gb))
        return
    work = scratch("wm-fp8-", args.workdir)
    try:
        src = work / "fp8"
        # In a process of its own: a child forked from a process that held the tensors would
        # start with its memory counted.
        made = subprocess.run(
            [sys.executable, __file__, "--make", str(src), "--gb", str(args.gb)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        size = int(made.stdout.strip())
        results: dict[str, list[tuple[float, float]]] = {"weightmap": [], "naive": []}
        for i in range(args.repeat):
            for tool, code in (("weightmap", WEIGHTMAP), ("naive", NAIVE))[:: 1 if i % 2 else -1]:
                results[tool].append(run(code, src, work / tool))
                print(f"{tool} run {i + 1}: {results[tool][-1]}", file=sys.stderr)
        check(src, work / "weightmap", work / "naive")
        text = render(size, results, args.repeat)
        print(text)
        if not args.no_write:
            write(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def render(size: int, results: dict[str, list[tuple[float, float]]], repeat: int) -> str:
    med = {k: (statistics.median(s for s, _ in v), statistics.median(r for _, r in v))
           for k, v in results.items()}  # fmt: skip
    w, n = med["weightmap"], med["naive"]
    rows = [
        "| tool | wall (median) | peak RSS (median) |",
        "|---|---|---|",
        f"| weightmap `--preset fp8-dequant` | {w[0]:.2f} s | {w[1]:,.0f} MiB |",
        f"| load-everything script | {n[0]:.2f} s | {n[1]:,.0f} MiB |",
        f"| naive / weightmap | {n[0] / w[0]:.2f}x | {n[1] / w[1]:.1f}x |",
    ]
    return "\n".join(
        [
            SECTION,
            "",
            f"A {size / 1e9:.2f} GB float8_e4m3fn checkpoint in DeepSeek-V3's layout at its real "
            "shapes (expert weights 2048 x 7168 and 7168 x 2048, one 576 x 7168 with partial "
            "blocks, float32 `weight_scale_inv` per 128x128 block) dequantized to bf16: "
            "weightmap's `fp8-dequant` preset against the script people write from "
            "DeepSeek-V3's `fp8_cast_bf16.py` (`load_file`, `float32(w) * scale` per weight, "
            "`save_file`). Each run is a fresh process; wall is the conversion alone, peak RSS "
            f"the process's own `VmHWM`; medians of {repeat} runs, interleaved. The two outputs "
            "are checked equal, bit for bit. `python bench/bench_fp8.py` "
            f"({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores).",
            "",
            *rows,
            "",
            "weightmap streams the weights in chunks of its budget (32 MiB over all threads) "
            "and releases the input pages each chunk read, so its peak stays at the chunk "
            "budget plus the interpreter and torch whatever the checkpoint's size; the script "
            "holds the fp8 input and the bf16 output (three times the input) at once.",
            "",
        ]
    )


def write(text: str) -> None:
    """Replace (or append) this section of docs/benchmarks.md only."""
    write_section(SECTION, text)


if __name__ == "__main__":
    main()
