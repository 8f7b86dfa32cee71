"""Synthetic checkpoints: the drafter's shapes at any size, written fast, and the mappings.

The tensors have the names of a speculators EAGLE-3 drafter and, at 4.3 GB, the shapes of the
Kimi-K2.5 drafter (``dims_for`` scales the smaller sizes). The mapping texts are the ones the
benchmark runs; the report prints them as written here.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import GB, MIB, ROOT

if TYPE_CHECKING:
    import numpy as np

EXAMPLE_CONFIG = ROOT / "examples" / "eagle3-speculators" / "config.json"
PRESET = "eagle3-sglang"

# The Kimi-K2.5 EAGLE-3 drafter: one Llama decoder layer at the verifier's hidden size.
HIDDEN = 7168
HEAD_DIM = 128
FULL = {"vocab": 163840, "draft_vocab": 32000, "heads": 64, "kv_heads": 8, "inter": 18432}
LAYER = "layers.0."
SPLIT_NAME = LAYER + "self_attn.qkv_proj.weight"
TRANSPOSE_NAME = "fc.weight"

RENAME_FORWARD = """weightmap 1
rename "layers.0.{rest*}" -> "midlayer.{rest}"
keep "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"
"""
RENAME_BACK = """weightmap 1
rename "midlayer.{rest*}" -> "layers.0.{rest}"
keep "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"
"""
CAST_TO_F32 = """weightmap 1
cast "{name*}" to F32 where dtype == "BF16"
keep "{name*}"
"""
CAST_TO_BF16 = """weightmap 1
cast "{name*}" to BF16 where dtype == "F32"
keep "{name*}"
"""
SPLIT = f"""weightmap 1
split "{SPLIT_NAME}" dim 0 sizes [{HIDDEN}, {HIDDEN}, {HIDDEN}] -> "{LAYER}self_attn.q_proj.weight", "{LAYER}self_attn.k_proj.weight", "{LAYER}self_attn.v_proj.weight"
"""  # noqa: E501
TRANSPOSE = f"""weightmap 1
transpose "{TRANSPOSE_NAME}"
"""


@dataclass(frozen=True)
class Dims:
    vocab: int
    draft_vocab: int
    heads: int
    kv_heads: int
    inter: int

    def tensors(self, float_dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (safetensors dtype, shape), in the speculators EAGLE-3 layout."""
        h, f = HIDDEN, float_dtype
        q, kv = self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM
        return {
            "d2t": ("I64", (self.draft_vocab,)),
            "t2d": ("BOOL", (self.vocab,)),
            "embed_tokens.weight": (f, (self.vocab, h)),
            "fc.weight": (f, (h, 3 * h)),
            "lm_head.weight": (f, (self.draft_vocab, h)),
            "norm.weight": (f, (h,)),
            LAYER + "input_layernorm.weight": (f, (h,)),
            LAYER + "hidden_norm.weight": (f, (h,)),
            LAYER + "post_attention_layernorm.weight": (f, (h,)),
            # The attention input is [embeddings; hidden state], hence 2 * hidden.
            LAYER + "self_attn.q_proj.weight": (f, (q, 2 * h)),
            LAYER + "self_attn.k_proj.weight": (f, (kv, 2 * h)),
            LAYER + "self_attn.v_proj.weight": (f, (kv, 2 * h)),
            LAYER + "self_attn.o_proj.weight": (f, (h, q)),
            LAYER + "mlp.gate_proj.weight": (f, (self.inter, h)),
            LAYER + "mlp.up_proj.weight": (f, (self.inter, h)),
            LAYER + "mlp.down_proj.weight": (f, (h, self.inter)),
        }

    def nbytes(self, float_dtype: str = "BF16") -> int:
        return sum(_nbytes(d, s) for d, s in self.tensors(float_dtype).values())


_ITEMSIZE = {"F8_E4M3": 1, "BF16": 2, "F32": 4, "I64": 8, "BOOL": 1}


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return _ITEMSIZE[dtype] * math.prod(shape)


def dims_for(size_gb: float) -> Dims:
    """The full drafter at 4.3 GB; smaller sizes scale every row count but the hidden size.

    Scaling the vocabulary alone cannot go below the ~2 GB of the other tensors, so the draft
    vocabulary, heads and intermediate size shrink by the same factor, and the vocabulary
    absorbs the rounding so the checkpoint lands on the requested size.
    """
    full = Dims(**FULL)
    target = size_gb * GB
    if abs(target - full.nbytes()) < 0.05 * GB:
        return full
    fixed = _nbytes("BF16", (HIDDEN, 3 * HIDDEN))
    g = max(1e-3, (target - fixed) / (full.nbytes() - fixed))
    kv_heads = max(1, round(FULL["kv_heads"] * g))
    heads = max(kv_heads, round(FULL["heads"] * g / kv_heads) * kv_heads)
    rest = Dims(
        vocab=0,
        draft_vocab=max(64, round(FULL["draft_vocab"] * g / 64) * 64),
        heads=heads,
        kv_heads=kv_heads,
        inter=max(128, round(FULL["inter"] * g / 128) * 128),
    )
    per_row = 2 * HIDDEN + 1  # an embedding row plus its t2d entry
    vocab = max(64, round((target - rest.nbytes()) / per_row / 64) * 64)
    return Dims(vocab, rest.draft_vocab, rest.heads, rest.kv_heads, rest.inter)


