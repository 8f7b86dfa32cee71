"""Several inputs at 4 GB: Meta's eight rank files joined, and a LoRA adapter merged into its
base, each side by side with the script people run and with ``cp -r`` + fsync of the same bytes.

    python bench/bench_several.py [--repeat 3] [--workdir DIR] [--no-write]

- **Ranks**: a Llama-3-shaped model (dim 4096, 32 heads, 8 KV heads, intermediate 14336,
  vocab 32000, 8 layers; 4.0 GB in bf16) saved as Meta saves a model-parallel checkpoint,
  ``consolidated.00.pth`` ... ``consolidated.07.pth`` + ``params.json``. Three conversions:
  ``weightmap --preset llama-meta-ranks-to-hf`` (the join, the rotary permute, the renames),
  a mapping that only joins the ranks (``merge`` over the rank, Meta's names kept), and the
  converter's code (``write_model``: every rank loaded, each tensor concatenated and permuted,
  ``save_file``); against ``cp -r`` + fsync of the rank files.
- **LoRA**: a 4.0 GB bf16 Llama base (same shapes, Hugging Face names) and a PEFT adapter of
  rank 16 on q, k, v and o (bf16): ``weightmap --preset lora-merge`` against peft's
  ``merge_and_unload`` (transformers ``from_pretrained``, ``PeftModel.from_pretrained``,
  ``merge_and_unload``, ``save_pretrained``; needs ``pip install peft``) and ``cp -r`` + fsync
  of the base. The outputs are compared bit for bit.

Each run is a fresh process (``bench/_job.py``), interleaved, warm page cache, output deleted
and synced between runs; weightmap fsyncs its output, the scripts do not (their writeback
lands after their clock stops, in the sync between runs). Writes the section "Several
inputs" of docs/benchmarks.md (``--no-write``: print it only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from common import command_line, scratch
from jobs import Launcher, Runner, Samples
from sections import write_section

SECTION = "## Several inputs"
DIM, HEADS, KV, INTER, VOCAB, LAYERS, RANKS = 4096, 32, 8, 14336, 32000, 8, 8
JOIN = """weightmap 1
input ranks files "consolidated.{rank}.pth"
merge "ranks:{r:int}:layers.{n:int}.attention.{p:wq,wk,wv}.weight" dim 0
    -> "layers.{n}.attention.{p}.weight"
merge "ranks:{r:int}:layers.{n:int}.attention.wo.weight" dim 1 -> "layers.{n}.attention.wo.weight"
merge "ranks:{r:int}:layers.{n:int}.feed_forward.{p:w1,w3}.weight" dim 0
    -> "layers.{n}.feed_forward.{p}.weight"
merge "ranks:{r:int}:layers.{n:int}.feed_forward.w2.weight" dim 1
    -> "layers.{n}.feed_forward.w2.weight"
merge "ranks:{r:int}:{p:output,tok_embeddings}.weight" dim 0 -> "{p}.weight"
rename "ranks:0:layers.{n:int}.{p:attention_norm,ffn_norm}.weight" -> "layers.{n}.{p}.weight"
rename "ranks:0:norm.weight" -> "norm.weight"
drop "ranks:{r:int}:layers.{n:int}.{p:attention_norm,ffn_norm}.weight", "ranks:{r:int}:norm.weight"
"""


def _filler(shape: tuple[int, ...], block: Any) -> Any:
    """A bf16 tensor of ``shape`` filled from a repeated random block (every byte written, as
    real weights are, without the cost of a random number per element)."""
    n = 1
    for d in shape:
        n *= d
    reps = -(-n // block.numel())
    return block.repeat(reps)[:n].reshape(shape).clone()


def _shapes() -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Meta's tensors: full shape and the dim its ranks split (None: on every rank)."""
    out: dict[str, tuple[tuple[int, ...], int | None]] = {
        "tok_embeddings.weight": ((VOCAB, DIM), 0),
        "output.weight": ((VOCAB, DIM), 0),
        "norm.weight": ((DIM,), None),
    }
    head = DIM // HEADS
    for n in range(LAYERS):
        p = f"layers.{n}."
        out |= {
            p + "attention.wq.weight": ((DIM, DIM), 0),
            p + "attention.wk.weight": ((KV * head, DIM), 0),
            p + "attention.wv.weight": ((KV * head, DIM), 0),
            p + "attention.wo.weight": ((DIM, DIM), 1),
            p + "feed_forward.w1.weight": ((INTER, DIM), 0),
            p + "feed_forward.w2.weight": ((DIM, INTER), 1),
            p + "feed_forward.w3.weight": ((INTER, DIM), 0),
            p + "attention_norm.weight": ((DIM,), None),
            p + "ffn_norm.weight": ((DIM,), None),
        }
    return out


