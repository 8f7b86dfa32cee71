"""The primitives of quantized formats (unpack/pack, int <-> float casts, gather, lookup, sub,
matmul) and the GPTQ and AWQ dequantization presets, each bit for bit against plain-torch code
written from the cited converter, through both executors at chunk sizes that cut packed words
and groups."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import weightmap
from weightmap import ExecutionError, MappingError

from valuetools import as_bytes, run_every_way, save_checkpoint


def _run(
    root: Path, mapping: str | None = None, preset: str | None = None,
    chunks: tuple[int, ...] = (1 << 20, 1000, 333), params: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    return run_every_way(root, mapping=mapping, preset=preset, params=params, chunks=chunks)


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
    save_checkpoint(root, tensors, {"torch_dtype": "float16", "quantization_config": quant})
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
        assert torch.equal(as_bytes(out[name]), as_bytes(t)), name


def test_gptq_v2_keeps_the_zero_points_and_target_rounds_once(tmp_path: Path) -> None:
    tensors = _gptq_checkpoint(tmp_path / "src", checkpoint_format="gptq_v2")
    out = _run(tmp_path / "src", preset="gptq-dequant", params={"target": "bf16"})
    for name, t in _expect_gptq(tensors, 4, "gptq_v2").items():
        assert torch.equal(as_bytes(out[name]), as_bytes(t.to(out[name].dtype))), name
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16


def test_gptq_dequant_preset_from_remap_writes_the_config(tmp_path: Path) -> None:
    tensors = _gptq_checkpoint(tmp_path / "src", desc_act=True)
    weightmap.remap(tmp_path / "src", tmp_path / "out", preset="gptq-dequant", progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    for name, t in _expect_gptq(tensors, 4).items():
        assert torch.equal(as_bytes(out[name]), as_bytes(t)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "float32"


def test_gptq_dequant_preset_refuses_other_checkpoints(tmp_path: Path) -> None:
    root = save_checkpoint(
        tmp_path / "fp", {"a.weight": torch.ones(2, 2)}, {"torch_dtype": "float32"}
    )
    with pytest.raises(MappingError, match="not a GPTQ checkpoint"):
        weightmap.compile(root, preset="gptq-dequant")
    _gptq_checkpoint(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MappingError, match="GPTQ with 3-bit codes"):
        weightmap.compile(tmp_path / "src", preset="gptq-dequant")


def test_gptq_per_channel_without_g_idx(tmp_path: Path) -> None:
    """group_size -1: one group of every input row per output column. Without g_idx the
    rows' group was i // group_size, which -1 cannot give: the block is the whole dim."""
    gen = torch.Generator().manual_seed(5)
    tensors = {"model.norm.weight": torch.randn(64, generator=gen).half()}
    layer = _gptq_layer(gen, 64, 48, 64, 4, False)  # one group of all 64 rows
    for part in ("qweight", "qzeros", "scales"):
        tensors[f"model.layers.0.o_proj.{part}"] = layer[part]
    quant = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False}
    save_checkpoint(tmp_path / "src", tensors, {"quantization_config": quant})
    out = _run(tmp_path / "src", preset="gptq-dequant")
    expected = dequant_gptq(
        torch.zeros(64, dtype=torch.int32), layer["qweight"], layer["qzeros"], layer["scales"], 4
    )
    assert torch.equal(as_bytes(out["model.layers.0.o_proj.weight"]), as_bytes(expected))


