"""A deliberately naive speculators -> SGLang converter: rename-only, refusing nothing.

The forward test converts with the real ``eagle3-sglang`` preset; this stub shows what a
one-off script does, so the test can prove that the preset's refusals are necessary (a
norm_before_residual drafter converted this way loads and computes something else).
Tensors: ``layers.0.`` -> ``midlayer.``, ``verifier_*`` dropped, everything else kept.
Config: the flat Llama-style config of the facts sheet, section 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

# Layer-config fields rewritten below; the top-level speculators fields that are not copied
# explicitly (flags, speculators_config, auto_map, ...) are speculators-only and dropped.
_LAYER_FIELDS_DROPPED = ("architectures", "rope_parameters", "rope_theta", "rope_scaling")


def flat_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The flat ``LlamaForCausalLMEagle3`` config for a nested speculators config."""
    layer: dict[str, Any] = cfg["transformer_layer_config"]
    out: dict[str, Any] = {k: v for k, v in layer.items() if k not in _LAYER_FIELDS_DROPPED}
    out["architectures"] = ["LlamaForCausalLMEagle3"]
    out["model_type"] = "llama"
    if "rope_parameters" in layer:
        params = dict(layer["rope_parameters"])
        out["rope_theta"] = params.pop("rope_theta")
        scaling: dict[str, Any] | None = params
    else:
        out["rope_theta"] = layer.get("rope_theta", 10000.0)
        scaling = layer.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        out["rope_scaling"] = scaling
    out["head_dim"] = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
    out["draft_vocab_size"] = cfg["draft_vocab_size"]
    out["tie_word_embeddings"] = False
    if cfg.get("target_hidden_size") is not None:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    if cfg.get("dtype") is not None:
        out["dtype"] = cfg["dtype"]
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "use_aux_hidden_state": True,
        }
    return out


def convert_tensors(src: Path, dst: Path) -> None:
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
        if not k.startswith("verifier_")
    }
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})


def convert(src_dir: Path | str, dst_dir: Path | str) -> None:
    """Write the SGLang-layout checkpoint of the speculators one in ``src_dir``."""
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    convert_tensors(src, dst)
    text = json.dumps(flat_config(cfg), indent=2, sort_keys=True) + "\n"
    (dst / "config.json").write_text(text, encoding="utf-8")
