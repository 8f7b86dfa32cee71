"""The command line, through the installed console script (and `python -m`) in subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from weightmap.cli import _parser

EXE = shutil.which("weightmap")


def run(*args: str, module: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "weightmap"] if module or EXE is None else [EXE]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


def test_inspect_lists_16_tensors(example: Path) -> None:
    r = run("inspect", str(example))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "dtype", "shape", "bytes", "file"]
    assert len(lines) == 18
    row = next(line for line in lines if line.startswith("layers.0.self_attn.q_proj.weight "))
    assert row.split() == [
        "layers.0.self_attn.q_proj.weight",
        "BF16",
        "[64,",
        "128]",
        "16,384",
        "model.safetensors",
    ]
    assert lines[-1] == "16 tensors, 198,656 bytes (198.7 KB) in 1 file(s)"


def test_inspect_json_via_module(example: Path) -> None:
    r = run("inspect", "--json", str(example), module=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["total_tensors"] == 16
    assert {
        "name": "d2t",
        "dtype": "I64",
        "shape": [128],
        "bytes": 1024,
        "file": "model.safetensors",
    } in doc["tensors"]
    assert doc["config"]["speculators_model_type"] == "eagle3"


def test_inspect_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    r = run("inspect", str(tmp_path))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("weightmap: error: ") and "header-beyond-file" in r.stderr


@pytest.mark.parametrize("env_debug", [False, True])
def test_debug_shows_traceback(tmp_path: Path, env_debug: bool) -> None:
    args = ("inspect", str(tmp_path / "missing"))
    if env_debug:
        cmd = [sys.executable, "-m", "weightmap", *args]
        r = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=120,
            env={**__import__("os").environ, "WEIGHTMAP_DEBUG": "1"},
        )
    else:
        r = run("--debug", *args)
    assert r.returncode != 0
    assert "Traceback" in r.stderr


@pytest.mark.parametrize(
    ("argv", "debug"),
    [
        (["inspect", "x"], False),
        (["--debug", "inspect", "x"], True),
        (["inspect", "x", "--debug"], True),  # after the command, as people type it
        (["convert", "x", "y", "--preset", "p", "--debug"], True),
    ],
)
def test_debug_goes_before_or_after_the_command(argv: list[str], debug: bool) -> None:
    assert _parser().parse_args(argv).debug is debug


def test_plan_help_says_it_writes_nothing() -> None:
    r = run("plan", "--help")
    assert r.returncode == 0
    assert "planned as carried" in r.stdout and "into DST" not in r.stdout


def test_usage_error_exit_code() -> None:
    r = run("frobnicate")
    assert r.returncode == 2


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["convert", "a", "b", "--preset", "cast", "--workers", "abc"],
            "weightmap convert: error: argument --workers: invalid int value: 'abc' "
            "(see weightmap convert --help)",
        ),
        (
            ["convert", "a", "b", "--preset", "cast", "--set"],
            "weightmap convert: error: argument --set: expected one argument "
            "(see weightmap convert --help)",
        ),
        (["inspect"], "weightmap inspect: error: the following arguments are required: "),
    ],
)
def test_argument_errors_are_one_line_saying_where_the_usage_is(args: list[str], line: str) -> None:
    """argparse printed the command's whole usage (nine lines for convert) before its line."""
    r = run(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(line)
    assert r.stderr.rstrip().endswith("--help)")


def test_convert_example(example: Path, tmp_path: Path) -> None:
    r = run("convert", str(example), str(tmp_path / "out"), "--preset", "eagle3-sglang", "--verify")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "plan: 16 input tensors -> 16 outputs (0 dropped), 198,656 bytes (198.7 KB); "
        "config.json edited"
    )
    assert lines[-1].startswith(f"16 tensors, 198,656 bytes into {tmp_path / 'out'} in ")
    assert lines[-1].endswith("(verified)")
    assert (tmp_path / "out" / "config.json").exists()


