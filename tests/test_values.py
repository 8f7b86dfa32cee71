"""Value rules against the reference converters, bit for bit: fp8 block dequantization
(DeepSeek-V3 ``weight_dequant``), fp8 block quantization (transformers ``Fp8Quantize``), the
Gemma norm offset (llama.cpp's converter), masks; each through both executors, with chunk sizes
that cut through blocks; and the fp8 presets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import weightmap
from weightmap import ExecutionError, MappingError
from weightmap.format.dtypes import DTYPES

from valuetools import as_bytes, run_every_way, save_checkpoint

E4M3 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(E4M3).max  # 448


def _run(
    root: Path, mapping: str, chunks: tuple[int, ...] = (1 << 20, 3000, 777)
) -> dict[str, torch.Tensor]:
    return run_every_way(root, mapping=mapping, chunks=chunks)


# ---------------------------------------------------------------- fp8 block dequantization


def weight_dequant(w: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3 inference/kernel.py ``weight_dequant`` (used by fp8_cast_bf16.py): each
    element times its block's scale in float32, stored in the default dtype (bf16); a partial
    block at the bottom or right edge uses the same scale entry."""
    m, n = w.shape
    scale = s.repeat_interleave(block, 0)[:m].repeat_interleave(block, 1)[:, :n]
    return (w.to(torch.float32) * scale).to(torch.bfloat16)


DEQUANT = """weightmap 1
mul "{x*}.weight", "{x*}.weight_scale_inv" block [128, 128] to bf16 -> "{x}.weight"
    where dtype == f8_e4m3 or name == x + ".weight_scale_inv"
unmatched keep
"""


def _fp8_pair(gen: torch.Generator, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(m, n, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    s = torch.rand(math.ceil(m / 128), math.ceil(n / 128), generator=gen) * 1e-2 + 1e-4
    return w, s


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (576, 130), (1, 129)])
def test_dequant_matches_weight_dequant(tmp_path: Path, shape: tuple[int, int]) -> None:
    # (576, 130): DeepSeek-V3's kv_a_proj_with_mqa rows (512 + 64), a partial block each way.
    gen = torch.Generator().manual_seed(sum(shape))
    w, s = _fp8_pair(gen, *shape)
    norm = torch.randn(shape[1], generator=gen).to(torch.bfloat16)
    root = save_checkpoint(
        tmp_path / "src", {"l.weight": w, "l.weight_scale_inv": s, "norm.weight": norm}
    )
    out = _run(root, DEQUANT)
    assert torch.equal(out["l.weight"], weight_dequant(w, s))
    assert torch.equal(out["norm.weight"], norm)
    assert sorted(out) == ["l.weight", "norm.weight"]


