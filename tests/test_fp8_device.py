"""fp8 block (de)quantization against the reference computed on the accelerator, bit for bit.

weightmap computes on the CPU; serving engines dequantize DeepSeek-V3-style checkpoints with
``weight_dequant`` on the GPU. The two must agree to the bit, so the reference here runs on
CUDA when it is available (``tests/gpu/run.sh`` runs these with the forward test), else on the
CPU. Each case appends what it measured to ``$WEIGHTMAP_DEVICE_REPORT`` when that is set.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import weightmap
from test_values import DEQUANT, E4M3, FP8_MAX, QUANT

from valuetools import as_bytes, save_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.device


def _report(node: pytest.Item, entry: dict[str, object]) -> None:
    node.user_properties.extend(entry.items())
    path = os.environ.get("WEIGHTMAP_DEVICE_REPORT")
    if path:
        with Path(path).open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def weight_dequant_on(w: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek-V3's ``weight_dequant`` semantics in torch on DEVICE: each element times its
    block's scale in float32, stored as bf16 (the Triton kernel computes the same products)."""
    w, s = w.to(DEVICE), s.to(DEVICE)
    m, n = w.shape
    scale = s.repeat_interleave(block, 0)[:m].repeat_interleave(block, 1)[:, :n]
    return (w.to(torch.float32) * scale).to(torch.bfloat16).cpu()


def quantize_on(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``Fp8Quantize`` semantics on DEVICE (partial blocks zero-padded)."""
    rows, cols = x.shape
    rt, ct = -(-rows // block), -(-cols // block)
    padded = torch.zeros(rt * block, ct * block, device=DEVICE)
    padded[:rows, :cols] = x.to(DEVICE, torch.float32)
    blocks = padded.reshape(rt, block, ct, block)
    max_abs = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(max_abs > 0, FP8_MAX / torch.where(max_abs > 0, max_abs, 1.0), 1.0)
    q = torch.clamp(blocks * scales[:, None, :, None], -FP8_MAX, FP8_MAX).to(E4M3)
    q = q.reshape(rt * block, ct * block)[:rows, :cols]
    return q.cpu(), (1.0 / scales).to(torch.float32).cpu()


# DeepSeek-V3's shapes, cut to a few blocks each way where they are large: q_a_proj's rows
# (1536), kv_a_proj_with_mqa (576 = 512 + 64 rows, a partial block), an expert's down_proj.
SHAPES = [(1536, 512), (576, 896), (512, 2048)]


@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_on_the_device_is_bitwise_weightmaps(
    tmp_path: Path, shape: tuple[int, int], request: pytest.FixtureRequest
) -> None:
    gen = torch.Generator().manual_seed(shape[0] + shape[1])
    w = (torch.randn(*shape, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    s = torch.rand(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128), generator=gen) * 1e-2
    root = save_checkpoint(tmp_path / "src", {"l.weight": w, "l.weight_scale_inv": s + 1e-4})
    weightmap.remap(root, tmp_path / "out", mapping=DEQUANT, progress=False)
    got = load_file(tmp_path / "out" / "model.safetensors")["l.weight"]
    ref = weight_dequant_on(w, s + 1e-4)
    differ = int((as_bytes(got).view(torch.int16) != as_bytes(ref).view(torch.int16)).sum())
    _report(request.node, {"case": f"dequant {shape}", "device": DEVICE, "elements_differ": differ})
    assert differ == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_on_the_device_is_bitwise_weightmaps(
    tmp_path: Path, shape: tuple[int, int], request: pytest.FixtureRequest
) -> None:
    gen = torch.Generator().manual_seed(shape[0] * 3 + shape[1])
    x = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)
    root = save_checkpoint(tmp_path / "src", {"l.weight": x})
    weightmap.remap(root, tmp_path / "out", mapping=QUANT, progress=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    q, inv = quantize_on(x)
    differ = int((as_bytes(out["l.weight"]) != as_bytes(q)).sum())
    scales_differ = int((out["l.weight_scale_inv"] != inv).sum())
    _report(
        request.node,
        {
            "case": f"quantize {shape}",
            "device": DEVICE,
            "elements_differ": differ,
            "scales_differ": scales_differ,
        },
    )
    assert differ == 0 and scales_differ == 0
