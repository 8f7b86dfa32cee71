"""Tiny EAGLE-3 drafters in the SGLang / research layouts found in public repositories.

Each ``Layout`` writes ``config.json`` with the fields, and in the order, that its public
source writes (sizes shrunk, token ids small) and ``model.safetensors`` with the tensor names
that source saves. Weights come from ``checkpoints.make_tensors``, renamed ``layers.0.`` ->
``midlayer.``, so they share its fan-in scaling.

Sources (read in the public repositories; shared/domain/eagle3.md, "Drafter layouts in the
wild"):

- SafeAILab/EAGLE ``eagle/traineagle3/config.json``: the research trainer's config
  (``LlamaForCausalLM``; no rope_theta, head_dim, rope_scaling or eagle_config; float16).
- sgl-project/SpecForge ``configs/llama3-8B-eagle3.json``: the same fields with
  ``LlamaForCausalLMEagle3``.
- sgl-project/SpecForge ``configs/llama3-70B-ealge3.json``: head_dim, llama3 rope_scaling
  (factor 8, original 4096), rope_theta 5e5, float16; exported without embed_tokens.
- sgl-project/SpecForge ``configs/qwen3-30B-A3B-eagle3.1.json``: fc_norm and norm_output true,
  ``rope_scaling: null``, Qwen2-style sliding-window fields, bfloat16; ``fc_norm.{0,1,2}.weight``
  tensors (``specforge/modeling/draft/llama3_eagle.py``).
- sgl-project/SpecForge ``specforge/export/to_hf.py`` + ``checkpoint_io.py`` under
  transformers 5: ``rope_parameters`` and ``dtype``; ``apply_legacy_rope_scaling`` mirrors
  rope_theta / rope_scaling unless ``SPECFORGE_DISABLE_LEGACY_ROPE_SCALING=1``.
- NVIDIA Model-Optimizer ``modelopt/torch/export/plugins/hf_spec_export.py`` with the
  ``llama_eagle_template_config`` of ``hf_spec_configs.py``: an eagle_config with its own keys;
  tensors fc, norm, lm_head, d2t and the layer, no t2d, no embed_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.checkpoints import DraftSpec, make_tensors

# The drafter every layout starts from: GQA, a draft vocabulary smaller than the target's,
# three aux layers of a 16-layer verifier (speculators' ids 2, 8, 13 = SGLang's 1, 7, 12).
BASE = DraftSpec(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=160,
    draft_vocab_size=48,
    aux_layer_ids=(2, 8, 13),
    num_target_layers=16,
)
LLAMA3_SCALING = {  # SpecForge configs/llama3-70B-ealge3.json, keys in its order
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "llama3",
}


@dataclass(frozen=True)
class Layout:
    """One public drafter layout: how its config is written and which tensors it saves."""

    name: str
    source: str
    spec: DraftSpec
    make_config: Callable[[DraftSpec], dict[str, Any]]
    with_t2d: bool = True
    indent: int = 2
    # save_pretrained writes {"format": "pt"}; Model-Optimizer calls save_file without metadata.
    metadata: dict[str, str] | None = field(default_factory=lambda: {"format": "pt"})
    # What the source's own loader computes with (rope theta and scaling), for the forward.
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None

    @property
    def has_eagle_config(self) -> bool:
        return "eagle_config" in self.make_config(self.spec)

    @property
    def params(self) -> dict[str, Any]:
        """What eagle3-speculators needs beside the checkpoint for this layout."""
        out: dict[str, Any] = {"verifier": "example-org/verifier"}
        if not self.has_eagle_config:
            out["target_num_layers"] = self.spec.num_target_layers
        return out


def sglang_ids(spec: DraftSpec) -> list[int]:
    return [i - 1 for i in spec.aux_layer_ids]


def _dtype_name(spec: DraftSpec) -> str:
    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(spec.dtype, "float32")


def eagle_research(spec: DraftSpec, architecture: str = "LlamaForCausalLM") -> dict[str, Any]:
    """SafeAILab/EAGLE eagle/traineagle3/config.json (SpecForge llama3-8B-eagle3.json has the
    same fields with LlamaForCausalLMEagle3)."""
    return {
        "architectures": [architecture],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(spec),
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
    }


def specforge_70b(spec: DraftSpec) -> dict[str, Any]:
    """SpecForge configs/llama3-70B-ealge3.json."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": [2, 3, 4],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": dict(LLAMA3_SCALING),
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(spec),
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
    }


