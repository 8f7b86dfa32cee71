"""Mappings of several inputs (``input NAME``): Meta's rank files joined, a LoRA adapter
merged into its base, two models averaged, each bit for bit against its plain-torch
reference (tests/several.py), streamed at several chunk sizes and in memory, from Python and
from the CLI; and every way binding inputs can go wrong, each refused with its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap
from several import (
    DIM,
    VOCAB,
    intermediate,
    lora_pair,
    meta_params,
    meta_ranks,
    peft_merge,
    write_model,
)
from test_conversions import example
from weightmap import cli
from weightmap.errors import CheckpointError, MappingError

from valuetools import as_bytes

Tensors = dict[str, torch.Tensor]


def _same(got: Tensors, expected: Tensors) -> None:
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(as_bytes(got[name]), as_bytes(t)), name


def _every_way(src: Path, tmp: Path, inputs: dict[str, Any], **how: Any) -> Tensors:
    """remap at two chunk sizes and iter_tensors: all the same bytes; returns one."""
    memory = {k: v.clone() for k, v in weightmap.iter_tensors(src, inputs=inputs, **how)}
    for i, chunk in enumerate((4096, 1 << 20)):
        out = tmp / f"out{i}"
        weightmap.remap(src, out, inputs=inputs, chunk_bytes=chunk, progress=False, **how)
        _same(load_file(out / "model.safetensors"), memory)
    return memory


# -- Meta's rank files -----------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "ranks"), [("2", 1), ("2", 4), ("3", 2), ("3", 4)])
def test_meta_ranks_are_write_model(tmp_path: Path, version: str, ranks: int) -> None:
    folder, loaded = meta_ranks(tmp_path, version, ranks)
    params = {"version": version} | ({"vocab_size": VOCAB} if version == "2" else {})
    got = _every_way(folder, tmp_path, {}, preset="llama-meta-ranks-to-hf", params=params)
    _same(got, write_model(loaded, meta_params(version), version))
    config = json.loads((tmp_path / "out0" / "config.json").read_text())
    assert config["intermediate_size"] == intermediate(meta_params(version))
    # The main input's side files come along; the rank files are the family's, not side files.
    assert (tmp_path / "out0" / "tokenizer.model").read_bytes() == b"tokenizer"
    assert not list((tmp_path / "out0").glob("consolidated.*"))
    assert weightmap.check_loads(tmp_path / "out0").ok


@pytest.mark.parametrize("ranks", [1, 4])
def test_meta_ranks_worked_example_is_write_model(tmp_path: Path, ranks: int) -> None:
    """docs/language.md's join of Meta's ranks: write_model's tensors, bit for bit."""
    folder, loaded = meta_ranks(tmp_path, "3", ranks)
    mapping = example("meta-ranks-to-hf")
    got = _every_way(folder, tmp_path, {}, mapping=mapping, params={"version": "3"})
    _same(got, write_model(loaded, meta_params("3"), "3"))


def test_meta_ranks_plan_names_the_ranks(tmp_path: Path) -> None:
    folder, _ = meta_ranks(tmp_path, "3", 2)
    plan = weightmap.compile(folder, preset="llama-meta-ranks-to-hf", params={"version": "3"})
    sources = {s.name for o in plan.outputs for s in o.node.sources()}
    assert "ranks:1:layers.0.attention.wq.weight" in sources
    # The norms every rank holds are read from each rank, to check they are the same.
    assert "ranks:0:norm.weight" in sources and "ranks:1:norm.weight" in sources
    assert "ranks:0:layers.0.feed_forward.w2.weight BF16[64, 112] (+1 more)" in plan.explain()
    assert "same bytes in all 2" in plan.explain()
    rank0 = weightmap.compile(
        folder,
        preset="llama-meta-ranks-to-hf",
        params={"version": "3", "check_replicas": False},
    )
    sources = {s.name for o in rank0.outputs for s in o.node.sources()}
    assert "ranks:0:norm.weight" in sources and "ranks:1:norm.weight" not in sources


