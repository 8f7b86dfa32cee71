"""The primitives of quantized formats (unpack/pack, int <-> float casts, gather, lookup, sub,
matmul) and the GPTQ and AWQ dequantization presets, each bit for bit against plain-torch code
written from the cited converter, through both executors at chunk sizes that cut packed words
and groups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap
from weightmap import ExecutionError, MappingError
from weightmap.execute.streaming import execute
from weightmap.inputs.checkpoint import Checkpoint


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _run(
    root: Path, mapping: str | None = None, preset: str | None = None,
    chunks: tuple[int, ...] = (1 << 20, 1000, 333), params: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Convert streamed at every chunk size and in memory; all must agree; return one."""
    how: dict[str, Any] = {"mapping": mapping} if preset is None else {"preset": preset}
    plan = weightmap.compile(root, params=params, **how)
    memory = {k: v.clone() for k, v in weightmap.iter_tensors(root, params=params, **how)}
    for i, chunk in enumerate(chunks):
        dest = root.parent / f"{root.name}-out{i}"
        with Checkpoint.open(root) as ckpt:
            execute(plan, ckpt, dest, chunk_bytes=chunk, workers=2, overwrite=True)
        streamed = load_file(dest / "model.safetensors")
        assert streamed.keys() == memory.keys()
        for name, t in streamed.items():
            assert t.dtype == memory[name].dtype, name
            assert torch.equal(_bits(t), _bits(memory[name])), (name, chunk)
    return memory


def _save(root: Path, tensors: dict[str, torch.Tensor], config: Any = None) -> Path:
    root.mkdir(parents=True)
    save_file(tensors, root / "model.safetensors")
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    return root


