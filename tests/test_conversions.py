"""The worked examples of docs/language.md, each run through the streaming and the in-memory
executor and compared bit for bit with plain torch written from the cited converter's code.

The mappings are read from the docs (the ```weightmap block after each
``<!-- example: NAME -->`` marker), so the docs cannot drift from what is tested.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap

REPO = Path(__file__).resolve().parent.parent
LANGUAGE_DOC = REPO / "docs" / "language.md"
EXAMPLE = re.compile(r"<!-- example: ([\w-]+) -->\n```weightmap\n(.*?)^```", re.M | re.S)

Tensors = dict[str, torch.Tensor]


def example(name: str) -> str:
    """The mapping text of one worked example in docs/language.md."""
    found = dict(EXAMPLE.findall(LANGUAGE_DOC.read_text()))
    assert name in found, f"docs/language.md has no example {name!r} (has {sorted(found)})"
    return found[name]


def _random(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _convert(
    tmp_path: Path, tensors: Tensors, config: dict[str, Any] | None, mapping: str
) -> tuple[Tensors, dict[str, Any] | None]:
    """Convert with the streaming executor; check the in-memory one gives the same bytes."""
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, src / "model.safetensors")
    if config is not None:
        (src / "config.json").write_text(json.dumps(config))
    dest = tmp_path / "out"
    weightmap.remap(src, dest, mapping=mapping, progress=False, verify=True)
    streamed = load_file(dest / "model.safetensors")
    in_memory = {k: v.clone() for k, v in weightmap.iter_tensors(src, mapping=mapping)}
    assert streamed.keys() == in_memory.keys()
    for name, t in streamed.items():
        assert t.dtype == in_memory[name].dtype and torch.equal(t, in_memory[name]), name
    out_config = json.loads((dest / "config.json").read_text()) if config is not None else None
    return streamed, out_config


def _same(got: Tensors, expected: Tensors) -> None:
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


# ---------------------------------------------------------------- Llama rotary permutes

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, INTER = 64, 4, 2, 2, 32, 96
HEAD_DIM = DIM // HEADS


def _meta_llama(gen: torch.Generator) -> Tensors:
    sd = {
        "tok_embeddings.weight": _random(gen, VOCAB, DIM),
        "norm.weight": _random(gen, DIM),
        "output.weight": _random(gen, VOCAB, DIM),
        "rope.freqs": _random(gen, HEAD_DIM // 2),
    }
    for n in range(LAYERS):
        p = f"layers.{n}."
        sd |= {
            p + "attention.wq.weight": _random(gen, DIM, DIM),
            p + "attention.wk.weight": _random(gen, KV_HEADS * HEAD_DIM, DIM),
            p + "attention.wv.weight": _random(gen, KV_HEADS * HEAD_DIM, DIM),
            p + "attention.wo.weight": _random(gen, DIM, DIM),
            p + "feed_forward.w1.weight": _random(gen, INTER, DIM),
            p + "feed_forward.w2.weight": _random(gen, DIM, INTER),
            p + "feed_forward.w3.weight": _random(gen, INTER, DIM),
            p + "attention_norm.weight": _random(gen, DIM),
            p + "ffn_norm.weight": _random(gen, DIM),
        }
    return sd


def permute_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers models/llama/convert_llama_weights_to_hf.py, ``permute``."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def permute_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """torchtitan's Llama state-dict adapter, the inverse view of ``permute``."""
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def meta_to_hf_reference(sd: Tensors) -> Tensors:
    """The tensor part of transformers' Meta -> HF Llama conversion (one shard)."""
    out = {
        "model.embed_tokens.weight": sd["tok_embeddings.weight"],
        "model.norm.weight": sd["norm.weight"],
        "lm_head.weight": sd["output.weight"],
    }
    for n in range(LAYERS):
        src, dst = f"layers.{n}.", f"model.layers.{n}."
        out |= {
            dst + "self_attn.q_proj.weight": permute_meta_to_hf(
                sd[src + "attention.wq.weight"], HEADS
            ),
            dst + "self_attn.k_proj.weight": permute_meta_to_hf(
                sd[src + "attention.wk.weight"], KV_HEADS
            ),
            dst + "self_attn.v_proj.weight": sd[src + "attention.wv.weight"],
            dst + "self_attn.o_proj.weight": sd[src + "attention.wo.weight"],
            dst + "mlp.gate_proj.weight": sd[src + "feed_forward.w1.weight"],
            dst + "mlp.down_proj.weight": sd[src + "feed_forward.w2.weight"],
            dst + "mlp.up_proj.weight": sd[src + "feed_forward.w3.weight"],
            dst + "input_layernorm.weight": sd[src + "attention_norm.weight"],
            dst + "post_attention_layernorm.weight": sd[src + "ffn_norm.weight"],
        }
    return out