def test_replicas_that_differ_stop_the_run(tmp_path: Path) -> None:
    folder, per = meta_ranks(tmp_path, "3", 2)
    per[1]["layers.1.ffn_norm.weight"][3] += 1
    torch.save(per[1], folder / "consolidated.01.pth")
    how: dict[str, Any] = {"preset": "llama-meta-ranks-to-hf", "params": {"version": "3"}}
    message = "ranks:1:layers.1.ffn_norm.weight holds other bytes than ranks:0:layers.1.ffn_norm"
    with pytest.raises(weightmap.errors.ExecutionError, match=message):
        weightmap.remap(folder, tmp_path / "out", progress=False, **how)
    assert not (tmp_path / "out").exists()
    with pytest.raises(weightmap.errors.ExecutionError, match=message):
        dict(weightmap.iter_tensors(folder, **how))
    # write_model's way: rank 0's, the others unread.
    how["params"]["check_replicas"] = False
    weightmap.remap(folder, tmp_path / "out", progress=False, **how)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(
        got["model.layers.1.post_attention_layernorm.weight"], per[0]["layers.1.ffn_norm.weight"]
    )


@pytest.mark.parametrize(("version", "ranks"), [("2", 4), ("3", 2)])
def test_meta_ranks_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str, ranks: int
) -> None:
    """Llama 2 (embeddings joined along dim 1) and Llama 3 (dim 0), as a user runs them."""
    folder, loaded = meta_ranks(tmp_path, version, ranks)
    out = tmp_path / "hf"
    sets = ["--set", f"version={version}"]
    if version == "2":
        sets += ["--set", f"vocab_size={VOCAB}"]
    rc = cli.main(
        ["convert", str(folder), str(out), "--preset", "llama-meta-ranks-to-hf", *sets, "--quiet"]
    )
    assert rc == 0, capsys.readouterr().err
    expected = write_model(loaded, meta_params(version), version)
    _same(load_file(out / "model.safetensors"), expected)


def test_meta_rank_gaps_are_refused(tmp_path: Path) -> None:
    folder, _ = meta_ranks(tmp_path, "3", 4)
    (folder / "consolidated.02.pth").unlink()
    with pytest.raises(CheckpointError, match="rank 2 is missing"):
        weightmap.compile(folder, preset="llama-meta-ranks-to-hf", params={"version": "3"})
    shutil.copy(folder / "consolidated.01.pth", folder / "consolidated.2.pth")
    shutil.copy(folder / "consolidated.01.pth", folder / "consolidated.02.pth")
    with pytest.raises(CheckpointError, match="both rank 2"):
        weightmap.compile(folder, preset="llama-meta-ranks-to-hf", params={"version": "3"})


def test_a_rank_missing_a_tensor_is_named(tmp_path: Path) -> None:
    folder, per = meta_ranks(tmp_path, "3", 2)
    del per[1]["layers.1.attention.wo.weight"]
    torch.save(per[1], folder / "consolidated.01.pth")
    with pytest.raises(MappingError, match=r"group n=1 is incomplete: missing r=1"):
        weightmap.compile(folder, preset="llama-meta-ranks-to-hf", params={"version": "3"})


def test_the_single_rank_preset_points_at_the_ranks_one(tmp_path: Path) -> None:
    folder, _ = meta_ranks(tmp_path, "3", 2)
    with pytest.raises(CheckpointError, match="model-parallel") as caught:
        weightmap.compile(folder, preset="llama-meta-to-hf", params={"version": "3"})
    assert "--preset llama-meta-ranks-to-hf" in str(caught.value)


