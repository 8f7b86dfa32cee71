"""The eagle-sglang and eagle-vllm presets: an EAGLE-1 drafter as its authors publish it,
converted for each loader, checked against the names that loader expects, every refusal, and
the way back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap
from weightmap import MappingError
from weightmap.cli import main
from weightmap.language.mapping import load_preset

H, HEADS, KV, INTER, VOCAB = 64, 4, 2, 128, 256
HD = H // HEADS

# SafeAILab/EAGLE eagle/model/cnets1.py (the EAGLE-1/2 model): a Llama config with one decoder
# layer; its Model keeps fc (Linear(2H, H), bias=True by default), layers.N (layer 0 without
# input_layernorm) and embed_tokens, all unprefixed; no norm, no lm_head (the target's).
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": H,
    "intermediate_size": INTER,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": HEADS,
    "num_hidden_layers": 1,
    "num_key_value_heads": KV,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": VOCAB,
}


def layer(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.float16)

    tensors = {
        f"layers.{n}.self_attn.q_proj.weight": t(HEADS * HD, H),
        f"layers.{n}.self_attn.k_proj.weight": t(KV * HD, H),
        f"layers.{n}.self_attn.v_proj.weight": t(KV * HD, H),
        f"layers.{n}.self_attn.o_proj.weight": t(H, HEADS * HD),
        f"layers.{n}.mlp.gate_proj.weight": t(INTER, H),
        f"layers.{n}.mlp.up_proj.weight": t(INTER, H),
        f"layers.{n}.mlp.down_proj.weight": t(H, INTER),
        f"layers.{n}.post_attention_layernorm.weight": t(H),
    }
    if n > 0:
        tensors[f"layers.{n}.input_layernorm.weight"] = t(H)
    return tensors


def drafter(
    folder: Path,
    *,
    bias: bool = True,
    layers: int = 1,
    extra: dict[str, torch.Tensor] | None = None,
    drop: tuple[str, ...] = (),
    config: dict[str, Any] | None = None,
    unset: tuple[str, ...] = (),
) -> Path:
    """Writes a tiny EAGLE-1 drafter with the published names, random float16 values."""
    gen = torch.Generator().manual_seed(12)
    tensors = {
        "embed_tokens.weight": torch.randn(VOCAB, H, generator=gen).to(torch.float16),
        "fc.weight": torch.randn(H, 2 * H, generator=gen).to(torch.float16),
    }
    if bias:
        tensors["fc.bias"] = torch.randn(H, generator=gen).to(torch.float16)
    for n in range(layers):
        tensors.update(layer(n, gen))
    tensors.update(extra or {})
    for name in drop:
        del tensors[name]
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = {**CONFIG, "num_hidden_layers": layers, **(config or {})}
    for key in unset:
        del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# ---- what each loader expects, written down from its source ----------------------------------
# Both fuse q/k/v -> qkv_proj and gate/up -> gate_up_proj while loading.
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj"}
STACKED |= {".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def fused(name: str) -> str:
    for shard, param in STACKED.items():
        if shard in name:
            return name.replace(shard, param)
    return name


def layer_params(prefix: str, layers: int) -> set[str]:
    names = set()
    for n in range(layers):
        for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            names.add(f"{prefix}layers.{n}.{p}.weight")
        names.add(f"{prefix}layers.{n}.post_attention_layernorm.weight")
        if n > 0:  # layer 0's input_layernorm is deleted (identity) in both loaders
            names.add(f"{prefix}layers.{n}.input_layernorm.weight")
    return names


def sglang_params(layers: int) -> set[str]:
    """SGLang python/sglang/srt/models/llama_eagle.py, LlamaForCausalLMEagle: model.embed_tokens,
    model.layers.N, model.fc (nn.Linear(2H, H): weight and bias); lm_head is the target's."""
    base = {"model.embed_tokens.weight", "model.fc.weight", "model.fc.bias"}
    return base | layer_params("model.", layers)


def sglang_load(names: set[str]) -> set[str]:
    """Its load_weights: names containing lm_head are skipped, the others get "model."."""
    return {fused("model." + n) for n in names if "lm_head" not in n}