META_PARAMS = {"dim": DIM, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "n_layers": LAYERS}
HF_CONFIG = {"hidden_size": DIM, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}


def test_llama_meta_to_hf(tmp_path: Path) -> None:
    sd = _meta_llama(torch.Generator().manual_seed(0))
    got, _ = _convert(tmp_path, sd, META_PARAMS, example("llama-meta-to-hf"))
    _same(got, meta_to_hf_reference(sd))


def test_llama_hf_to_meta_undoes_meta_to_hf(tmp_path: Path) -> None:
    sd = meta_to_hf_reference(_meta_llama(torch.Generator().manual_seed(1)))
    got, _ = _convert(tmp_path, sd, HF_CONFIG, example("llama-hf-to-meta"))
    expected = dict(sd)
    for n in range(LAYERS):
        for proj, heads in (("q", HEADS), ("k", KV_HEADS)):
            name = f"model.layers.{n}.self_attn.{proj}_proj.weight"
            expected[name] = permute_hf_to_meta(sd[name], heads)
    _same(got, expected)
    # And the two permutes are each other's inverse, bit for bit.
    for n in range(LAYERS):
        name = f"model.layers.{n}.self_attn.q_proj.weight"
        assert torch.equal(permute_meta_to_hf(got[name], HEADS), sd[name])


# ---------------------------------------------------------------- MoE experts

EXPERTS, HIDDEN, EXPERT_INTER = 4, 8, 6


def _mixtral(gen: torch.Generator) -> Tensors:
    sd: Tensors = {}
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe."
        sd[p + "gate.weight"] = _random(gen, EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            sd[p + f"experts.{e}.w1.weight"] = _random(gen, EXPERT_INTER, HIDDEN)
            sd[p + f"experts.{e}.w2.weight"] = _random(gen, HIDDEN, EXPERT_INTER)
            sd[p + f"experts.{e}.w3.weight"] = _random(gen, EXPERT_INTER, HIDDEN)
        sd[f"model.layers.{i}.input_layernorm.weight"] = _random(gen, HIDDEN)
    return sd


def fuse_reference(sd: Tensors) -> Tensors:
    """transformers v5 conversion_mapping.py, "mixtral": MergeModulelist(dim=0) then
    Concatenate(dim=1) for w1/w3 -> gate_up_proj; MergeModulelist(dim=0) for w2."""
    out: Tensors = {}
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe."
        w1, w2, w3 = (
            torch.stack([sd[p + f"experts.{e}.{w}.weight"] for e in range(EXPERTS)], dim=0)
            for w in ("w1", "w2", "w3")
        )
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = w2
        out[f"model.layers.{i}.mlp.gate.weight"] = sd[p + "gate.weight"]
        out[f"model.layers.{i}.input_layernorm.weight"] = sd[
            f"model.layers.{i}.input_layernorm.weight"
        ]
    return out


def test_moe_fuse(tmp_path: Path) -> None:
    sd = _mixtral(torch.Generator().manual_seed(2))
    got, _ = _convert(tmp_path, sd, None, example("moe-fuse"))
    _same(got, fuse_reference(sd))
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        EXPERTS,
        2 * EXPERT_INTER,
        HIDDEN,
    )