def test_gptq_dequant_reads_gptq_layouts_only(tmp_path: Path) -> None:
    """A kernel's layout (marlin repacks codes and scales) would dequantize to wrong weights
    without an error; a null checkpoint_format is GPTQ's default, zero points minus one."""
    _gptq_checkpoint(tmp_path / "marlin", checkpoint_format="marlin")
    with pytest.raises(MappingError, match=r'checkpoint_format "marlin": only GPTQ\'s own'):
        weightmap.compile(tmp_path / "marlin", preset="gptq-dequant")
    tensors = _gptq_checkpoint(tmp_path / "null")
    config = json.loads((tmp_path / "null" / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = None
    (tmp_path / "null" / "config.json").write_text(json.dumps(config))
    out = _run(tmp_path / "null", preset="gptq-dequant")
    for name, t in _expect_gptq(tensors, 4, "gptq").items():
        assert torch.equal(as_bytes(out[name]), as_bytes(t)), name


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
    save_checkpoint(root, tensors, {"torch_dtype": "float16", "quantization_config": quant})
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
        assert torch.equal(as_bytes(out[f"{base}.weight"]), as_bytes(ref)), base
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
    config["quantization_config"].update(bits=4, zero_point=False)
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MappingError, match="AWQ without zero points"):
        weightmap.compile(tmp_path / "src", preset="awq-dequant")
    config["quantization_config"].update(zero_point=True, version="gemv")
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MappingError, match=r'AWQ version "gemv": only the GEMM layout'):
        weightmap.compile(tmp_path / "src", preset="awq-dequant")
    del config["quantization_config"]["group_size"]
    config["quantization_config"]["version"] = "gemm"
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    with pytest.raises(MappingError, match="quantization_config has no group_size"):
        weightmap.compile(tmp_path / "src", preset="awq-dequant")


def test_awq_dequant_reads_autoawqs_own_config_keys(tmp_path: Path) -> None:
    """AutoAWQ's quant_config names (q_group_size, w_bit, version "GEMM"), as transformers
    reads them too: the same weights as with transformers' names."""
    tensors = _awq_checkpoint(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    quant = config["quantization_config"]
    config["quantization_config"] = {
        "quant_method": "awq", "w_bit": 4, "q_group_size": quant["group_size"],
        "version": "GEMM", "zero_point": True,
    }  # fmt: skip
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    out = _run(tmp_path / "src", preset="awq-dequant")
    base = "model.layers.0.mlp.up_proj"
    ref = dequantize_gemm(
        tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], 4, 32
    ).T
    assert torch.equal(as_bytes(out[f"{base}.weight"]), as_bytes(ref))


# ---------------------------------------------------------------- the primitives