def vllm_params(layers: int) -> set[str]:
    """vLLM vllm/model_executor/models/llama_eagle.py, LlamaModel.named_parameters():
    embed_tokens, layers.N, fc (nn.Linear(2H, H, bias=False)); the HASS norms only with
    add_para_norm. EagleLlamaForCausalLM adds "model." and strips it again before these."""
    return {"embed_tokens.weight", "fc.weight"} | layer_params("", layers)


def vllm_load(names: set[str]) -> set[str]:
    """Its load_weights with pipeline parallelism off: embed_tokens skipped (the target's is
    shared), every name not in params_dict skipped without a word; returns what it loads."""
    return {fused(n) for n in names if "embed_tokens." not in n}


# ---- conversions -----------------------------------------------------------------------------


def test_sglang_layout_loads_every_parameter_bit_exact(tmp_path: Path) -> None:
    src = drafter(tmp_path / "in", layers=2)
    result = weightmap.remap(
        src, tmp_path / "out", preset="eagle-sglang", verify=True, progress=False
    )
    out = load_file(tmp_path / "out" / "model.safetensors")
    loaded = sglang_load(set(out))
    assert loaded == sglang_params(2)  # nothing missing, nothing SGLang would skip
    original = load_file(src / "model.safetensors")
    assert set(out) == set(original)
    for name, t in out.items():
        assert t.dtype == original[name].dtype and torch.equal(t, original[name])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {**CONFIG, "num_hidden_layers": 2, "architectures": ["LlamaForCausalLMEagle"]}
    assert result.plan.warnings == ()
    assert result.bytes_copied == result.bytes_written  # renames only: kernel copies


def test_vllm_layout_loads_every_parameter_bit_exact(tmp_path: Path) -> None:
    src = drafter(tmp_path / "in", bias=False)
    weightmap.remap(src, tmp_path / "out", preset="eagle-vllm", verify=True, progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert {fused(n) for n in out} <= vllm_params(1)  # vLLM would skip nothing
    assert vllm_load(set(out)) == vllm_params(1) - {"embed_tokens.weight"}
    original = load_file(src / "model.safetensors")
    assert set(out) == set(original)
    for name, t in out.items():
        assert t.dtype == original[name].dtype and torch.equal(t, original[name])
    # vLLM's EAGLEConfig names the class "Eagle" + architectures[0]: EagleLlamaForCausalLM.
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == CONFIG
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        src / "model.safetensors"
    ).read_bytes()


def test_vllm_hass_drafter_keeps_its_norms(tmp_path: Path) -> None:
    norms = {n: torch.ones(H, dtype=torch.float16) for n in HASS_NORMS}
    src = drafter(tmp_path / "in", bias=False, extra=norms, config={"add_para_norm": True})
    weightmap.remap(src, tmp_path / "out", preset="eagle-vllm", progress=False)
    out = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert {fused(n) for n in out} <= vllm_params(1) | set(HASS_NORMS)
    assert set(HASS_NORMS) <= out


HASS_NORMS = ("embedding_layernorm.weight", "hidden_states_layernorm.weight")


def test_vllm_round_trip_through_the_inverse(tmp_path: Path) -> None:
    src = drafter(tmp_path / "in", bias=False)
    mapping = load_preset("eagle-vllm")
    plan = weightmap.compile(src, preset="eagle-vllm")
    inverse = weightmap.invert(mapping, check=plan)  # names, dtypes, shapes and config back
    weightmap.remap(src, tmp_path / "out", preset="eagle-vllm", progress=False)
    weightmap.remap(tmp_path / "out", tmp_path / "back", mapping=inverse, progress=False)
    back = tmp_path / "back"
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((back / "config.json").read_text()) == CONFIG


def test_sglang_is_not_invertible_and_says_why() -> None:
    with pytest.raises(MappingError) as info:
        weightmap.invert(load_preset("eagle-sglang"))
    assert "cannot invert this config block: config edits other than `move`" in str(info.value)