def test_moe_fuse_refuses_a_layer_short_of_its_last_expert(tmp_path: Path) -> None:
    """Experts 0..n-2 are a stack without a gap; the config's count says one is missing,
    which fused would be a tensor its own config contradicts."""
    sd = _mixtral(torch.Generator().manual_seed(4))
    src = tmp_path / "src"
    src.mkdir()
    config = {"model_type": "mixtral", "num_local_experts": EXPERTS}
    (src / "config.json").write_text(json.dumps(config))
    save_file(sd, src / "model.safetensors")
    assert weightmap.compile(src, preset="moe-fuse").outputs  # whole, it fuses
    for w in ("w1", "w2", "w3"):
        del sd[f"model.layers.0.block_sparse_moe.experts.{EXPERTS - 1}.{w}.weight"]
    save_file(sd, src / "model.safetensors")
    with pytest.raises(weightmap.MappingError) as caught:
        weightmap.compile(src, preset="moe-fuse")
    text = str(caught.value)
    assert "`model.layers.0.block_sparse_moe.experts.w2` " in text
    assert f"[{EXPERTS - 1}, {HIDDEN}, {EXPERT_INTER}] does not have the declared shape " in text
    assert f"[{EXPERTS}, {HIDDEN}, {EXPERT_INTER}]" in text
    assert "layers.1" not in text


def test_moe_unfuse_restores_the_experts(tmp_path: Path) -> None:
    sd = _mixtral(torch.Generator().manual_seed(3))
    fused = fuse_reference(sd)
    got, _ = _convert(tmp_path, fused, None, example("moe-unfuse"))
    # The reverse of the v5 fusion: chunk dim 1 in two, then unstack dim 0.
    _same(got, sd)


# ---------------------------------------------------------------- GPT-2 Conv1D

GPT2_HIDDEN = 12


def _gpt2(gen: torch.Generator) -> Tensors:
    h = GPT2_HIDDEN
    sd: Tensors = {"wte.weight": _random(gen, 20, h)}
    for i in range(2):
        p = f"h.{i}."
        sd |= {
            p + "attn.c_attn.weight": _random(gen, h, 3 * h),
            p + "attn.c_attn.bias": _random(gen, 3 * h),
            p + "attn.c_proj.weight": _random(gen, h, h),
            p + "attn.c_proj.bias": _random(gen, h),
            p + "mlp.c_fc.weight": _random(gen, h, 4 * h),
            p + "mlp.c_proj.weight": _random(gen, 4 * h, h),
            p + "ln_1.weight": _random(gen, h),
        }
    return sd


def gpt2_reference(sd: Tensors) -> Tensors:
    """nanoGPT ``from_pretrained`` transposes the Conv1D weights; q/k/v are the three column
    blocks of c_attn, transposed: ``c_attn.weight[:, j*H:(j+1)*H].t()``, bias likewise."""
    h = GPT2_HIDDEN
    out = dict(sd)
    for i in range(2):
        p = f"h.{i}."
        w, b = out.pop(p + "attn.c_attn.weight"), out.pop(p + "attn.c_attn.bias")
        for j, name in enumerate("qkv"):
            out[p + f"attn.{name}_proj.weight"] = w[:, j * h : (j + 1) * h].t().contiguous()
            out[p + f"attn.{name}_proj.bias"] = b[j * h : (j + 1) * h]
        for conv in ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"):
            out[p + conv] = sd[p + conv].t().contiguous()
    return out


def test_gpt2_conv1d_to_linear(tmp_path: Path) -> None:
    sd = _gpt2(torch.Generator().manual_seed(4))
    got, _ = _convert(tmp_path, sd, None, example("gpt2-conv1d"))
    _same(got, gpt2_reference(sd))


# ---------------------------------------------------------------- transpose, cast, untie


