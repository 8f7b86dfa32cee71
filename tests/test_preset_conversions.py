"""The conversion presets (cast, llama-meta-to-hf, llama-hf-to-meta, moe-fuse, moe-unfuse),
each against the converter it replaces, on tiny models made here.

- ``cast``: transformers' ``model.to(dtype)``, bit for bit; integer and boolean tensors kept.
- ``llama-meta-to-hf``: transformers' ``convert_llama_weights_to_hf.py`` (``write_model``,
  one rank), its weights rewritten below in plain torch from the script's code and its config
  built with ``LlamaConfig`` from the arguments the script passes; ``llama-hf-to-meta``
  gives the Meta folder back, bit for bit.
- ``moe-fuse`` / ``moe-unfuse``: transformers 5 itself, which fuses the experts when it loads
  (``conversion_mapping.py``) and unfuses them when it saves: the fused tensors are the
  loaded model's ``state_dict()``, the per-expert ones what ``save_pretrained`` writes.

Every output is checked with ``check_loads`` and loaded with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap

import hfmodel

Tensors = dict[str, torch.Tensor]


def _same(got: Tensors, expected: Tensors) -> None:
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def _loads_cleanly(folder: Path) -> Any:
    """check_loads finds nothing, and transformers loads the folder with nothing missing,
    unexpected or mismatched."""
    from transformers import AutoModelForCausalLM

    report = weightmap.check_loads(folder)
    assert report.ok, str(report)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


# -- cast ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("presets") / "llama"
    return folder, hfmodel.build(folder, "safetensors", tied=False)


@pytest.mark.parametrize(("target", "dtype"), [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_cast_is_model_to(
    llama: tuple[Path, torch.nn.Module], tmp_path: Path, target: str, dtype: torch.dtype
) -> None:
    folder, model = llama
    plan = weightmap.compile(folder, preset="cast", params={"target": target})
    assert plan.warnings == ()  # no stale-dtype warning: the config says the new dtype
    out = tmp_path / "out"
    weightmap.remap(folder, out, preset="cast", params={"target": target}, progress=False)
    reference = {k: v.to(dtype) for k, v in model.state_dict().items()}
    _same(load_file(out / "model.safetensors"), reference)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == str(dtype).removeprefix("torch.")
    loaded = _loads_cleanly(out)
    assert next(loaded.parameters()).dtype == dtype  # the config's dtype, no cast back


def test_cast_leaves_integers_and_booleans(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    tensors = {
        "w": torch.randn(4, 4),
        "h": torch.randn(4).to(torch.bfloat16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "ids": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "codes": torch.arange(4, dtype=torch.uint8),
    }
    save_file(tensors, src / "model.safetensors")
    # A transformers-4 config: torch_dtype is updated, no dtype field is added.
    (src / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    out = tmp_path / "out"
    weightmap.remap(src, out, preset="cast", params={"target": "f16"}, progress=False)
    got = load_file(out / "model.safetensors")
    floats = {k: tensors[k].to(torch.float16) for k in ("w", "h", "f8")}
    _same(got, {**tensors, **floats})
    assert json.loads((out / "config.json").read_text()) == {"torch_dtype": "float16"}
    # A checkpoint without config.json is cast all the same, and written without one.
    (src / "config.json").unlink()
    bare = tmp_path / "bare"
    weightmap.remap(src, bare, preset="cast", params={"target": "f16"}, progress=False)
    _same(load_file(bare / "model.safetensors"), {**tensors, **floats})
    assert not (bare / "config.json").exists()


def test_cast_refusals(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    folder, _ = llama
    with pytest.raises(weightmap.MappingError, match="cast to f32, f16, bf16 or f64"):
        weightmap.compile(folder, preset="cast", params={"target": "i8"})
    quantized = tmp_path / "q"
    quantized.mkdir()
    save_file({"w": torch.zeros(2)}, quantized / "model.safetensors")
    (quantized / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8"}})
    )
    with pytest.raises(weightmap.MappingError, match="dequantize it first"):
        weightmap.compile(quantized, preset="cast")


# -- Llama: Meta <-> Hugging Face ----------------------------------------------------------------

DIM, HEADS, LAYERS, VOCAB = 64, 4, 2, 40
HEAD_DIM = DIM // HEADS
# What each Llama version's params.json says, in miniature (the real 8B values in comments).
PARAMS: dict[str, dict[str, Any]] = {
    # Llama 2 7B: no n_kv_heads, vocab_size -1, multiple_of 256, rope.freqs in the checkpoint.
    "2": {"multiple_of": 32, "vocab_size": -1},
    # Llama 3 8B: GQA, ffn_dim_multiplier 1.3, multiple_of 1024, theta 5e5.
    "3": {"n_kv_heads": 2, "multiple_of": 32, "ffn_dim_multiplier": 1.3, "rope_theta": 500000.0},
    "3.1": {
        "n_kv_heads": 2,
        "multiple_of": 32,
        "ffn_dim_multiplier": 1.3,
        "rope_theta": 500000.0,
        "use_scaled_rope": True,
    },
    # Llama 3.2 1B: ffn_dim_multiplier 1.5, tied embeddings (output.weight equal to them).
    "3.2": {
        "n_kv_heads": 2,
        "multiple_of": 32,
        "ffn_dim_multiplier": 1.5,
        "rope_theta": 500000.0,
        "use_scaled_rope": True,
    },
}


def _intermediate(params: dict[str, Any]) -> int:
    # convert_llama_weights_to_hf.py, compute_intermediate_size.
    m, f = params.get("multiple_of", 256), params.get("ffn_dim_multiplier") or 1
    return int(m * ((int(f * int(8 * params["dim"] / 3)) + m - 1) // m))


def _meta_folder(root: Path, version: str) -> tuple[Path, Tensors, dict[str, Any]]:
    params = {"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS, "norm_eps": 1e-5}
    params.update({"vocab_size": VOCAB, **PARAMS[version]})
    kv = params.get("n_kv_heads", HEADS)
    inter = _intermediate(params)
    gen = torch.Generator().manual_seed(len(version))

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    sd = {"tok_embeddings.weight": r(VOCAB, DIM), "norm.weight": r(DIM)}
    sd["output.weight"] = sd["tok_embeddings.weight"].clone() if version == "3.2" else r(VOCAB, DIM)
    if version == "2":
        sd["rope.freqs"] = r(HEAD_DIM // 2)
    for n in range(LAYERS):
        p = f"layers.{n}."
        sd |= {
            p + "attention.wq.weight": r(DIM, DIM),
            p + "attention.wk.weight": r(kv * HEAD_DIM, DIM),
            p + "attention.wv.weight": r(kv * HEAD_DIM, DIM),
            p + "attention.wo.weight": r(DIM, DIM),
            p + "feed_forward.w1.weight": r(inter, DIM),
            p + "feed_forward.w2.weight": r(DIM, inter),
            p + "feed_forward.w3.weight": r(inter, DIM),
            p + "attention_norm.weight": r(DIM),
            p + "ffn_norm.weight": r(DIM),
        }
    folder = root / f"meta-{version}"
    folder.mkdir()
    torch.save(sd, folder / "consolidated.00.pth")
    (folder / "params.json").write_text(json.dumps(params))
    return folder, sd, params


def _write_model_weights(loaded: Tensors, params: dict[str, Any], version: str) -> Tensors:
    """write_model's state dict for one rank (num_shards == 1), in plain torch from its code."""
    n_heads, dim = params["n_heads"], params["dim"]
    dims_per_head = dim // n_heads
    num_key_value_heads = params.get("n_kv_heads") or n_heads
    key_value_dim = dims_per_head * num_key_value_heads

    def permute(w: torch.Tensor, n_heads: int, dim1: int = dim, dim2: int = dim) -> torch.Tensor:
        return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    out: Tensors = {}
    for i in range(params["n_layers"]):
        out |= {
            f"model.layers.{i}.self_attn.q_proj.weight": permute(
                loaded[f"layers.{i}.attention.wq.weight"], n_heads=n_heads
            ),
            f"model.layers.{i}.self_attn.k_proj.weight": permute(
                loaded[f"layers.{i}.attention.wk.weight"],
                n_heads=num_key_value_heads,
                dim1=key_value_dim,
            ),
            f"model.layers.{i}.self_attn.v_proj.weight": loaded[f"layers.{i}.attention.wv.weight"],
            f"model.layers.{i}.self_attn.o_proj.weight": loaded[f"layers.{i}.attention.wo.weight"],
            f"model.layers.{i}.mlp.gate_proj.weight": loaded[f"layers.{i}.feed_forward.w1.weight"],
            f"model.layers.{i}.mlp.down_proj.weight": loaded[f"layers.{i}.feed_forward.w2.weight"],
            f"model.layers.{i}.mlp.up_proj.weight": loaded[f"layers.{i}.feed_forward.w3.weight"],
            f"model.layers.{i}.input_layernorm.weight": loaded[f"layers.{i}.attention_norm.weight"],
            f"model.layers.{i}.post_attention_layernorm.weight": loaded[
                f"layers.{i}.ffn_norm.weight"
            ],
        }
    out["model.embed_tokens.weight"] = loaded["tok_embeddings.weight"]
    out["model.norm.weight"] = loaded["norm.weight"]
    if version != "3.2":  # tied in 3.2: save_pretrained writes no lm_head
        out["lm_head.weight"] = loaded["output.weight"]
    return out


