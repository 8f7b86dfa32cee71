"""A pure-PyTorch reference of the EAGLE-3 draft step in the ``speculators`` layout.

It reads a checkpoint written by ``speculators`` (nested ``config.json``, names
``layers.N.*``) and computes what ``Eagle3DraftModel`` computes at inference: the facts
sheet's section 3, with the flags ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``
and ``norm_output`` (Eagle-3.1: the next step is fed the normalised state), Qwen3
``q_norm``/``k_norm``, biases and extra decoder layers. Norms follow transformers'
``LlamaRMSNorm`` (float32 statistics, weight applied in the model dtype); attention uses
``scaled_dot_product_attention`` over a KV cache.

This module must stay independent of ``sglang_mirror``: the forward test is only worth
something if the two models share no code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class DraftOutput(NamedTuple):
    logits: torch.Tensor  # [n, Vd], float32
    hidden: torch.Tensor  # [n, H], the un-normalised output fed to the next draft step


def speculators_layers_to_capture(layer_ids: Sequence[int]) -> list[int]:
    """speculators (and vLLM) capture the input of layer ``id`` for each aux id."""
    return list(layer_ids)


@dataclass(frozen=True)
class RefConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    num_layers: int
    vocab_size: int
    draft_vocab_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool

    @classmethod
    def from_json(cls, cfg: dict[str, Any]) -> RefConfig:
        if cfg.get("speculators_model_type") != "eagle3":
            raise ValueError("not a speculators EAGLE-3 config")
        tl = cfg["transformer_layer_config"]
        if tl.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {tl['hidden_act']!r}")
        if "rope_parameters" in tl:
            params = dict(tl["rope_parameters"])
            theta = float(params.pop("rope_theta"))
            scaling: dict[str, Any] | None = params
        else:
            theta = float(tl.get("rope_theta", 10000.0))
            scaling = tl.get("rope_scaling")
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        return cls(
            hidden_size=tl["hidden_size"],
            num_heads=tl["num_attention_heads"],
            num_kv_heads=tl["num_key_value_heads"],
            head_dim=tl.get("head_dim") or tl["hidden_size"] // tl["num_attention_heads"],
            rms_norm_eps=tl["rms_norm_eps"],
            num_layers=tl.get("num_hidden_layers", 1),
            vocab_size=tl["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"],
            rope_theta=theta,
            rope_scaling=scaling,
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            norm_before_fc=bool(cfg.get("norm_before_fc", False)),
            fc_norm=bool(cfg.get("fc_norm", False)),
            norm_output=bool(cfg.get("norm_output", False)),
        )


def _inv_freq(cfg: RefConfig) -> torch.Tensor:
    """transformers' default / llama3 rope frequencies, in float32."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if cfg.rope_scaling is None:
        return inv
    kind = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    if kind != "llama3":
        raise NotImplementedError(f"rope type {kind!r}")
    factor = float(cfg.rope_scaling["factor"])
    low = float(cfg.rope_scaling["low_freq_factor"])
    high = float(cfg.rope_scaling["high_freq_factor"])
    old_len = float(cfg.rope_scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class SpeculatorsReference:
    """The draft model of a speculators checkpoint, run as a server would: extend, then steps.

    ``embed_tokens`` supplies the embedding table when the checkpoint has none (the
    verifier's table in practice).
    """

    def __init__(
        self,
        directory: Path,
        *,
        dtype: torch.dtype,
        device: torch.device,
        embed_tokens: torch.Tensor | None = None,
    ) -> None:
        cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        self.cfg = RefConfig.from_json(cfg)
        raw = load_file(str(directory / "model.safetensors"))
        self.w: dict[str, torch.Tensor] = {
            k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in raw.items()
        }
        if embed_tokens is not None:
            if "embed_tokens.weight" in self.w:
                raise ValueError("the checkpoint has its own embed_tokens.weight")
            self.w["embed_tokens.weight"] = embed_tokens.to(device=device, dtype=dtype)
        self.dtype, self.device = dtype, device
        self.d2t = self.w.get("d2t")
        if self.d2t is None and self.cfg.draft_vocab_size != self.cfg.vocab_size:
            raise ValueError("draft vocab differs from target vocab but there is no d2t")
        self.inv_freq = _inv_freq(self.cfg).to(device)
        self.reset()

    def reset(self) -> None:
        self.cache: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.cfg.num_layers
        self.next_position = 0

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids via ``d2t``."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _attention(self, n: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c, p = self.cfg, f"layers.{n}.self_attn."
        t = x.shape[0]
        q = self._linear(x, p + "q_proj").view(t, c.num_heads, c.head_dim)
        k = self._linear(x, p + "k_proj").view(t, c.num_kv_heads, c.head_dim)
        v = self._linear(x, p + "v_proj").view(t, c.num_kv_heads, c.head_dim)
        if p + "q_norm.weight" in self.w:  # Qwen3: per-head norms before rope
            q = _rms_norm(q, self.w[p + "q_norm.weight"], c.rms_norm_eps)
            k = _rms_norm(k, self.w[p + "k_norm.weight"], c.rms_norm_eps)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, t, hd]
        cached = self.cache[n]
        if cached is not None:
            k, v = torch.cat([cached[0], k], dim=1), torch.cat([cached[1], v], dim=1)
        self.cache[n] = (k, v)
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        total = k.shape[1]
        key_idx = torch.arange(total, device=x.device)
        query_idx = torch.arange(total - t, total, device=x.device)
        mask = key_idx[None, :] <= query_idx[:, None]
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim)
        )[0]
        return self._linear(out.transpose(0, 1).reshape(t, -1), p + "o_proj")

    def _mlp(self, n: int, x: torch.Tensor) -> torch.Tensor:
        p = f"layers.{n}.mlp."
        return self._linear(
            F.silu(self._linear(x, p + "gate_proj")) * self._linear(x, p + "up_proj"),
            p + "down_proj",
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        *,
        from_aux: bool,
        positions: torch.Tensor | None = None,
    ) -> DraftOutput:
        c, eps = self.cfg, self.cfg.rms_norm_eps
        t = input_ids.shape[0]
        if positions is None:
            positions = torch.arange(self.next_position, self.next_position + t, device=self.device)
        hidden = hidden.to(self.dtype)
        if from_aux:
            if c.norm_before_fc:
                hidden = _rms_norm(hidden, self.w["input_norm.weight"], eps)
            if c.fc_norm:  # Eagle-3.1: one norm per aux hidden state
                chunks = hidden.chunk(sum(k.startswith("fc_norm.") for k in self.w), dim=-1)
                hidden = torch.cat(
                    [
                        _rms_norm(x, self.w[f"fc_norm.{j}.weight"], eps)
                        for j, x in enumerate(chunks)
                    ],
                    dim=-1,
                )
            hidden = self._linear(hidden, "fc")
        embeds = F.embedding(input_ids, self.w["embed_tokens.weight"])
        normed_hidden = _rms_norm(hidden, self.w["layers.0.hidden_norm.weight"], eps)
        residual = normed_hidden if c.norm_before_residual else hidden
        z = torch.cat(
            [_rms_norm(embeds, self.w["layers.0.input_layernorm.weight"], eps), normed_hidden],
            dim=-1,
        )
        x = residual + self._attention(0, z, positions)
        x = x + self._mlp(0, _rms_norm(x, self.w["layers.0.post_attention_layernorm.weight"], eps))
        for n in range(1, c.num_layers):
            p = f"layers.{n}."
            x = x + self._attention(
                n, _rms_norm(x, self.w[p + "input_layernorm.weight"], eps), positions
            )
            x = x + self._mlp(n, _rms_norm(x, self.w[p + "post_attention_layernorm.weight"], eps))
        normed = _rms_norm(x, self.w["norm.weight"], eps)
        logits = F.linear(normed, self.w["lm_head.weight"])
        self.next_position = int(positions[-1].item()) + 1
        # norm_output (Eagle-3.1): the next step is fed the normalised state.
        return DraftOutput(logits.float(), normed if c.norm_output else x)

    def extend(
        self, aux: torch.Tensor, input_ids: torch.Tensor, start: int | torch.Tensor = 0
    ) -> DraftOutput:
        """Prefill over a context: ``aux`` [T, A*tH] target hidden states, ``input_ids`` [T],
        at positions ``start``, ``start + 1``, ..., or at those listed in a tensor ``start``."""
        self.reset()
        if isinstance(start, torch.Tensor):
            return self._forward(input_ids, aux, from_aux=True, positions=start.to(self.device))
        self.next_position = start
        return self._forward(input_ids, aux, from_aux=True)

    def step(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> DraftOutput:
        """One draft step: the previous step's ``hidden`` [n, H] and target-vocab ``input_ids``."""
        return self._forward(input_ids, hidden, from_aux=False)


def speculators_capture(
    layer_inputs: Sequence[torch.Tensor], layer_ids: Sequence[int]
) -> torch.Tensor:
    """The aux hidden states a verifier hands to the drafter under speculators' (and vLLM's)
    rule: walking the layers in order, the input of each layer whose index is an aux id."""
    wanted = set(speculators_layers_to_capture(layer_ids))
    return torch.cat([x for i, x in enumerate(layer_inputs) if i in wanted], dim=-1)
