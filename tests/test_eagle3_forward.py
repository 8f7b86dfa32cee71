"""Forward equivalence of an EAGLE-3 drafter before and after conversion to SGLang's layout.

A tiny random speculators checkpoint runs in a pure-PyTorch reference of speculators' draft
step; its conversion runs in a model that mirrors SGLang's ``LlamaForCausalLMEagle3`` and loads
by SGLang's rules. Both extend over a context and then draft a chain of steps; logits, the
hidden states fed to the next step and the proposed target-vocabulary tokens must agree.

Uses CUDA when available (both dtypes), else the CPU. Set ``WEIGHTMAP_FORWARD_REPORT`` to a
file path to get one JSON line of measured differences per case (tests/gpu/run.sh does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple, Protocol

import pytest
import torch

import weightmap

from eagle3 import convert_stub
from eagle3.checkpoints import DraftSpec, write_checkpoint
from eagle3.sglang_mirror import MirrorLoadError, load_converted, sglang_capture
from eagle3.speculators_ref import SpeculatorsReference, speculators_capture

pytestmark = pytest.mark.forward

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONTEXT = 7  # tokens in the extend
STEPS = 4  # draft steps after the extend

F32_TOL = 1e-5  # absolute, on logits and hidden states
# bfloat16: relative to the largest magnitude in the compared tensor. bf16 keeps 8 significant
# bits, so each rounding moves a value by up to 2**-9 of its binade. Both models compute in bf16
# with float32 norm statistics, but they round at different points: SGLang's fused add+norm
# normalises the float32 sum where the reference first rounds the residual sum to bf16, the
# fused qkv / gate_up matmuls and the float32 attention accumulate in another order than split
# linears and SDPA. Errors land where terms cancel, so they scale with the tensor's largest
# values, not with each element. About ten such roundings per forward, compounded over the
# extend and STEPS steps that feed each model its own hidden state, give a random walk of
# ~sqrt(50) * 2**-9 ~ 0.014; 2**-5 = 16 roundoff units allows that with room (measured on CPU:
# <= 0.013 on hidden states, <= 0.008 on logits), while any layout or math error (a dropped
# norm, a swapped shard, a wrong residual) moves values by O(1) of that scale.
BF16_REL_TOL = 2**-5


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    if dtype == torch.float32:
        return F32_TOL
    return BF16_REL_TOL * reference.abs().max().item()


def convert_checkpoint(src: Path, dst: Path) -> None:
    """The conversion under test: the shipped preset, through the public API."""
    weightmap.remap(src, dst, preset="eagle3-sglang", progress=False)


class DraftModel(Protocol):
    def extend(
        self, aux: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def step(
        self, hidden: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


class Trace(NamedTuple):
    logits: torch.Tensor  # [CONTEXT + STEPS, Vd] float32
    hidden: torch.Tensor  # [CONTEXT + STEPS, H] float32
    tokens: torch.Tensor  # [CONTEXT + STEPS] target-vocab ids of each row's argmax
    fed: list[torch.Tensor]  # the token fed into each draft step


def run_chain(
    model: DraftModel,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    fed: list[torch.Tensor] | None = None,
) -> Trace:
    """Extend, then STEPS draft steps, each fed the previous step's last hidden state and
    proposed token. ``fed`` overrides the tokens (so a bf16 near-tie cannot fork the chains);
    each model always feeds on its own hidden states."""
    logits, hidden = model.extend(aux, input_ids)
    all_logits, all_hidden, used = [logits], [hidden], []
    for s in range(STEPS):
        token = model.to_target(all_logits[-1][-1:].argmax(-1)) if fed is None else fed[s]
        used.append(token)
        logits, hidden = model.step(all_hidden[-1][-1:], token)
        all_logits.append(logits)
        all_hidden.append(hidden)
    cat_logits = torch.cat(all_logits)
    return Trace(
        cat_logits,
        torch.cat(all_hidden).float(),
        model.to_target(cat_logits.argmax(-1)),
        used,
    )


@dataclass
class Pair:
    reference: SpeculatorsReference
    converted: Path
    embed: torch.Tensor | None
    aux: torch.Tensor
    input_ids: torch.Tensor


def build(spec: DraftSpec, tmp_path: Path, convert: Callable[[Path, Path], None]) -> Pair:
    src = write_checkpoint(spec, tmp_path / "speculators")
    dst = tmp_path / "sglang"
    convert(src, dst)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    # Without embed_tokens in the checkpoint, SGLang shares the target's embedding table:
    # both models get the same externally supplied one.
    embed = (
        None
        if spec.with_embed_tokens
        else torch.randn(spec.vocab_size, spec.hidden_size, generator=gen).to(DEVICE)
    )
    aux = torch.randn(CONTEXT, spec.aux_width, generator=gen).to(DEVICE, spec.dtype)
    ids = torch.randint(0, spec.vocab_size, (CONTEXT,), generator=gen).to(DEVICE)
    ref = SpeculatorsReference(src, dtype=spec.dtype, device=DEVICE, embed_tokens=embed)
    return Pair(ref, dst, embed, aux, ids)


def report(node: pytest.Item, entry: dict[str, object]) -> None:
    """Attach the measurements to the test item (``user_properties``: the ``record_property``
    fixture would warn under junit xunit2) and append them to $WEIGHTMAP_FORWARD_REPORT."""
    node.user_properties.extend(entry.items())
    path = os.environ.get("WEIGHTMAP_FORWARD_REPORT")
    if path:
        with Path(path).open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def compare(
    ref: Trace,
    got: Trace,
    dtype: torch.dtype,
    case: str,
    node: pytest.Item,
) -> None:
    """Assert that two traces agree within the dtype's tolerance and record the differences."""
    d_logits = (got.logits - ref.logits).abs()
    d_hidden = (got.hidden - ref.hidden).abs()
    tol_logits, tol_hidden = tolerance(dtype, ref.logits), tolerance(dtype, ref.hidden)
    if dtype == torch.float32:
        decisive = torch.ones(ref.tokens.shape, dtype=torch.bool, device=DEVICE)
    else:
        # If no logit of a row moved by more than d, its argmax can change only where the
        # reference's top-2 margin is at most 2 d.
        top2 = ref.logits.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * d_logits.max(dim=-1).values
    report(
        node,
        {
            "case": case,
            "dtype": str(dtype).removeprefix("torch."),
            "device": DEVICE.type,
            "max_abs_diff_logits": d_logits.max().item(),
            "max_abs_diff_hidden": d_hidden.max().item(),
            "tol_logits": tol_logits,
            "tol_hidden": tol_hidden,
            "max_abs_logit": ref.logits.abs().max().item(),
            "max_abs_hidden": ref.hidden.abs().max().item(),
            "tokens_compared": int(decisive.sum().item()),
            "tokens_total": decisive.numel(),
        },
    )
    assert d_logits.max().item() <= tol_logits, f"logits differ by {d_logits.max():.3g}"
    assert d_hidden.max().item() <= tol_hidden, f"hidden states differ by {d_hidden.max():.3g}"
    assert torch.equal(got.tokens[decisive], ref.tokens[decisive])
    assert decisive.sum().item() >= decisive.numel() // 2, "too many near-ties to judge tokens"


