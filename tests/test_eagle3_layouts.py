"""The EAGLE-3 presets against the drafter layouts found in public repositories.

Each layout of ``eagle3/layouts.py`` (one tiny drafter per public source) is converted to
speculators' layout (``eagle3-speculators``) and back (``eagle3-sglang``). The source
drafter's forward is computed independently by the SGLang mirror, reading the source as its
trainer ran it (float32, positions spread over thousands, where rope theta and scaling
matter). It must agree with the pure-PyTorch speculators reference on the speculators copy,
with the real speculators library (``Eagle3DraftModel.from_pretrained``, its own forward) on
that copy, and with the strict SGLang mirror on the copy converted back.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap
from weightmap import ExecutionError, MappingError

from eagle3 import speculators_lib
from eagle3.layouts import LAYOUTS, Layout, write_layout
from eagle3.sglang_mirror import MirrorConfig, load_converted, sglang_layers_to_capture
from eagle3.speculators_ref import SpeculatorsReference

# Rope is relative: what theta and scaling change is the rotation between tokens far apart.
# The context's positions are spread over thousands (draft step k of row i sits at
# POSITIONS[i] + k), so 1e4 vs 5e5 and llama3 scaling (original length 4096) both bite.
POSITIONS = torch.tensor([3000, 3700, 4900, 6100, 7600, 9000])
CONTEXT = len(POSITIONS)
STEPS = 3  # the extend, then two draft steps
F32_TOL = 2e-5  # absolute, on float32 logits of O(1)

# Every layout, the Model-Optimizer export both as it ships (no t2d: the reverse preset derives
# it) and with the t2d its exporter leaves out.
WORKING = [*LAYOUTS, "modelopt+t2d"]


def _layers_layout(layout: Layout) -> dict[str, Any]:
    """eagle3-sglang's params: fc_norm / norm_output need the newer SGLang layout."""
    return {"layout": "layers"} if layout.spec.fc_norm else {}


@dataclass
class Converted:
    layout: Layout
    src: Path  # the public layout
    spec: Path  # eagle3-speculators of src
    sglang: Path  # eagle3-sglang of spec
    again: Path  # eagle3-speculators of sglang
    reverse_plan: weightmap.Plan
    embed: torch.Tensor | None  # the target's table, for drafters without embed_tokens


def _add_t2d(directory: Path, vocab: int) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    d2t = tensors["d2t"]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(d2t.shape[0]) + d2t] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Converted]:
    cache: dict[str, Converted] = {}

    def get(name: str) -> Converted:
        if name not in cache:
            layout = LAYOUTS[name.removesuffix("+t2d")]
            root = tmp_path_factory.mktemp(name)
            src = write_layout(layout, root / "src")
            if name.endswith("+t2d"):
                _add_t2d(src, layout.spec.vocab_size)
            plan = weightmap.remap(
                src, root / "spec", preset="eagle3-speculators", params=layout.params
            ).plan
            weightmap.remap(
                root / "spec",
                root / "sglang",
                preset="eagle3-sglang",
                params=_layers_layout(layout),
            )
            weightmap.remap(
                root / "sglang", root / "again", preset="eagle3-speculators", params=layout.params
            )
            gen = torch.Generator().manual_seed(layout.spec.seed + 100)
            spec = layout.spec
            embed = (
                None
                if spec.with_embed_tokens
                else torch.randn(spec.vocab_size, spec.hidden_size, generator=gen)
            )
            cache[name] = Converted(
                layout, src, root / "spec", root / "sglang", root / "again", plan, embed
            )
        return cache[name]

    return get


