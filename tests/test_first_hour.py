"""The first hour's rough edges, each through the command line as a new user meets it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightmap", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def _layers(tmp_path: Path, n: int = 18) -> Path:
    folder = tmp_path / "layers"
    folder.mkdir()
    save_file(
        {f"layers.{i}.attn.weight": torch.zeros(4, 4) for i in range(n)},
        folder / "model.safetensors",
    )
    (folder / "config.json").write_text('{"hidden_size": 4, "torch_dtype": "float32"}')
    return folder


def _mapping(tmp_path: Path, text: str) -> str:
    path = tmp_path / "m.wm"
    path.write_text("weightmap 1\n" + text + "\n")
    return str(path)


def test_one_problem_for_many_tensors_is_one_line(tmp_path: Path) -> None:
    ckpt = _layers(tmp_path)
    m = _mapping(tmp_path, 'rename "layers.{layer}.attn.weight" -> "x.{layr}"')
    r = run("check", m, str(ckpt))
    assert r.returncode == 2
    assert r.stderr.count("unknown name") == 1
    assert (
        "unknown name `layr` (did you mean `layer`?) (in 18 tensors: layers.{0..17}.attn.weight)"
        in r.stderr
    )
    m = _mapping(
        tmp_path,
        'split "layers.{n}.attn.weight" dim 0 sizes [config.hidden, 2] -> "a.{n}", "b.{n}"',
    )
    r = run("check", m, str(ckpt))
    assert r.stderr.count("is missing from the config") == 1
    assert "`config.hidden` is missing from the config (did you mean `config.hidden_size`?)" in (
        r.stderr
    )
    m = _mapping(tmp_path, 'reshape "layers.{n}.attn.weight" to [3, 5]')
    r = run("check", m, str(ckpt))
    assert "cannot reshape `layers.{0..17}.attn.weight` [4, 4] (16 elements) to [3, 5] " in (
        r.stderr
    )


def test_did_you_mean_names_and_params(tmp_path: Path, example: Path) -> None:
    m = _mapping(tmp_path, 'keep "fc.weights"\nunmatched keep')
    r = run("check", m, str(example))
    assert "input tensor `fc.weights` is missing; did you mean `fc.weight`?" in r.stderr
    r = run("plan", str(example), "--preset", "eagle3-sglang", "--set", "layot=layers")
    assert r.returncode == 2 and "unknown param 'layot' (did you mean 'layout'?)" in r.stderr


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--preset", "FILE"], "is a mapping file, not a preset name: pass it as mapping="),
        (["--mapping", "eagle3-sglang"], "is a preset, not a mapping file: pass it as preset="),
        (["--mapping", "eagle3_sglang"], "did you mean the preset 'eagle3-sglang'"),
        (["--preset", "eagle3_sglang"], "(did you mean 'eagle3-sglang'?)"),
        (["--preset", "mine.wm"], "'mine.wm' looks like a mapping file, not a preset name"),
    ],
)
def test_preset_and_mapping_point_at_each_other(
    tmp_path: Path, example: Path, args: list[str], text: str
) -> None:
    args = [a.replace("FILE", _mapping(tmp_path, "unmatched keep")) for a in args]
    r = run("convert", str(example), str(tmp_path / "out"), *args)
    assert r.returncode == 2 and text in r.stderr, r.stderr
    r = run("check", "missing.wm")
    assert r.returncode == 2 and "missing.wm: no such mapping file (and no preset" in r.stderr


@pytest.mark.parametrize(
    ("rule", "hint"),
    [
        ('cast "fc.weight" too f32', "hint: did you mean `to`?"),
        ('permute "fc.weight" dims 0', "write the list in brackets: dims [0, ...]"),
        ('split "fc.weight" dim 0 sizes 32, 32 -> "a", "b"', "brackets: `sizes [32, 32]`"),
        ('merge "a", "b" dims 0 -> "c"', "hint: merge takes one dimension: `dim N`"),
        ('transpose "fc.weight" dim 0', "takes a list of dimensions: `dims [a, b]`"),
        ("unmatched keeps", "hint: `keeps` is not a keyword here; did you mean `keep`?"),
        ('keep "fc.weight" wher dtype == f32', "hint: did you mean `where`?"),
    ],
)
def test_parse_hints_for_common_slips(tmp_path: Path, example: Path, rule: str, hint: str) -> None:
    r = run("check", _mapping(tmp_path, rule), str(example))
    assert r.returncode == 2 and hint in r.stderr, r.stderr


def test_a_file_like_destination_is_refused(tmp_path: Path, example: Path) -> None:
    out = tmp_path / "out" / "model.safetensors"
    r = run("convert", str(example), str(out), "--preset", "eagle3-sglang")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "model.safetensors is named like a file, but the destination is a folder" in r.stderr
    assert f"give the folder ({tmp_path / 'out' / 'model'})" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_closed_pipe_is_a_quiet_exit(example: Path) -> None:
    cmd = [sys.executable, "-m", "weightmap", "inspect", str(example)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()  # what `| head -c 10` does
    with proc.stderr:
        assert proc.stderr.read() == b""
    assert proc.wait(timeout=60) == 0


def test_plan_summary_comes_before_the_progress_bar(tmp_path: Path, example: Path) -> None:
    # A terminal, so that the progress bar is shown: both streams go to one pseudo-terminal.
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    cmd = [sys.executable, "-m", "weightmap", "convert", str(example), str(tmp_path / "out")]
    proc = subprocess.Popen(
        [*cmd, "--preset", "eagle3-sglang"], stdout=follower, stderr=follower, close_fds=True
    )
    os.close(follower)
    seen = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        try:
            chunk = os.read(leader, 4096) if ready else b""
        except OSError:  # the child closed the terminal
            chunk = b""
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = seen.decode()
    assert text.index("plan: 16 input tensors") < text.index("weightmap:")  # the bar's label
    assert text.index("plan: 16 input tensors") < text.index("16 tensors, 198,656 bytes")


@pytest.mark.parametrize(
    "command", ["convert", "plan", "inspect", "diff", "presets", "check", "invert", "clean"]
)
def test_every_argument_has_help(command: str) -> None:
    r = run(command, "--help")
    assert r.returncode == 0
    block = r.stdout.split("positional arguments:\n", 1)[1].split("\n\n", 1)[0]
    entries = re.findall(r"^  (\S+)(.*)$", block, re.M)
    assert entries and all(help_text.strip() for _name, help_text in entries), block


def test_a_cast_that_leaves_the_config_dtype_stale_warns(tmp_path: Path) -> None:
    ckpt = _layers(tmp_path, 2)
    m = _mapping(tmp_path, 'cast "**" to bf16\nunmatched keep')
    r = run("convert", str(ckpt), str(tmp_path / "out"), "--mapping", m, "--quiet")
    assert r.returncode == 0
    assert r.stderr == (
        f'weightmap: warning: {m}:2:1: config.json says torch_dtype = "float32" but the '
        "floating-point weights are now bfloat16; to say so, add to the mapping: "
        'config { if config.torch_dtype == "float32" { torch_dtype = "bfloat16" } } (written '
        "so, `weightmap invert` can undo it)\n"
    )
    fixed = _mapping(
        tmp_path, 'cast "**" to bf16\nunmatched keep\nconfig { torch_dtype = "bfloat16" }'
    )
    r = run("plan", str(ckpt), "--mapping", fixed)
    assert r.returncode == 0 and r.stderr == ""
