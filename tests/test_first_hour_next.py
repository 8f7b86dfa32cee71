"""The next round of first-hour rough edges (items 2-10 of issue 36), each through the
command line as a new user meets it."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # (a Hub lookup must not be what answers)
    return subprocess.run(
        [sys.executable, "-m", "weightmap", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def _ckpt(folder: Path, names: list[str] | None = None) -> Path:
    folder.mkdir(parents=True)
    names = names or ["w"]
    save_file({n: np.ones(3, dtype=np.float32) for n in names}, folder / "model.safetensors")
    return folder


def _mapping(tmp_path: Path, text: str) -> str:
    path = tmp_path / "m.wm"
    path.write_text("weightmap 1\n" + text + "\n")
    return str(path)


# -- 2: a mistyped local path is not a Hub id


@pytest.mark.parametrize("given", ["sub/llama-bf1", "./sub/llama-bf1", "../x/sub/llama-bf1"])
def test_a_mistyped_local_path_is_said_so(tmp_path: Path, given: str) -> None:
    _ckpt(tmp_path / "x" / "sub" / "llama-bf16")
    r = run("inspect", given, cwd=tmp_path / "x")
    assert r.returncode == 1
    assert "Hugging Face" not in r.stderr and "Hub" not in r.stderr
    assert f"{given}: no such file or folder" in r.stderr
    shown = given.rpartition("/")[0]
    assert f"did you mean {shown}/llama-bf16?" in r.stderr


def test_an_absolute_path_is_never_a_hub_id(tmp_path: Path) -> None:
    r = run("inspect", str(tmp_path / "nothere" / "model"))
    assert r.returncode == 1
    assert "no such file or folder (nor is" in r.stderr and "Hub" not in r.stderr


# -- 3: files recognised by their first bytes


def test_a_torch_zip_is_read_whatever_its_name(tmp_path: Path) -> None:
    torch.save({"a.weight": torch.arange(6.0).reshape(2, 3)}, tmp_path / "model.ckpt")
    r = run("inspect", str(tmp_path / "model.ckpt"))
    assert r.returncode == 0, r.stderr
    assert re.search(r"a\.weight\s+F32\s+\[2, 3\]", r.stdout)
    out = tmp_path / "out"
    r = run(
        "convert",
        str(tmp_path / "model.ckpt"),
        str(out),
        "--mapping",
        _mapping(tmp_path, "unmatched keep"),
    )
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file()


def test_a_gguf_file_and_a_foreign_zip_are_named(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))
    r = run("inspect", str(gguf))
    assert r.returncode == 1
    assert "this is a GGUF file" in r.stderr and "[gguf]" in r.stderr
    assert "header length" not in r.stderr
    other = tmp_path / "weights.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("readme.txt", "hello")
    r = run("inspect", str(other))
    assert r.returncode == 1
    assert (
        "zip archive but not a PyTorch checkpoint" in r.stderr and "header length" not in r.stderr
    )


# -- 4: the README's torch build


def test_readme_says_which_torch_build_its_commands_install() -> None:
    text = (REPO / "README.md").read_text()
    assert "CPU build of torch first" not in text  # (the old claim its command did not keep)
    assert "installs torch's CUDA build" in text
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    commands = re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)
    assert len(commands) == 2 and all("pip install torch==2.13.0 && " in c for c in commands)


# -- 5: files { add } with a single-file input


def test_a_files_add_with_a_single_file_input_is_said(tmp_path: Path) -> None:
    src = _ckpt(tmp_path / "in")
    m = _mapping(tmp_path, 'unmatched keep\nfiles { add "NOTE.txt" = "hello" }')
    r = run("convert", str(src / "model.safetensors"), str(tmp_path / "out"), "--mapping", m)
    assert r.returncode == 0
    assert 'files { add "NOTE.txt" ... } is skipped' in r.stderr
    assert not (tmp_path / "out" / "NOTE.txt").exists()
    r = run("convert", str(src), str(tmp_path / "out2"), "--mapping", m)  # the folder: written
    assert r.returncode == 0 and "skipped" not in r.stderr
    assert (tmp_path / "out2" / "NOTE.txt").read_text() == "hello"


# -- 6: diff compares side files


def test_diff_compares_side_files(tmp_path: Path) -> None:
    a, b = _ckpt(tmp_path / "a"), _ckpt(tmp_path / "b")
    (a / "tokenizer_config.json").write_text('{"x": 1}')
    (b / "tokenizer_config.json").write_text('{"x": 2}')
    (b / "extra.txt").write_text("more")
    r = run("diff", str(a), str(b))
    assert r.returncode == 1
    assert "file ~ tokenizer_config.json" in r.stdout and "file + extra.txt" in r.stdout
    assert "1 tensor identical, 2 side file difference(s)" in r.stdout
    (b / "tokenizer_config.json").write_text('{"x": 1}')
    (b / "extra.txt").unlink()
    r = run("diff", str(a), str(b))
    assert r.returncode == 0 and r.stdout.strip().endswith("1 tensor identical, 0 differ")


# -- 7: `if` where `where` is meant


def test_a_rule_with_if_gets_where(tmp_path: Path) -> None:
    src = _ckpt(tmp_path / "in")
    m = _mapping(tmp_path, 'cast "**" to f16 if dtype == bf16\nunmatched keep')
    r = run("check", m, str(src))
    assert r.returncode == 2
    assert f"{m}:2:18: a rule's condition is written with `where`, not `if`" in r.stderr
    assert 'did you mean `where`? `cast "**" to f16 where dtype == bf16`' in r.stderr
    assert "unmatched" not in r.stderr.splitlines()[0]


# -- 8: the stale-dtype warning


def test_the_docs_mapping_gives_no_stale_dtype_warning_and_plan_warns_once(
    tmp_path: Path,
) -> None:
    text = (REPO / "docs" / "index.md").read_text()
    own = re.search(r"cat > out/my\.wm <<'EOF'\n(.*?)^EOF", text, re.M | re.S)
    assert own is not None
    path = tmp_path / "my.wm"
    path.write_text(own[1])
    example = REPO / "examples" / "eagle3-speculators"
    r = run("plan", str(example), "--mapping", str(path))
    assert r.returncode == 0 and "warning" not in r.stdout + r.stderr
    stale = _mapping(tmp_path, 'cast "{name*}" to f32 where dtype == bf16\nunmatched keep')
    r = run("plan", str(example), "--mapping", stale)
    assert (r.stdout + r.stderr).count("config.json says dtype") == 1
    assert "`weightmap invert` can undo it" in r.stdout
    # The advice, followed, keeps a mapping invertible (it made one that could not be).
    advice = re.search(r"add to the mapping: (config \{.*\}) \(written so", r.stdout)
    assert advice is not None
    followed = _mapping(tmp_path, f'cast "{{name*}}" from bf16 to f32\n{advice[1]}\nunmatched keep')
    assert run("plan", str(example), "--mapping", followed).stdout.count("warning") == 0
    r = run("invert", followed, str(example))
    assert r.returncode == 0, r.stderr
    assert 'if config.dtype == "float32"' in r.stdout and 'dtype = "bfloat16"' in r.stdout


# -- 9: what follows a failed rule


def test_no_follow_on_error_after_a_failed_rule_and_no_refused_cast_advice(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    save_file(
        {"w": np.ones((2, 3), dtype=np.float32), "m": np.ones(3, dtype=np.uint8)},
        src / "model.safetensors",
    )
    m = _mapping(tmp_path, 'transpose "w" dims [0, 5]\nrename "w" -> "x"\nunmatched keep')
    r = run("check", m, str(src))
    assert r.returncode == 2
    assert "dim 5 is out of range" in r.stderr
    assert "which dropped" not in r.stderr and "(1 problem)" in r.stderr
    m = _mapping(tmp_path, 'mul "m" 0.5 to f16 -> "y"\nunmatched keep')
    r = run("check", m, str(src))
    assert r.returncode == 2
    assert "cast it first" not in r.stderr and "cannot be cast to one" in r.stderr


# -- 10: the smaller ones


def test_version_and_ray_address_help() -> None:
    r = run("--version")
    assert r.returncode == 0 and re.fullmatch(r"weightmap \d+\.\d+\.\d+\S*\n", r.stdout)
    r = run("convert", "--help")
    assert "the Ray cluster's address" in " ".join(r.stdout.split())


def _commands() -> list[str]:
    """Every subcommand the CLI has, as its parser lists them."""
    from weightmap.cli import _parser

    (sub,) = (a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_every_command_is_asked_for_examples() -> None:
    assert {"convert", "plan", "inspect", "diff", "presets", "check", "invert", "clean"} <= set(
        _commands()
    )


@pytest.mark.parametrize("command", _commands())
def test_help_has_examples(command: str) -> None:
    r = run(command, "--help")
    assert r.returncode == 0
    assert re.search(rf"^examples:\n  weightmap {command}\b", r.stdout, re.M), r.stdout


def test_did_you_mean_for_a_tensor_pattern(tmp_path: Path) -> None:
    src = _ckpt(tmp_path / "in", [f"model.layers.{i}.weight" for i in range(3)])
    m = _mapping(tmp_path, 'rename "model.layer.{n}.weight" -> "x.{n}"\nunmatched keep')
    r = run("check", m, str(src))
    assert r.returncode == 2
    assert "did you mean a name like `model.layers.0.weight`?" in r.stderr


def test_plan_lists_tensors_in_natural_order(tmp_path: Path) -> None:
    names = ["lm_head.weight", "model.layers.10.w", "model.norm.weight", "model.layers.2.w"]
    src = _ckpt(tmp_path / "in", names)
    r = run("plan", str(src), "--mapping", _mapping(tmp_path, "unmatched keep"))
    assert r.returncode == 0
    shown = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")]
    assert shown == ["lm_head.weight", "model.layers.2.w", "model.layers.10.w", "model.norm.weight"]


def test_progress_lines_when_stderr_is_not_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lines by tenths, in order, none in the first half second of writing, none at 100%:
    driven by a clock of our own (the machine's speed decides how long a real run writes, so a
    run that must last past the quiet half second cannot be sized for every machine)."""
    import weightmap.cli as cli

    # (The first time is the run's start, when the lines are made.)
    clock = iter([0.0, 0.0, 0.1, 0.6, 0.7, 1.2, 1.3, 2.0, 40.0, 41.0])
    real_time = cli.time
    monkeypatch.setattr(cli, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    lines = cli._ProgressLines()
    total = 1000
    for done in (50, 120, 180, 390, 420, 700, 710, 730, 1000):
        lines(done, total)
    err = capsys.readouterr().err
    assert re.findall(r"^weightmap: (\d+)% \(", err, re.M) == ["18", "39", "42", "70", "73"]
    # (18% at 0.6 s: the first after the quiet half second; 71% at 2 s: no new tenth; 73% at
    # 40 s: 30 s without a new tenth; nothing at 12% (0.1 s) nor at 100%.)
    # A run whose first chunk is done only after seconds, at 94%, says so then.
    clock = iter([0.0, 5.8, 6.0])
    lines = cli._ProgressLines()
    lines(940, total)
    lines(1000, total)
    assert re.findall(r"^weightmap: (\d+)% \(", capsys.readouterr().err, re.M) == ["94"]

    # The command line uses it where stderr is no terminal, and --no-progress silences it.
    src = tmp_path / "in"
    src.mkdir()
    block = np.full((256, 1024), 1.5, dtype=np.float32)
    save_file({f"w{i}": block for i in range(4)}, src / "model.safetensors")
    m = _mapping(tmp_path, 'cast "**" to bf16')
    seen: list[object] = []
    import weightmap.api as api

    real_remap = api.remap

    def remap(*args: object, **kw: object) -> object:
        seen.append(kw["progress"])
        return real_remap(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(api, "remap", remap)  # (the command imports it when it runs)
    monkeypatch.setattr(cli, "time", real_time)
    assert cli.main(["convert", str(src), str(tmp_path / "out"), "--mapping", m]) == 0
    assert isinstance(seen[-1], cli._ProgressLines)
    r = run("convert", str(src), str(tmp_path / "out2"), "--mapping", m, "--no-progress")
    assert r.returncode == 0 and "%" not in r.stderr


def test_docs_explain_output_sharding() -> None:
    text = (REPO / "docs" / "index.md").read_text()
    assert "How the output is sharded" in text and "comes out as one file" in text
