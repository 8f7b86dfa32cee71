"""Generate the tiny EAGLE-3 draft checkpoint in speculators layout shipped in examples/.

The checkpoint has the names, shapes and config fields that speculators 0.9.0 writes for a
Llama draft layer (16 tensors, draft vocab 128 != target vocab 512, hidden size 64), filled
with deterministic random values so the output is identical on every run:

    python examples/make_eagle3_example.py            # rewrites examples/eagle3-speculators
    python examples/make_eagle3_example.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

HIDDEN = 64  # H (= target hidden size here)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
INTERMEDIATE = 128
TARGET_VOCAB, DRAFT_VOCAB = 512, 128
AUX_LAYER_IDS = [2, 4, 6]  # speculators' ids for a hypothetical 8-layer verifier
DTYPE = torch.bfloat16


def make_config() -> dict[str, Any]:
    """The nested config.json speculators writes for an EAGLE-3 Llama drafter."""
    return {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "eagle3.Eagle3DraftModel"},
        "draft_vocab_size": DRAFT_VOCAB,
        "dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS,
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
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
        "target_hidden_size": None,
        "transformer_layer_config": {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": HEAD_DIM,
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "initializer_range": 0.02,
            "intermediate_size": INTERMEDIATE,
            "max_position_embeddings": 2048,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": HEADS,
            "num_hidden_layers": 1,
            "num_key_value_heads": KV_HEADS,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": TARGET_VOCAB,
        },
    }


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The 16 tensors, deterministic for a given seed."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * scale).to(DTYPE)

    def norm(n: int) -> torch.Tensor:
        return torch.from_numpy(1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).to(DTYPE)

    # The draft vocabulary is a sorted subset of the target's; d2t holds the offsets.
    draft_to_target = np.sort(rng.choice(TARGET_VOCAB, DRAFT_VOCAB, replace=False))
    t2d = np.zeros(TARGET_VOCAB, dtype=bool)
    t2d[draft_to_target] = True
    d2t = draft_to_target - np.arange(DRAFT_VOCAB)
    layer = "layers.0."
    return {
        "d2t": torch.from_numpy(d2t.astype(np.int64)),
        "t2d": torch.from_numpy(t2d),
        "embed_tokens.weight": rand(TARGET_VOCAB, HIDDEN, scale=1.0),
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN),
        "norm.weight": norm(HIDDEN),
        layer + "input_layernorm.weight": norm(HIDDEN),
        layer + "hidden_norm.weight": norm(HIDDEN),
        layer + "post_attention_layernorm.weight": norm(HIDDEN),
        layer + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        layer + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        layer + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        layer + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        layer + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
        layer + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
        layer + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
    }


def write(out: Path) -> None:
    """Write config.json and model.safetensors into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(make_tensors(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(make_config(), indent=2) + "\n")


if __name__ == "__main__":
    target = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "eagle3-speculators"
    )
    write(target)
    print(f"wrote {target}")
