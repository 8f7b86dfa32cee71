"""Tiny random EAGLE-3 draft checkpoints in the layout the ``speculators`` library saves.

``write_checkpoint(DraftSpec(...), directory)`` writes ``config.json`` (nested, as
``Eagle3DraftModel.save_pretrained`` writes it) and ``model.safetensors`` with the tensor
names, shapes and dtypes of the facts sheet (shared/domain/eagle3.md, section 1). Weights are
drawn from a seeded generator with fan-in scaling so that hidden states and logits are O(1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

RopeStyle = Literal["rope_parameters", "rope_theta"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class DraftSpec:
    """Everything that shapes a generated checkpoint.

    ``head_dim`` deliberately differs from ``hidden_size // num_attention_heads`` by default:
    SGLang falls back to that quotient when ``head_dim`` is missing, and a test should notice.
    ``draft_vocab_size == vocab_size`` means no vocabulary mapping (no ``d2t`` / ``t2d``).
    """

    seed: int = 0
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 24
    intermediate_size: int = 96
    vocab_size: int = 160
    draft_vocab_size: int = 48
    target_hidden_size: int | None = None
    aux_layer_ids: tuple[int, ...] = (2, 8, 13)
    num_target_layers: int = 16
    with_embed_tokens: bool = True
    dtype: torch.dtype = torch.float32
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    num_layers: int = 1
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_style: RopeStyle = "rope_parameters"
    rope_theta: float = 500000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    architecture: str = "Eagle3DraftModel"
    extra_tensors: tuple[str, ...] = field(default=())

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def aux_width(self) -> int:
        """Width of the concatenated aux hidden states, A * tH."""
        return self.num_aux * (self.target_hidden_size or self.hidden_size)

    @property
    def has_vocab_mapping(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


def make_tensors(spec: DraftSpec) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, keyed by their speculators names."""
    gen = torch.Generator().manual_seed(spec.seed)
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    nh, nkv = spec.num_attention_heads, spec.num_key_value_heads
    th = spec.target_hidden_size or h
    out: dict[str, torch.Tensor] = {}

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def norm(width: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(width, generator=gen)

    def bias(width: int) -> torch.Tensor:
        return 0.05 * torch.randn(width, generator=gen)

    if spec.has_vocab_mapping:
        if not 0 < spec.draft_vocab_size < spec.vocab_size:
            raise ValueError("draft_vocab_size must lie between 1 and vocab_size")
        hot = torch.randperm(spec.vocab_size, generator=gen)[: spec.draft_vocab_size]
        hot, _ = torch.sort(hot)
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[hot] = True
        out["d2t"] = hot - torch.arange(spec.draft_vocab_size)
        out["t2d"] = t2d
    if spec.with_embed_tokens:
        out["embed_tokens.weight"] = torch.randn(spec.vocab_size, h, generator=gen)
    if spec.norm_before_fc:
        out["input_norm.weight"] = norm(spec.aux_width)
    if spec.fc_norm:
        for j in range(spec.num_aux):
            out[f"fc_norm.{j}.weight"] = norm(th)
    out["fc.weight"] = linear(h, spec.aux_width)
    for n in range(spec.num_layers):
        p = f"layers.{n}."
        width = 2 * h if n == 0 else h
        out[p + "input_layernorm.weight"] = norm(h)
        if n == 0:
            out[p + "hidden_norm.weight"] = norm(h)
        out[p + "post_attention_layernorm.weight"] = norm(h)
        for proj, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            out[f"{p}self_attn.{proj}_proj.weight"] = linear(rows, width)
            if spec.attention_bias:
                out[f"{p}self_attn.{proj}_proj.bias"] = bias(rows)
        out[p + "self_attn.o_proj.weight"] = linear(h, nh * hd)
        if spec.attention_bias:
            out[p + "self_attn.o_proj.bias"] = bias(h)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = norm(hd)
            out[p + "self_attn.k_norm.weight"] = norm(hd)
        out[p + "mlp.gate_proj.weight"] = linear(inter, h)
        out[p + "mlp.up_proj.weight"] = linear(inter, h)
        out[p + "mlp.down_proj.weight"] = linear(h, inter)
        if spec.mlp_bias:
            for proj, rows in (("gate", inter), ("up", inter), ("down", h)):
                out[f"{p}mlp.{proj}_proj.bias"] = bias(rows)
    out["norm.weight"] = norm(h)
    out["lm_head.weight"] = linear(spec.draft_vocab_size, h)
    for name in spec.extra_tensors:
        out[name] = norm(h)
    return {
        k: v.to(spec.dtype).contiguous() if v.is_floating_point() else v for k, v in out.items()
    }


def make_config(spec: DraftSpec) -> dict[str, Any]:
    """config.json as speculators writes it: nested, no top-level ``model_type``."""
    layer: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if spec.qk_norm else "LlamaForCausalLM"],
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": spec.head_dim,
        "hidden_act": spec.hidden_act,
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 2048,
        "mlp_bias": spec.mlp_bias,
        "model_type": "qwen3" if spec.qk_norm else "llama",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    if not spec.qk_norm:
        layer["pretraining_tp"] = 1  # a LlamaConfig field
    if spec.rope_style == "rope_parameters":  # transformers 5
        params: dict[str, Any] = {"rope_theta": spec.rope_theta, "rope_type": "default"}
        if spec.rope_scaling is not None:
            params.update(spec.rope_scaling)
        layer["rope_parameters"] = params
    else:  # transformers 4
        layer["rope_theta"] = spec.rope_theta
        layer["rope_scaling"] = spec.rope_scaling
    dtype = _DTYPE_NAMES[spec.dtype]
    return {
        "architectures": [spec.architecture],
        "auto_map": {"": "eagle3.Eagle3DraftModel"},
        "draft_vocab_size": spec.draft_vocab_size,
        "dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "embed_requires_grad": False,
        "fc_norm": spec.fc_norm,
        "norm_before_fc": spec.norm_before_fc,
        "norm_before_residual": spec.norm_before_residual,
        "norm_output": spec.norm_output,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "architectures": ["LlamaForCausalLM"],
                "name_or_path": "example-org/tiny-llama-verifier",
            },
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": spec.target_hidden_size,
        "transformer_layer_config": layer,
    }


def write_checkpoint(spec: DraftSpec, directory: Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``spec`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(make_tensors(spec), str(directory / "model.safetensors"), metadata={"format": "pt"})
    text = json.dumps(make_config(spec), indent=2, sort_keys=True) + "\n"
    (directory / "config.json").write_text(text, encoding="utf-8")
    return directory
