"""Will it load: a checkpoint or a plan's output against the model its config.json names.

A tiny Llama saved by transformers is the clean case; each broken output (a dropped tensor, a
wrong shape, a transposed non-square weight, an extra key, a stale dtype) must be said in one
line naming the tensor, from the Python function and the command line alike, and
``convert --check-loads`` must refuse a broken conversion before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import weightmap
from weightmap.cli import main
from weightmap.compiler.compile import compile_plan
from weightmap.format.dtypes import TensorSpec
from weightmap.language.mapping import resolve_mapping

import hfmodel


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("loads") / "llama"
    hfmodel.build(folder, "safetensors", tied=False)
    return folder


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("loads") / "tied"
    hfmodel.build(folder, "safetensors", tied=True)
    return folder


def _problems(llama: Path, rules: str) -> tuple[str, ...]:
    plan = weightmap.compile(llama, mapping="weightmap 1\n" + rules + "\nunmatched keep\n")
    return weightmap.check_loads(plan).problems


def test_a_clean_checkpoint_loads(llama: Path, tied: Path) -> None:
    report = weightmap.check_loads(llama)
    assert report.ok and report.problems == ()
    assert report.model_class == "LlamaForCausalLM"
    # save_pretrained leaves a tied lm_head out: its absence is no problem...
    assert "lm_head.weight" not in weightmap.Checkpoint.open(tied).tensors
    assert weightmap.check_loads(tied).ok
    # ...but the same absence is, when the config says the head is not tied.
    assert _problems(llama, 'drop "lm_head.weight"') == (
        "missing: lm_head.weight: the model has F32[10, 32]",
    )


def test_a_dropped_tensor(llama: Path) -> None:
    assert _problems(llama, 'drop "model.layers.1.mlp.down_proj.weight"') == (
        "missing: model.layers.1.mlp.down_proj.weight: the model has F32[32, 64]",
    )


def test_a_wrong_shape(llama: Path) -> None:
    problems = _problems(llama, 'reshape "model.layers.0.self_attn.q_proj.weight" to [16, 64]')
    assert problems == (
        "shape: model.layers.0.self_attn.q_proj.weight is F32[16, 64], the model has [32, 32]",
    )


def test_a_transposed_non_square_weight(llama: Path) -> None:
    assert _problems(llama, 'transpose "model.layers.0.mlp.up_proj.weight"') == (
        "shape: model.layers.0.mlp.up_proj.weight is F32[32, 64], the model has [64, 32] "
        "(the transposed shape)",
    )


def test_an_unexpected_key(llama: Path) -> None:
    assert _problems(llama, 'copy "model.norm.weight" -> "model.final_norm.weight"') == (
        "unexpected: model.final_norm.weight: the model has no such parameter or buffer",
    )


def test_a_dtype_other_than_the_configs(llama: Path) -> None:
    (line,) = _problems(llama, 'cast "model.norm.weight" to bf16')
    assert line.startswith("dtype: model.norm.weight is BF16 but config.json says float32")


def test_problems_of_many_layers_are_grouped(llama: Path) -> None:
    assert _problems(llama, 'drop "model.layers.{n}.mlp.down_proj.weight"') == (
        "missing: model.layers.{0..1}.mlp.down_proj.weight: the model has F32[32, 64] (2 tensors)",
    )


def test_transformers_ignore_patterns_are_honoured(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaForCausalLM

    rules = 'copy "model.norm.weight" -> "model.layers.0.self_attn.scale_cache"\n'
    rules += 'drop "model.layers.1.mlp.down_proj.weight"'
    assert len(_problems(llama, rules)) == 2
    monkeypatch.setattr(
        LlamaForCausalLM, "_keys_to_ignore_on_load_unexpected", [r"self_attn\.scale_cache"]
    )
    monkeypatch.setattr(LlamaForCausalLM, "_keys_to_ignore_on_load_missing", [r"\.mlp\.down_"])
    assert _problems(llama, rules) == ()


def test_remote_code_is_never_run_without_the_flag(tmp_path: Path, llama: Path) -> None:
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    marker = tmp_path / "ran"
    (folder / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((llama / "config.json").read_text())
    config.update(
        model_type="custom-llama",
        architectures=["CustomForCausalLM"],
        auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(weightmap.LoadError, match="pass trust_remote_code"):
        weightmap.check_loads(folder)
    assert not marker.exists()
    assert main(["check", str(folder), "--loads", "transformers"]) == 1
    assert not marker.exists()


def test_engines_are_not_checked_here(llama: Path) -> None:
    with pytest.raises(ValueError, match="sglang builds its models in its own runtime"):
        weightmap.check_loads(llama, "sglang")


def test_a_70b_llama_config_is_checked_from_headers() -> None:
    # Built on the meta device: nothing allocated, whatever the size (the time is measured
    # apart, not asserted here).
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    specs = [TensorSpec(n, "BF16", tuple(t.shape)) for n, t in model.state_dict().items()]
    doc = {**json.loads(config.to_json_string()), "architectures": ["LlamaForCausalLM"]}
    rules = resolve_mapping(
        mapping='weightmap 1\ndrop "model.layers.79.mlp.up_proj.weight"\nunmatched keep\n'
    )
    report = weightmap.check_loads(compile_plan(rules, specs, doc))
    assert report.expected == 80 * 9 + 3
    assert report.problems == (
        "missing: model.layers.79.mlp.up_proj.weight: the model has BF16[28672, 8192]",
    )


# -- the command line --------------------------------------------------------------------------


def test_check_loads_command(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(llama), "--loads", "transformers"]) == 0
    assert "loads as LlamaForCausalLM" in capsys.readouterr().out
    mapping = tmp_path / "m.wm"
    mapping.write_text(
        'weightmap 1\ntranspose "model.layers.0.mlp.up_proj.weight"\nunmatched keep\n'
    )
    # A mapping and its checkpoint: the mapping's output is checked.
    assert main(["check", str(mapping), str(llama), "--loads", "transformers"]) == 1
    out = capsys.readouterr().out
    assert "shape: model.layers.0.mlp.up_proj.weight is F32[32, 64]" in out
    # Without --loads, check still only compiles.
    assert main(["check", str(mapping), str(llama)]) == 0


def test_convert_check_loads_refuses_before_writing(
    llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mapping = tmp_path / "m.wm"
    mapping.write_text('weightmap 1\ndrop "model.norm.weight"\nunmatched keep\n')
    out = tmp_path / "out"
    args = ["convert", str(llama), str(out), "--mapping", str(mapping), "--quiet"]
    assert main([*args, "--check-loads", "transformers"]) == 1
    err = capsys.readouterr().err
    assert "missing: model.norm.weight: the model has F32[32]" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [mapping]
    # The same conversion without the check writes (and the written folder fails the check).
    assert main(args) == 0
    assert main(["check", str(out), "--loads", "transformers"]) == 1
    assert "missing: model.norm.weight" in capsys.readouterr().out


def test_remote_code_runs_with_the_flag(tmp_path: Path, llama: Path) -> None:
    # A built-in model type whose auto_map names a class of its own: without the flag the
    # built-in class is checked and the folder's code never runs; with it, the code's class.
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    marker = tmp_path / "ran"
    (folder / "modeling_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaForCausalLM\n\n\n"
        "class CustomLlama(LlamaForCausalLM):\n    pass\n"
    )
    config = json.loads((llama / "config.json").read_text())
    config.update(
        architectures=["CustomLlama"],
        auto_map={"AutoModelForCausalLM": "modeling_custom.CustomLlama"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    report = weightmap.check_loads(folder)
    assert report.ok and report.model_class == "LlamaForCausalLM"
    assert not marker.exists()
    report = weightmap.check_loads(folder, trust_remote_code=True)
    assert report.ok and report.model_class == "CustomLlama"
    assert marker.exists()


def test_a_config_transformers_cannot_build_is_one_error(tmp_path: Path, llama: Path) -> None:
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    config = json.loads((llama / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["__class__"]}))
    with pytest.raises(weightmap.LoadError, match="'__class__', which is no model class of"):
        weightmap.check_loads(folder)
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
    with pytest.raises(weightmap.LoadError, match="transformers cannot build the model"):
        weightmap.check_loads(folder)


def test_another_librarys_class_is_not_checked_as_the_model_types(tmp_path: Path) -> None:
    """SGLang's EAGLE-3 drafter names LlamaForCausalLMEagle3, which transformers lacks: built
    as LlamaForCausalLM instead, every difference between the two came out as 23 problems of
    the checkpoint (the README's own conversion, with --check-loads)."""
    out = tmp_path / "sglang"
    weightmap.remap("examples/eagle3-speculators", out, preset="eagle3-sglang", progress=False)
    with pytest.raises(weightmap.LoadError) as caught:
        weightmap.check_loads(out)
    assert str(caught.value).startswith(
        "config.json's architectures names 'LlamaForCausalLMEagle3', which is no model class "
        "of transformers"
    )
    assert "check it with the library it is for" in str(caught.value)
    assert main(["check", str(out), "--loads", "transformers"]) == 1


def test_the_names_transformers_drops_for_every_model_are_no_problem(llama: Path) -> None:
    """transformers drops an older checkpoint's per-layer rotary_emb.inv_freq (and a saved
    position_ids) where the model has such a buffer, whatever the model's own patterns say."""
    rules = (
        'copy "model.norm.weight" -> "model.layers.0.self_attn.rotary_emb.inv_freq"\n'
        'copy "model.norm.weight" -> "model.rotary_emb.inv_freq"\n'
    )
    assert _problems(llama, rules) == ()
    # A name no such rule covers is still one.
    assert _problems(llama, 'copy "model.norm.weight" -> "model.layers.0.inv_freq_extra"') == (
        "unexpected: model.layers.0.inv_freq_extra: the model has no such parameter or buffer",
    )