@pytest.mark.parametrize(
    ("word", "bits", "order", "dim"),
    [
        (torch.int32, 4, [0, 4, 1, 5, 2, 6, 3, 7], 1),
        (torch.int32, 4, list(range(8)), 0),
        (torch.uint8, 2, [3, 2, 1, 0], 1),
        (torch.int64, 16, [1, 0, 3, 2], 0),
        (torch.int16, 1, list(range(15, -1, -1)), 1),
    ],
)
def test_unpack_is_shift_and_mask_and_pack_undoes_it(
    tmp_path: Path, word: torch.dtype, bits: int, order: list[int], dim: int
) -> None:
    gen = torch.Generator().manual_seed(bits)
    info = torch.iinfo(word)
    words = torch.randint(info.min, info.max, (6, 5), generator=gen, dtype=torch.int64).to(word)
    root = save_checkpoint(tmp_path / "src", {"w": words})
    width = info.bits
    name = {torch.int32: "i32", torch.uint8: "u8", torch.int64: "i64", torch.int16: "i16"}[word]
    mapping = f"""weightmap 1
unpack "w" dim {dim} bits {bits} order {order} -> "codes"
copy "codes" -> "c2"
pack "c2" dim {dim} bits {bits} order {order} to {name} -> "back"
"""
    out = _run(root, mapping, chunks=(1 << 20, 7, 3))
    wide = words.to(torch.int64)
    fields = [(wide >> (f * bits)) & ((1 << bits) - 1) for f in order]  # code i = field order[i]
    expected = torch.stack(fields, dim + 1).flatten(dim, dim + 1)
    assert out["codes"].dtype == (torch.uint8 if bits <= 8 else torch.uint16)
    assert out["codes"].shape[dim] == words.shape[dim] * (width // bits)
    assert torch.equal(out["codes"].to(torch.int64), expected)
    assert torch.equal(out["back"], words)


def test_pack_stops_at_a_code_too_wide_for_its_field(tmp_path: Path) -> None:
    root = save_checkpoint(
        tmp_path / "src", {"c": torch.tensor([[1, 2, 3, 16, 0, 0, 0, 0]], dtype=torch.uint8)}
    )
    with pytest.raises(ExecutionError, match=r"codes in \[0, 16\] do not fit in 4 bits"):
        _run(root, 'weightmap 1\npack "c" dim 1 bits 4 -> "w"\n', chunks=(1 << 20,))


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ('unpack "w" dim 0 bits 3', "bits must be one of 1, 2, 4, 8, 16, got 3"),
        ('unpack "w" dim 0 bits 4 order [0, 1, 2]', r"order \[0, 1, 2\] must list each of the 8"),
        ('unpack "f" dim 0 bits 4', "`f` is F32: unpack reads integer words"),
        ('unpack "b" dim 0 bits 8', "8-bit codes need a word wider than U8's 8 bits"),
        ('pack "b" dim 0 bits 4 -> "p"', r"dim 0 must hold whole words of 8 codes"),
        ('pack "f" dim 0 bits 4 -> "p"', "`f` is F32: pack reads integer codes"),
        ('pack "b" dim 0 bits 4 to f32 -> "p"', "word dtype"),
        ('gather "f", "f2" dim 0 -> "g"', "the index of a gather must be an integer tensor"),
        ('gather "f", "w" dim 0 -> "g"', r"`w` is \[2, 3\]: a gather's index is 1-D"),
        ('lookup "f", "f2" -> "v"', "the codes of a lookup must be an integer tensor"),
        ('lookup "b", "w" -> "v"', "a lookup table is a non-empty 1-D tensor"),
        ('matmul "f", "w" -> "m"', "matmul runs on float|is I32: arithmetic runs on float"),
        ('matmul "f", "f3" -> "m"', r"the columns of the first must match the rows"),
        ('matmul "f", "f2" in bf16 -> "m"', "compute dtype"),
        ('matmul "f" -> "m"', "`matmul` takes two tensors, one per pattern"),
        ('sub "w" 1', "`w` is I32: arithmetic runs on float tensors"),
        ('round "w"', "`w` is I32: arithmetic runs on float tensors"),
        ('clamp "f" [2, 1]', r"clamp bounds \[2, 1\] must be finite, low <= high"),
        ('clamp "f" 3', "clamp takes \\[low, high\\], two numbers"),
        ('amax "f" dim 1 group 2 -> "m"', "group 2 must be positive and divide dim 1"),
        ('sum "w" dim 0 -> "m"', "`w` is I32: arithmetic runs on float tensors"),
        ('sum "f" dim 0 in bf16 -> "m"', "compute dtype"),
    ],
)
def test_primitives_are_checked_at_compile_time(tmp_path: Path, rule: str, why: str) -> None:
    root = save_checkpoint(
        tmp_path / "src",
        {"w": torch.zeros(2, 3, dtype=torch.int32), "f": torch.zeros(2, 3),
         "f2": torch.zeros(3, 2), "f3": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.uint8)},
    )  # fmt: skip
    with pytest.raises(MappingError, match=why):
        weightmap.compile(root, mapping=f"weightmap 1\n{rule}\nunmatched keep\n")


def test_casts_between_integers_and_floats_check_what_would_change(tmp_path: Path) -> None:
    root = save_checkpoint(
        tmp_path / "src",
        {"i": torch.tensor([-3, 0, 70000], dtype=torch.int32),
         "u": torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16),
         "whole": torch.tensor([-2.0, 0.0, 255.0]), "half": torch.tensor([1.5]),
         "nan": torch.tensor([float("nan")]), "big": torch.tensor([300.0])},
    )  # fmt: skip
    out = _run(root, 'weightmap 1\ncast "i" to f32\ncast "whole" to i16\nunmatched keep\n')
    assert torch.equal(out["i"], torch.tensor([-3.0, 0.0, 70000.0]))
    assert torch.equal(out["whole"], torch.tensor([-2, 0, 255], dtype=torch.int16))
    for rule, why in (
        (
            'cast "half" to i32',
            r"1\.5 is not a whole number: a cast from F32 to I32 does not round",
        ),
        ('cast "nan" to i32', "a NaN or an infinity cannot be cast from F32 to I32"),
        ('cast "big" to u8', r"values in \[300, 300\] do not fit in U8"),
        ('cast "u" to f16', r"values in \[1, 65535\] do not fit in F16"),
    ):
        with pytest.raises(ExecutionError, match=why):
            _run(root, f"weightmap 1\n{rule}\nunmatched keep\n", chunks=(1 << 20,))


