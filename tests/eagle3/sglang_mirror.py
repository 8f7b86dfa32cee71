"""A model whose modules and loader mirror SGLang's ``LlamaForCausalLMEagle3``.

Parameter names, fused ``qkv_proj`` / ``gate_up_proj`` shards, the ``model.`` prefix rule,
``d2t`` -> ``hot_token_id`` and the skipped ``t2d`` follow
python/sglang/srt/models/llama_eagle3.py (the ``midlayer`` layout of the older releases,
which is also what the newer ones rewrite ``midlayer`` names into). The forward follows SGLang's
numerics where they differ from transformers: norms fuse the residual add in float32, rope
is applied as two halves from a cos/sin cache, attention runs in float32 over grouped heads.

Where SGLang is silent, this mirror is loud: any tensor name that would be skipped, any shape
that does not fit, any parameter or shard left unloaded, and any config field SGLang would
quietly default (``rope_theta``) is an error. All sizes come from the converted checkpoint's
flat ``config.json``; nothing is read from the speculators source.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn


class MirrorLoadError(ValueError):
    """A converted checkpoint that SGLang would load wrongly or not at all."""


class MirrorOutput(NamedTuple):
    logits: torch.Tensor  # [n, Vd], float32
    hidden: torch.Tensor  # [n, H], ``hidden_states_to_aux``: before the final norm, or after it
    # with norm_output


def sglang_layers_to_capture(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """SGLang's ``set_eagle3_layers_to_capture``: the input of layer ``id + 1`` per aux id."""
    if layer_ids is None:
        return [2, num_layers // 2, num_layers - 3]
    return [i + 1 for i in layer_ids]


@dataclass(frozen=True)
class MirrorConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    hidden_size_in: int
    fc_bias: bool
    aux_layer_ids: tuple[int, ...] | None
    fc_norm: bool = False
    norm_output: bool = False

    @classmethod
    def from_flat(cls, cfg: dict[str, Any], *, source: bool = False) -> MirrorConfig:
        """Read a flat config as SGLang does. ``source=True`` reads a drafter as its trainer
        ran it rather than checking a conversion: a missing ``rope_theta`` is SGLang's and
        EAGLE's 10000, and transformers-5 ``rope_parameters`` carry theta and scaling."""
        problems: list[str] = []
        if source and cfg.get("rope_parameters"):
            params = dict(cfg["rope_parameters"])
            cfg = {**cfg, "rope_theta": params.pop("rope_theta", 10000.0), "rope_scaling": params}
        elif source:
            cfg = {"rope_theta": 10000.0, **cfg}
        arch = (cfg.get("architectures") or [None])[0]
        # The EAGLE research trainer's config names LlamaForCausalLM; its code runs this model.
        if arch != "LlamaForCausalLMEagle3" and not (source and arch == "LlamaForCausalLM"):
            problems.append(f"architectures[0] is {arch!r}, SGLang needs LlamaForCausalLMEagle3")
        if cfg.get("hidden_act") != "silu":
            problems.append(f"hidden_act is {cfg.get('hidden_act')!r}, SGLang runs silu")
        if cfg.get("tie_word_embeddings", False):
            problems.append("tie_word_embeddings is true: SGLang would use embed_tokens as lm_head")
        if cfg.get("draft_vocab_size") is None:
            problems.append("draft_vocab_size is missing")
        if "rope_theta" not in cfg:
            problems.append("rope_theta is missing: SGLang would silently use 10000")
        if "target_hidden_size" in cfg and cfg["target_hidden_size"] is None:
            problems.append("target_hidden_size is null: SGLang crashes on it")
        if cfg.get("num_hidden_layers", 1) != 1:
            problems.append("this mirror models the single midlayer only")
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and len(ids) != cfg.get("num_aux_hidden_states", 3):
            problems.append(f"{len(ids)} aux layer ids, but SGLang captures 3")
        scaling = cfg.get("rope_scaling")
        kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "llama3"):
            problems.append(f"rope type {kind!r} is not modelled by this mirror")
        if problems:
            raise MirrorLoadError("; ".join(problems))
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg.get("head_dim") or hidden // heads),  # SGLang's fallback
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg["draft_vocab_size"]),
            rope_theta=float(cfg["rope_theta"]),
            rope_scaling=None if kind in (None, "default") else dict(scaling or {}),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            hidden_size_in=int(cfg.get("target_hidden_size") or hidden),
            fc_bias=bool(cfg.get("bias", False)),
            aux_layer_ids=None if ids is None else tuple(ids),
            fc_norm=bool(cfg.get("fc_norm", False)),
            norm_output=bool(cfg.get("norm_output", False)),
        )


