"""The real ``speculators`` library (0.9.0): load a converted drafter, run its own forward.

``load`` calls ``Eagle3DraftModel.from_pretrained`` and records what transformers reports
as missing or unexpected, then checks more than that report does: transformers forgives the
names listed in ``_keys_to_ignore_on_load_missing`` (``t2d``, ``d2t``, ``embed_tokens``), so
every tensor of the model must also be present in the file (verifier-owned ones and a
layout's absent ``embed_tokens`` excepted) and hold the file's values.

``ttt_logits`` runs ``Eagle3DraftModel.forward`` — the library's own test-time-training
forward — and captures each step's logits with a hook on ``lm_head``. Step ``k`` row ``i``
attends to the context keys ``0..i`` and to its own earlier draft steps, and is fed token
``i + k`` (0 past the end) at position ``positions[i] + k``: the same numbers as a serving chain
that extends over rows ``0..i`` and then drafts ``k`` steps (``chain_logits``).

``speculators`` is installed with ``--no-deps`` (README), so ``available()`` says whether it
is there; the tests that need it skip otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

VERIFIER_ONLY = {"verifier_lm_head.weight", "verifier_norm.weight"}


def available() -> bool:
    return importlib.util.find_spec("speculators") is not None


@contextmanager
def _quiet_imports() -> Iterator[None]:
    # Importing speculators imports torch.compile's inductor, whose import uses the deprecated
    # torch.jit.script_method (a DeprecationWarning, an error under filterwarnings = error).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def write_verifier(
    directory: Path, *, hidden: int, vocab: int, num_layers: int, embed: torch.Tensor
) -> Path:
    """A tiny local verifier: the config and the three tensors ``load_verifier_weights``
    reads (no hub access is possible or wanted)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
    }
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    gen = torch.Generator().manual_seed(99)
    tensors = {
        "model.embed_tokens.weight": embed.float().contiguous(),
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen),
        "model.norm.weight": torch.ones(hidden),
    }
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@dataclass
class Loaded:
    model: Any  # speculators.models.eagle3.Eagle3DraftModel
    missing: list[str]  # as transformers reports them
    unexpected: list[str]


def load(directory: Path, verifier: Path, *, embed_tokens: torch.Tensor | None = None) -> Loaded:
    """``Eagle3DraftModel.from_pretrained`` in float32 with eager attention (flex attention
    needs a GPU compiler), the verifier pointed at a local folder.

    Raises ``AssertionError`` naming every tensor the model has but the file lacks, or whose
    value differs; ``embed_tokens`` (when the checkpoint has none) is set afterwards, since
    speculators under transformers 5 may leave it uninitialised.
    """
    with _quiet_imports():
        import transformers.modeling_utils as tmu
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")

    config = Eagle3SpeculatorConfig.from_pretrained(str(directory))
    config.transformer_layer_config._attn_implementation = "eager"
    reports: list[tuple[list[str], list[str]]] = []
    original: Callable[..., Any] = tmu.log_state_dict_report

    def spy(*args: Any, **kwargs: Any) -> Any:
        info = kwargs["loading_info"]
        reports.append((sorted(info.missing_keys), sorted(info.unexpected_keys)))
        return original(*args, **kwargs)

    tmu.log_state_dict_report = spy
    try:
        model = Eagle3DraftModel.from_pretrained(str(directory), config=config, dtype=torch.float32)
    finally:
        tmu.log_state_dict_report = original
    assert len(reports) == 1, reports
    model.eval()

    saved = load_file(str(directory / "model.safetensors"))
    problems = []
    for name, value in model.state_dict().items():
        if name in VERIFIER_ONLY or (name == "embed_tokens.weight" and embed_tokens is not None):
            continue
        if name not in saved:
            problems.append(f"{name}: not in the checkpoint")
        elif not torch.equal(value.to(saved[name].dtype), saved[name]):
            problems.append(f"{name}: loaded values differ from the file")
    assert not problems, "\n".join(problems)
    if embed_tokens is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed_tokens)
    return Loaded(model, *reports[0])


@torch.no_grad()
def ttt_logits(
    model: Any, aux: torch.Tensor, input_ids: torch.Tensor, *, positions: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The library's forward over one document at ``positions`` [T]: each step's logits
    [T, Vd] in float32."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    try:
        t = input_ids.shape[0]
        with _quiet_imports():
            model(
                hidden_states=aux[None].float(),
                input_ids=input_ids[None],
                document_ids=torch.zeros(1, t, dtype=torch.long),
                position_ids=positions[None],
                ttt_steps=steps,
            )
    finally:
        hook.remove()
    return [x.float() for x in captured]


def chain_logits(
    extend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    positions: torch.Tensor,
    steps: int,
) -> list[torch.Tensor]:
    """What ``ttt_logits`` computes, from a model that serves (extend, then draft steps):
    for each row ``i``, extend over rows ``0..i`` and draft ``steps - 1`` steps fed the
    following context tokens."""
    t = input_ids.shape[0]
    padded = torch.cat([input_ids, input_ids.new_zeros(steps)])
    rows: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    for i in range(t):
        logits, hidden = extend(aux[: i + 1], input_ids[: i + 1], positions[: i + 1])
        rows[0].append(logits[-1])
        for k in range(1, steps):
            logits, hidden = step(hidden[-1:], padded[i + k : i + k + 1])
            rows[k].append(logits[-1])
    return [torch.stack(r).float() for r in rows]