def test_gather_and_lookup_stop_at_an_index_out_of_range(tmp_path: Path) -> None:
    root = save_checkpoint(
        tmp_path / "src",
        {"s": torch.randn(3, 4), "g": torch.tensor([0, 2, 3, 1]),
         "c": torch.tensor([[0, 1], [5, 2]], dtype=torch.uint8), "t": torch.randn(4)},
    )  # fmt: skip
    with pytest.raises(ExecutionError, match=r"gather indexes run from 0 to 3, outside 0\.\.2"):
        _run(root, 'weightmap 1\ngather "s", "g" dim 0 -> "x"\nunmatched keep\n', chunks=(1 << 20,))
    with pytest.raises(ExecutionError, match=r"lookup codes run from 0 to 5, outside 0\.\.3"):
        _run(root, 'weightmap 1\nlookup "c", "t" -> "x"\nunmatched keep\n', chunks=(1 << 20,))


def test_lookup_decodes_codes_through_a_codebook(tmp_path: Path) -> None:
    """A 4-bit codebook format: two codes per byte, low nibble first, each an entry of a
    16-value table (bitsandbytes' NF4 values here), times a per-block absmax."""
    gen = torch.Generator().manual_seed(3)
    nf4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                        0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])  # fmt: skip
    packed = torch.randint(0, 256, (64,), generator=gen, dtype=torch.int64).to(torch.uint8)
    absmax = torch.rand(4, generator=gen)
    root = save_checkpoint(
        tmp_path / "src", {"w.packed": packed, "w.table": nf4, "w.absmax": absmax}
    )
    mapping = """weightmap 1
unpack "w.packed" dim 0 bits 4 -> "w.codes"
lookup "w.codes", "w.table" -> "w.values"
mul "w.values", "w.absmax" block [32] -> "w.weight"
"""
    out = _run(root, mapping, chunks=(1 << 20, 40, 9))
    codes = torch.stack([packed & 15, packed >> 4], 1).flatten().long()
    expected = nf4[codes] * absmax.repeat_interleave(32)
    assert torch.equal(out["w.weight"], expected)


def test_dequantizations_are_not_inverted_and_say_why() -> None:
    for text, why in (
        ('unpack "w" dim 0 bits 4 -> "c"', "does not say the words' dtype"),
        ('gather "s", "g" dim 0 -> "x"', "a gather repeats or leaves out"),
        ('lookup "c", "t" -> "x"', "a table lookup cannot be read back"),
        ('matmul "a", "b" -> "c"', "cannot be factored back"),
        ('sub "a", "b" -> "c"', "arithmetic rounds to its result dtype"),
        ('round "a"', "rounding and clamping forget"),
        ('amax "a" dim 0 group 32 -> "s"', "a reduction keeps one value of many"),
    ):
        with pytest.raises(MappingError, match=why):
            weightmap.invert(weightmap.load_mapping(f"weightmap 1\n{text}\n"))
    with pytest.raises(MappingError, match=r"cannot be factored back|a gather repeats"):
        weightmap.invert(weightmap.load_mapping("gptq-dequant"))


# ---------------------------------------------------------------- the matrix product


def _matmul_node(m: int, k: int, n: int, compute: str = "F32", out: str = "F32") -> Any:
    from weightmap.plan.nodes import Matmul, Source

    a = Source(name="a", dtype="F32", shape=(m, k))
    b = Source(name="b", dtype="F32", shape=(k, n))
    return Matmul(a=a, b=b, compute=compute, dtype=out, shape=(m, n))


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40), k=st.integers(1, 30), n=st.integers(1, 40),
    cuts=st.lists(st.integers(1, 39), max_size=4), dim=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_matmul_gives_the_same_bits_whatever_the_chunks_and_threads(
    m: int, k: int, n: int, cuts: list[int], dim: int, seed: int
) -> None:
    """Each output element is summed in the same order, however the output is cut into
    chunks (by rows or by columns) and whatever torch's thread count; torch.matmul itself
    differs between one thread and two on some of these shapes."""
    from weightmap.execute.chunks import region
    from weightmap.execute.kernels import evaluate

    gen = torch.Generator().manual_seed(seed)
    inputs = {"a": torch.randn(m, k, generator=gen), "b": torch.randn(k, n, generator=gen)}
    node = _matmul_node(m, k, n)
    extent = node.shape[dim]
    bounds = sorted({0, extent, *(c for c in cuts if c < extent)})
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            whole = evaluate(node, inputs.__getitem__)
            pieces = [
                region(node, dim, lo, hi, inputs.__getitem__, "t")
                for lo, hi in itertools.pairwise(bounds)
            ]
            assert torch.equal(torch.cat(pieces, dim), whole)
            results.append(whole)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], inputs["a"] @ inputs["b"], rtol=1e-5, atol=1e-5)