def test_cli_converts_with_each_preset(tmp_path: Path) -> None:
    for preset, bias in (("eagle-sglang", True), ("eagle-vllm", False)):
        src = drafter(tmp_path / preset / "in", bias=bias)
        assert main(["convert", str(src), str(tmp_path / preset / "out"), "--preset", preset]) == 0


# ---- refusals --------------------------------------------------------------------------------

Edit = Callable[[Path], Path]

EAGLE3 = {"d2t": torch.zeros(4, dtype=torch.int64)}
NOT_LLAMA_TYPE = 'config.json has no model_type "llama": not a Llama-architecture EAGLE drafter'
NOT_EAGLE = (
    "no fc.weight or layers.0.self_attn.q_proj.weight: not an EAGLE drafter as its authors "
    "publish it (unprefixed fc.*, layers.N.*)"
)
NO_LAYER_COUNT = "config.json has no num_hidden_layers: not a complete Llama config"
LAYER0_NORM = {"layers.0.input_layernorm.weight": torch.ones(H, dtype=torch.float16)}

SGLANG_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    (
        "mistral",
        {"config": {"architectures": ["MistralForCausalLM"]}},
        'architectures is ["MistralForCausalLM"]: not a Llama-architecture EAGLE drafter '
        "(SGLang's LlamaForCausalLMEagle runs Llama layers only)",
    ),
    ("model_type", {"config": {"model_type": "qwen2"}}, NOT_LLAMA_TYPE),
    (
        "eagle3",
        {"extra": EAGLE3},
        "an EAGLE-3 drafter (d2t / midlayer.*): its SGLang layout is LlamaForCausalLMEagle3; see "
        "the eagle3-sglang and eagle3-speculators presets",
    ),
    ("no fc", {"drop": ("fc.weight",)}, NOT_EAGLE),
    ("no layer count", {"unset": ("num_hidden_layers",)}, NO_LAYER_COUNT),
    (
        "no fc.bias",
        {"bias": False},
        "no fc.bias: SGLang's EAGLE fc always has a bias and would run with an unloaded one; this "
        "drafter (trained with bias=False) loads in vLLM, see the eagle-vllm preset",
    ),
    (
        "layer 0 norm",
        {"extra": LAYER0_NORM},
        "layers.0.input_layernorm.weight: SGLang's EAGLE layer 0 has no input norm (EAGLE's has "
        "none) and would skip it; this drafter was trained with one",
    ),
    (
        "hass",
        {"config": {"add_para_norm": True}},
        "a HASS drafter (add_para_norm: embedding_layernorm / hidden_states_layernorm): SGLang's "
        "LlamaForCausalLMEagle has no such norms; vLLM runs it (eagle-vllm preset)",
    ),
    (
        "gelu",
        {"config": {"hidden_act": "gelu"}},
        'hidden_act is "gelu": SGLang\'s Llama layer computes silu',
    ),
]