@pytest.fixture(autouse=True)
def _exact_float32_matmul() -> Iterator[None]:
    """TF32 would blow the float32 tolerance on GPUs; keep full precision for the test."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


BASE = DraftSpec()
CASES = {
    "gqa-vocabmap-embed": BASE,
    "gqa-vocabmap-noembed": replace(BASE, seed=1, with_embed_tokens=False),
    "gqa-fullvocab-embed": replace(BASE, seed=2, draft_vocab_size=BASE.vocab_size),
    "gqa-fullvocab-noembed": replace(
        BASE, seed=3, draft_vocab_size=BASE.vocab_size, with_embed_tokens=False
    ),
    # transformers-4 rope fields, llama3 rope scaling that bites at these positions, and a
    # target hidden size different from the draft's.
    "tf4rope-llama3-target48": replace(
        BASE,
        seed=4,
        rope_style="rope_theta",
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        target_hidden_size=48,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_converted_drafter_matches_reference(
    case: str,
    dtype: torch.dtype,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    spec = replace(CASES[case], dtype=dtype)
    pair = build(spec, tmp_path, convert_checkpoint)
    mirror = load_converted(pair.converted, dtype=dtype, device=DEVICE, embed_tokens=pair.embed)

    ref = run_chain(pair.reference, pair.aux, pair.input_ids)
    got = run_chain(mirror, pair.aux, pair.input_ids, fed=ref.fed)

    compare(ref, got, dtype, case, request.node)
    # The chain must exercise the vocabulary mapping, not just pass ids through.
    if spec.has_vocab_mapping:
        assert not torch.equal(ref.tokens, ref.logits.argmax(-1))


def test_shipped_example_matches_reference(
    example: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The example checkpoint of the repository (bfloat16), converted and run the same way."""
    if not (example / "model.safetensors").is_file():
        pytest.skip("no example checkpoint")
    dst = tmp_path / "sglang"
    convert_checkpoint(example, dst)
    cfg = json.loads((example / "config.json").read_text(encoding="utf-8"))
    layer = cfg["transformer_layer_config"]
    width = len(cfg["eagle_aux_hidden_state_layer_ids"]) * (
        cfg["target_hidden_size"] or layer["hidden_size"]
    )
    gen = torch.Generator().manual_seed(7)
    aux = torch.randn(CONTEXT, width, generator=gen).to(DEVICE, torch.bfloat16)
    ids = torch.randint(0, layer["vocab_size"], (CONTEXT,), generator=gen).to(DEVICE)
    reference = SpeculatorsReference(example, dtype=torch.bfloat16, device=DEVICE)
    mirror = load_converted(dst, dtype=torch.bfloat16, device=DEVICE)
    ref = run_chain(reference, aux, ids)
    got = run_chain(mirror, aux, ids, fed=ref.fed)
    compare(ref, got, torch.bfloat16, "example", request.node)