def test_matmul_rule_streams_in_row_chunks(tmp_path: Path) -> None:
    """``matmul`` of two tensors of a checkpoint (a LoRA-shaped product, B @ A), rounded once
    to bf16 from float32; streamed at chunk sizes that cut row tiles."""
    gen = torch.Generator().manual_seed(9)
    lora_b = torch.randn(200, 8, generator=gen).to(torch.bfloat16)
    lora_a = torch.randn(8, 96, generator=gen).to(torch.bfloat16)
    root = save_checkpoint(tmp_path / "src", {"l.lora_B": lora_b, "l.lora_A": lora_a})
    out = _run(root, 'weightmap 1\nmatmul "l.lora_B", "l.lora_A" to bf16 -> "l.delta"\n',
               chunks=(1 << 20, 5000, 100))  # fmt: skip
    acc = torch.zeros(200, 96)
    for i in range(8):  # the inner index in order, each product and sum rounded in float32
        acc = acc + lora_b[:, i : i + 1].float() * lora_a[i : i + 1, :].float()
    assert torch.equal(out["l.delta"], acc.to(torch.bfloat16))
    plan = weightmap.compile(root, mapping='weightmap 1\nmatmul "l.lora_B", "l.lora_A" -> "d"\n')
    assert "matmul l.lora_A in F32" in plan.explain()


@pytest.mark.parametrize(("m", "k", "n"), [(64, 16, 64), (32, 1024, 48), (8, 4096, 8)])
def test_matmul_error_is_within_the_bound_of_an_ordered_sum(m: int, k: int, n: int) -> None:
    """Summed in order in float32, each element is within gamma_k * sum_i |a_i b_i| of the
    exact product (gamma_k = k u / (1 - k u), u = 2**-24), the classic bound of a recursive
    sum; torch.matmul's blocked sums meet it too, with other bits."""
    from weightmap.execute import values

    gen = torch.Generator().manual_seed(k)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    ours = values.matmul(a, b, _matmul_node(m, k, n))
    exact = a.double() @ b.double()
    u = 2.0**-24
    gamma = k * u / (1 - k * u)
    bound = gamma * (a.abs().double() @ b.abs().double())
    assert bool(((ours.double() - exact).abs() <= bound).all())


# ---------------------------------------------------------------- the worked examples


def test_gptq_worked_example_matches_llama_cpp(tmp_path: Path) -> None:
    from test_conversions import example

    tensors = _gptq_checkpoint(tmp_path / "src", desc_act=True)
    out = _run(tmp_path / "src", example("gptq-dequant"))
    expected = _expect_gptq(tensors, 4)
    assert out.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(as_bytes(out[name]), as_bytes(t)), name


def test_awq_worked_example_matches_autoawq(tmp_path: Path) -> None:
    from test_conversions import example

    tensors = _awq_checkpoint(tmp_path / "src")
    out = _run(tmp_path / "src", example("awq-dequant"))
    for base in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        ref = dequantize_gemm(
            tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], 4, 32
        ).T
        assert torch.equal(as_bytes(out[f"{base}.weight"]), as_bytes(ref)), base


# ---------------------------------------------------------------- rounding, clamping, reductions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_round_floor_ceil_clamp_are_torchs(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(40, 6, generator=gen) * 6).to(dtype)
    x[0, :4] = torch.tensor([0.5, 1.5, 2.5, -0.5]).to(dtype)  # ties go to even
    x[1, 0] = float("nan")
    names = ("r", "f", "c", "k")
    root = save_checkpoint(tmp_path / "src", {n: x.clone() for n in names})
    mapping = """weightmap 1
round "r"
floor "f"
ceil "c"
clamp "k" [-2.5, 3]
"""
    out = _run(root, mapping, chunks=(1 << 20, 50, 7))
    # torch in the tensor's own dtype; a NaN stays a NaN (its payload is not a value).
    for name, ref in zip(names, (torch.round(x), torch.floor(x), torch.ceil(x),
                                 torch.clamp(x, -2.5, 3)), strict=True):  # fmt: skip
        got = out[name]
        assert got.dtype == dtype
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), name
        keep = ~torch.isnan(ref)
        assert torch.equal(as_bytes(got[keep]), as_bytes(ref[keep])), name
    assert torch.equal(out["r"][0, :4].float(), torch.tensor([0.0, 2.0, 2.0, -0.0]))