def test_dequant_refuses_a_scale_that_is_not_the_block_grid(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    w, _ = _fp8_pair(gen, 300, 200)
    root = save_checkpoint(
        tmp_path / "src", {"l.weight": w, "l.weight_scale_inv": torch.ones(2, 2)}
    )
    with pytest.raises(
        MappingError, match=r"`l.weight_scale_inv` is \[2, 2\] but must be \[3, 2\]"
    ):
        weightmap.compile(root, mapping=DEQUANT)


def test_dequant_refuses_an_fp8_weight_without_its_scale(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    w, s = _fp8_pair(gen, 128, 128)
    tensors = {"a.weight": w, "a.weight_scale_inv": s, "b.weight": w.clone()}
    root = save_checkpoint(tmp_path / "src", tensors)
    with pytest.raises(
        MappingError,
        match=r"group x=\"b\" is incomplete: missing `{x\*}.weight_scale_inv` \(pattern 2\)",
    ):
        weightmap.compile(root, mapping=DEQUANT)


# ---------------------------------------------------------------- fp8 block quantization


def fp8_quantize(value: torch.Tensor, block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    """transformers v5 integrations/finegrained_fp8.py, ``Fp8Quantize._quantize_one``, on
    shapes that are whole blocks (that op passes other shapes through); extended to partial
    edge blocks by zero padding, which leaves every block's absolute maximum unchanged."""
    block_m, block_n = block
    *lead, rows, cols = value.shape
    rt, ct = -(-rows // block_m), -(-cols // block_n)
    value_fp32 = torch.zeros(*lead, rt * block_m, ct * block_n)
    value_fp32[..., :rows, :cols] = value.to(torch.float32)
    reshaped = value_fp32.reshape(*lead, rt, block_m, ct, block_n)
    max_abs = reshaped.abs().amax(dim=(-3, -1))
    safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_MAX / safe_max_abs
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv_scales = (1.0 / scales).to(torch.float32)
    scaled = reshaped * scales.unsqueeze(-1).unsqueeze(-3)
    quantized = torch.clamp(scaled, min=-FP8_MAX, max=FP8_MAX).to(E4M3)
    quantized = quantized.reshape(*lead, rt * block_m, ct * block_n)[..., :rows, :cols]
    return {"weight": quantized, "weight_scale_inv": inv_scales}


QUANT = """weightmap 1
quantize "{x*}.weight" to f8_e4m3 block [128, 128] -> "{x}.weight", "{x}.weight_scale_inv"
    where len(shape) >= 2
unmatched keep
"""


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (4, 256, 128), (130, 1)])
def test_quantize_matches_fp8_quantize(tmp_path: Path, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)
    x[..., :128, :1] = 0  # an all-zero column inside the first block does not change it
    if shape == (256, 384):
        x[128:, 256:] = 0  # an all-zero block: scale 1, as the reference
    root = save_checkpoint(tmp_path / "src", {"l.weight": x, "l.bias": x.reshape(-1)[:5].clone()})
    out = _run(root, QUANT)
    ref = fp8_quantize(x)
    assert torch.equal(as_bytes(out["l.weight"]), as_bytes(ref["weight"]))
    assert torch.equal(out["l.weight_scale_inv"], ref["weight_scale_inv"])
    if shape == (256, 384):
        assert out["l.weight_scale_inv"][1, 2].item() == 1.0
    assert torch.equal(out["l.bias"], x.reshape(-1)[:5])


def test_quantize_then_dequantize_is_within_one_fp8_step(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 256, generator=gen).to(torch.bfloat16)
    root = save_checkpoint(tmp_path / "src", {"l.weight": x})
    weightmap.remap(root, tmp_path / "q", mapping=QUANT, progress=False)
    weightmap.remap(tmp_path / "q", tmp_path / "back", mapping=DEQUANT, progress=False)
    back = load_file(tmp_path / "back" / "model.safetensors")["l.weight"].float()
    # e4m3's steps near its maximum (448) are 32 wide: at most half a step (16) times the
    # block's scale_inv, plus the bf16 rounding of the result (2**-8 relative).
    scale = fp8_quantize(x)["weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((back - x.float()).abs() <= scale * 16 + back.abs() * 2**-8).all()


def test_inverse_of_value_rules_is_refused_with_the_reason() -> None:
    for text, why in (
        (QUANT, "quantization loses precision"),
        (DEQUANT, "arithmetic rounds"),
        ('weightmap 1\nadd "a" 1\n', "arithmetic rounds"),
        ('weightmap 1\nmask "t2d" size 8\n', "a mask cannot give back"),
    ):
        with pytest.raises(MappingError, match=why):
            weightmap.invert(weightmap.load_mapping(text))


# ---------------------------------------------------------------- constants, compute dtypes


def test_gemma_norm_offset_matches_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp convert_hf_to_gguf.py, GemmaModel.modify_tensors: ``data_torch + 1`` in the
    tensor's own dtype (bf16 rounds), then 1-D tensors stored as F32."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(512, generator=gen) * 1e-2).to(torch.bfloat16)
    root = save_checkpoint(
        tmp_path / "src", {"model.norm.weight": w, "lm_head.weight": torch.ones(2, 2)}
    )
    mapping = """weightmap 1
add "**norm.weight" 1 in bf16
cast "**norm.weight" to f32
unmatched keep
"""
    out = _run(root, mapping, chunks=(1 << 20, 100))
    expected = (w + 1).to(torch.float32)
    assert torch.equal(out["model.norm.weight"], expected)
    # In float32 (the default compute dtype) the bf16 rounding does not happen: other bits.
    out32 = _run(root, 'weightmap 1\nadd "**norm.weight" 1 to f32\nunmatched keep\n')
    assert torch.equal(out32["model.norm.weight"], w.to(torch.float32) + 1)
    assert not torch.equal(out32["model.norm.weight"], expected)


def test_arithmetic_is_refused_on_integers_and_non_numbers(tmp_path: Path) -> None:
    root = save_checkpoint(tmp_path / "src", {"ids": torch.arange(4), "w": torch.ones(4)})
    with pytest.raises(MappingError, match=r"`ids` is I64: arithmetic runs on float tensors"):
        weightmap.compile(root, mapping='weightmap 1\nmul "ids" 2\nunmatched keep\n')
    with pytest.raises(MappingError, match="must be a number"):
        weightmap.compile(root, mapping='weightmap 1\nadd "w" "one"\nunmatched keep\n')
    with pytest.raises(MappingError, match="compute dtype"):
        weightmap.compile(root, mapping='weightmap 1\nadd "w" 1 in i32\nunmatched keep\n')


# ---------------------------------------------------------------- masks


def test_mask_marks_the_positions_once(tmp_path: Path) -> None:
    d2t = torch.tensor([0, 1, 1, 5, 3], dtype=torch.int64)
    root = save_checkpoint(tmp_path / "src", {"d2t": d2t})
    out = _run(root, 'weightmap 1\ncopy "d2t" -> "t2d"\nmask "t2d" size 12 plus index\n')
    expected = torch.zeros(12, dtype=torch.bool)
    expected[torch.arange(5) + d2t] = True
    assert torch.equal(out["t2d"], expected) and torch.equal(out["d2t"], d2t)
    with pytest.raises(ExecutionError, match="positions repeat"):
        _run(root, 'weightmap 1\nmask "d2t" size 12\n', chunks=(1 << 20,))


# ---------------------------------------------------------------- the presets

DEEPSEEK_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def _deepseek_like(root: Path, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's names and dtypes at small sizes: fp8 Linear weights with scales (one with
    partial blocks, as kv_a_proj_with_mqa), bf16 embeddings, head, norms, router, and the f32
    routing bias."""
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, 256, generator=gen).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 256, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(256, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(8, 256, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(8, generator=gen),
    }
    for name, shape in (
        ("model.layers.0.self_attn.kv_a_proj_with_mqa", (576, 256)),
        ("model.layers.0.self_attn.o_proj", (256, 256)),
        ("model.layers.0.mlp.experts.0.down_proj", (256, 384)),
    ):
        w, s = _fp8_pair(gen, *shape)
        tensors[f"{name}.weight"] = w
        tensors[f"{name}.weight_scale_inv"] = s
    save_checkpoint(root, tensors, DEEPSEEK_CONFIG)
    return tensors


def test_fp8_dequant_preset(tmp_path: Path) -> None:
    src = tmp_path / "src"
    tensors = _deepseek_like(src, torch.Generator().manual_seed(5))
    result = weightmap.remap(src, tmp_path / "out", preset="fp8-dequant", verify=True)
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert not any(k.endswith("_scale_inv") for k in out)
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == E4M3:
            assert torch.equal(out[name], weight_dequant(t, tensors[name + "_scale_inv"]))
        else:
            assert torch.equal(out[name], t), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert result.plan.config == config


def test_fp8_dequant_preset_refuses_a_checkpoint_that_is_not_fp8(tmp_path: Path) -> None:
    root = save_checkpoint(
        tmp_path / "src", {"a.weight": torch.ones(2, 2)}, {"torch_dtype": "float32"}
    )
    with pytest.raises(MappingError, match="not an fp8 checkpoint"):
        weightmap.compile(root, preset="fp8-dequant")


def test_fp8_quant_preset_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _deepseek_like(src, torch.Generator().manual_seed(6))
    weightmap.remap(src, tmp_path / "bf16", preset="fp8-dequant", progress=False)
    weightmap.remap(tmp_path / "bf16", tmp_path / "fp8", preset="fp8-quant", progress=False)
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    fp8 = load_file(tmp_path / "fp8" / "model.safetensors")
    # Whole-block matrices quantized (the router too: a Linear here); the partial-block one,
    # the embeddings and head (skipped by name) and everything 1-D kept as they were.
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.experts.0.down_proj"):
        ref = fp8_quantize(bf16[f"{name}.weight"])
        assert torch.equal(as_bytes(fp8[f"{name}.weight"]), as_bytes(ref["weight"]))
        assert torch.equal(fp8[f"{name}.weight_scale_inv"], ref["weight_scale_inv"])
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):  # fmt: skip
        assert torch.equal(fp8[name], bf16[name]), name
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head", "embed_tokens"]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_block_operands_applied_by_bands_give_the_expanded_operands_bits(data: Any) -> None:
    """A block-broadcast operand is combined a band of block rows at a time, in place, from
    a block height of ``values._BAND_MIN``: the same bits as the operand expanded to the full
    shape, for every op, block and region of the block grid (a chunk starting inside a block),
    NaNs and infinities included."""
    from weightmap.execute import values
    from weightmap.execute.nans import convert
    from weightmap.plan.nodes import Binary, Source

    lead = data.draw(st.sampled_from([(), (2,)]))
    nblocked = data.draw(st.integers(1, 2))
    block = tuple(
        data.draw(st.integers(values._BAND_MIN, 12) if i == 0 else st.integers(1, 6))
        for i in range(nblocked)
    )
    full = tuple(data.draw(st.integers(1, 3 * b + 2)) for b in block)
    # The region a chunk computes: rows [r0, r1) of the first blocked dim.
    r0 = data.draw(st.integers(0, full[0] - 1))
    r1 = data.draw(st.integers(r0 + 1, full[0]))
    shape = (*lead, r1 - r0, *full[1:])
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    dtype = data.draw(st.sampled_from(["BF16", "F32"]))  # (F32: converting it is a no-op)
    a = torch.randn(shape, generator=gen).to(DTYPES[dtype].torch())
    specials = torch.tensor([math.nan, math.inf, -math.inf])
    a.view(-1)[:3] = specials[: min(3, a.numel())]
    before = a.clone()
    grid = tuple(-(-n // b) for n, b in zip(full, block, strict=True))
    b_full = torch.randn((*lead, *grid), generator=gen)
    b = b_full.narrow(len(lead), r0 // block[0], (r1 - 1) // block[0] - r0 // block[0] + 1)
    offsets = (r0 % block[0], *(0 for _ in block[1:]))
    op = data.draw(st.sampled_from(["add", "sub", "mul"]))
    # (BF16: its NaNs depend on how torch splits the elements into runs; the bands keep away)
    compute = data.draw(st.sampled_from(["F32", "F64", "BF16"]))
    node = Binary(
        a=Source(name="a", dtype=dtype, shape=shape),
        b=Source(name="b", dtype="F32", shape=tuple(b.shape)),
        op=op, block=block, compute=compute, dtype="BF16", shape=shape,
    )  # fmt: skip
    got = values.binary(a, b, node, offsets)
    # The expanded operand, converted as every kernel converts (NaN bits settled: nans.py).
    ac = convert(a, DTYPES[compute].torch())
    bc = values.expand_blocks(convert(b, ac.dtype), block, shape, offsets)
    want = convert({"add": ac + bc, "sub": ac - bc, "mul": ac * bc}[op], torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(a.view(torch.uint8), before.view(torch.uint8))  # (never written)


def test_block_products_in_bf16_keep_the_nan_of_the_whole_tensor() -> None:
    """torch's bfloat16 arithmetic gives one NaN in its vector loop and another in its scalar
    one; combined band by band, a NaN at a band's end came out as the scalar loop's. A
    bfloat16 compute keeps the expanded operand (the bands are for float32 and float64)."""
    from weightmap.execute import values
    from weightmap.execute.nans import convert
    from weightmap.plan.nodes import Binary, Source

    a = torch.ones(64, 3, dtype=torch.bfloat16)
    a[6, 0] = math.nan
    b = torch.full((8, 1), 2.0)
    node = Binary(
        a=Source(name="a", dtype="BF16", shape=(64, 3)),
        b=Source(name="b", dtype="F32", shape=(8, 1)),
        op="mul", block=(8, 3), compute="BF16", dtype="BF16", shape=(64, 3),
    )  # fmt: skip
    bc = values.expand_blocks(convert(b, torch.bfloat16), (8, 3), (64, 3), (0, 0))
    want = convert(a * bc, torch.bfloat16)
    got = values.binary(a, b, node)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
