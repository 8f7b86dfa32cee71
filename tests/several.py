"""Builders and plain-torch references of the several-inputs conversions: Meta's Llama rank
files (transformers' ``convert_llama_weights_to_hf.py``, ``write_model``) and a PEFT LoRA
adapter merged into its base (peft's ``tuners/lora/layer.py``, ``get_delta_weight`` and
``merge``), each written from the cited code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

Tensors = dict[str, torch.Tensor]

DIM, LAYERS, HEADS, HEAD_DIM, VOCAB = 64, 2, 8, 8, 96


def meta_params(version: str) -> dict[str, Any]:
    """params.json of a tiny Llama 2 (no GQA, vocab -1 as Llama 2's) or Llama 3 (GQA)."""
    params: dict[str, Any] = {"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS, "norm_eps": 1e-5}
    if version == "2":
        params |= {"vocab_size": -1, "multiple_of": 32}
    else:
        params |= {"vocab_size": VOCAB, "n_kv_heads": 4, "multiple_of": 32}
        params |= {"ffn_dim_multiplier": 1.3, "rope_theta": 500000.0}
    return params


def intermediate(params: dict[str, Any]) -> int:
    """convert_llama_weights_to_hf.py's compute_intermediate_size."""
    m, f = params.get("multiple_of", 256), params.get("ffn_dim_multiplier") or 1
    return int(m * ((int(f * int(8 * params["dim"] / 3)) + m - 1) // m))


def meta_ranks(root: Path, version: str, ranks: int, seed: int = 0) -> tuple[Path, list[Tensors]]:
    """A Meta folder of ``ranks`` consolidated.NN.pth files + params.json: each rank holds its
    slice of every tensor, as Meta's model-parallel code saves them (the slices write_model
    concatenates back), and the norms on every rank."""
    params = meta_params(version)
    kv = params.get("n_kv_heads", HEADS)
    inter = intermediate(params)
    gen = torch.Generator().manual_seed(seed + ranks)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    per: list[Tensors] = [{} for _ in range(ranks)]

    def split(name: str, full: torch.Tensor, dim: int) -> None:
        for i, part in enumerate(full.chunk(ranks, dim=dim)):
            per[i][name] = part.clone()

    def same(name: str, full: torch.Tensor) -> None:
        for i in range(ranks):
            per[i][name] = full.clone()

    split("tok_embeddings.weight", r(VOCAB, DIM), 1 if version == "2" else 0)
    split("output.weight", r(VOCAB, DIM), 0)
    same("norm.weight", r(DIM))
    if version == "2":
        same("rope.freqs", r(HEAD_DIM // 2))
    for n in range(LAYERS):
        p = f"layers.{n}."
        split(p + "attention.wq.weight", r(DIM, DIM), 0)
        split(p + "attention.wk.weight", r(kv * HEAD_DIM, DIM), 0)
        split(p + "attention.wv.weight", r(kv * HEAD_DIM, DIM), 0)
        split(p + "attention.wo.weight", r(DIM, DIM), 1)
        split(p + "feed_forward.w1.weight", r(inter, DIM), 0)
        split(p + "feed_forward.w2.weight", r(DIM, inter), 1)
        split(p + "feed_forward.w3.weight", r(inter, DIM), 0)
        same(p + "attention_norm.weight", r(DIM))
        same(p + "ffn_norm.weight", r(DIM))
    folder = root / f"meta-{version}-{ranks}"
    folder.mkdir(parents=True)
    for i, sd in enumerate(per):
        torch.save(sd, folder / f"consolidated.{i:02d}.pth")
    (folder / "params.json").write_text(json.dumps(params))
    (folder / "tokenizer.model").write_bytes(b"tokenizer")
    return folder, per


def write_model(loaded: list[Tensors], params: dict[str, Any], version: str) -> Tensors:
    """write_model's state dict for ``num_shards = len(loaded)``, in plain torch from its
    code (the num_shards > 1 branch: cat per tensor, then the rotary permute)."""
    n_heads, dim = params["n_heads"], params["dim"]
    num_shards = len(loaded)
    n_heads_per_shard = n_heads // num_shards
    dims_per_head = dim // n_heads
    num_key_value_heads = params.get("n_kv_heads") or n_heads
    num_local_key_value_heads = num_key_value_heads // num_shards
    key_value_dim = dims_per_head * num_key_value_heads

    def permute(w: torch.Tensor, n_heads: int, dim1: int = dim, dim2: int = dim) -> torch.Tensor:
        return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    out: Tensors = {}
    for layer_i in range(params["n_layers"]):
        pre = f"model.layers.{layer_i}."
        out[pre + "input_layernorm.weight"] = loaded[0][
            f"layers.{layer_i}.attention_norm.weight"
        ].clone()
        out[pre + "post_attention_layernorm.weight"] = loaded[0][
            f"layers.{layer_i}.ffn_norm.weight"
        ].clone()
        out[pre + "self_attn.q_proj.weight"] = permute(
            torch.cat(
                [
                    loaded[i][f"layers.{layer_i}.attention.wq.weight"].view(
                        n_heads_per_shard, dims_per_head, dim
                    )
                    for i in range(num_shards)
                ],
                dim=0,
            ).reshape(dim, dim),
            n_heads=n_heads,
        )
        out[pre + "self_attn.k_proj.weight"] = permute(
            torch.cat(
                [
                    loaded[i][f"layers.{layer_i}.attention.wk.weight"].view(
                        num_local_key_value_heads, dims_per_head, dim
                    )
                    for i in range(num_shards)
                ],
                dim=0,
            ).reshape(key_value_dim, dim),
            num_key_value_heads,
            key_value_dim,
            dim,
        )
        out[pre + "self_attn.v_proj.weight"] = torch.cat(
            [
                loaded[i][f"layers.{layer_i}.attention.wv.weight"].view(
                    num_local_key_value_heads, dims_per_head, dim
                )
                for i in range(num_shards)
            ],
            dim=0,
        ).reshape(key_value_dim, dim)
        out[pre + "self_attn.o_proj.weight"] = torch.cat(
            [loaded[i][f"layers.{layer_i}.attention.wo.weight"] for i in range(num_shards)], dim=1
        )
        out[pre + "mlp.gate_proj.weight"] = torch.cat(
            [loaded[i][f"layers.{layer_i}.feed_forward.w1.weight"] for i in range(num_shards)],
            dim=0,
        )
        out[pre + "mlp.down_proj.weight"] = torch.cat(
            [loaded[i][f"layers.{layer_i}.feed_forward.w2.weight"] for i in range(num_shards)],
            dim=1,
        )
        out[pre + "mlp.up_proj.weight"] = torch.cat(
            [loaded[i][f"layers.{layer_i}.feed_forward.w3.weight"] for i in range(num_shards)],
            dim=0,
        )
    concat_dim = 0 if version != "2" else 1
    out["model.norm.weight"] = loaded[0]["norm.weight"]
    out["model.embed_tokens.weight"] = torch.cat(
        [loaded[i]["tok_embeddings.weight"] for i in range(num_shards)], dim=concat_dim
    )
    out["lm_head.weight"] = torch.cat(
        [loaded[i]["output.weight"] for i in range(num_shards)], dim=0
    )
    return out


# -- LoRA ----------------------------------------------------------------------------------------

TARGETS = {"self_attn.q_proj": (DIM, DIM), "self_attn.v_proj": (32, DIM), "mlp.up_proj": (96, DIM)}


def lora_pair(
    root: Path,
    *,
    base_dtype: torch.dtype,
    adapter_dtype: torch.dtype,
    r: int = 8,
    alpha: int = 16,
    extra: dict[str, Any] | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """A base model folder and a PEFT adapter folder for it (q, v and up projections of two
    layers adapted; the norms and embeddings not)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    base: Tensors = {"model.embed_tokens.weight": rand(VOCAB, DIM, dtype=base_dtype)}
    adapter: Tensors = {}
    fan_in_fan_out = bool((extra or {}).get("fan_in_fan_out"))
    for n in range(LAYERS):
        base[f"model.layers.{n}.input_layernorm.weight"] = rand(DIM, dtype=base_dtype)
        for module, (out_dim, in_dim) in TARGETS.items():
            shape = (in_dim, out_dim) if fan_in_fan_out else (out_dim, in_dim)
            base[f"model.layers.{n}.{module}.weight"] = rand(*shape, dtype=base_dtype)
            key = f"base_model.model.model.layers.{n}.{module}"
            adapter[f"{key}.lora_A.weight"] = rand(r, in_dim, dtype=adapter_dtype) * 0.1
            adapter[f"{key}.lora_B.weight"] = rand(out_dim, r, dtype=adapter_dtype) * 0.1
    base_dir, adapter_dir = root / "base", root / "adapter"
    base_dir.mkdir(parents=True)
    adapter_dir.mkdir(parents=True)
    save_file(base, base_dir / "model.safetensors")
    (base_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(adapter, adapter_dir / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": ["q_proj", "v_proj", "up_proj"],
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        **(extra or {}),
    }
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    return base_dir, adapter_dir


def peft_merge(
    base: Tensors, adapter: Tensors, config: dict[str, Any], *, autocast: bool = True
) -> Tensors:
    """merge_and_unload's weights on the CPU: get_delta_weight, then ``weight.data += delta``.

    ``autocast``: the adapter as ``PeftModel.from_pretrained`` loads it by default
    (``autocast_adapter_dtype=True``, ``_cast_adapter_dtype``): bfloat16 and float16 adapter
    weights become float32, so get_delta_weight's ``cast_to_fp32`` branch is not taken and
    the float32 delta is added to the weight with one rounding. Without it (the adapter kept
    in its dtype), the delta is computed in float32 and rounded to the adapter's dtype first.
    """
    import math

    r, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    out = {k: v.clone() for k, v in base.items()}
    for name in base:
        key = f"base_model.model.{name[: -len('.weight')]}"
        if f"{key}.lora_A.weight" not in adapter:
            continue
        weight_a, weight_b = adapter[f"{key}.lora_A.weight"], adapter[f"{key}.lora_B.weight"]
        if autocast and weight_b.dtype in (torch.float16, torch.bfloat16):
            weight_a, weight_b = weight_a.float(), weight_b.float()
        dtype = weight_b.dtype
        cast_to_fp32 = dtype in (torch.float16, torch.bfloat16)  # (device.type == "cpu")
        if cast_to_fp32:
            weight_a, weight_b = weight_a.float(), weight_b.float()
        delta = weight_b @ weight_a
        if config.get("fan_in_fan_out"):
            delta = delta.T
        delta = delta * scaling
        if cast_to_fp32:
            delta = delta.to(dtype=dtype)
        out[name] += delta
    return out
