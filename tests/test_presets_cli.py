"""Finding the right preset: ``weightmap presets`` says each one whole (description, params,
model types), ``presets --for CHECKPOINT`` says which apply and why the others do not, and
``convert IN OUT`` without a mapping names the presets that apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightmap.cli import main
from weightmap.language.mapping import load_preset, preset_names


def test_presets_lists_each_whole(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    # fp8-dequant's description spans three comment lines: said whole, on its preset's line.
    line = next(x for x in out.splitlines() if x.startswith("fp8-dequant "))
    assert line.endswith("over 128x128 blocks, rounded once. Streamed in chunks.")
    for name in preset_names():
        assert any(x.startswith(f"{name} ") for x in out.splitlines()), name
    blocks = out.split("\n" + "moe-fuse ")[1].splitlines()
    assert blocks[1].strip() == "params: (none)"
    assert blocks[2].strip().startswith("model types: mixtral, minimax, minimax_m2, phimoe, ")
    assert blocks[2].strip().endswith(", cohere2_moe, jamba")
    cast = (
        ("\n" + out)
        .split("\ncast ")[1]
        .split("\n" + next(n for n in preset_names() if n > "cast") + " ")[0]
    )
    assert 'params: target="bf16"' in cast and "model types: any" in cast


def _per_expert_mixtral(folder: Path) -> None:
    folder.mkdir()
    tensors = {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(2, 4)}
    for e in range(2):
        for w, shape in (("w1", (6, 4)), ("w2", (4, 6)), ("w3", (6, 4))):
            name = f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
            tensors[name] = torch.zeros(shape)
    save_file(tensors, folder / "model.safetensors")
    config = {"model_type": "mixtral", "intermediate_size": 6, "dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))


def _lines(out: str) -> dict[str, str]:
    return {line.split()[0]: line.split(maxsplit=1)[1] for line in out.splitlines()}


def test_presets_for_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "mixtral"
    _per_expert_mixtral(folder)
    assert main(["presets", "--for", str(folder)]) == 0
    said = _lines(capsys.readouterr().out)
    assert sorted(said) == preset_names()
    assert said["moe-fuse"] == "applies"
    assert said["cast"] == "applies"
    assert said["moe-unfuse"].startswith("no: no experts.gate_up_proj: the experts are not")
    assert said["llama-hf-to-meta"] == (
        'no: model_type is "mixtral", not "llama": this preset converts Llama models only'
    )
    assert said["llama-meta-to-hf"].startswith("no: the mapping reads its config from params")


def test_a_preset_that_needs_a_param_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "meta"
    folder.mkdir()
    params = {"dim": 8, "n_layers": 1, "n_heads": 2, "norm_eps": 1e-5, "vocab_size": 4}
    (folder / "params.json").write_text(json.dumps(params))
    torch.save({"tok_embeddings.weight": torch.zeros(4, 8)}, folder / "consolidated.00.pth")
    assert main(["presets", "--for", str(folder)]) == 0
    said = _lines(capsys.readouterr().out)
    assert said["llama-meta-to-hf"].startswith(
        'applies once a parameter is set: version="": say which Llama this is'
    )


def test_presets_for_a_checkpoint_that_is_not_there_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Said once, exit 1, as inspect says it: not a "no: does not exist" per preset, exit 0."""
    missing = tmp_path / "nope"
    assert main(["presets", "--for", str(missing)]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.strip() == f"weightmap: error: {missing}: no such file or folder [missing]"
    link = tmp_path / "gone"
    link.symlink_to(tmp_path / "elsewhere")
    assert main(["presets", "--for", str(link)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith("which does not exist; fix or remove the link [dangling-link]")
    assert len(err.splitlines()) == 1


def test_convert_without_a_mapping_names_the_presets_that_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "mixtral"
    _per_expert_mixtral(folder)
    out = tmp_path / "out"
    assert main(["convert", str(folder), str(out)]) == 2
    err = capsys.readouterr().err
    assert "give exactly one of --preset NAME or --mapping FILE; presets that apply to" in err
    assert ": cast, fp8-quant, moe-fuse (`weightmap presets --for" in err
    assert not out.exists()


def test_every_preset_names_what_it_accepts() -> None:
    # A preset is documentation: a description, and a comment on each param.
    for name in preset_names():
        preset = load_preset(name)
        lines = preset.text.splitlines()
        assert lines[0] == "weightmap 1" and lines[1].startswith("# "), name


def _listing(env: dict[str, str]) -> tuple[str, bool]:
    """``weightmap presets`` in a fresh process: what it prints, and whether it imported the
    rule language."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from weightmap.cli import main; main(['presets']); "
        "print('weightmap.language.mapping' in sys.modules, file=sys.stderr)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, **env},
    )  # fmt: skip
    return r.stdout, r.stderr.strip().splitlines()[-1] == "True"


def test_the_listing_is_kept_and_made_again_when_what_it_is_made_from_changes(
    tmp_path: Path,
) -> None:
    """The rows ``presets`` lists come from the per-user cache once made (the rule language is
    not imported), are the rows made without the cache, and a listing kept under another key
    (another preset text or code) is not used."""
    import pickle

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    fresh, imported = _listing({**env, "WEIGHTMAP_PARSER_CACHE": "0"})
    assert imported
    first, imported = _listing(env)
    assert first == fresh and imported  # (made, and kept)
    kept, imported = _listing(env)
    assert kept == fresh and not imported
    listing = tmp_path / "weightmap" / "presets-listing.pickle"
    _, rows = pickle.loads(listing.read_bytes())
    rows[0] = ("stale", "a listing of other presets", "(none)", "any")
    listing.write_bytes(pickle.dumps(("another key", rows)))
    again, imported = _listing(env)
    assert again == fresh and imported