class RMSNorm(nn.Module):
    """SGLang's ``RMSNorm.forward_native``, including the fused residual add."""

    def __init__(self, width: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, **factory))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        orig = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig)
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x.to(orig) * self.weight, residual


class Attention(nn.Module):
    def __init__(self, c: MirrorConfig, **factory: Any) -> None:
        super().__init__()
        self.c = c
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(2 * c.hidden_size, qkv_rows, bias=False, **factory)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False, **factory)
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        c = self.c
        hd = c.head_dim
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        if c.rope_scaling is not None:  # SGLang's Llama3RotaryEmbedding._compute_inv_freq
            factor = float(c.rope_scaling["factor"])
            low = float(c.rope_scaling["low_freq_factor"])
            high = float(c.rope_scaling["high_freq_factor"])
            orig = float(c.rope_scaling["original_max_position_embeddings"])
            wave = 2 * math.pi / inv
            smooth = (orig / wave - low) / (high - low)
            inv = torch.where(
                wave < orig / high,
                inv,
                torch.where(
                    wave > orig / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv
                ),
            )
        # SGLang sizes the cache by the serving context; here, by the positions asked for.
        length = max(c.max_position_embeddings, int(positions.max().item()) + 1)
        t = torch.arange(length, dtype=torch.float)
        freqs = torch.einsum("i,j->ij", t, inv)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
        return cache.to(positions.device).index_select(0, positions)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        c, t = self.c, x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = self.cos_sin(positions, x.dtype).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q = self.rope(q.view(t, c.num_heads, c.head_dim), cos, sin)
        k = self.rope(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        if self.cache is not None:
            k, v = torch.cat([self.cache[0], k]), torch.cat([self.cache[1], v])
        self.cache = (k, v)
        s = k.shape[0]
        groups = c.num_heads // c.num_kv_heads
        qg = q.view(t, c.num_kv_heads, groups, c.head_dim).float()
        scores = torch.einsum("tkgd,skd->kgts", qg, k.float()) / math.sqrt(c.head_dim)
        allowed = (
            torch.arange(s, device=x.device)[None, :]
            <= (torch.arange(s - t, s, device=x.device)[:, None])
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("kgts,skd->tkgd", scores.softmax(dim=-1), v.float())
        result: torch.Tensor = self.o_proj(out.reshape(t, self.q_size).to(x.dtype))
        return result


class MLP(nn.Module):
    def __init__(self, c: MirrorConfig, **factory: Any) -> None:
        super().__init__()
        self.inter = c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * self.inter, bias=False, **factory)
        self.down_proj = nn.Linear(self.inter, c.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = torch.nn.functional.silu(gate_up[..., : self.inter]) * gate_up[..., self.inter :]
        result: torch.Tensor = self.down_proj(act)
        return result


class MidLayer(nn.Module):
    def __init__(self, c: MirrorConfig, **factory: Any) -> None:
        super().__init__()
        eps = c.rms_norm_eps
        self.self_attn = Attention(c, **factory)
        self.mlp = MLP(c, **factory)
        self.input_layernorm = RMSNorm(c.hidden_size, eps, **factory)
        self.hidden_norm = RMSNorm(c.hidden_size, eps, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps, **factory)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden  # SGLang never normalises the residual (no norm_before_residual)
        embeds, _ = self.input_layernorm(embeds)
        hidden, _ = self.hidden_norm(hidden)
        x = self.self_attn(positions, torch.cat([embeds, hidden], dim=-1))
        x, new_residual = self.post_attention_layernorm(x, residual)
        assert new_residual is not None
        return self.mlp(x), new_residual


class Eagle3Model(nn.Module):
    def __init__(self, c: MirrorConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.fc = nn.Linear(3 * c.hidden_size_in, c.hidden_size, bias=c.fc_bias, **factory)
        # Eagle-3.1 (fc_norm): one RMSNorm per aux hidden state, applied before fc.
        self.fc_norm = (
            nn.ModuleList(RMSNorm(c.hidden_size_in, c.rms_norm_eps, **factory) for _ in range(3))
            if c.fc_norm
            else None
        )
        self.midlayer = MidLayer(c, **factory)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)


class SGLangEagle3Mirror(nn.Module):
    """``LlamaForCausalLMEagle3`` with the ``midlayer`` module layout."""

    _stacked = (  # (param_name, shard_name, shard_id), as in SGLang's load_weights
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(self, c: MirrorConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.c = c
        self.model = Eagle3Model(c, dtype=dtype, device=device)
        self.lm_head = nn.Linear(
            c.hidden_size, c.draft_vocab_size, bias=False, **{"dtype": dtype, "device": device}
        )
        self.hot_token_id: torch.Tensor | None
        self.register_buffer("hot_token_id", None)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(float("nan"))  # an unloaded parameter must never look plausible
        self.next_position = 0

    # ---- loading -------------------------------------------------------------------------
    def _shard_slice(self, param_name: str, shard_id: str | int) -> slice:
        c = self.c
        if param_name.endswith("qkv_proj.weight"):
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            start = {"q": 0, "k": q, "v": q + kv}[str(shard_id)]
            return slice(start, start + (q if shard_id == "q" else kv))
        inter = c.intermediate_size
        return slice(int(shard_id) * inter, (int(shard_id) + 1) * inter)

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        embed_tokens: torch.Tensor | None = None,
        newer_sglang: bool = False,
    ) -> None:
        """SGLang's ``load_weights``, then ``set_embed`` when ``embed_tokens`` is given.
        ``newer_sglang``: names ``layers.0.*`` load too, as in SGLang 0.5.2x, which builds
        ``model.layers[0]`` (older SGLang skips them).

        Raises ``MirrorLoadError`` listing every name SGLang would skip, every shape that
        does not fit and every parameter (or fused shard) left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set[str | int | None]] = {}
        errors: list[str] = []
        d2t: torch.Tensor | None = None

        def put(pname: str, tensor: torch.Tensor, shard: str | int | None, orig: str) -> None:
            param = params[pname]
            target = param.data if shard is None else param.data[self._shard_slice(pname, shard)]
            if tuple(target.shape) != tuple(tensor.shape):
                errors.append(f"{orig}: shape {list(tensor.shape)} != {list(target.shape)}")
                return
            if shard in loaded.setdefault(pname, set()):
                errors.append(f"{orig}: loaded twice into {pname}")
            loaded[pname].add(shard)
            target.copy_(tensor)

        with torch.no_grad():
            for name, tensor in weights:
                if "d2t" in name:
                    d2t = tensor
                    continue
                if "t2d" in name:
                    continue
                orig = name
                # Newer SGLang builds model.layers[0] and loads both names into it; this
                # mirror keeps the older module name.
                if newer_sglang and name.startswith("layers.0."):
                    name = "midlayer." + name.removeprefix("layers.0.")
                for param_name, weight_name, shard_id in self._stacked:
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    pname = name if name in params else f"model.{name}"
                    if pname in params:
                        put(pname, tensor, shard_id, orig)
                    else:
                        errors.append(f"{orig}: no parameter (SGLang would skip it silently)")
                    break
                else:
                    pname = name if name in params else f"model.{name}"
                    if pname in params:
                        put(pname, tensor, None, orig)
                    else:
                        errors.append(f"{orig}: no parameter (SGLang would skip it silently)")
            if embed_tokens is not None:  # SGLang's set_embed: the target's table
                if "model.embed_tokens.weight" in loaded:
                    errors.append("embed_tokens given but the checkpoint has its own")
                put("model.embed_tokens.weight", embed_tokens, None, "<target embed_tokens>")

        full: dict[str, set[str | int | None]] = {
            "qkv_proj": {"q", "k", "v"},
            "gate_up_proj": {0, 1},
        }
        for pname in params:
            kind = pname.split(".")[-2]
            want: set[str | int | None] = set(full.get(kind, {None}))
            missing = want - loaded.get(pname, set())
            if missing:
                what = "" if missing == {None} else f" (shards {sorted(map(str, missing))})"
                errors.append(f"{pname}: never loaded{what}")
        c = self.c
        if d2t is None:
            if c.draft_vocab_size != c.vocab_size:
                errors.append("no d2t although draft_vocab_size != vocab_size")
        elif tuple(d2t.shape) != (c.draft_vocab_size,):
            errors.append(f"d2t: shape {list(d2t.shape)} != [{c.draft_vocab_size}]")
        if errors:
            raise MirrorLoadError("\n".join(errors))
        if d2t is not None:
            device = self.lm_head.weight.device
            self.hot_token_id = (d2t + torch.arange(d2t.shape[0])).to(device)

    # ---- forward -------------------------------------------------------------------------
    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.hot_token_id is None else self.hot_token_id[draft_ids]

    def _forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None
    ) -> MirrorOutput:
        m = self.model
        t = input_ids.shape[0]
        if positions is None:
            positions = torch.arange(
                self.next_position, self.next_position + t, device=input_ids.device
            )
        embeds = m.embed_tokens(input_ids)
        hidden = hidden.to(embeds.dtype)
        if hidden.shape[-1] != embeds.shape[-1]:  # SGLang's test for "this is aux, run fc"
            if m.fc_norm is not None:
                chunks = hidden.chunk(len(m.fc_norm), dim=-1)
                hidden = torch.cat([n(x)[0] for n, x in zip(m.fc_norm, chunks, strict=True)], -1)
            hidden = m.fc(hidden)
        x, residual = m.midlayer(positions, embeds, hidden)
        to_logits, to_aux = m.norm(x, residual)
        assert to_aux is not None
        if self.c.norm_output:  # Eagle-3.1: the next step is fed the normalised state
            to_aux = to_logits
        logits = torch.matmul(to_logits.to(self.lm_head.weight.dtype), self.lm_head.weight.T)
        self.next_position = int(positions[-1].item()) + 1
        return MirrorOutput(logits.float(), to_aux)

    @torch.no_grad()
    def extend(
        self, aux: torch.Tensor, input_ids: torch.Tensor, start: int | torch.Tensor = 0
    ) -> MirrorOutput:
        """Prefill at positions ``start``, ``start + 1``, ..., or at the positions listed in a
        tensor ``start`` (rope is relative: spread positions give distances of thousands
        without a context of thousands)."""
        self.model.midlayer.self_attn.cache = None
        if isinstance(start, torch.Tensor):
            return self._forward(input_ids, aux, start.to(input_ids.device))
        self.next_position = start
        return self._forward(input_ids, aux)

    @torch.no_grad()
    def step(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> MirrorOutput:
        return self._forward(input_ids, hidden)


def load_converted(
    directory: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    embed_tokens: torch.Tensor | None = None,
    source: bool = False,
    newer_sglang: bool = False,
) -> SGLangEagle3Mirror:
    """Build the mirror from a converted checkpoint's flat config and load its tensors
    (``source``: see ``MirrorConfig.from_flat``; ``newer_sglang``: see ``load_weights``)."""
    cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config = MirrorConfig.from_flat(cfg, source=source)
    model = SGLangEagle3Mirror(config, dtype=dtype, device=device)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise MirrorLoadError(f"no .safetensors file in {directory}")

    def tensors() -> Iterable[tuple[str, torch.Tensor]]:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield key, f.get_tensor(key)

    model.load_weights(tensors(), embed_tokens=embed_tokens, newer_sglang=newer_sglang)
    return model


def sglang_capture(
    layer_inputs: Sequence[torch.Tensor], layer_ids: Sequence[int] | None
) -> torch.Tensor:
    """The aux hidden states SGLang's Llama forward captures: walking the layers in order, the
    input of each layer listed by ``sglang_layers_to_capture`` (ids past the end are dropped
    silently, as in SGLang)."""
    wanted = set(sglang_layers_to_capture(layer_ids, len(layer_inputs)))
    return torch.cat([x for i, x in enumerate(layer_inputs) if i in wanted], dim=-1)