def test_convert_with_mapping_file_set_and_shards(example: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.wm"
    rules.write_text(
        'weightmap 1\nparam target = "bf16"\n'
        'cast "{x*}.weight" to f32 -> "{x}.weight" where dtype == bf16\nunmatched keep\n'
    )
    r = run(
        "convert",
        str(example),
        str(tmp_path / "out"),
        "--mapping",
        str(rules),
        "--max-shard-size",
        "100KB",
        "--workers",
        "1",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_convert_dry_run_writes_nothing(example: Path, tmp_path: Path) -> None:
    r = run(
        "convert", str(example), str(tmp_path / "out"), "--preset", "eagle3-sglang", "--dry-run"
    )
    assert r.returncode == 0, r.stderr
    assert "midlayer.mlp.up_proj.weight" in r.stdout
    assert not (tmp_path / "out").exists()


def test_convert_inplace(example: Path, tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(example, ckpt)
    r = run("convert", str(ckpt), "--preset", "eagle3-sglang", "--inplace", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "midlayer.norm" not in run("inspect", str(ckpt)).stdout
    assert "midlayer.self_attn.q_proj.weight" in run("inspect", str(ckpt)).stdout


def test_convert_refusal_is_exit_2_and_names_the_problem(tmp_path: Path) -> None:
    from dataclasses import replace

    from eagle3.checkpoints import DraftSpec, write_checkpoint

    src = write_checkpoint(replace(DraftSpec(), norm_before_residual=True), tmp_path / "in")
    r = run("convert", str(src), str(tmp_path / "out"), "--preset", "eagle3-sglang")
    assert r.returncode == 2
    assert "norm_before_residual=true" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_convert_set_parameter(tmp_path: Path) -> None:
    from dataclasses import replace

    from eagle3.checkpoints import DraftSpec, write_checkpoint

    src = write_checkpoint(replace(DraftSpec(), num_layers=2), tmp_path / "in")
    r = run("convert", str(src), str(tmp_path / "out"), "--preset", "eagle3-sglang")
    assert r.returncode == 2 and "--set layout=layers" in r.stderr
    r = run(
        "convert",
        str(src),
        str(tmp_path / "out"),
        "--preset",
        "eagle3-sglang",
        "--set",
        "layout=layers",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--preset", "eagle3-sglang", "--mapping", "x.wm"], "exactly one of --preset"),
        ([], "exactly one of --preset"),
        (["--preset", "nope"], "no preset named 'nope'"),
        (["--mapping", "missing.wm"], "does not exist"),
        (["--preset", "eagle3-sglang", "--set", "layout"], "KEY=VALUE"),
        (["--preset", "eagle3-sglang", "--max-shard-size", "5XB"], "cannot parse size"),
    ],
)
def test_convert_usage_errors(example: Path, tmp_path: Path, args: list[str], text: str) -> None:
    r = run("convert", str(example), str(tmp_path / "out"), *args)
    assert r.returncode == 2, r.stderr
    assert text in r.stderr
    assert not (tmp_path / "out").exists()


def test_convert_existing_destination_is_exit_1(example: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    r = run("convert", str(example), str(tmp_path / "out"), "--preset", "eagle3-sglang")
    assert r.returncode == 1
    assert "--overwrite" in r.stderr or "overwrite=True" in r.stderr


def test_plan_table_and_json(example: Path) -> None:
    r = run("plan", str(example), "--preset", "eagle3-sglang")
    assert r.returncode == 0, r.stderr
    assert "layers.0.self_attn.q_proj.weight" in r.stdout and "midlayer." in r.stdout
    r = run("plan", str(example), "--preset", "eagle3-sglang", "--json")
    doc = json.loads(r.stdout)
    assert len(doc["outputs"]) == 16
    assert doc["config"]["architectures"] == ["LlamaForCausalLMEagle3"]


def test_plan_summarises_a_large_plan_unless_all(tmp_path: Path) -> None:
    """Past the first rows, `plan` says how many outputs and drops it left out; --all lists
    every one."""
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    tensors = {f"model.w.{i}": torch.zeros(2) for i in range(70)}
    tensors |= {f"extra.{i}": torch.zeros(1) for i in range(55)}
    save_file(tensors, str(src / "model.safetensors"))
    rules = tmp_path / "rules.wm"
    rules.write_text('weightmap 1\nrename "model.{rest*}" -> "{rest}"\nunmatched drop\n')
    r = run("plan", str(src), "--mapping", str(rules))
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if " -> w." in line]
    dropped = [line for line in r.stdout.splitlines() if line.startswith("  dropped ")]
    assert (len(rows), len(dropped)) == (50, 50)
    assert "  ... and 20 more outputs (`weightmap plan --all` lists every one)" in r.stdout
    assert "  ... and 5 more dropped inputs (`weightmap plan --all` lists every one)" in r.stdout
    r = run("plan", str(src), "--mapping", str(rules), "--all")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if " -> w." in line]
    dropped = [line for line in r.stdout.splitlines() if line.startswith("  dropped ")]
    assert (len(rows), len(dropped)) == (70, 55) and "more outputs" not in r.stdout


def test_diff(example: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(example, tmp_path / "a")
    r = run("diff", str(example), str(tmp_path / "a"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "16 tensors identical, 0 differ"
    loc_file = tmp_path / "a" / "model.safetensors"
    data = bytearray(loc_file.read_bytes())
    data[-1] ^= 1  # the last byte belongs to the last tensor in the file
    loc_file.write_bytes(bytes(data))
    r = run("diff", str(example), str(tmp_path / "a"))
    assert r.returncode == 1
    assert "bytes differ: t2d" in r.stdout
    assert r.stdout.splitlines()[-1] == "15 tensors identical, 1 with other bytes"


def test_diff_counts_a_rename_once_each_side_and_shows_config_as_json(
    example: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sglang"
    assert run("convert", str(example), str(out), "--preset", "eagle3-sglang").returncode == 0
    r = run("diff", str(example), str(out))
    assert r.returncode == 1
    last = r.stdout.splitlines()[-1]
    assert last.startswith("6 tensors identical, 10 only in A, 10 only in B, ")
    assert last.endswith(" config difference(s)")
    assert 'config - auto_map: {"": "eagle3.Eagle3DraftModel"}' in r.stdout  # as JSON
    assert "True" not in r.stdout and "False" not in r.stdout
    r = run("plan", str(example), "--preset", "eagle3-sglang")
    assert '- auto_map[""]' in r.stdout  # the field named "" quoted, no dangling dot


def test_presets_list_and_show() -> None:
    r = run("presets")
    assert r.returncode == 0
    assert any(line.startswith("eagle3-sglang  ") for line in r.stdout.splitlines())
    r = run("presets", "eagle3-sglang")
    assert 'layout = "midlayer"' in r.stdout
    assert "- norm_before_residual=true" in r.stdout


def test_check(example: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.wm"
    good.write_text('weightmap 1\nrename "layers.0.{r*}" -> "midlayer.{r}"\nunmatched keep\n')
    assert run("check", str(good)).returncode == 0
    r = run("check", str(good), str(example))
    assert r.returncode == 0 and "ok against" in r.stdout
    bad = tmp_path / "bad.wm"
    bad.write_text('weightmap 1\nrename "a" => "b"\n')
    r = run("check", str(bad))
    assert r.returncode == 2
    assert f"{bad}:2:" in r.stderr and "^" in r.stderr
    partial = tmp_path / "partial.wm"
    partial.write_text('weightmap 1\nrename "layers.0.{r*}" -> "midlayer.{r}"\n')
    r = run("check", str(partial), str(example))
    assert r.returncode == 2 and "fc.weight" in r.stderr
    # The checkpoint where the mapping goes was "no preset named ..."; --set without a
    # checkpoint was not checked.
    r = run("check", str(example), str(good))
    assert r.returncode == 2 and "is a folder, not a mapping file or a preset" in r.stderr
    r = run("check", str(good), "--set", "=x")
    assert r.returncode == 2 and "--set takes KEY=VALUE" in r.stderr


def test_invert_checked_against_a_checkpoint(example: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.wm"
    good.write_text('weightmap 1\nrename "layers.0.{r*}" -> "midlayer.{r}"\nunmatched keep\n')
    r = run("invert", str(good), str(example))
    assert r.returncode == 0 and 'rename "midlayer.{r*}" -> "layers.0.{r}"' in r.stdout
    # d2t is I64 already: the inverse cast would narrow it to I32.
    cast = tmp_path / "cast.wm"
    cast.write_text('weightmap 1\ncast? "**" from i32 to i64\nunmatched keep\n')
    r = run("invert", str(cast), str(example))
    assert r.returncode == 2 and "does not give back this checkpoint" in r.stderr
    assert "d2t: I64" in r.stderr


def test_invert(tmp_path: Path) -> None:
    m = tmp_path / "m.wm"
    m.write_text('weightmap 1\nrename "layers.0.{r*}" -> "midlayer.{r}"\n')
    r = run("invert", str(m))
    assert r.returncode == 0, r.stderr
    assert 'rename "midlayer.{r*}" -> "layers.0.{r}"' in r.stdout
    lossy = tmp_path / "lossy.wm"
    lossy.write_text('weightmap 1\ndrop "x"\n')
    r = run("invert", str(lossy))
    assert r.returncode == 2 and "drop" in r.stderr


def test_clean_removes_leftovers_of_dead_runs(tmp_path: Path) -> None:
    from weightmap.fs.atomic import owner_tag

    here = owner_tag().partition("@")[2]
    dead = tmp_path / f".out.weightmap-tmp-999999999@{here}-abcd"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    alive = tmp_path / f".out.weightmap-tmp-{owner_tag()}-abcd"
    alive.mkdir()
    # Another container's (its own pids, the same host name): never judged from here.
    elsewhere = tmp_path / f".out.weightmap-tmp-999999999@{here.partition('+')[0]}+1-abcd"
    elsewhere.mkdir()
    r = run("clean", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and alive.exists() and elsewhere.exists()
    again = run("clean", str(tmp_path)).stdout
    assert again.startswith("nothing to clean")
    # What stays is named, with why: a leftover must not take disk space silently.
    assert f"left {alive}: its conversion (process {os.getpid()}) is still running" in again
    assert f"left {elsewhere}: written by process 999999999 on " in again
    assert "cannot be checked from here" in again


def test_clean_goes_on_past_a_leftover_it_cannot_remove(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import weightmap.cli as cli
    import weightmap.fs.atomic as atomic

    stuck = tmp_path / ".a.weightmap-tmp-999999998-abcd"
    dead = tmp_path / ".b.weightmap-tmp-999999999-abcd"
    stuck.mkdir()
    dead.mkdir()
    real = atomic.remove_path

    def remove(path: Path) -> None:
        if path == stuck:
            raise PermissionError(13, "Permission denied")
        real(path)

    # (the command imports remove_path when it runs: patched where it lives)
    monkeypatch.setattr(atomic, "remove_path", remove)
    assert cli.main(["clean", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert f"could not remove {stuck}: Permission denied" in out.err
    assert f"removed {dead}" in out.out
    assert stuck.exists() and not dead.exists()


def test_plan_json_refuses_what_strict_json_cannot_hold(example: Path, tmp_path: Path) -> None:
    # A side file whose name is not UTF-8 came out as a lone surrogate escape, which strict
    # JSON readers (and weightmap's own) refuse.
    src = tmp_path / "src"
    shutil.copytree(example, src)
    Path(os.fsdecode(os.fsencode(src) + b"/\xffbad.txt")).write_text("x")
    r = run("plan", str(src), "--preset", "eagle3-sglang", "--json")
    assert r.returncode == 1 and r.stdout == ""
    assert "lone surrogate at `files." in r.stderr and "strict JSON only" in r.stderr
    r = run("plan", str(src), "--preset", "eagle3-sglang", "--json", "--no-side-files")
    assert r.returncode == 0 and json.loads(r.stdout)["outputs"]


def test_help_imports_neither_the_compiler_nor_torch() -> None:
    """`weightmap --help` starts as fast as the interpreter: the package and the command line
    import the compiler, the executors, the parser and torch only for the commands that use
    them (docs/benchmarks.md, start-up)."""
    code = (
        "import sys, contextlib, io\n"
        "from weightmap import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "heavy = sorted(m for m in sys.modules if m.startswith(('weightmap.compiler', "
        "'weightmap.execute', 'weightmap.language', 'weightmap.api', 'torch', 'lark', "
        "'numpy', 'safetensors')))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_help_and_inspect_import_no_more_than_they_use(example: Path) -> None:
    """`--help` never imports dataclasses (and inspect, ast, dis with it), and `inspect` of a
    safetensors folder neither the layout planner nor the PyTorch archive reader's modules
    (docs/benchmarks.md, start-up)."""
    code = (
        "import sys, contextlib, io\n"
        "from weightmap import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    cli.main(sys.argv[1:])\n"
        "print(sorted(m for m in ('dataclasses', 'weightmap.format.layout', 'zipfile', "
        "'pickle', 'ctypes') if m in sys.modules))\n"
    )

    def imported(*argv: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    assert imported("--help") == "[]"
    assert imported("inspect", str(example)) == "['dataclasses']"


def test_the_parser_shows_the_library_s_choices() -> None:
    """The parser's copies of the layouts and load-check libraries (kept in cli.py so that
    building it imports nothing heavy) are the library's."""
    from weightmap import cli
    from weightmap.format.layout import LAYOUTS
    from weightmap.loads import LIBRARIES

    assert cli._LAYOUTS == LAYOUTS
    assert cli._LIBRARIES == LIBRARIES


def test_the_package_names_load_on_first_use() -> None:
    import weightmap

    assert set(weightmap.__all__) <= set(dir(weightmap))
    for name in weightmap.__all__:
        assert getattr(weightmap, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = weightmap.nope  # type: ignore[attr-defined]