def _write_model_config(params: dict[str, Any], version: str) -> Any:
    """The LlamaConfig write_model builds, from the arguments it passes."""
    from transformers import LlamaConfig

    base = params.get("rope_theta", 10000.0)
    context = {"3.2": 131072, "3.1": 131072, "3": 8192, "2": 4096}[version]
    rope_scaling = None
    if version in ["3.1", "3.2"]:
        rope_scaling = {
            "factor": 32.0 if version == "3.2" else 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        }
    llama3 = version != "2"
    return LlamaConfig(
        hidden_size=params["dim"],
        intermediate_size=_intermediate(params),
        num_attention_heads=params["n_heads"],
        num_hidden_layers=params["n_layers"],
        rms_norm_eps=params["norm_eps"],
        num_key_value_heads=params.get("n_kv_heads") or params["n_heads"],
        vocab_size=VOCAB,
        rope_theta=base,
        rope_scaling=rope_scaling,
        max_position_embeddings=context,
        bos_token_id=128000 if llama3 else 1,
        eos_token_id=128001 if llama3 else 2,
        tie_word_embeddings=version == "3.2",
    )


@pytest.mark.parametrize("version", ["2", "3", "3.1", "3.2"])
def test_llama_meta_to_hf_is_the_converter(tmp_path: Path, version: str) -> None:
    src, loaded, params = _meta_folder(tmp_path, version)
    out = tmp_path / "hf"
    settings: dict[str, Any] = {"version": version}
    if version == "2":
        settings["vocab_size"] = VOCAB  # params.json says -1, as Llama 2's does
    weightmap.remap(src, out, preset="llama-meta-to-hf", params=settings, progress=False)
    _same(load_file(out / "model.safetensors"), _write_model_weights(loaded, params, version))

    model = _loads_cleanly(out)
    ours, theirs = model.config, _write_model_config(params, version)
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "rope_parameters",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
    ):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.dtype == torch.bfloat16  # what the weights are: no cast on load

    # And back: the Meta folder again, bit for bit (rope.freqs, which transformers recomputes,
    # aside), params.json with the same fields.
    back = tmp_path / "meta-again"
    derived = {k: params[k] for k in ("multiple_of", "ffn_dim_multiplier") if k in params}
    weightmap.remap(out, back, preset="llama-hf-to-meta", params=derived, progress=False)
    again = load_file(back / "model.safetensors")
    _same(again, {k: v for k, v in loaded.items() if k != "rope.freqs"})
    written = json.loads((back / "params.json").read_text())
    assert written.pop("ffn_dim_multiplier") == params.get("ffn_dim_multiplier")
    expected = {k: v for k, v in params.items() if k != "ffn_dim_multiplier"}
    expected |= {"vocab_size": VOCAB, "n_kv_heads": params.get("n_kv_heads", HEADS)}
    # The rotary fields as Meta's file has them: none for Llama 2 (whose loader refuses
    # them), rope_theta for 3, and use_scaled_rope too for 3.1 and 3.2.
    assert written == expected