# -- LoRA merge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize(
    ("base_dtype", "adapter_dtype", "extra"),
    [
        (torch.bfloat16, torch.bfloat16, {}),
        (torch.float16, torch.float16, {"use_rslora": True, "r": 16, "lora_alpha": 8}),
        (torch.bfloat16, torch.bfloat16, {"fan_in_fan_out": True}),
    ],
)
def test_lora_merge_is_peft(
    tmp_path: Path,
    base_dtype: torch.dtype,
    adapter_dtype: torch.dtype,
    extra: dict[str, Any],
    autocast: bool,
) -> None:
    base, adapter = lora_pair(
        tmp_path,
        base_dtype=base_dtype,
        adapter_dtype=adapter_dtype,
        r=extra.get("r", 8),
        alpha=extra.get("lora_alpha", 16),
        extra={k: v for k, v in extra.items() if k not in ("r", "lora_alpha")},
    )
    params = {} if autocast else {"autocast": False}
    got = _every_way(base, tmp_path, {"adapter": adapter}, preset="lora-merge", params=params)
    config = json.loads((adapter / "adapter_config.json").read_text())
    expected = peft_merge(
        load_file(base / "model.safetensors"),
        load_file(adapter / "adapter_model.safetensors"),
        config,
        autocast=autocast,
    )
    # Half-precision adapters: every product of two bf16/f16 values is exact in float32, and
    # with r terms BLAS sums them in order (as matmul does): peft's bits exactly.
    _same(got, expected)
    # The two roundings differ: the default (one rounding) is not the other's result.
    other = peft_merge(
        load_file(base / "model.safetensors"),
        load_file(adapter / "adapter_model.safetensors"),
        config,
        autocast=not autocast,
    )
    assert any(not torch.equal(got[k], other[k]) for k in got)


