"""Peak memory of converting a large ``pytorch_model.bin`` into safetensors.

    python bench/bench_pickle.py [--size-gb 4] [--repeat 3] [--workdir DIR]

Builds a Llama-shaped PyTorch checkpoint of about ``--size-gb`` GB (bf16, hidden size 4096,
intermediate size 11008, vocabulary 32000; ``torch.save``'s zip format) with a config.json and
a tokenizer.json, then converts it, each run in a fresh process:

- **weightmap, keep**: ``weightmap convert SRC DST --mapping KEEP`` (every tensor unchanged,
  renamed to safetensors: the byte ranges of the zip archive are copied in the kernel);
- **weightmap, cast to f32**: the same with a ``cast`` rule (every tensor computed, in chunks);
- **naive**: ``torch.load(weights_only=True)`` then safetensors' ``save_file``, the script
  people write;
- **naive, mmap**: the same with ``torch.load(..., mmap=True)``.

Peak RSS is ``ru_maxrss`` of the converting process alone (``os.wait4`` on it), and the
largest anonymous and file-backed resident sizes seen while it ran (``/proc/PID/status``,
sampled every 5 ms): pages of a memory-mapped input count in RSS but are page cache the
kernel can reclaim. Each figure is the median of ``--repeat`` runs, after a warm-up run.
Prints a Markdown table; the scratch folder is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import scratch

KEEP = "weightmap 1\nunmatched keep\n"
CAST = """weightmap 1
cast "**" to f32 where dtype == bf16
unmatched keep
config {
    torch_dtype = "float32"
}
"""
NAIVE = """
import sys, torch
from safetensors.torch import save_file
src, dst, mmap = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
state = torch.load(src, weights_only=True, mmap=mmap)
save_file({k: v.contiguous() for k, v in state.items()}, dst)
"""


def build(folder: Path, size_gb: float) -> int:
    """Write the checkpoint in a child process (it needs the whole state dict in memory)."""
    code = f"""
import json, torch
from pathlib import Path
folder = Path({str(folder)!r})
hidden, inter, vocab = 4096, 11008, 32000
block = torch.randn(32 * 2**20 // 2).to(torch.bfloat16)
def fill(*shape):
    t = torch.empty(*shape, dtype=torch.bfloat16)
    flat = t.view(-1)
    for i in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - i)
        flat[i : i + n] = block[:n]
    return t
state = {{"model.embed_tokens.weight": fill(vocab, hidden), "lm_head.weight": fill(vocab, hidden),
          "model.norm.weight": fill(hidden)}}
per_layer = (4 * hidden * hidden + 3 * hidden * inter) * 2
layers = max(1, round(({size_gb} * 1e9 - 2 * vocab * hidden * 2) / per_layer))
for n in range(layers):
    p = f"model.layers.{{n}}."
    for m in ("q", "k", "v", "o"):
        state[p + f"self_attn.{{m}}_proj.weight"] = fill(hidden, hidden)
    state[p + "mlp.gate_proj.weight"] = fill(inter, hidden)
    state[p + "mlp.up_proj.weight"] = fill(inter, hidden)
    state[p + "mlp.down_proj.weight"] = fill(hidden, inter)
    state[p + "input_layernorm.weight"] = fill(hidden)
    state[p + "post_attention_layernorm.weight"] = fill(hidden)
torch.save(state, folder / "pytorch_model.bin")
config = {{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "vocab_size": vocab,
           "torch_dtype": "bfloat16"}}
(folder / "config.json").write_text(json.dumps(config))
(folder / "tokenizer.json").write_text(json.dumps({{"version": "1.0", "model": {{}}}}))
"""
    folder.mkdir(parents=True)
    subprocess.run([sys.executable, "-c", code], check=True)
    return (folder / "pytorch_model.bin").stat().st_size


class Sampler:
    """Largest RssAnon / RssFile of one process, from /proc every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.anon, self.file = pid, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with open(f"/proc/{self.pid}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"RssAnon:"):
                            self.anon = max(self.anon, int(line.split()[1]))
                        elif line.startswith(b"RssFile:"):
                            self.file = max(self.file, int(line.split()[1]))
            except OSError:
                pass
            time.sleep(0.005)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def measure(cmd: list[str]) -> dict[str, float]:
    """Run ``cmd``; its wall time, peak RSS (MiB) and sampled anon / file peaks (MiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    sampler = Sampler(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    sampler.stop()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed with {proc.returncode}")
    return {
        "seconds": seconds,
        "rss": usage.ru_maxrss / 1024,
        "anon": sampler.anon / 1024,
        "file": sampler.file / 1024,
    }


def tools(src: Path, work: Path) -> dict[str, tuple[list[str], Path]]:
    (work / "keep.wm").write_text(KEEP)
    (work / "cast.wm").write_text(CAST)
    wm = [sys.executable, "-m", "weightmap", "convert", str(src)]
    bin_path = str(src / "pytorch_model.bin")
    return {
        "weightmap, keep": (
            [*wm, str(work / "out-keep"), "--mapping", str(work / "keep.wm"), "--quiet"],
            work / "out-keep",
        ),
        "weightmap, cast to f32": (
            [*wm, str(work / "out-cast"), "--mapping", str(work / "cast.wm"), "--quiet"],
            work / "out-cast",
        ),
        "naive": (
            [sys.executable, "-c", NAIVE, bin_path, str(work / "naive.safetensors"), "0"],
            work / "naive.safetensors",
        ),
        "naive, mmap": (
            [sys.executable, "-c", NAIVE, bin_path, str(work / "naive-mmap.safetensors"), "1"],
            work / "naive-mmap.safetensors",
        ),
    }


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = scratch("weightmap-bench-pickle-", args.workdir)
    try:
        src = work / "model"
        size = build(src, args.size_gb)
        runs: dict[str, list[dict[str, float]]] = {}
        jobs = tools(src, work)
        for i in range(args.repeat + 1):  # the first round warms up and is not counted
            for name, (cmd, out) in jobs.items():
                _remove(out)
                subprocess.run(["sync"], check=True)
                sample = measure(cmd)
                if i:
                    runs.setdefault(name, []).append(sample)
                print(f"{name}: {json.dumps(sample)}", file=sys.stderr)
        print(
            f"\n`pytorch_model.bin` of {size / 1e9:.2f} GB ({size / 2**30:.2f} GiB), "
            f"median of {args.repeat} runs:\n"
        )
        print("| tool | time | peak RSS | anon / file-backed (sampled) |")
        print("|---|---|---|---|")
        for name, samples in runs.items():
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            print(
                f"| {name} | {med['seconds']:.1f} s | {med['rss']:,.0f} MiB | "
                f"{med['anon']:,.0f} MiB / {med['file']:,.0f} MiB |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