def test_llama_hf_to_meta_of_a_transformers_llama(
    llama: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    folder, model = llama
    meta = tmp_path / "meta"
    # The tiny Llama's intermediate_size (64 for hidden 32) in Meta's formula: multiple_of 16
    # gives int(8 * 32 / 3) = 85 -> 96 without a multiplier, so one is derived.
    weightmap.remap(folder, meta, preset="llama-hf-to-meta", params={"multiple_of": 16})
    params = json.loads((meta / "params.json").read_text())
    assert _intermediate(params) == 64
    sd = load_file(meta / "model.safetensors")
    # The inverse permute (torchtitan's Llama adapter): Meta's q rows are pairs per head.
    heads, kv, dim = 4, 2, 32
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    k = model.state_dict()["model.layers.0.self_attn.k_proj.weight"]
    inv_q = q.view(heads, 2, dim // heads // 2, dim).transpose(1, 2).reshape(dim, dim)
    inv_k = k.view(kv, 2, k.shape[0] // kv // 2, dim).transpose(1, 2).reshape(k.shape[0], dim)
    assert torch.equal(sd["layers.0.attention.wq.weight"], inv_q)
    assert torch.equal(sd["layers.0.attention.wk.weight"], inv_k)
    # And back to Hugging Face: the same tensors as the model's.
    hf = tmp_path / "hf"
    (meta / "config.json").unlink()  # a Meta folder has params.json alone
    weightmap.remap(
        meta,
        hf,
        preset="llama-meta-to-hf",
        params={"version": "2", "weights_dtype": "float32"},
    )
    _same(load_file(hf / "model.safetensors"), model.state_dict())


def test_llama_refusals(tmp_path: Path, llama: tuple[Path, torch.nn.Module]) -> None:
    src, _, params = _meta_folder(tmp_path, "3.1")
    with pytest.raises(weightmap.MappingError, match="say which Llama this is"):
        weightmap.compile(src, preset="llama-meta-to-hf")
    with pytest.raises(weightmap.MappingError, match=r"does not match params\.json's use_scaled"):
        weightmap.compile(src, preset="llama-meta-to-hf", params={"version": "3"})
    (src / "params.json").write_text(json.dumps({**params, "moe_args": {}}))
    with pytest.raises(weightmap.MappingError, match="fields this preset does not know"):
        weightmap.compile(src, preset="llama-meta-to-hf", params={"version": "3.1"})
    two, _, _ = _meta_folder(tmp_path, "2")
    with pytest.raises(weightmap.MappingError, match="--set vocab_size=32000"):
        weightmap.compile(two, preset="llama-meta-to-hf", params={"version": "2"})
    folder, _ = llama
    with pytest.raises(weightmap.MappingError, match="do not give intermediate_size 64"):
        weightmap.compile(
            folder, preset="llama-hf-to-meta", params={"multiple_of": 16, "ffn_dim_multiplier": 1.3}
        )
    with pytest.raises(weightmap.MappingError, match="not a multiple of multiple_of=256"):
        weightmap.compile(folder, preset="llama-hf-to-meta")


# -- MoE experts: per expert <-> transformers 5 fused ---------------------------------------------


MOE_TYPES = [
    *("mixtral", "minimax", "minimax_m2", "phimoe"),  # block_sparse_moe.experts.N.w1/w2/w3
    *("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "deepseek_v2", "deepseek_v3"),
    *("deepseek_v32", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "hunyuan_v1_moe"),
    *("longcat_flash", "solar_open", "mellum", "afmoe", "cohere2_moe", "jamba"),
]


def _moe(kind: str) -> Any:
    """A tiny random model of ``kind`` with every layer a MoE layer of 4 experts (each config
    class takes the fields it knows: the others are ignored)."""
    import transformers as T
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sizes = {
        "vocab_size": 32,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,  # no GQA: the MLA models (DeepSeek, GLM-Lite) have none
        "head_dim": 8,
        "intermediate_size": 48,
        "moe_intermediate_size": 24,
        "num_experts": 4,
        "n_routed_experts": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    }
    cls = getattr(T, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])
    return cls(CONFIG_MAPPING[kind](**sizes))


@pytest.mark.parametrize("kind", MOE_TYPES)
def test_moe_fuse_and_unfuse_are_transformers_own(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    model = _moe(kind).eval()
    per_expert = tmp_path / "per-expert"
    model.save_pretrained(per_expert)  # transformers 5 unfuses the experts when it saves
    saved = load_file(per_expert / "model.safetensors")
    assert any(".experts.0." in name for name in saved)

    fused = tmp_path / "fused"
    weightmap.remap(per_expert, fused, preset="moe-fuse", progress=False)
    tied = set(
        getattr(model, "all_tied_weights_keys", None) or {}
    )  # saved once, as transformers does
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    _same(load_file(fused / "model.safetensors"), state)
    back = tmp_path / "back"
    weightmap.remap(fused, back, preset="moe-unfuse", progress=False)
    _same(load_file(back / "model.safetensors"), saved)

    # Both load, and compute the logits of the model they came from. The weights are equal
    # bit for bit (above); the loaded copies may run the expert matmuls on other memory
    # layouts, so the float32 sums may differ in the last bits.
    ids = torch.tensor([[1, 5, 7, 3, 2]])
    with torch.no_grad():
        # (no cache: the hybrid models, Qwen3-Next and Jamba, have layers without attention)
        expected = model(ids, use_cache=False).logits
        for folder in (per_expert, fused):
            got = _loads_cleanly(folder)(ids, use_cache=False).logits
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=str(folder))


def test_moe_refusals(tmp_path: Path, llama: tuple[Path, torch.nn.Module]) -> None:
    folder, _ = llama
    with pytest.raises(
        weightmap.MappingError,
        match='model_type "llama": this preset fuses the experts of the model types listed',
    ):
        weightmap.compile(folder, preset="moe-fuse")
    torch.manual_seed(0)
    model = _moe("mixtral")
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(model.state_dict(), fused / "model.safetensors")
    model.config.save_pretrained(fused)
    with pytest.raises(weightmap.MappingError, match="already fused\\? moe-unfuse"):
        weightmap.compile(fused, preset="moe-fuse")
    assert weightmap.compile(fused, preset="moe-unfuse").outputs


# -- the fp8 presets, through the load check ------------------------------------------------------


def test_fp8_round_trip_output_loads(llama: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    # A bf16 model, as the fp8 releases' unquantized tensors are (fp8-dequant sets the config's
    # dtype to its target, and leaves the norms, embeddings and head in theirs).
    folder, _ = llama
    bf16 = tmp_path / "bf16-source"
    weightmap.remap(folder, bf16, preset="cast", params={"target": "bf16"})
    quantized = tmp_path / "fp8"
    weightmap.remap(bf16, quantized, preset="fp8-quant", params={"block_size": [16, 16]})
    # An fp8 checkpoint is not one the plain model loads: its scales are unexpected names.
    report = weightmap.check_loads(quantized)
    assert any(p.startswith("unexpected: model.layers.{0..1}.") for p in report.problems)
    plain = tmp_path / "bf16"
    weightmap.remap(quantized, plain, preset="fp8-dequant", params={"target": "bf16"})
    assert json.loads((plain / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(_loads_cleanly(plain).parameters()).dtype == torch.bfloat16
