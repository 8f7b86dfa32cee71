"""Hostile folders, journals and mappings: nothing is written outside the checkpoint, no
secret is echoed, no traceback. Each test reproduces a reported failure first."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import weightmap
from weightmap import CheckpointError, MappingSyntaxError
from weightmap.format.layout import JOURNAL_NAME

EXE = [sys.executable, "-m", "weightmap"]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXE, *args], capture_output=True, text=True, env=env, timeout=120)


def _hashes(*paths: Path) -> dict[str, str]:
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        out.update({str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    return out


@pytest.fixture
def ckpt(tmp_path: Path, example: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(example, root)
    return root


def _journal(root: Path, files: object, index: object = None, config: object = None) -> None:
    doc = {"files": files, "index": index, "config": config}
    (root / JOURNAL_NAME).write_text(json.dumps(doc))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------- 1. clean writes outside


@pytest.mark.parametrize("where", ["absolute", "parent", "link", "config", "index"])
def test_clean_never_writes_outside_the_checkpoint(ckpt: Path, tmp_path: Path, where: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious data, never to be touched")
    name = {
        "absolute": str(victim),
        "parent": "../victim.txt",
        "link": "escape.safetensors",
        "config": "config.json",  # inside the folder, but not a shard
        "index": "model.safetensors.index.json",
    }[where]
    if where == "link":
        (ckpt / "escape.safetensors").symlink_to(victim)
    _journal(ckpt, {name: _b64(b"HACKED")})
    before = _hashes(ckpt, victim)

    # `inspect` points the user at `clean`; `clean` must then refuse, writing nothing.
    inspect = _run("inspect", str(ckpt))
    assert "weightmap clean" in inspect.stderr
    result = _run("clean", str(ckpt))
    assert result.returncode == 1, result.stderr
    assert "refusing to replay this journal" in result.stderr
    assert "Traceback" not in result.stderr
    assert _hashes(ckpt, victim) == before
    with pytest.raises(CheckpointError, match=r"\[journal\]"):
        weightmap.recover(ckpt)
    assert _hashes(ckpt, victim) == before


def test_clean_refuses_a_header_that_does_not_fit_the_shard(ckpt: Path) -> None:
    shard = ckpt / "model.safetensors"
    size = int.from_bytes(shard.read_bytes()[:8], "little")
    before = _hashes(ckpt)
    # The right size but not a header for this file (garbage JSON padded to size).
    _journal(ckpt, {"model.safetensors": _b64(b"{}" + b" " * (size - 2))})
    with pytest.raises(CheckpointError, match=r"is not valid .*\[journal\]"):
        weightmap.recover(ckpt)
    # The wrong size.
    _journal(ckpt, {"model.safetensors": _b64(b"{}")})
    with pytest.raises(CheckpointError, match=f"has 2 bytes but the shard's header has {size}"):
        weightmap.recover(ckpt)
    assert {k: v for k, v in _hashes(ckpt).items() if JOURNAL_NAME not in k} == {
        k: v for k, v in before.items() if JOURNAL_NAME not in k
    }


def test_a_journal_weightmap_wrote_still_replays(ckpt: Path) -> None:
    # The journal of a real rename, left as a kill between the journal and the header writes
    # would leave it: clean finishes the rename.
    from weightmap.compiler.compile import compile_plan
    from weightmap.execute.inplace import inplace_headers
    from weightmap.language.mapping import load_mapping

    mapping = load_mapping('weightmap 1\nrename "layers.0.{r*}" -> "midlayer.{r}"\nunmatched keep')
    with weightmap.Checkpoint.open(ckpt) as c:
        plan = compile_plan(mapping, c.specs(), c.config)
        headers = inplace_headers(plan, c)
    _journal(ckpt, {p.name: _b64(h) for p, h in headers.items()})
    assert weightmap.recover(ckpt) is True
    with weightmap.Checkpoint.open(ckpt) as c:
        assert "midlayer.mlp.up_proj.weight" in c.tensors
    assert not (ckpt / JOURNAL_NAME).exists()


# ---------------------------------------------------------------- 2. secrets in messages


def test_include_of_a_secret_file_does_not_echo_it(tmp_path: Path) -> None:
    secret = "hunter2-" + os.urandom(8).hex()
    mapping = tmp_path / "m.wm"
    mapping.write_text('weightmap 1\ninclude "/proc/self/environ"\n')
    env = {**os.environ, "WEIGHTMAP_TEST_SECRET": secret}
    result = _run("check", str(mapping), env=env)
    assert result.returncode == 2
    assert "is not a weightmap mapping" in result.stderr
    assert secret not in result.stderr + result.stdout


@pytest.mark.parametrize("how", ["include", "mapping", "check"])
def test_a_file_that_is_not_a_mapping_is_never_quoted(tmp_path: Path, how: str) -> None:
    secret = "root:$6$" + os.urandom(8).hex() + ":19000:0:99999:7:::"
    key = tmp_path / "shadow"
    key.write_text(secret + "\n")
    if how == "include":
        text = f'weightmap 1\ninclude "{key}"\n'
        with pytest.raises(MappingSyntaxError) as err:
            weightmap.load_mapping(text)
        message = str(err.value)
    elif how == "mapping":
        with pytest.raises(MappingSyntaxError) as err:
            weightmap.load_mapping(key)
        message = str(err.value)
    else:
        result = _run("check", str(key))
        assert result.returncode == 2
        message = result.stderr + result.stdout
    assert "is not a weightmap mapping" in message
    assert secret[:12] not in message


def test_a_mapping_file_still_shows_its_syntax_errors(tmp_path: Path) -> None:
    # The refusal is for files that are not mappings; a mapping's own error keeps its caret.
    bad = tmp_path / "bad.wm"
    bad.write_text('# comment first\nweightmap 1\nrename "a" => "b"\n')
    result = _run("check", str(bad))
    assert result.returncode == 2
    assert 'rename "a" => "b"' in result.stderr
    assert "hint: the arrow is written `->`" in result.stderr


# ---------------------------------------------------------------- 5. malformed journals


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ({"files": [], "index": None, "config": None}, '"files" is not a non-empty object'),
        ({"files": {"model.safetensors": 7}, "index": None, "config": None}, "not a base64"),
        ({"files": {"model.safetensors": "!!"}, "index": None, "config": None}, "not valid base64"),
        ({"files": {"x": "AA=="}, "index": 3, "config": None}, "not a safetensors shard"),
        ({"files": None}, 'an object with "files"'),
        ([1, 2], 'an object with "files"'),
    ],
)
def test_malformed_journals_are_refused_in_one_line(ckpt: Path, doc: object, why: str) -> None:
    (ckpt / JOURNAL_NAME).write_text(json.dumps(doc))
    result = _run("clean", str(ckpt))
    assert result.returncode == 1
    assert why in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_journal_whose_index_disagrees_is_refused(ckpt: Path) -> None:
    shard = ckpt / "model.safetensors"
    size = int.from_bytes(shard.read_bytes()[:8], "little")
    header = shard.read_bytes()[8 : 8 + size]
    index = json.dumps({"weight_map": {"other": "model.safetensors"}})
    _journal(ckpt, {"model.safetensors": _b64(header)}, index=index)
    with pytest.raises(CheckpointError, match="does not list the tensors of its headers"):
        weightmap.recover(ckpt)
    assert not (ckpt / "model.safetensors.index.json").exists()