def specforge_eagle31(spec: DraftSpec) -> dict[str, Any]:
    """SpecForge configs/qwen3-30B-A3B-eagle3.1.json."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "fc_norm": True,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 2048,
        "max_window_layers": 48,
        "model_type": "llama",
        "norm_output": True,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(spec),
        "transformers_version": "4.53.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
    }


def specforge_tf5(spec: DraftSpec, *, legacy_mirror: bool) -> dict[str, Any]:
    """A SpecForge export under transformers 5: the 70B draft config as LlamaConfig writes it
    there (rope_parameters, dtype), with the eagle_config SpecForge adds; with
    ``legacy_mirror`` the rope_theta / rope_scaling copies of ``apply_legacy_rope_scaling``."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "draft_vocab_size": spec.draft_vocab_size,
        "dtype": _dtype_name(spec),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_ids(spec),
            "use_aux_hidden_state": True,
        },
        "eos_token_id": [2, 3, 4],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": spec.num_key_value_heads,
        "pad_token_id": 0,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0},
        "tie_word_embeddings": False,
        "transformers_version": "5.3.0",
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    if legacy_mirror:
        cfg["rope_scaling"] = dict(LLAMA3_SCALING)
        cfg["rope_theta"] = 500000.0
    return dict(sorted(cfg.items()))  # checkpoint_io.py dumps with sort_keys=True


def modelopt(spec: DraftSpec) -> dict[str, Any]:
    """Model-Optimizer's llama_eagle_template_config, filled as EagleExporter._export_config
    fills it (keys in the template's order, json.dump indent 4)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_hidden_layers": 1,
        "pad_token_id": None,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(spec),
        "transformers_version": "4.55.0",
        "use_cache": True,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "rope_scaling": dict(LLAMA3_SCALING),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": spec.head_dim,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 500000.0,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_ids(spec),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
            "next_layer_regular": True,
            "parallel_draft_step": 1,
            "parallel_draft_heads_num_layers": None,
        },
    }


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in [
        Layout(
            "eagle-research",
            "SafeAILab/EAGLE eagle/traineagle3/config.json",
            replace(BASE, seed=11, dtype=torch.float16),
            eagle_research,
        ),
        Layout(
            "specforge-llama3-8b",
            "sgl-project/SpecForge configs/llama3-8B-eagle3.json",
            replace(BASE, seed=12, dtype=torch.float16),
            lambda spec: eagle_research(spec, "LlamaForCausalLMEagle3"),
        ),
        Layout(
            "specforge-70b",
            "sgl-project/SpecForge configs/llama3-70B-ealge3.json",
            replace(BASE, seed=13, head_dim=24, dtype=torch.float16, with_embed_tokens=False),
            specforge_70b,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_SCALING,
        ),
        Layout(
            "specforge-eagle3.1",
            "sgl-project/SpecForge configs/qwen3-30B-A3B-eagle3.1.json",
            replace(BASE, seed=14, head_dim=24, dtype=torch.bfloat16, fc_norm=True),
            specforge_eagle31,
            rope_theta=1000000.0,
        ),
        Layout(
            "specforge-tf5",
            "sgl-project/SpecForge specforge/export/to_hf.py (transformers 5)",
            replace(BASE, seed=15, head_dim=24, dtype=torch.bfloat16),
            lambda spec: specforge_tf5(spec, legacy_mirror=True),
            rope_theta=500000.0,
            rope_scaling=LLAMA3_SCALING,
        ),
        Layout(
            "specforge-tf5-rope-parameters-only",
            "sgl-project/SpecForge to_hf.py, SPECFORGE_DISABLE_LEGACY_ROPE_SCALING=1",
            replace(BASE, seed=16, head_dim=24, dtype=torch.bfloat16),
            lambda spec: specforge_tf5(spec, legacy_mirror=False),
            rope_theta=500000.0,
            rope_scaling=LLAMA3_SCALING,
        ),
        Layout(
            "modelopt",
            "NVIDIA Model-Optimizer modelopt/torch/export/plugins/hf_spec_export.py",
            replace(BASE, seed=17, head_dim=24, dtype=torch.bfloat16, with_embed_tokens=False),
            modelopt,
            with_t2d=False,
            indent=4,
            metadata=None,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_SCALING,
        ),
    ]
}


def make_tensors_for(layout: Layout) -> dict[str, torch.Tensor]:
    """The layout's tensors: speculators' names with ``layers.0.`` -> ``midlayer.``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in make_tensors(layout.spec).items():
        if name == "t2d" and not layout.with_t2d:
            continue
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        out[name] = tensor
    return out


def write_layout(layout: Layout, directory: Path) -> Path:
    """Write the layout's ``config.json`` and ``model.safetensors`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(make_tensors_for(layout), str(directory / "model.safetensors"), layout.metadata)
    text = json.dumps(layout.make_config(layout.spec), indent=layout.indent)
    (directory / "config.json").write_text(text, encoding="utf-8")
    return directory
