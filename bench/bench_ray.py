"""The Ray executor against the local one: the same conversions on a local Ray cluster.

    python bench/bench_ray.py                    # 1 GB checkpoints, 5 runs, print the section
    python bench/bench_ray.py --write            # and record it in docs/benchmarks.md
    python bench/bench_ray.py --size 0.25 --repeat 3 --workdir /scratch

Three conversions of synthetic checkpoints built in a scratch folder (deleted afterwards),
written to the scratch disk and to memory (/dev/shm, which takes the executors' own work
apart from the disk's):
the ``eagle3-sglang`` rename of a bf16 drafter (kernel copies), the cast of the same drafter
to f32 (computed), and the ``fp8-dequant`` preset on an fp8 block-scaled checkpoint shaped
like DeepSeek-V3's experts (computed: f32(weight) * scale over 128x128 blocks, to bf16), in
sharded input and output. Each runs with the local executor (1 and 2 threads) and the Ray
executor on a local cluster of 2 CPUs started by this process (1 and 2 workers), in a rotating
order run by run, input read beforehand, output deleted and synced between runs. Every
configuration has one untimed first run: Ray's workers start and import torch there, which a
conversion pays once per worker. The section (``--write``) replaces only its own part of
docs/benchmarks.md; ``bench/run.py`` keeps it when it regenerates the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from checkpoints import PRESET, Filler, _write_file, dims_for, make_config, warm, write_checkpoint
from common import GB, MIB, ROOT, log, scratch
from sections import write_section

DOC = ROOT / "docs" / "benchmarks.md"
TITLE = "## Past one machine: the Ray executor"
CAST = 'weightmap 1\ncast "{name*}" to F32 where dtype == "BF16"\nkeep "{name*}"\n'
# DeepSeek-V3's routed experts: gate/up [2048, 7168] and down [7168, 2048] in fp8 e4m3 with
# f32 scales per 128x128 block; the norms in bf16.
HIDDEN, MOE_INTER, BLOCK = 7168, 2048, 128


def fp8_checkpoint(folder: Path, size_gb: float, shards: int = 4) -> int:
    """An fp8 block-scaled MoE checkpoint of about ``size_gb`` GB in ``shards`` files."""
    import numpy as np
    import torch

    per_expert = 3 * (HIDDEN * MOE_INTER + (HIDDEN // BLOCK) * (MOE_INTER // BLOCK) * 4)
    experts = max(shards, round(size_gb * GB / per_expert))
    rng = np.random.default_rng(0)
    values = torch.from_numpy(rng.standard_normal(32 * MIB, dtype=np.float32) * 20)
    filler = Filler()
    filler.block["F8_E4M3"] = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().tobytes()
    filler.block["F32"] = (rng.random(16 * MIB, dtype=np.float32) * 1e-3).tobytes()
    tensors: list[dict[str, tuple[str, tuple[int, ...]]]] = [{} for _ in range(shards)]
    for e in range(experts):
        layer, shard = e // 64, e * shards // experts
        p = f"model.layers.{layer}.mlp.experts.{e % 64}"
        for w, shape in (("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)),
                         ("down_proj", (HIDDEN, MOE_INTER))):  # fmt: skip
            tensors[shard][f"{p}.{w}.weight"] = ("F8_E4M3", shape)
            grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            tensors[shard][f"{p}.{w}.weight_scale_inv"] = ("F32", grid)
        if e % 64 == 0:
            tensors[shard][f"model.layers.{layer}.post_attention_layernorm.weight"] = (
                "BF16",
                (HIDDEN,),
            )
    folder.mkdir(parents=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    size = 0
    weight_map = {}
    for name, group in zip(names, tensors, strict=True):
        size += _write_file(folder / name, group, {"format": "pt"}, filler)
        weight_map.update(dict.fromkeys(group, name))
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return size


def start_cluster() -> None:
    """A local cluster of 2 CPUs whose workers import this checkout (checked)."""
    import ray

    t0 = time.perf_counter()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT / "src")}},
    )
    started = time.perf_counter() - t0

    @ray.remote
    def where() -> str:
        import weightmap

        return str(Path(weightmap.__file__).resolve().parent)

    found = ray.get(where.remote())
    if found != str(ROOT / "src" / "weightmap"):
        raise SystemExit(f"Ray workers import weightmap from {found}, not this checkout")
    log(f"local Ray cluster started in {started:.1f} s")


Results = dict[str, dict[str, Any]]  # configuration -> first, runs, median, bytes


def measure(
    src: Path, out: Path, convert: dict[str, Any], configs: dict[str, dict[str, Any]], repeat: int
) -> Results:
    """Each configuration's first run and the median of ``repeat`` more, interleaved."""
    import weightmap

    results: Results = {k: {"runs": []} for k in configs}

    def once(key: str) -> float:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        warm(src)
        t0 = time.perf_counter()
        result = weightmap.remap(src, out, progress=False, **convert, **configs[key])
        seconds = time.perf_counter() - t0
        results[key]["bytes"] = result.bytes_written
        return seconds

    for key in configs:
        results[key]["first"] = once(key)
    keys = list(configs)
    for run in range(repeat):
        for key in keys[run % len(keys) :] + keys[: run % len(keys)]:
            results[key]["runs"].append(once(key))
    shutil.rmtree(out, ignore_errors=True)
    for r in results.values():
        r["median"] = statistics.median(r["runs"])
    return results