def test_transpose_then_cast(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    sd = {
        "fc.weight": _random(gen, 6, 10),
        "norm.weight": _random(gen, 10),
        "d2t": torch.arange(5),
    }
    got, _ = _convert(tmp_path, sd, None, example("transpose-then-cast"))
    _same(
        got,
        {
            "fc.weight": sd["fc.weight"].t().to(torch.bfloat16),
            "norm.weight": sd["norm.weight"].to(torch.bfloat16),
            "d2t": sd["d2t"],
        },
    )


def test_untie_embeddings(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(6)
    sd = {"model.embed_tokens.weight": _random(gen, 16, 8), "model.norm.weight": _random(gen, 8)}
    got, config = _convert(tmp_path, sd, {"tie_word_embeddings": True}, example("untie-embeddings"))
    _same(got, {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    assert config == {"tie_word_embeddings": False}


# ---------------------------------------------------------------- config arithmetic


def hf_intermediate_size(dim: int, multiplier: float, multiple_of: int) -> int:
    """transformers convert_llama_weights_to_hf.py, ``compute_intermediate_size``."""
    return multiple_of * ((int(multiplier * int(8 * dim / 3)) + multiple_of - 1) // multiple_of)


@pytest.mark.parametrize(
    ("dim", "multiplier", "multiple_of", "expected"),
    [
        (4096, 1.3, 1024, 14336),  # Llama 3 8B
        (8192, 1.3, 4096, 28672),  # Llama 3 70B
        (16384, 1.2, 4096, 53248),  # Llama 3.1 405B
        (4096, None, 256, 11008),  # Llama 2 7B: no ffn_dim_multiplier in params.json
    ],
)
def test_llama3_config_sizes_are_integers(
    tmp_path: Path, dim: int, multiplier: float | None, multiple_of: int, expected: int
) -> None:
    params: dict[str, Any] = {
        "dim": dim,
        "n_layers": 2,
        "n_heads": 32,
        "n_kv_heads": 8,
        "multiple_of": multiple_of,
        "norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "vocab_size": 128256,
    }
    if multiplier is not None:
        params["ffn_dim_multiplier"] = multiplier
    assert hf_intermediate_size(dim, multiplier or 1, multiple_of) == expected
    _, config = _convert(tmp_path, {"x": torch.zeros(1)}, params, example("llama3-config"))
    assert config is not None
    assert config["intermediate_size"] == expected
    assert type(config["intermediate_size"]) is int
    assert config["head_dim"] == dim // 32 and config["num_key_value_heads"] == 8
    assert "dim" not in config and "multiple_of" not in config


_LLAMA31 = {
    "dim": 2048,
    "n_layers": 2,
    "n_heads": 32,
    "n_kv_heads": 8,
    "multiple_of": 256,
    "ffn_dim_multiplier": 1.5,
    "norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
}


@pytest.mark.parametrize(
    ("scaled", "factor", "positions"),
    [(None, None, 8192), (False, None, 8192), (True, 8.0, 131072), (True, 32.0, 131072)],
)
def test_llama3_config_carries_the_rope_scaling_of_llama31_and_32(
    tmp_path: Path, scaled: bool | None, factor: float | None, positions: int
) -> None:
    # Without rope_scaling transformers runs the unscaled frequencies of a 3.1/3.2 model, and
    # no error says so; use_scaled_rope itself means nothing to it.
    params = dict(_LLAMA31) if scaled is None else {**_LLAMA31, "use_scaled_rope": scaled}
    mapping = example("llama3-config")
    if factor == 32.0:
        mapping = mapping.replace("param rope_factor = 8.0", "param rope_factor = 32.0")
    _, config = _convert(tmp_path, {"x": torch.zeros(1)}, params, mapping)
    assert config is not None and "use_scaled_rope" not in config
    assert config["max_position_embeddings"] == positions
    if factor is None:
        assert "rope_scaling" not in config
    else:
        assert config["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        assert config["rope_theta"] == 500000.0


def test_every_example_is_tested() -> None:
    tested = {
        "llama-meta-to-hf",
        "llama-hf-to-meta",
        "moe-fuse",
        "moe-unfuse",
        "gpt2-conv1d",
        "transpose-then-cast",
        "untie-embeddings",
        "llama3-config",
        "gptq-dequant",  # tests/test_quant_formats.py
        "awq-dequant",  # tests/test_quant_formats.py
        "average",  # tests/test_several_inputs.py
        "meta-ranks-to-hf",  # tests/test_several_inputs.py
        "lora-merge",  # tests/test_several_inputs.py
        "hf-to-meta-ranks",  # tests/test_several_outputs.py
    }
    assert set(dict(EXAMPLE.findall(LANGUAGE_DOC.read_text()))) == tested


def _lines(name: str) -> int:
    return len([x for x in example(name).splitlines() if x.strip() and not x.startswith("#")])


@pytest.mark.parametrize(
    "name",
    [
        "llama-hf-to-meta",
        "moe-fuse",
        "gpt2-conv1d",
        "untie-embeddings",
        "meta-ranks-to-hf",
        "hf-to-meta-ranks",
        "lora-merge",
    ],
)
def test_examples_stay_short(name: str) -> None:
    # The point of the language: each of these is a short, readable mapping.
    assert _lines(name) <= 15