def test_norm_before_residual_needs_refusal(tmp_path: Path) -> None:
    """SGLang always keeps the un-normalised hidden as residual, so a rename-only conversion of
    a norm_before_residual drafter loads cleanly and computes something else: the preset must
    refuse it. Uses the rename-only stub on purpose, whatever convert_checkpoint becomes."""
    spec = replace(BASE, seed=5, norm_before_residual=True)
    pair = build(spec, tmp_path, convert_stub.convert)
    mirror = load_converted(pair.converted, dtype=spec.dtype, device=DEVICE)
    ref = run_chain(pair.reference, pair.aux, pair.input_ids)
    got = run_chain(mirror, pair.aux, pair.input_ids, fed=ref.fed)
    d_logits = (got.logits - ref.logits).abs()
    # Not a rounding effect: the typical logit moves by a sizeable fraction of its own size.
    assert d_logits.max().item() > 0.5
    assert d_logits.mean().item() > 0.1 * ref.logits.abs().mean().item()
    assert d_logits.mean().item() > 1000 * F32_TOL


@pytest.mark.parametrize(
    ("aux_ids", "num_layers"), [((2, 8, 13), 16), ((1, 16, 29), 32), ((0, 3, 5), 8)]
)
def test_aux_ids_select_the_same_target_layers(
    aux_ids: tuple[int, ...], num_layers: int, tmp_path: Path
) -> None:
    """SGLang captures the input of layer id + 1, speculators the input of layer id."""
    spec = replace(BASE, aux_layer_ids=aux_ids, num_target_layers=num_layers)
    src = write_checkpoint(spec, tmp_path / "speculators")
    convert_checkpoint(src, tmp_path / "sglang")
    flat = json.loads((tmp_path / "sglang" / "config.json").read_text(encoding="utf-8"))
    converted_ids = flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    gen = torch.Generator().manual_seed(0)
    layer_inputs = [
        torch.randn(CONTEXT, spec.hidden_size, generator=gen) for _ in range(num_layers)
    ]

    expected = speculators_capture(layer_inputs, aux_ids)
    assert expected.shape[-1] == spec.aux_width
    assert torch.equal(sglang_capture(layer_inputs, converted_ids), expected)
    # Copying the ids verbatim would feed the drafter the wrong layers.
    assert not torch.equal(sglang_capture(layer_inputs, list(aux_ids)), expected)


def test_mirror_rejects_what_sglang_would_skip(tmp_path: Path) -> None:
    """The mirror is only a witness if it fails where SGLang stays silent."""
    spec = replace(BASE, seed=6, extra_tensors=("verifier_norm.weight",))
    src = write_checkpoint(spec, tmp_path / "speculators")
    dst = tmp_path / "sglang"
    convert_checkpoint(src, dst)
    load_converted(dst, dtype=spec.dtype, device=DEVICE)  # the good case loads

    # speculators names kept as they are: every layers.0 tensor would be skipped by SGLang
    # and every midlayer parameter left at its initial value.
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(src / "model.safetensors")), str(dst / "model.safetensors"))
    with pytest.raises(MirrorLoadError) as err:
        load_converted(dst, dtype=spec.dtype, device=DEVICE)
    message = str(err.value)
    assert "layers.0.self_attn.q_proj.weight: no parameter" in message
    assert (
        "model.midlayer.self_attn.qkv_proj.weight: never loaded (shards ['k', 'q', 'v'])" in message
    )
    assert "verifier_norm.weight: no parameter" in message

    # a missing shard is named
    tensors = load_file(str(src / "model.safetensors"))
    convert_stub.convert(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["midlayer.mlp.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(
        MirrorLoadError, match=r"gate_up_proj.weight: never loaded \(shards \['1'\]\)"
    ):
        load_converted(dst, dtype=spec.dtype, device=DEVICE)