def test_lora_merge_of_a_float32_adapter(tmp_path: Path) -> None:
    """A float32 adapter: products round, so BLAS (which fuses multiply and add, and may sum
    in another order) and matmul's ordered sum may differ in the delta's last bit. The merge
    is compared with the ordered sum exactly and with peft's BLAS product within two float32
    steps of the weight's largest value."""
    base, adapter = lora_pair(tmp_path, base_dtype=torch.float32, adapter_dtype=torch.float32)
    got = _every_way(base, tmp_path, {"adapter": adapter}, preset="lora-merge")
    weights = load_file(base / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    expected = peft_merge(weights, lora, json.loads((adapter / "adapter_config.json").read_text()))
    ordered = dict(weights)
    for name, w in weights.items():
        key = f"base_model.model.{name[: -len('.weight')]}"
        if f"{key}.lora_A.weight" not in lora:
            continue
        a, b = lora[f"{key}.lora_A.weight"], lora[f"{key}.lora_B.weight"]
        delta = b[:, 0:1] * a[0:1, :]
        for k in range(1, a.shape[0]):
            delta = delta + b[:, k : k + 1] * a[k : k + 1, :]
        ordered[name] = w + delta * 2.0
    _same(got, ordered)
    eps = torch.finfo(torch.float32).eps
    for name, t in expected.items():
        # (measured: about 6% of the adapted weights' elements differ, each by at most a
        # rounding step of the weight's scale; docs/language.md, "Several inputs")
        assert (got[name] - t).abs().max() <= 2 * eps * t.abs().max(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_worked_example_is_peft(tmp_path: Path, dtype: torch.dtype) -> None:
    """docs/language.md's LoRA merge: peft's merge_and_unload (adapter upcast), bit for bit."""
    base, adapter = lora_pair(tmp_path, base_dtype=dtype, adapter_dtype=dtype)
    got = _every_way(base, tmp_path, {"adapter": adapter}, mapping=example("lora-merge"))
    expected = peft_merge(
        load_file(base / "model.safetensors"),
        load_file(adapter / "adapter_model.safetensors"),
        json.loads((adapter / "adapter_config.json").read_text()),
    )
    _same(got, expected)


@pytest.mark.parametrize(
    ("dtype", "extra", "sets"),
    [
        (torch.bfloat16, {}, []),
        (torch.float16, {"use_rslora": True}, ["--set", "autocast=false"]),
        (torch.bfloat16, {"fan_in_fan_out": True}, []),
    ],
)
def test_lora_merge_from_the_cli_and_its_plan(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    dtype: torch.dtype,
    extra: dict[str, Any],
    sets: list[str],
) -> None:
    """The merge as a user runs it: bf16, f16 with rsLoRA's scaling and peft's rounding
    without autocast, and a Conv1D-style (fan_in_fan_out) base."""
    base, adapter = lora_pair(tmp_path, base_dtype=dtype, adapter_dtype=dtype, extra=extra)
    out = tmp_path / "merged"
    rc = cli.main(
        ["convert", str(base), str(out), "--preset", "lora-merge", "--input", f"adapter={adapter}",
         *sets, "--quiet"]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    expected = peft_merge(
        load_file(base / "model.safetensors"),
        load_file(adapter / "adapter_model.safetensors"),
        json.loads((adapter / "adapter_config.json").read_text()),
        autocast=not sets,
    )
    _same(load_file(out / "model.safetensors"), expected)
    rc = cli.main(["plan", str(base), "--preset", "lora-merge", "--input", f"adapter={adapter}"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "adapter:base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight" in printed


def test_lora_refusals(tmp_path: Path) -> None:
    base, adapter = lora_pair(tmp_path, base_dtype=torch.bfloat16, adapter_dtype=torch.bfloat16)
    with pytest.raises(MappingError, match=r"reads input 'adapter': bind it.*--input adapter="):
        weightmap.compile(base, preset="lora-merge")
    with pytest.raises(MappingError, match="declares no input 'lora'"):
        weightmap.compile(base, preset="lora-merge", inputs={"lora": adapter})
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(MappingError, match="DoRA"):
        weightmap.compile(base, preset="lora-merge", inputs={"adapter": adapter})
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no adapter_config\.json"):
        weightmap.compile(base, preset="lora-merge", inputs={"adapter": adapter})
    with pytest.raises(CheckpointError, match="read as the main input and as input 'adapter'"):
        weightmap.compile(base, preset="lora-merge", inputs={"adapter": base})


# -- the language: a namespace per input -------------------------------------------------------


def _two(tmp: Path) -> tuple[Path, Path, Tensors, Tensors]:
    gen = torch.Generator().manual_seed(5)
    a = {f"w{i}": torch.randn(16, 8, generator=gen).bfloat16() for i in range(3)}
    b = {f"w{i}": torch.randn(16, 8, generator=gen).bfloat16() for i in range(3)}
    for name, tensors in (("a", a), ("b", b)):
        (tmp / name).mkdir()
        save_file(tensors, tmp / name / "model.safetensors")
    return tmp / "a", tmp / "b", a, b


def test_a_weighted_merge_of_two_models(tmp_path: Path) -> None:
    """The worked example of docs/language.md ("Several inputs")."""
    first, second, a, b = _two(tmp_path)
    mapping = example("average")
    params = {"t": 0.25}
    got = _every_way(first, tmp_path, {"other": second}, mapping=mapping, params=params)
    expected = {k: (a[k].float() * 0.75 + b[k].float() * 0.25).to(torch.bfloat16) for k in a}
    _same(got, expected)


def test_patterns_see_their_own_input(tmp_path: Path) -> None:
    first, second, _a, _b = _two(tmp_path)
    # `**` is the main input's: the other input's tensors are not cast, and the one left
    # over is named, with how to take it.
    mapping = 'weightmap 1\ninput other\ncast "**" to f32\nunmatched keep\n'
    with pytest.raises(MappingError, match=r"output 'other:w0' \(and 2 more\) is still input"):
        weightmap.compile(first, mapping=mapping, inputs={"other": second})
    mapping = 'weightmap 1\ninput other\ncast "**" to f32\nrename "other:{x}" -> "o.{x}"\n'
    plan = weightmap.compile(first, mapping=mapping, inputs={"other": second})
    dtypes = {o.name: o.spec.dtype for o in plan.outputs}
    assert dtypes == {"w0": "F32", "w1": "F32", "w2": "F32"} | {f"o.w{i}": "BF16" for i in range(3)}
    # An input's config is read in expressions by its name.
    (second / "config.json").write_text(json.dumps({"hidden": 8}))
    mapping = (
        'weightmap 1\ninput other\nrequire other.config.hidden == 9 else "hidden is '
        '{other.config.hidden}"\nunmatched drop\n'
    )
    with pytest.raises(MappingError, match="hidden is 8"):
        weightmap.compile(first, mapping=mapping, inputs={"other": second})


def test_input_declarations_are_checked(tmp_path: Path) -> None:
    for text, message in [
        ('input a\ninput a\nkeep "**"', "declared twice"),
        ('param a = 1\ninput a\nkeep "**"', "takes a param's name"),
        ('input dtype\nkeep "**"', "takes a built-in name"),
        ('input r files "x/{n}.pth"\nkeep "**"', "one capture for the rank"),
        ('input r files "{a}.{b}"\nkeep "**"', "one capture for the rank"),
        ('input r config from "../x.json"\nkeep "**"', "inside the input's folder"),
    ]:
        with pytest.raises(MappingError, match=message):
            weightmap.load_mapping("weightmap 1\n" + text)


def test_a_main_tensor_named_like_an_input_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    save_file({"other:w": torch.zeros(2)}, tmp_path / "m" / "model.safetensors")
    _first, second, _, _ = _two(tmp_path)
    with pytest.raises(CheckpointError, match="reads as one of input 'other'"):
        weightmap.compile(
            tmp_path / "m", mapping='weightmap 1\ninput other\nkeep "**"', inputs={"other": second}
        )


def test_a_plain_input_does_not_invert_and_not_in_place(tmp_path: Path) -> None:
    """(A family's gather inverts into a scatter: test_several_outputs.py.)"""
    first, second, _, _ = _two(tmp_path)
    mapping = 'weightmap 1\ninput other\nrename "other:{x}" -> "o.{x}"\n'
    with pytest.raises(MappingError, match="one checkpoint combined into the output"):
        weightmap.invert(mapping)
    with pytest.raises(ValueError, match="in-place rename cannot"):
        weightmap.remap(first, mapping=mapping, inputs={"other": second}, inplace=True)


@pytest.mark.parametrize(("version", "given"), [("2", "3"), ("3", "2")])
def test_meta_ranks_of_another_llama_version_are_refused(
    tmp_path: Path, version: str, given: str
) -> None:
    """The version says which way tok_embeddings was split over the ranks; joined the other
    way, it would be written with a shape its config.json contradicts (no model loads it)."""
    folder, _ = meta_ranks(tmp_path, version, 4)
    params: dict[str, Any] = {"version": given, "vocab_size": VOCAB}
    with pytest.raises(MappingError) as caught:
        weightmap.compile(folder, preset="llama-meta-ranks-to-hf", params=params)
    if version == "2":  # (params.json's vocab_size -1 says so first)
        assert "vocab_size is -1, as only Llama 2's is: --set version=2" in str(caught.value)
    # Without that clue, the joined shape refuses it.
    (folder / "params.json").write_text(json.dumps(meta_params(version) | {"vocab_size": VOCAB}))
    with pytest.raises(MappingError) as caught:
        weightmap.compile(folder, preset="llama-meta-ranks-to-hf", params=params)
    joined = [VOCAB // 4, DIM * 4] if version == "3" else [VOCAB * 4, DIM // 4]
    assert f"`tok_embeddings.weight` {joined} does not have the declared shape" in str(caught.value)
    assert f"[{VOCAB}, {DIM}]" in str(caught.value)