def write_ranks(folder: Path) -> int:
    """The Meta folder; returns its bytes."""
    import torch

    folder.mkdir(parents=True)
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)).bfloat16()
    shapes = _shapes()
    for rank in range(RANKS):
        sd: dict[str, Any] = {}
        for name, (shape, dim) in shapes.items():
            if dim is None:
                sd[name] = _filler(shape, block)
                continue
            part = list(shape)
            part[dim] //= RANKS
            sd[name] = _filler(tuple(part), block.roll(rank * 7919 + len(name)))
        torch.save(sd, folder / f"consolidated.{rank:02d}.pth")
        del sd
    params = {"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV,
              "vocab_size": VOCAB, "multiple_of": 1024, "ffn_dim_multiplier": 1.3,
              "norm_eps": 1e-5, "rope_theta": 500000.0}  # fmt: skip
    (folder / "params.json").write_text(json.dumps(params))
    return sum(f.stat().st_size for f in folder.iterdir())


def write_lora(base: Path, adapter: Path, r: int = 16) -> int:
    """A bf16 Llama base in Hugging Face's names and a rank-``r`` adapter on q, k, v, o."""
    import torch
    from safetensors.torch import save_file

    base.mkdir(parents=True)
    adapter.mkdir(parents=True)
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2)).bfloat16()
    head = DIM // HEADS
    sd: dict[str, Any] = {
        "model.embed_tokens.weight": _filler((VOCAB, DIM), block),
        "model.norm.weight": _filler((DIM,), block),
        "lm_head.weight": _filler((VOCAB, DIM), block.roll(3)),
    }
    lora: dict[str, Any] = {}
    shapes = {"q_proj": (DIM, DIM), "k_proj": (KV * head, DIM), "v_proj": (KV * head, DIM),
              "o_proj": (DIM, DIM)}  # fmt: skip
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        for name, shape in shapes.items():
            sd[p + f"self_attn.{name}.weight"] = _filler(shape, block.roll(n * 31 + len(name)))
            key = f"base_model.model.{p}self_attn.{name}"
            lora[key + ".lora_A.weight"] = _filler((r, shape[1]), block.roll(n + 5)) * 0.01
            lora[key + ".lora_B.weight"] = _filler((shape[0], r), block.roll(n + 9)) * 0.01
        sd[p + "mlp.gate_proj.weight"] = _filler((INTER, DIM), block.roll(n + 1))
        sd[p + "mlp.up_proj.weight"] = _filler((INTER, DIM), block.roll(n + 2))
        sd[p + "mlp.down_proj.weight"] = _filler((DIM, INTER), block.roll(n + 3))
        sd[p + "input_layernorm.weight"] = _filler((DIM,), block)
        sd[p + "post_attention_layernorm.weight"] = _filler((DIM,), block)
    save_file(sd, base / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM,
              "intermediate_size": INTER, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
              "tie_word_embeddings": False, "dtype": "bfloat16", "hidden_act": "silu"}  # fmt: skip
    (base / "config.json").write_text(json.dumps(config))
    save_file(lora, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    adapter_config = {"peft_type": "LORA", "r": r, "lora_alpha": 32, "lora_dropout": 0.0,
                      "target_modules": list(shapes), "fan_in_fan_out": False, "bias": "none",
                      "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM",
                      "base_model_name_or_path": str(base), "inference_mode": True}  # fmt: skip
    (adapter / "adapter_config.json").write_text(json.dumps(adapter_config))
    return (base / "model.safetensors").stat().st_size


def _same_tensors(a: Path, b: Path) -> None:
    """The two folders' weights are equal, bit for bit (names and bytes)."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    out[k] = st.get_tensor(k)
        return out

    x, y = tensors(a), tensors(b)
    if sorted(x) != sorted(y):
        raise ValueError(f"names differ: {sorted(set(x) ^ set(y))[:3]}")
    for k in x:
        same = x[k].reshape(-1).view(torch.uint8).equal(y[k].reshape(-1).view(torch.uint8))
        if x[k].dtype != y[k].dtype or not same:
            raise ValueError(f"{k} differs")


def _table(samples: dict[str, Samples], cp: str) -> list[str]:
    rows = ["| tool | wall (median) | / cp | peak RSS (median) |", "|---|---|---|---|"]
    base = samples[cp].median("seconds")
    for name, s in samples.items():
        if s.failures:
            rows.append(f"| {name} | failed: {s.failures[0]} | | |")
            continue
        sec = s.median("seconds")
        rows.append(
            f"| {name} | {sec:.2f} s | {sec / base:.2f}x | {s.median('rss_peak'):,.0f} MiB |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", type=Path, help="scratch folder (default: a temporary one)")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    p.add_argument("--skip-peft", action="store_true", help="without peft's column")
    args = p.parse_args()
    launcher = Launcher()  # (started before anything heavy: see bench/jobs.py)
    workdir = scratch("weightmap-several-", args.workdir)
    try:
        meta = workdir / "meta"
        t0 = time.perf_counter()
        nbytes = write_ranks(meta)
        join = workdir / "join.wm"
        join.write_text(JOIN)
        runner = Runner(workdir, launcher)
        out = str(runner.out)
        ranks_tools = {
            "weightmap `--preset llama-meta-ranks-to-hf`": [
                "weightmap", str(meta), out, "--preset", "llama-meta-ranks-to-hf",
                "--torch", "--set", 'version="3"',
            ],
            "weightmap, join only": [
                "weightmap", str(meta), out, "--mapping", str(join), "--torch",
            ],
            "write_model (every rank loaded)": ["naive-ranks", str(meta), out],
            "cp -r + fsync": ["cp", str(meta), out, "--fsync"],
        }  # fmt: skip
        reference = workdir / "reference"

        def check_ranks(name: str, folder: Path) -> None:
            if name.startswith("write_model"):
                if not reference.exists():
                    shutil.copytree(folder, reference)
            elif "preset" in name and reference.exists():
                _same_tensors(folder, reference)

        # write_model first, so that the preset's output is compared with it.
        order = ["write_model (every rank loaded)", *[n for n in ranks_tools if "write" not in n]]
        ranks = runner.compare(
            {n: (lambda a=ranks_tools[n]: a) for n in order},
            [meta],
            args.repeat,
            check=check_ranks,
        )
        shutil.rmtree(meta)
        shutil.rmtree(reference, ignore_errors=True)

        base, adapter = workdir / "base", workdir / "adapter"
        base_bytes = write_lora(base, adapter)
        lora_tools: dict[str, list[str]] = {
            "weightmap `--preset lora-merge`": [
                "weightmap", str(base), out, "--preset", "lora-merge", "--torch",
                "--input", f"adapter={adapter}",
            ],
        }  # fmt: skip
        if not args.skip_peft:
            lora_tools["peft `merge_and_unload` + `save_pretrained`"] = [
                "peft",
                str(base),
                str(adapter),
                out,
            ]
        lora_tools["cp -r + fsync (the base)"] = ["cp", str(base), out, "--fsync"]
        merged = workdir / "peft-merged"

        def check_lora(name: str, folder: Path) -> None:
            if name.startswith("peft"):
                if not merged.exists():
                    shutil.copytree(folder, merged)
            elif name.startswith("weightmap") and merged.exists():
                _same_tensors(folder, merged)

        lora_order = [n for n in lora_tools if n.startswith("peft")]
        lora_order += [n for n in lora_tools if not n.startswith("peft")]
        lora = runner.compare(
            {n: (lambda a=lora_tools[n]: a) for n in lora_order},
            [base, adapter],
            args.repeat,
            check=check_lora,
        )
        setup = time.perf_counter() - t0
    finally:
        launcher.close()
        shutil.rmtree(workdir, ignore_errors=True)
    lines = [
        f"{SECTION}: eight rank files joined, a LoRA merged (4 GB)",
        "",
        f"Meta's layout: a Llama-3-shaped model (dim {DIM}, {HEADS} heads, {KV} KV heads, "
        f"intermediate {INTER}, vocab {VOCAB}, {LAYERS} layers) in {RANKS} rank files, "
        f"{nbytes / 1e9:.2f} GB of PyTorch pickles. Medians of {args.repeat} runs, each a fresh "
        "process, interleaved, warm page cache; peak RSS is the process's `ru_maxrss` (`cp`: "
        "its VmHWM). The preset's output is checked equal, bit for bit, to write_model's. "
        f"`{command_line(Path(__file__).name, p, args)}` ({time.strftime('%Y-%m-%d')}, "
        f"{os.uname().machine}, {os.cpu_count()} cores; {setup / 60:.0f} min with setup).",
        "",
        *_table(ranks, "cp -r + fsync"),
        "",
        f"LoRA: a {base_bytes / 1e9:.2f} GB bf16 Llama base (same shapes, Hugging Face names) "
        "and a rank-16 bf16 adapter on q, k, v and o. The two merges' weights are checked "
        "equal, bit for bit.",
        "",
        *_table(lora, "cp -r + fsync (the base)"),
        "",
        "The scripts' writeback is not in their time (they do not fsync; the sync between runs "
        "takes it), weightmap's is. Every clock but cp's starts after `import torch` (about a "
        "second here), which the scripts and weightmap's computing plans all need. The "
        "join-only mapping moves bytes (a concatenation along dim 0 is a copy of each rank's "
        "range; along dim 1 it is computed row by row); the "
        "preset also permutes q and k, which is computed. A process that imports torch is at "
        "about 220 MiB of RSS before reading anything (a third of it torch's mapped "
        "libraries); weightmap's peak over that is the chunks in flight on its two writer "
        "threads, their input pages and their intermediates.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