def _words(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random int32 words over the whole range (the sign bit holds the top code)."""
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(
        torch.int32
    )


# ---------------------------------------------------------------- GPTQ


def dequant_gptq(
    g_idx: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    bits: int, checkpoint_format: str = "gptq",
) -> torch.Tensor:  # fmt: skip
    """llama.cpp convert_hf_to_gguf.py, ``dequant_gptq`` (bits 2, 4, 8; int32 words): shift
    and mask the codes out of each word (qweight along dim 0, qzeros along dim 1), add 1 to the
    zeros for checkpoint_format "gptq", then ``(scales[g_idx].float() * (weight -
    zeros[g_idx]).float()).T``."""
    maxq = 2**bits - 1
    pack_factor = 32 // bits
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    small = torch.int16 if bits == 8 else torch.int8
    zeros = torch.bitwise_right_shift(
        qzeros.unsqueeze(2).expand(-1, -1, pack_factor), wf.unsqueeze(0)
    ).to(small)
    zeros = torch.bitwise_and(zeros, maxq).reshape(scales.shape)
    weight = torch.bitwise_and(
        torch.bitwise_right_shift(
            qweight.unsqueeze(1).expand(-1, pack_factor, -1), wf.unsqueeze(-1)
        ).to(small),
        maxq,
    )
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    if checkpoint_format == "gptq":
        zeros += 1
    return (scales[g_idx].float() * (weight - zeros[g_idx]).float()).T


def _gptq_layer(
    gen: torch.Generator, k: int, n: int, group: int, bits: int, desc_act: bool
) -> dict[str, torch.Tensor]:
    per = 32 // bits
    groups = k // group
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if desc_act:  # act-order: rows quantized in a permuted order, each keeping its group
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return {
        "qweight": _words(gen, k // per, n),
        "qzeros": _words(gen, groups, n // per),
        "scales": (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).to(torch.float16),
        "g_idx": g_idx,
    }


def _gptq_checkpoint(
    root: Path, bits: int = 4, desc_act: bool = False, with_g_idx: bool = True,
    checkpoint_format: str | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(bits * 10 + desc_act)
    tensors = {
        "model.embed_tokens.weight": torch.randn(16, 64, generator=gen).to(torch.float16),
        "model.norm.weight": torch.randn(64, generator=gen).to(torch.float16),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(48, generator=gen).to(torch.float16),
    }
    # o_proj: two groups of 32 rows; down_proj: four of 32 (128 input rows, 16 words).
    for name, (k, n) in {"self_attn.o_proj": (64, 48), "mlp.down_proj": (128, 64)}.items():
        for part, t in _gptq_layer(gen, k, n, 32, bits, desc_act).items():
            if part != "g_idx" or with_g_idx:
                tensors[f"model.layers.0.{name}.{part}"] = t
    quant: dict[str, Any] = {"quant_method": "gptq", "bits": bits, "group_size": 32,
                             "desc_act": desc_act, "sym": False}  # fmt: skip
    if checkpoint_format is not None:
        quant["checkpoint_format"] = checkpoint_format
    _save(root, tensors, {"torch_dtype": "float16", "quantization_config": quant})
    return tensors


def _expect_gptq(
    tensors: dict[str, torch.Tensor], bits: int, fmt: str = "gptq"
) -> dict[str, torch.Tensor]:
    out = {}
    for name in tensors:
        if name.endswith(".qweight"):
            base = name.removesuffix(".qweight")
            k = tensors[name].shape[0] * (32 // bits)
            g_idx = tensors.get(f"{base}.g_idx", torch.arange(k, dtype=torch.int32) // 32)
            out[f"{base}.weight"] = dequant_gptq(
                g_idx, tensors[name], tensors[f"{base}.qzeros"], tensors[f"{base}.scales"],
                bits, fmt,
            )  # fmt: skip
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            out[name] = tensors[name]
    return out


@pytest.mark.parametrize(
    ("bits", "desc_act", "with_g_idx"),
    [(4, False, True), (4, True, True), (4, False, False), (2, True, True), (8, False, True)],
)
def test_gptq_dequant_preset_matches_llama_cpp(
    tmp_path: Path, bits: int, desc_act: bool, with_g_idx: bool
) -> None:
    tensors = _gptq_checkpoint(tmp_path / "src", bits, desc_act, with_g_idx)
    out = _run(tmp_path / "src", preset="gptq-dequant")
    expected = _expect_gptq(tensors, bits)
    assert out.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(_bits(out[name]), _bits(t)), name


def test_gptq_v2_keeps_the_zero_points_and_target_rounds_once(tmp_path: Path) -> None:
    tensors = _gptq_checkpoint(tmp_path / "src", checkpoint_format="gptq_v2")
    out = _run(tmp_path / "src", preset="gptq-dequant", params={"target": "bf16"})
    for name, t in _expect_gptq(tensors, 4, "gptq_v2").items():
        assert torch.equal(_bits(out[name]), _bits(t.to(out[name].dtype))), name
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16


def test_gptq_dequant_preset_from_remap_writes_the_config(tmp_path: Path) -> None:
    tensors = _gptq_checkpoint(tmp_path / "src", desc_act=True)
    weightmap.remap(tmp_path / "src", tmp_path / "out", preset="gptq-dequant", progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    for name, t in _expect_gptq(tensors, 4).items():
        assert torch.equal(_bits(out[name]), _bits(t)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "float32"


def test_gptq_dequant_preset_refuses_other_checkpoints(tmp_path: Path) -> None:
    root = _save(tmp_path / "fp", {"a.weight": torch.ones(2, 2)}, {"torch_dtype": "float32"})
    with pytest.raises(MappingError, match="not a GPTQ checkpoint"):
        weightmap.compile(root, preset="gptq-dequant")
    _gptq_checkpoint(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MappingError, match="GPTQ with 3-bit codes"):
        weightmap.compile(tmp_path / "src", preset="gptq-dequant")


# ---------------------------------------------------------------- AWQ

AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def dequantize_gemm(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """AutoAWQ awq/utils/packing_utils.py: ``unpack_awq`` (shift each int32 word by 0, 4, ...
    28 along a new last dim, to int8), ``reverse_awq_order`` (columns of each word reordered by
    AWQ_REVERSE_ORDER), mask to ``bits``, zeros and scales repeated over ``group_size`` rows,
    ``(iweight - izeros) * scales``."""
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    order = torch.arange(iweights.shape[-1], dtype=torch.int32).view(-1, 32 // bits)
    order = order[:, AWQ_REVERSE_ORDER].view(-1)
    iweights, izeros = iweights[:, order], izeros[:, order]
    iweights = torch.bitwise_and(iweights, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweights - izeros) * scales


def _awq_checkpoint(root: Path, group: int = 32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tensors = {"lm_head.weight": torch.randn(8, 64, generator=gen).to(torch.float16)}
    for name, (k, n) in {"self_attn.q_proj": (64, 48), "mlp.up_proj": (96, 64)}.items():
        base = f"model.layers.0.{name}"
        tensors[f"{base}.qweight"] = _words(gen, k, n // 8)
        tensors[f"{base}.qzeros"] = _words(gen, k // group, n // 8)
        tensors[f"{base}.scales"] = (torch.rand(k // group, n, generator=gen) * 0.02).half()
    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
             "zero_point": True}  # fmt: skip
    _save(root, tensors, {"torch_dtype": "float16", "quantization_config": quant})
    return tensors


def test_awq_dequant_preset_matches_autoawq(tmp_path: Path) -> None:
    tensors = _awq_checkpoint(tmp_path / "src")
    out = _run(tmp_path / "src", preset="awq-dequant")
    assert sorted(out) == [
        "lm_head.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]  # fmt: skip
    for base in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        ref = dequantize_gemm(
            tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], 4, 32
        ).T
        assert ref.dtype == torch.float16
        assert torch.equal(_bits(out[f"{base}.weight"]), _bits(ref)), base
    assert torch.equal(out["lm_head.weight"], tensors["lm_head.weight"])


def test_awq_dequant_preset_refuses_other_checkpoints(tmp_path: Path) -> None:
    _gptq_checkpoint(tmp_path / "gptq")
    with pytest.raises(MappingError, match="not an AWQ checkpoint"):
        weightmap.compile(tmp_path / "gptq", preset="awq-dequant")
    _awq_checkpoint(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MappingError, match="not a 4-bit AWQ checkpoint"):
        weightmap.compile(tmp_path / "src", preset="awq-dequant")