CONFIGS = {
    "local, 1 thread": {"executor": "local", "workers": 1},
    "local, 2 threads": {"executor": "local", "workers": 2},
    "Ray, 1 worker": {"executor": "ray", "workers": 1},
    "Ray, 2 workers": {"executor": "ray", "workers": 2},
}


def section(rows: list[tuple[str, str, float, Results]], repeat: int, note: str) -> str:
    """The Markdown section: one table row per conversion, output place and configuration."""
    lines = [
        TITLE,
        "",
        "The same conversions with the local executor and with the Ray executor "
        '(`executor="ray"`, [scale.md](scale.md)) on a local Ray cluster of 2 CPUs started by '
        "the benchmark process: `python bench/bench_ray.py --write` (`bench/run.py` keeps this "
        "section as it is). Input read before each run (warm page cache). Output on the scratch "
        "disk (ext4, fsynced before the move as always), and in memory (tmpfs: no disk, so "
        "the figures are the executors' own work). Median of "
        f"{repeat} runs (slowest and fastest in brackets), configurations interleaved; "
        "**first run** is the untimed warm-up, where Ray's workers start and import torch. "
        "**per worker** is output bytes per second divided by the writer threads or Ray "
        "workers. A Ray worker computes on one core (Ray sets `OMP_NUM_THREADS=1`); the local "
        "executor's torch may use both cores inside one writer thread. "
        f"{note}",
        "",
        "| conversion | output on | configuration | first run | median | output GB/s "
        "| per worker | vs local, same count |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, place, size, results in rows:
        for key, r in results.items():
            count = int(key.split(", ")[1].split()[0])
            rate = r["bytes"] / r["median"] / GB
            twin = f"local, {count} thread" + ("s" if count > 1 else "")
            ratio = r["median"] / results[twin]["median"]
            spread = f"({min(r['runs']):.2f}-{max(r['runs']):.2f})"
            lines.append(
                f"| {label}, {size:.2f} GB -> {r['bytes'] / GB:.2f} GB | {place} | {key} | "
                f"{r['first']:.2f} s | {r['median']:.2f} s {spread} | {rate:.2f} | "
                f"{rate / count:.2f} | {ratio:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1.0, help="input size in GB (default 1)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per configuration")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch parent folder")
    ap.add_argument("--write", action="store_true", help="record it in docs/benchmarks.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    workdir = scratch("weightmap-bench-ray-", args.workdir)
    memory = Path(tempfile.mkdtemp(prefix="weightmap-bench-ray-", dir="/dev/shm"))
    rows: list[tuple[str, str, float, Results]] = []
    try:
        start_cluster()
        drafter = workdir / "drafter"
        d = dims_for(args.size)
        size = write_checkpoint(drafter, d.tensors("BF16"), make_config(d), Filler())
        fp8 = workdir / "fp8"
        fp8_size = fp8_checkpoint(fp8, args.size)
        (workdir / "cast.wm").write_text(CAST)
        jobs: list[tuple[str, Path, float, dict[str, Any]]] = [
            ("rename (eagle3-sglang)", drafter, size, {"preset": PRESET}),
            ("bf16 -> f32 cast", drafter, size, {"mapping": workdir / "cast.wm"}),
            (
                "fp8-dequant to bf16 (4 shards in, 500 MB out)",
                fp8,
                fp8_size,
                {"preset": "fp8-dequant", "max_shard_size": "500MB"},
            ),
        ]
        for place, out in (("disk", workdir / "out"), ("memory", memory / "out")):
            for label, src, nbytes, convert in jobs:
                log(f"{label}, output on {place}: {nbytes / GB:.2f} GB")
                results = measure(src, out, convert, CONFIGS, args.repeat)
                for key, r in results.items():
                    runs = " ".join(f"{x:.2f}" for x in r["runs"])
                    log(f"  {key}: first {r['first']:.2f} s, runs {runs}")
                rows.append((label, place, nbytes / GB, results))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    minutes = (time.perf_counter() - t0) / 60
    note = (
        f"The run took {minutes:.1f} minutes on {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average {load:.2f} at the start and "
        f"{os.getloadavg()[0]:.2f} at the end (a shared machine)."
    )
    text = section(rows, args.repeat, note)
    print(text)
    if args.write:
        write_section(TITLE, text)
        log(f"wrote {DOC}")


if __name__ == "__main__":
    main()