def make_config(d: Dims) -> dict[str, Any]:
    """The example's speculators config.json with this drafter's sizes."""
    config: dict[str, Any] = json.loads(EXAMPLE_CONFIG.read_text())
    config["draft_vocab_size"] = d.draft_vocab
    layer = config["transformer_layer_config"]
    layer.update(
        head_dim=HEAD_DIM,
        hidden_size=HIDDEN,
        intermediate_size=d.inter,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        vocab_size=d.vocab,
    )
    return config


class Filler:
    """Plausible values fast: a 64 MiB block of normal floats, repeated."""

    def __init__(self, seed: int = 0) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        f32 = (rng.standard_normal(16 * MIB, dtype=np.float32) * 0.02).astype(np.float32)
        self.block = {
            "F32": f32.tobytes(),
            # bf16 is the top half of an f32, rounded to nearest even.
            "BF16": (
                ((f32.view(np.uint32) + 0x7FFF + ((f32.view(np.uint32) >> 16) & 1)) >> 16)
                .astype(np.uint16)
                .tobytes()
            ),
        }
        self.rng: np.random.Generator = rng

    def write(self, fd: int, dtype: str, shape: tuple[int, ...]) -> None:
        import numpy as np

        n = _nbytes(dtype, shape)
        if dtype == "I64":
            data = self.rng.integers(0, 4096, n // 8, dtype=np.int64).tobytes()
            os.write(fd, data)
            return
        if dtype == "BOOL":
            os.write(fd, (self.rng.random(n) < 0.2).astype(np.uint8).tobytes())
            return
        block = memoryview(self.block[dtype])
        start = int(self.rng.integers(0, 1024)) * 64
        while n:
            chunk = block[start : start + n]
            start = 0
            n -= os.write(fd, chunk)
            if n and len(chunk) == 0:
                raise RuntimeError("empty fill block")


def write_checkpoint(
    folder: Path,
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    config: dict[str, Any] | None,
    filler: Filler,
) -> int:
    """A one-file safetensors checkpoint (and config.json); returns the file's size."""
    folder.mkdir(parents=True)
    size = _write_file(folder / "model.safetensors", tensors, {"format": "pt"}, filler)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return size


def _write_file(
    path: Path,
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    metadata: dict[str, str],
    filler: Filler,
) -> int:
    """One safetensors file, tensors in the given order; returns its size."""
    header: dict[str, Any] = {"__metadata__": metadata}
    position = 0
    for name, (dtype, shape) in tensors.items():
        end = position + _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, end]}
        position = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, struct.pack("<Q", len(text)) + text)
        for dtype, shape in tensors.values():
            filler.write(fd, dtype, shape)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path.stat().st_size


def read_header(folder: Path) -> dict[str, Any]:
    """The tensor entries of every ``*.safetensors`` file in ``folder`` (shards merged)."""
    header: dict[str, Any] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header.update(json.loads(f.read(n)))
    header.pop("__metadata__", None)
    return header


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def warm(folder: Path) -> None:
    """Read every file once so the run starts with its input in the page cache."""
    buf = bytearray(64 * MIB)
    for path in sorted(folder.iterdir()):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# A MoE-shaped checkpoint of many small tensors: 48 layers in 48 shards, 388 tensors each
# (126 routed experts and one shared expert of 3 projections, q/k/v/o, the router, two norms).
MOE_LAYERS = 48
MOE_EXPERTS = 126
MOE_HIDDEN = 256
MOE_INTER = 87
MOE_RENAME = """weightmap 1
rename "model.layers.{i:int}.{rest*}" -> "layers.{i}.{rest}"
"""


def moe_layer(i: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of layer ``i``, in the order the reference writer stores them."""
    h, m, p = MOE_HIDDEN, MOE_INTER, f"model.layers.{i}."
    out: dict[str, tuple[str, tuple[int, ...]]] = {
        p + "input_layernorm.weight": ("BF16", (h,)),
        p + "post_attention_layernorm.weight": ("BF16", (h,)),
        p + "mlp.gate.weight": ("BF16", (MOE_EXPERTS, h)),
    }
    for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"{p}self_attn.{w}.weight"] = ("BF16", (h, h))
    experts = [f"experts.{e}" for e in range(MOE_EXPERTS)] + ["shared_experts"]
    for e in experts:
        out[f"{p}mlp.{e}.gate_proj.weight"] = ("BF16", (m, h))
        out[f"{p}mlp.{e}.up_proj.weight"] = ("BF16", (m, h))
        out[f"{p}mlp.{e}.down_proj.weight"] = ("BF16", (h, m))
    return dict(sorted(out.items()))


def write_moe_checkpoint(folder: Path, filler: Filler) -> int:
    """48 shards of one layer each, with an index; returns the total size of the shards."""
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(MOE_LAYERS):
        name = f"model-{i + 1:05d}-of-{MOE_LAYERS:05d}.safetensors"
        layer = moe_layer(i)
        total += _write_file(folder / name, layer, {"format": "pt"}, filler)
        weight_map.update(dict.fromkeys(layer, name))
    size = sum(_nbytes(d, s) for i in range(MOE_LAYERS) for d, s in moe_layer(i).values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total