VLLM_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    (
        "sglang name",
        {"bias": False, "config": {"architectures": ["LlamaForCausalLMEagle"]}},
        'architectures is ["LlamaForCausalLMEagle"]: vLLM loads a Llama-architecture EAGLE '
        'drafter named LlamaForCausalLM or EagleLlamaForCausalLM (it prefixes "Eagle" itself; '
        "SGLang's LlamaForCausalLMEagle would become an unknown EagleLlamaForCausalLMEagle)",
    ),
    ("model_type", {"bias": False, "config": {"model_type": "mistral"}}, NOT_LLAMA_TYPE),
    (
        "eagle3",
        {"bias": False, "extra": EAGLE3},
        "an EAGLE-3 drafter (d2t / midlayer.*): vLLM loads it with method eagle3; see the "
        "eagle3-sglang preset",
    ),
    ("no layer", {"bias": False, "drop": ("layers.0.self_attn.q_proj.weight",)}, NOT_EAGLE),
    ("no layer count", {"bias": False, "unset": ("num_hidden_layers",)}, NO_LAYER_COUNT),
    (
        "fc.bias",
        {},
        "fc.bias: vLLM's EAGLE fc has no bias and drops it silently, so the drafter would run "
        "without it. Serve it with SGLang (eagle-sglang preset); if the bias is all zeros, drop "
        'it first (a mapping: drop "fc.bias" and unmatched keep)',
    ),
    (
        "layer 0 norm",
        {"bias": False, "extra": LAYER0_NORM},
        "layers.0.input_layernorm.weight: vLLM's EAGLE layer 0 has no input norm (EAGLE's has "
        "none) and would skip it silently; this drafter was trained with one",
    ),
    (
        "hass flag without norms",
        {"bias": False, "config": {"add_para_norm": True}},
        "add_para_norm and the HASS norms (embedding_layernorm.weight, "
        "hidden_states_layernorm.weight) disagree: vLLM reads the norms only with add_para_norm: "
        "true, and needs both",
    ),
    (
        "lm_head",
        {"bias": False, "extra": {"lm_head.weight": torch.zeros(VOCAB, H, dtype=torch.float16)}},
        "lm_head.weight: vLLM's EAGLE-1 model shares the target's head and has no lm_head to load "
        "it into; remove it from the drafter if it equals the target's",
    ),
    (
        "gelu",
        {"bias": False, "config": {"hidden_act": "gelu"}},
        'hidden_act is "gelu": vLLM\'s Llama layer computes silu here',
    ),
]


def problems(preset: str, tmp_path: Path, **edit: Any) -> list[str]:
    src = drafter(tmp_path / "in", **edit)
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, preset=preset)
    return [p.message for p in info.value.problems]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("preset", "edit", "message"),
    [pytest.param("eagle-sglang", e, m, id=f"sglang-{i}") for i, e, m in SGLANG_REFUSALS]
    + [pytest.param("eagle-vllm", e, m, id=f"vllm-{i}") for i, e, m in VLLM_REFUSALS],
)
def test_refusal(preset: str, edit: dict[str, Any], message: str, tmp_path: Path) -> None:
    assert problems(preset, tmp_path, **edit) == [f"requirement failed: {message}"]


def test_refusal_on_the_cli_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = drafter(tmp_path / "in")  # fc.bias: refused for vLLM
    assert main(["convert", str(src), str(tmp_path / "out"), "--preset", "eagle-vllm"]) != 0
    err = capsys.readouterr().err
    assert "fc.bias: vLLM's EAGLE fc has no bias" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_unknown_tensor_is_refused_not_dropped(tmp_path: Path) -> None:
    # Both loaders would skip a name they do not know; the presets list it instead.
    for preset, bias in (("eagle-sglang", True), ("eagle-vllm", False)):
        extra = {"enorm.weight": torch.ones(H, dtype=torch.float16)}
        src = drafter(tmp_path / preset, bias=bias, extra=extra)
        with pytest.raises(MappingError) as info:
            weightmap.compile(src, preset=preset)
        assert "enorm.weight" in str(info.value)


def test_presets_for_the_drafter_names_the_one_that_applies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = drafter(tmp_path / "in")  # with fc.bias, as EAGLE's Model(bias=True) saves it
    assert main(["presets", "--for", str(src)]) == 0
    said = {
        line.split()[0]: line.split(maxsplit=1)[1] for line in capsys.readouterr().out.splitlines()
    }
    assert said["eagle-sglang"] == "applies"
    assert said["eagle-vllm"].startswith("no: fc.bias: vLLM's EAGLE fc has no bias")


def test_a_layer_beyond_num_hidden_layers_is_refused(tmp_path: Path) -> None:
    # The loaders build num_hidden_layers layers and would skip layers.1.* here.
    for preset, bias in (("eagle-sglang", True), ("eagle-vllm", False)):
        src = drafter(tmp_path / preset, bias=bias, layers=2, config={"num_hidden_layers": 1})
        with pytest.raises(MappingError) as info:
            weightmap.compile(src, preset=preset)
        assert "layers.1.self_attn.q_proj.weight" in str(info.value)
        assert "layers.0." not in str(info.value)