def test_reductions_by_axis_and_by_group(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(12, 10, generator=gen).to(torch.bfloat16)
    ids = torch.randint(-100, 100, (12, 10), generator=gen).to(torch.int16)
    root = save_checkpoint(tmp_path / "src", {"x": x, "ids": ids})
    mapping = """weightmap 1
copy "x" -> "x2", "x3"
amax "x" dim 0 group 4 -> "amax"
amin "ids" dim 1 -> "amin"
sum "x2" dim 1 group 5 to f32 -> "sum"
sum "x3" dim 0 in f64 -> "total"
"""
    out = _run(root, mapping, chunks=(1 << 20, 30, 5))
    assert torch.equal(out["amax"], x.reshape(3, 4, 10).amax(1))
    assert torch.equal(out["amin"], ids.amin(1))
    groups = x.float().reshape(12, 2, 5)
    acc = groups[:, :, 0]
    for i in range(1, 5):  # in order, each sum rounded in float32
        acc = acc + groups[:, :, i]
    assert torch.equal(out["sum"], acc)
    col = x.double()
    total = col[0]
    for i in range(1, 12):
        total = total + col[i]
    assert torch.equal(out["total"], total.to(torch.bfloat16))
    assert out["total"].shape == (10,)


def test_int4_quantization_composes_and_packs(tmp_path: Path) -> None:
    """round(w / s) clamped to [-8, 7], offset to [0, 15], cast to bytes and packed eight to an
    int32 (GPTQ's layout) from the primitives; a code that would not fit stops the run."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(64, 6, generator=gen)
    inv_scales = torch.rand(2, 6, generator=gen) * 4 + 1
    root = save_checkpoint(tmp_path / "src", {"w": w, "inv_s": inv_scales})
    mapping = """weightmap 1
mul "w", "inv_s" block [32, 1] -> "q"
round "q"
clamp "q" [-8, 7]
add "q" 8
cast "q" to u8
pack "q" dim 0 bits 4 to i32 -> "qweight"
"""
    out = _run(root, mapping, chunks=(1 << 20, 100, 9))
    codes = (torch.clamp(torch.round(w * inv_scales.repeat_interleave(32, 0)), -8, 7) + 8).long()
    words = sum(codes.reshape(8, 8, 6)[:, i] << (4 * i) for i in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(out["qweight"], words)
    unclamped = mapping.replace('clamp "q" [-8, 7]\n', "")
    with pytest.raises(ExecutionError, match="do not fit in U8"):
        _run(root, unclamped, chunks=(1 << 20,))


def test_gather_and_lookup_move_any_dtype(tmp_path: Path) -> None:
    """torch has no index_select for uint16..uint64 (found by the generated plans): elements
    are selected as the integers of their width, whatever the dtype."""
    gen = torch.Generator().manual_seed(14)
    u16 = torch.randint(0, 2**16, (3, 4), generator=gen).to(torch.uint16)
    fp8 = torch.randn(3, 4, generator=gen).to(torch.float8_e4m3fn)
    table = torch.randint(0, 2**32, (5,), generator=gen).to(torch.uint32)
    index = torch.tensor([2, 0, 2, 1])
    codes = torch.tensor([[4, 0], [1, 1]], dtype=torch.uint8)
    root = save_checkpoint(tmp_path / "src", {"u16": u16, "fp8": fp8, "table": table, "g": index,
                                    "codes": codes})  # fmt: skip
    mapping = """weightmap 1
copy "g" -> "g2"
gather "u16", "g" dim 0 -> "a"
gather "fp8", "g2" dim 1 -> "b"
lookup "codes", "table" -> "c"
"""
    out = _run(root, mapping, chunks=(1 << 20, 5))
    assert torch.equal(out["a"].view(torch.int16), u16.view(torch.int16)[index])
    assert torch.equal(as_bytes(out["b"]), as_bytes(fp8[:, index]))
    assert torch.equal(out["c"].view(torch.int32), table.view(torch.int32)[codes.long()])


@pytest.mark.parametrize(
    ("desc_act", "with_g_idx", "group"), [(True, True, 32), (False, False, 16)]
)
def test_gptq_and_awq_presets_from_the_command_line(
    tmp_path: Path, desc_act: bool, with_g_idx: bool, group: int
) -> None:
    """Both presets as a user runs them: GPTQ with act-order (g_idx) and without any g_idx
    (groups in order), AWQ at two group sizes; every dequantized projection checked."""
    from weightmap import cli

    tensors = _gptq_checkpoint(tmp_path / "gptq", desc_act=desc_act, with_g_idx=with_g_idx)
    code = cli.main(["convert", str(tmp_path / "gptq"), str(tmp_path / "gptq-out"), "--preset",
                     "gptq-dequant", "--set", "target=f16", "--quiet", "--verify"])  # fmt: skip
    assert code == 0
    out = load_file(tmp_path / "gptq-out" / "model.safetensors")
    for name, t in _expect_gptq(tensors, 4).items():
        assert torch.equal(out[name], t.to(out[name].dtype)), name
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    awq = _awq_checkpoint(tmp_path / "awq", group)
    code = cli.main(["convert", str(tmp_path / "awq"), str(tmp_path / "awq-out"), "--preset",
                     "awq-dequant", "--quiet"])  # fmt: skip
    assert code == 0
    out = load_file(tmp_path / "awq-out" / "model.safetensors")
    for base in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"):
        ref = dequantize_gemm(awq[f"{base}.qweight"], awq[f"{base}.qzeros"],
                              awq[f"{base}.scales"], 4, group).T  # fmt: skip
        assert torch.equal(out[f"{base}.weight"], ref), base


# ---------------------------------------------------------------- the outputs load


@pytest.mark.parametrize("preset", ["gptq-dequant", "awq-dequant"])
def test_a_dequantized_llama_loads_into_its_model(tmp_path: Path, preset: str) -> None:
    """Every Linear of a tiny Llama (saved by transformers) quantized as GPTQ or AWQ lays them
    out, then dequantized by the preset: the output loads into LlamaForCausalLM with nothing
    missing, unexpected or mis-shaped (the load check every preset's tests run)."""
    from hfmodel import build

    model = build(tmp_path / "llama", "safetensors", tied=False)
    gen = torch.Generator().manual_seed(3)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        base = name.removesuffix(".weight")
        if not (name.endswith("_proj.weight") and t.dim() == 2):
            tensors[name] = t.half()  # (as the releases keep them: float16)
            continue
        n, k = t.shape  # nn.Linear's [out, in]
        if preset == "gptq-dequant":  # codes along the input dim
            tensors[f"{base}.qweight"] = _words(gen, k // 8, n)
            tensors[f"{base}.qzeros"] = _words(gen, k // 32, n // 8)
            tensors[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // 32
        else:  # AWQ: codes along the output dim
            tensors[f"{base}.qweight"] = _words(gen, k, n // 8)
            tensors[f"{base}.qzeros"] = _words(gen, k // 32, n // 8)
        tensors[f"{base}.scales"] = (torch.rand(k // 32, n, generator=gen) * 0.02).half()
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float16"
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
        if preset == "gptq-dequant"
        else {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 32,
            "version": "gemm",
            "zero_point": True,
        }
    )
    src = save_checkpoint(tmp_path / "quantized", tensors, config)
    before = weightmap.check_loads(src)
    assert not before.ok  # (the quantized layout is no Llama of plain weights)
    # target=f16: the weights in the dtype of the rest (gptq-dequant's default, f32, leaves the
    # float16 norms and embeddings beside float32 weights, which the check reports: see
    # docs/presets.md).
    params = {"target": "f16"} if preset == "gptq-dequant" else None
    result = weightmap.remap(src, tmp_path / "out", preset=preset, params=params, progress=False)
    report = weightmap.check_loads(tmp_path / "out")
    assert report.ok, str(report)
    assert weightmap.check_loads(result.plan).ok  # (and before a byte is written)