def _inputs(layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(layout.spec.seed + 1)
    aux = torch.randn(CONTEXT, layout.spec.aux_width, generator=gen)
    ids = torch.randint(0, layout.spec.vocab_size, (CONTEXT,), generator=gen)
    return aux, ids


Chain = list[torch.Tensor]  # logits [CONTEXT, Vd] per step, speculators_lib.ttt_logits' order


def _mirror_chain(directory: Path, c: Converted, *, source: bool) -> Chain:
    mirror = load_converted(
        directory,
        dtype=torch.float32,
        device=torch.device("cpu"),
        embed_tokens=c.embed,
        source=source,
        newer_sglang=c.layout.spec.fc_norm,  # eagle3-sglang's layout="layers"
    )
    aux, ids = _inputs(c.layout)
    return speculators_lib.chain_logits(
        mirror.extend, mirror.step, aux, ids, positions=POSITIONS, steps=STEPS
    )


def _max_diff(a: Chain, b: Chain) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# -- conversion to speculators -------------------------------------------------------------


@pytest.mark.parametrize("name", WORKING)
def test_speculators_config_is_explicit(converted: Callable[[str], Converted], name: str) -> None:
    """Every field vLLM's speculators adapter and speculators read is written, rope intact."""
    c = converted(name)
    cfg = json.loads((c.spec / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert isinstance(cfg[flag], bool), flag
    assert cfg["norm_before_residual"] is False  # vLLM would assume true when absent
    assert cfg["fc_norm"] is cfg["norm_output"] is c.layout.spec.fc_norm
    assert layer["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(c.layout.spec.aux_layer_ids)
    spec_cfg = cfg["speculators_config"]
    assert spec_cfg["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec_cfg["verifier"]["name_or_path"] == "example-org/verifier"
    assert layer["head_dim"] == c.layout.spec.head_dim
    rope = dict(layer["rope_parameters"])
    assert rope.pop("rope_theta") == c.layout.rope_theta
    assert rope == (c.layout.rope_scaling or {"rope_type": "default"})
    assert not {"rope_theta", "rope_scaling", "eagle_config", "torch_dtype"} & set(layer)
    assert (
        cfg["dtype"] == {torch.float16: "float16", torch.bfloat16: "bfloat16"}[c.layout.spec.dtype]
    )
    defaulted = "config.json has no rope_theta: written as 10000.0"
    assert any(defaulted in w for w in c.reverse_plan.warnings) == (
        name.startswith(("eagle", "specforge-llama3"))
    )


@pytest.mark.parametrize("name", WORKING)
def test_speculators_tensors_are_the_source_tensors(
    converted: Callable[[str], Converted], name: str
) -> None:
    c = converted(name)
    src, out = (
        load_file(str(c.src / "model.safetensors")),
        load_file(str(c.spec / "model.safetensors")),
    )
    derived = _derived_t2d(src, out, c.layout)
    assert {k.replace("midlayer.", "layers.0.") for k in src} | derived == set(out)
    for key, value in src.items():
        got = out[key.replace("midlayer.", "layers.0.")]
        assert got.dtype == value.dtype and torch.equal(got, value), key


def _derived_t2d(
    src: dict[str, torch.Tensor], out: dict[str, torch.Tensor], layout: Layout
) -> set[str]:
    """{"t2d"} where the source had d2t only and the conversion derived t2d (checked here)."""
    if "t2d" in src or "d2t" not in src:
        return set()
    expected = torch.zeros(layout.spec.vocab_size, dtype=torch.bool)
    expected[torch.arange(src["d2t"].numel()) + src["d2t"]] = True
    assert torch.equal(out["t2d"], expected)
    return {"t2d"}


# -- forward -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKING)
def test_converted_drafters_compute_the_source_forward(
    converted: Callable[[str], Converted], name: str
) -> None:
    """Source (mirror, read as trained) = speculators reference on the speculators copy =
    strict SGLang mirror on the copy converted back."""
    c = converted(name)
    expected = _mirror_chain(c.src, c, source=True)
    ref = SpeculatorsReference(
        c.spec, dtype=torch.float32, device=torch.device("cpu"), embed_tokens=c.embed
    )
    aux, ids = _inputs(c.layout)
    got_ref = speculators_lib.chain_logits(
        ref.extend, ref.step, aux, ids, positions=POSITIONS, steps=STEPS
    )
    assert _max_diff(got_ref, expected) <= F32_TOL
    assert _max_diff(_mirror_chain(c.sglang, c, source=False), expected) <= F32_TOL


@pytest.mark.parametrize("name", WORKING)
def test_positions_make_rope_matter(converted: Callable[[str], Converted], name: str) -> None:
    """At POSITIONS, reading theta 10000 for 5e5 (or the reverse), or dropping llama3 scaling,
    moves the logits far beyond the tolerance: the forward comparisons see the rope."""
    c = converted(name)
    expected = _mirror_chain(c.src, c, source=True)
    cfg = json.loads((c.src / "config.json").read_text())
    theta = 500000.0 if c.layout.rope_theta == 10000.0 else 10000.0
    wrong = [{"rope_theta": theta, "rope_parameters": {"rope_theta": theta}}]
    if c.layout.rope_scaling is not None:
        wrong.append({"rope_scaling": None, "rope_parameters": {"rope_theta": c.layout.rope_theta}})
    for i, edit in enumerate(wrong):
        variant = c.src.parent / f"wrong-rope-{i}"
        shutil.copytree(c.src, variant, dirs_exist_ok=True)
        edited = {**cfg, **edit}
        if "rope_parameters" not in cfg:
            del edited["rope_parameters"]
        (variant / "config.json").write_text(json.dumps(edited))
        assert _max_diff(_mirror_chain(variant, c, source=True), expected) > 1000 * F32_TOL, edit


@pytest.mark.skipif(not speculators_lib.available(), reason="speculators is not installed")
@pytest.mark.parametrize("name", WORKING)
def test_speculators_library_loads_and_matches(
    converted: Callable[[str], Converted], name: str, tmp_path: Path
) -> None:
    """The real library: from_pretrained reports no missing or unexpected key, every tensor
    holds the file's values, and its own forward computes the source's logits."""
    c = converted(name)
    spec = c.layout.spec
    folder = shutil.copytree(c.spec, tmp_path / "spec")
    embed = (
        c.embed
        if c.embed is not None
        else load_file(str(c.src / "model.safetensors"))["embed_tokens.weight"]
    )
    verifier = speculators_lib.write_verifier(
        tmp_path / "verifier",
        hidden=spec.hidden_size,
        vocab=spec.vocab_size,
        num_layers=spec.num_target_layers,
        embed=embed,
    )
    loaded = speculators_lib.load(folder, verifier, embed_tokens=c.embed)
    assert (loaded.missing, loaded.unexpected) == ([], [])
    aux, ids = _inputs(c.layout)
    got = speculators_lib.ttt_logits(loaded.model, aux, ids, positions=POSITIONS, steps=STEPS)
    assert _max_diff(got, _mirror_chain(c.src, c, source=True)) <= F32_TOL


# -- back to SGLang --------------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKING)
def test_round_trip(converted: Callable[[str], Converted], name: str) -> None:
    """source -> speculators -> SGLang: the same tensors (the same bytes where the names stay),
    and a config from which SGLang reads the same model; a second round trip changes nothing."""
    c = converted(name)
    src, back = c.src / "model.safetensors", c.sglang / "model.safetensors"
    if c.layout.metadata is not None and not c.layout.spec.fc_norm:
        assert back.read_bytes() == src.read_bytes()
    else:
        # fc_norm: newer SGLang's layers.0.* (older SGLang would skip fc_norm.N);
        # Model-Optimizer saves no {"format": "pt"} metadata, which the output has.
        rename = "layers.0." if c.layout.spec.fc_norm else "midlayer."
        a, b = load_file(str(src)), load_file(str(back))
        derived = _derived_t2d(a, b, c.layout)  # the shipped Model-Optimizer export lacks t2d
        assert {k.replace("midlayer.", rename) for k in a} | derived == set(b)
        assert all(torch.equal(v, b[k.replace("midlayer.", rename)]) for k, v in a.items())
    source_cfg = json.loads((c.src / "config.json").read_text())
    back_cfg = json.loads((c.sglang / "config.json").read_text())
    # What SGLang reads: the same sizes, rope and flags, and the same capture points (the
    # source may leave them to SGLang's default, the conversion writes them).
    before = MirrorConfig.from_flat(source_cfg, source=True)
    after = MirrorConfig.from_flat(back_cfg)
    assert replace(after, aux_layer_ids=None) == replace(before, aux_layer_ids=None)
    layers = c.layout.spec.num_target_layers
    assert sglang_layers_to_capture(after.aux_layer_ids, layers) == sglang_layers_to_capture(
        before.aux_layer_ids, layers
    )
    # Converted once, the drafter is a fixed point: the same bytes, the same config (fields in
    # another order).
    again, spec = c.again / "model.safetensors", c.spec / "model.safetensors"
    assert again.read_bytes() == spec.read_bytes()
    assert json.loads((c.again / "config.json").read_text()) == json.loads(
        (c.spec / "config.json").read_text()
    )


# -- Model-Optimizer: no t2d -------------------------------------------------------------------


def test_modelopt_t2d_is_derived_from_d2t(tmp_path: Path) -> None:
    layout = LAYOUTS["modelopt"]
    src = write_layout(layout, tmp_path / "src")
    result = weightmap.remap(
        src, tmp_path / "spec", preset="eagle3-speculators", params=layout.params
    )
    out = load_file(str(tmp_path / "spec" / "model.safetensors"))
    d2t, t2d = out["d2t"], out["t2d"]
    expected = torch.zeros(layout.spec.vocab_size, dtype=torch.bool)
    expected[torch.arange(layout.spec.draft_vocab_size) + d2t] = True
    assert t2d.dtype == torch.bool and torch.equal(t2d, expected)
    assert any("t2d" in w and "derived" in w for w in result.plan.warnings)


def test_a_d2t_that_does_not_fit_the_vocabulary_is_refused_when_deriving_t2d(
    tmp_path: Path,
) -> None:
    # t2d[i + d2t[i]] must land inside the target vocabulary, once per position.
    layout = LAYOUTS["modelopt"]
    src = write_layout(layout, tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + layout.spec.vocab_size
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ExecutionError, match=r"mask positions run from .* outside 0\.\."):
        weightmap.remap(src, tmp_path / "spec", preset="eagle3-speculators", params=layout.params)
    assert not (tmp_path / "spec").exists()


# -- refusals of what speculators would compute differently ------------------------------------

EAGLE_CONFIG_REFUSALS = {
    "use_aux_hidden_state": (False, "eagle_config.use_aux_hidden_state is false"),
    "use_input_layernorm_in_first_layer": (False, "always normalises the token embeddings"),
    "use_last_layernorm": (False, "always applies the final norm"),
    "use_mtp_layernorm": (True, "no MTP layer norms"),
    "next_layer_regular": (False, "plain decoder layers"),
    "parallel_draft_step": (2, "parallel draft heads have no counterpart"),
    "medusa_heads": (2, "eagle_config has keys this preset does not know"),
}


@pytest.mark.parametrize(
    ("key", "refusal"), EAGLE_CONFIG_REFUSALS.items(), ids=list(EAGLE_CONFIG_REFUSALS)
)
def test_modelopt_eagle_config_values_speculators_cannot_compute(
    tmp_path: Path, key: str, refusal: tuple[Any, str]
) -> None:
    layout = LAYOUTS["modelopt"]
    src = write_layout(layout, tmp_path / "src")
    _add_t2d(src, layout.spec.vocab_size)
    cfg = json.loads((src / "config.json").read_text())
    weightmap.compile(src, preset="eagle3-speculators", params=layout.params)  # as exported: fine
    cfg["eagle_config"][key] = refusal[0]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, preset="eagle3-speculators", params=layout.params)
    (problem,) = info.value.problems  # type: ignore[attr-defined]
    assert refusal[1] in problem.message


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [
        (
            {"rope_theta": 10000.0},
            "rope_theta (10000.0) and rope_parameters.rope_theta (500000.0) disagree",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_scaling (yarn) and rope_parameters (llama3) disagree",
        ),
        ({"fc_norm": False}, "fc_norm.N.weight tensors without fc_norm=true"),
        ({"norm_before_residual": True}, "norm_before_residual=true in a flat config"),
    ],
    ids=["theta", "scaling", "fc-norm-flag", "norm-before-residual"],
)
def test_ambiguous_flat_configs_are_refused(
    tmp_path: Path, edit: dict[str, Any], refusal: str
) -> None:
    layout = LAYOUTS["specforge-tf5"]
    src = write_layout(layout, tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    if "fc_norm" in edit:  # fc_norm tensors, as Eagle-3.1 saves them, without the flag
        for j in range(3):
            tensors[f"fc_norm.{j}.weight"] = torch.ones(
                layout.spec.hidden_size, dtype=torch.bfloat16
            )
        save_file(tensors, str(src / "model.safetensors"))
    cfg = {**json.loads((src / "config.json").read_text()), **edit}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, preset="eagle3-speculators", params=layout.params)
    (problem,) = info.value.problems  # type: ignore[attr-defined]
    assert refusal in problem.message
