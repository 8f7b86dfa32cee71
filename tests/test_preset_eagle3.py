"""The eagle3-sglang preset: the conversion of the example, every refusal and warning."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import weightmap
from weightmap import MappingError

from eagle3.checkpoints import DraftSpec, write_checkpoint

SGLANG_NAMES = {
    "d2t",
    "t2d",
    "embed_tokens.weight",
    "fc.weight",
    "lm_head.weight",
    "norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}

EXAMPLE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "draft_vocab_size": 128,
    "dtype": "bfloat16",
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True},
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 512,
}


def test_example_converts_per_the_facts_sheet(example: Path, tmp_path: Path) -> None:
    result = weightmap.remap(
        example, tmp_path / "out", preset="eagle3-sglang", verify=True, progress=False
    )
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert set(out) == SGLANG_NAMES
    src = load_file(example / "model.safetensors")
    for name, t in out.items():
        original = name.replace("midlayer.", "layers.0.")
        assert t.dtype == src[original].dtype and torch.equal(t, src[original])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == EXAMPLE_CONFIG
    assert "target_hidden_size" not in config  # null in the input: SGLang would crash on it
    assert result.plan.warnings == ()
    assert result.bytes_copied == result.bytes_written  # a rename: kernel copies only


def test_example_converts_in_place(example: Path, tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(example, ckpt)
    weightmap.remap(ckpt, preset="eagle3-sglang", inplace=True)
    assert set(load_file(ckpt / "model.safetensors")) == SGLANG_NAMES
    assert json.loads((ckpt / "config.json").read_text()) == EXAMPLE_CONFIG


def problems(spec: DraftSpec, tmp_path: Path, **params: Any) -> list[str]:
    src = write_checkpoint(spec, tmp_path / "in")
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, preset="eagle3-sglang", params=params)
    return [p.message for p in info.value.problems]  # type: ignore[attr-defined]


BASE = DraftSpec()

NOT_SPECULATORS = (
    'not a speculators EAGLE-3 checkpoint: config.json has no speculators_model_type "eagle3" '
    "(a drafter already in SGLang layout needs no conversion; eagle3-speculators converts the "
    "other way)"
)

REFUSALS: list[tuple[str, DraftSpec, dict[str, Any], str]] = [
    (
        "norm_before_residual",
        replace(BASE, norm_before_residual=True),
        {},
        "norm_before_residual=true: this drafter was trained with the normalised hidden state as "
        "its residual, but SGLang always keeps the un-normalised one, so it would load without "
        "error and draft wrong tokens (acceptance near 1). Serve it with vLLM or speculators, or "
        "retrain with norm_before_residual=false",
    ),
    (
        "norm_before_fc",
        replace(BASE, norm_before_fc=True),
        {},
        "norm_before_fc=true (input_norm.weight): SGLang's Llama EAGLE-3 layer does not normalise "
        "the aux hidden states before fc, so it would ignore input_norm.weight and draft wrong "
        "tokens. Serve it with vLLM or speculators",
    ),
    (
        "qwen3",
        replace(BASE, qk_norm=True),
        {},
        'the draft layer is "qwen3", not a Llama layer (Qwen3-style q_norm/k_norm): SGLang\'s '
        "LlamaForCausalLMEagle3 has no q/k norms and would skip them silently. Serve it with an "
        "engine that implements this draft layer",
    ),
    (
        "attention_bias",
        replace(BASE, attention_bias=True),
        {},
        "the draft layer has attention or MLP biases, which SGLang's Llama EAGLE-3 layer does not "
        "load (it would skip them silently). Serve it with vLLM or speculators",
    ),
    (
        "mlp_bias",
        replace(BASE, mlp_bias=True),
        {},
        "the draft layer has attention or MLP biases, which SGLang's Llama EAGLE-3 layer does not "
        "load (it would skip them silently). Serve it with vLLM or speculators",
    ),
    (
        "hidden_act",
        replace(BASE, hidden_act="gelu"),
        {},
        'hidden_act is "gelu"; SGLang\'s Llama EAGLE-3 layer only computes silu',
    ),
    (
        "two_layers",
        replace(BASE, num_layers=2),
        {},
        "the drafter has more than one layer (layers.1.* and up); the midlayer layout holds one. "
        'Pass layout="layers" (params={"layout": "layers"}, or --set layout=layers) for SGLang '
        "versions that name layers layers.N",
    ),
    (
        "fc_norm",
        replace(BASE, fc_norm=True),
        {},
        "fc_norm=true: older SGLang does not normalise the aux states per layer and would skip "
        'fc_norm.*; pass layout="layers" for a newer SGLang that reads fc_norm',
    ),
    (
        "norm_output",
        replace(BASE, norm_output=True),
        {},
        'norm_output=true: older SGLang ignores this flag; pass layout="layers" for a newer SGLang '
        "that reads norm_output",
    ),
    (
        "four_aux",
        replace(BASE, aux_layer_ids=(2, 5, 8, 13)),
        {},
        "the drafter reads 4 aux hidden states; older SGLang always captures 3. Pass "
        'layout="layers" for a newer SGLang that reads num_aux_hidden_states',
    ),
    (
        "bad_layout",
        BASE,
        {"layout": "model"},
        'unknown layout "model": use layout="midlayer" (default) or layout="layers"',
    ),
]


@pytest.mark.parametrize(
    ("spec", "params", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS]
)
def test_refusal_message(
    tmp_path: Path, spec: DraftSpec, params: dict[str, Any], message: str
) -> None:
    assert problems(spec, tmp_path, **params) == [f"requirement failed: {message}"]


def test_refuses_a_checkpoint_already_converted(example: Path, tmp_path: Path) -> None:
    weightmap.remap(example, tmp_path / "sglang", preset="eagle3-sglang", progress=False)
    with pytest.raises(MappingError) as info:
        weightmap.compile(tmp_path / "sglang", preset="eagle3-sglang")
    assert f"requirement failed: {NOT_SPECULATORS}" in [p.message for p in info.value.problems]  # type: ignore[attr-defined]


def test_unknown_tensor_is_listed(tmp_path: Path) -> None:
    spec = replace(BASE, extra_tensors=("mtp_head.weight",))
    (message,) = problems(spec, tmp_path)
    assert "mtp_head.weight" in message


def test_verifier_tensors_are_dropped(tmp_path: Path) -> None:
    spec = replace(BASE, extra_tensors=("verifier_lm_head.weight", "verifier_norm.weight"))
    src = write_checkpoint(spec, tmp_path / "in")
    plan = weightmap.compile(src, preset="eagle3-sglang")
    assert sorted(d.name for d in plan.dropped) == [
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    ]


@pytest.mark.parametrize(
    "spec",
    [replace(BASE, draft_vocab_size=BASE.vocab_size), replace(BASE, with_embed_tokens=False)],
    ids=["no-vocab-mapping", "no-embed-tokens"],
)
def test_optional_tensors(tmp_path: Path, spec: DraftSpec) -> None:
    src = write_checkpoint(spec, tmp_path / "in")
    plan = weightmap.compile(src, preset="eagle3-sglang")
    names = {o.name for o in plan.outputs}
    assert "midlayer.self_attn.q_proj.weight" in names
    assert ("d2t" in names) == spec.has_vocab_mapping
    assert ("embed_tokens.weight" in names) == spec.with_embed_tokens


def test_layers_layout_for_deeper_drafters(tmp_path: Path) -> None:
    spec = replace(BASE, num_layers=3, fc_norm=True, norm_output=True, aux_layer_ids=(1, 4, 7, 10))
    src = write_checkpoint(spec, tmp_path / "in")
    plan = weightmap.compile(src, preset="eagle3-sglang", params={"layout": "layers"})
    names = {o.name for o in plan.outputs}
    assert "layers.0.input_layernorm.weight" in names
    assert "layers.1.hidden_norm.weight" in names and "layers.2.hidden_norm.weight" in names
    assert "layers.1.input_layernorm.weight" not in names
    assert "fc_norm.0.weight" in names
    config = plan.config
    assert config is not None
    assert config["num_aux_hidden_states"] == 4
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6, 9]


def test_rope_styles(tmp_path: Path) -> None:
    yarn = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    for i, spec in enumerate(
        [
            replace(BASE, rope_scaling=yarn),
            replace(BASE, rope_style="rope_theta", rope_scaling=yarn),
        ]
    ):
        src = write_checkpoint(spec, tmp_path / f"in{i}")
        config = weightmap.compile(src, preset="eagle3-sglang").config
        assert config is not None
        assert config["rope_theta"] == 500000.0
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert "rope_theta" not in config["rope_scaling"] and "rope_parameters" not in config


def _edit_config(src: Path, edit: dict[str, Any]) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["transformer_layer_config"].update(edit)
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("edit", "warning"),
    [
        (
            {"layer_types": ["sliding_attention"], "sliding_window": 4096},
            "the draft layer uses sliding-window attention (layer_types); SGLang's Llama EAGLE-3 "
            "layer attends over the full context, so long contexts may draft differently",
        ),
        (
            {"sliding_window": 4096},
            "transformer_layer_config sets sliding_window; SGLang's Llama EAGLE-3 layer attends "
            "over the full context",
        ),
        (
            {
                "rope_parameters": {
                    "rope_theta": 1e6,
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                }
            },
            "yarn rope with mscale fields: check that your SGLang version applies mscale / "
            "mscale_all_dim as the drafter was trained",
        ),
    ],
    ids=["layer-types", "sliding-window", "yarn-mscale"],
)
def test_warnings(tmp_path: Path, edit: dict[str, Any], warning: str) -> None:
    src = write_checkpoint(BASE, tmp_path / "in")
    _edit_config(src, edit)
    plan = weightmap.compile(src, preset="eagle3-sglang")
    assert any(w.endswith(warning) for w in plan.warnings), plan.warnings


def _edit_top(src: Path, edit: dict[str, Any]) -> None:
    """Set top-level config fields; None removes one."""
    cfg = json.loads((src / "config.json").read_text())
    for key, value in edit.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))


def test_a_null_rope_parameters_beside_rope_theta_converts(tmp_path: Path) -> None:
    # has(config.rope_parameters.rope_theta) raised "cannot index null" under a null parent.
    src = write_checkpoint(replace(BASE, rope_style="rope_theta"), tmp_path / "in")
    _edit_config(src, {"rope_parameters": None})
    config = weightmap.compile(src, preset="eagle3-sglang").config
    assert config is not None
    assert config["rope_theta"] == 500000.0 and "rope_parameters" not in config


def test_config_fields_sglang_needs_are_written_whatever_speculators_left_out(
    tmp_path: Path,
) -> None:
    # Without d2t the draft vocabulary is the target's: SGLang still reads draft_vocab_size.
    src = write_checkpoint(replace(BASE, draft_vocab_size=BASE.vocab_size), tmp_path / "in")
    _edit_top(src, {"draft_vocab_size": None, "target_hidden_size": None})
    config = weightmap.compile(src, preset="eagle3-sglang").config
    assert config is not None
    assert config["draft_vocab_size"] == BASE.vocab_size and "target_hidden_size" not in config


def test_d2t_without_draft_vocab_size_is_refused(tmp_path: Path) -> None:
    src = write_checkpoint(BASE, tmp_path / "in")
    _edit_top(src, {"draft_vocab_size": None})
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, preset="eagle3-sglang")
    assert (
        "requirement failed: config.json has no draft_vocab_size but the drafter has a d2t "
        "table: SGLang needs the draft vocabulary size; add draft_vocab_size (the length of "
        "d2t) to config.json"
    ) in [p.message for p in info.value.problems]  # type: ignore[attr-defined]


def test_a_top_level_torch_dtype_wins_over_the_layers(tmp_path: Path) -> None:
    # transformers-4 style: torch_dtype at the top and a different one in the layer config.
    src = write_checkpoint(BASE, tmp_path / "in")
    _edit_top(src, {"dtype": None, "torch_dtype": "bfloat16"})
    _edit_config(src, {"torch_dtype": "float32"})
    config = weightmap.compile(src, preset="eagle3-sglang").config
    assert config is not None and config["torch_dtype"] == "bfloat16"


# -- the reverse: eagle3-speculators ----------------------------------------------------------

VERIFIER = {"verifier": "example-org/tiny-llama-verifier"}


def test_round_trip_is_byte_identical(example: Path, tmp_path: Path) -> None:
    weightmap.remap(example, tmp_path / "sglang", preset="eagle3-sglang", progress=False)
    weightmap.remap(
        tmp_path / "sglang",
        tmp_path / "back",
        preset="eagle3-speculators",
        params=VERIFIER,
        progress=False,
    )
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        example / "model.safetensors"
    ).read_bytes()
    original = json.loads((example / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    # auto_map points at a config.py that speculators saves beside its weights; the example
    # ships none, so the reverse does not claim one (test_sidefiles.py: where it does).
    del original["auto_map"]
    assert back == original


@pytest.mark.parametrize(
    "spec",
    [
        replace(BASE, rope_style="rope_theta"),
        replace(
            BASE,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        replace(BASE, target_hidden_size=48, draft_vocab_size=BASE.vocab_size),
        replace(BASE, with_embed_tokens=False, dtype=torch.bfloat16),
    ],
    ids=["transformers4-rope", "llama3-scaling", "target-hidden", "no-embed-bf16"],
)
def test_round_trip_is_equivalent(tmp_path: Path, spec: DraftSpec) -> None:
    """speculators -> SGLang -> speculators gives the same tensors and a config that converts
    to the same SGLang config (rope fields may change style, transformers 4 -> 5)."""
    src = write_checkpoint(spec, tmp_path / "in")
    weightmap.remap(src, tmp_path / "sglang", preset="eagle3-sglang", progress=False)
    weightmap.remap(
        tmp_path / "sglang",
        tmp_path / "back",
        preset="eagle3-speculators",
        params=VERIFIER,
        progress=False,
    )
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = weightmap.compile(tmp_path / "back", preset="eagle3-sglang").config
    assert again == json.loads((tmp_path / "sglang" / "config.json").read_text())


def _sglang_copy(example: Path, tmp_path: Path, edit: dict[str, Any] | None = None) -> Path:
    dst = tmp_path / "sglang"
    weightmap.remap(example, dst, preset="eagle3-sglang", progress=False)
    if edit is not None:
        _edit_top(dst, edit)
    return dst


@pytest.mark.parametrize(
    ("edit", "params", "message"),
    [
        (
            None,
            {},
            "the flat config does not name the verifier (the target model): pass "
            'verifier=ORG/NAME (params={"verifier": ...} or --set verifier=ORG/NAME)',
        ),
        (
            {"architectures": ["LlamaForCausalLM"], "draft_vocab_size": None},
            VERIFIER,
            "not an SGLang EAGLE-3 drafter: config.json architectures should hold "
            '"LlamaForCausalLMEagle3" (or "LlamaForCausalLM" beside draft_vocab_size and '
            "midlayer.* weights, as the EAGLE trainer writes)",
        ),
        (
            {"speculators_model_type": "eagle3"},
            VERIFIER,
            "config.json is already a speculators config (speculators_model_type is set); "
            "eagle3-sglang converts the other way",
        ),
        (
            {"eagle_config": None},
            VERIFIER,
            "config.json has no eagle_config.eagle_aux_hidden_state_layer_ids, so the aux layers "
            "the drafter was trained on are unknown: pass aux_layer_ids=[...] (speculators' ids), "
            "or target_num_layers=L (the verifier's layer count) for the default SGLang and "
            "SpecForge use, [2, L // 2, L - 3]",
        ),
    ],
    ids=["no-verifier", "not-eagle3", "already-speculators", "no-aux-ids"],
)
def test_reverse_refusals(
    example: Path, tmp_path: Path, edit: dict[str, Any] | None, params: dict[str, Any], message: str
) -> None:
    src = _sglang_copy(example, tmp_path, edit)
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, preset="eagle3-speculators", params=params)
    assert f"requirement failed: {message}" in [
        p.message
        for p in info.value.problems  # type: ignore[attr-defined]
    ]


def test_reverse_with_explicit_aux_ids(example: Path, tmp_path: Path) -> None:
    src = _sglang_copy(example, tmp_path, {"eagle_config": None})
    plan = weightmap.compile(
        src, preset="eagle3-speculators", params={**VERIFIER, "aux_layer_ids": [2, 4, 6]}
    )
    assert plan.config is not None
    assert plan.config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"target_num_layers": 4}, "target_num_layers=4 is too small: the default aux layers"),
        ({"aux_layer_ids": [1.5, 2, 3]}, "aux_layer_ids must be non-negative integers"),
        ({"aux_layer_ids": [-1, 2, 3]}, "aux_layer_ids must be non-negative integers"),
    ],
)
def test_reverse_refuses_aux_ids_that_name_no_layers(
    example: Path, tmp_path: Path, params: dict[str, Any], message: str
) -> None:
    # target_num_layers=4 wrote [2, 2, 1], and 2 wrote [2, 1, -1], without a word.
    src = _sglang_copy(example, tmp_path, {"eagle_config": None})
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, preset="eagle3-speculators", params={**VERIFIER, **params})
    messages = [p.message for p in info.value.problems]  # type: ignore[attr-defined]
    assert any(message in m for m in messages), messages


def test_reverse_writes_float_spelled_aux_ids_as_integers(example: Path, tmp_path: Path) -> None:
    src = _sglang_copy(example, tmp_path, {"eagle_config": None})
    plan = weightmap.compile(
        src, preset="eagle3-speculators", params={**VERIFIER, "aux_layer_ids": [2.0, 4, 6]}
    )
    assert plan.config is not None
    ids = plan.config["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, 4, 6] and all(type(i) is int for i in ids)
