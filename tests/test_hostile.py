"""Hostile folders, journals and mappings: nothing is written outside the checkpoint, no
secret is echoed, no traceback, no crash, no stuck checkpoint. Sections follow the numbered
findings they reproduce; each test failed before its fix. Crashes are run in a subprocess, so
that a segfault fails the test and not the suite; cases that need root (an immutable file)
or need not to be root (a read-only file) skip otherwise."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import weightmap
from weightmap import CheckpointError, MappingError, MappingSyntaxError
from weightmap.format.layout import JOURNAL_NAME
from weightmap.fs.atomic import owner_tag

EXE = [sys.executable, "-m", "weightmap"]
REPO = Path(__file__).resolve().parent.parent


KEEP_ALL_MAPPING = "weightmap 1\nunmatched keep\n"


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


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
needs_user = pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")


def _chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *map(str, paths)], check=True, capture_output=True)


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[list[Path]]:
    """Paths the test makes immutable; made mutable again whatever happens, and so is the
    whole of ``tmp_path``: a file made immutable may have been moved since (an overwrite moves
    the old output under a temporary name), and pytest could not remove it."""
    made: list[Path] = []
    yield made
    for p in made:
        subprocess.run(["chattr", "-i", str(p)], capture_output=True)
    if made:
        subprocess.run(["chattr", "-R", "-i", str(tmp_path)], capture_output=True)


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


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets", "name"])
def test_header_errors_quote_a_bounded_part_of_the_header(tmp_path: Path, field: str) -> None:
    from sftools import entry, write_raw

    junk = "x" * 1_000_000
    header: dict[str, object] = {"w": entry("F32", [1], 0, 4)}
    if field == "name":
        header = {junk: {"dtype": "F32", "shape": [1], "data_offsets": [0, 5]}}
    else:
        header["w"][field] = junk  # type: ignore[index]
    path = write_raw(tmp_path / "model.safetensors", header, b"\0" * 4)
    with pytest.raises(weightmap.FormatError) as err:
        weightmap.Checkpoint.open(path)
    assert len(str(err.value)) < 1000


# ---------------------------------------------------------------- 3. concurrent in-place renames


def _sharded(folder: Path, shards: int = 4, per_shard: int = 300) -> Path:
    """A checkpoint of ``shards`` shards named t0.<i>, with a config.json."""
    import torch
    from safetensors.torch import save_file

    source = folder.parent / f"{folder.name}-single"
    source.mkdir()
    n = shards * per_shard
    save_file({f"t0.{i}": torch.full((4,), float(i)) for i in range(n)}, source / "w.safetensors")
    (source / "config.json").write_text(json.dumps({"renamed_by": "t0"}))
    weightmap.remap(
        source / "w.safetensors",
        folder,
        mapping='weightmap 1\nkeep "**"\n',
        max_shard_size=per_shard * 16 + 1,
    )
    shutil.rmtree(source)
    assert len(list(folder.glob("model-*.safetensors"))) == shards
    return folder


def _rename_to(prefix: str, source: str = "t") -> str:
    return (
        f'weightmap 1\nrename "{source}.{{r*}}" -> "{prefix}.{{r}}"\n'
        f'config {{ renamed_by = "{prefix}" }}\n'
    )


def _state(root: Path, quiet: bool = True) -> str:
    """The one name prefix every shard, the index and the config agree on (or an error).

    What one Checkpoint.open read (headers, index, config), and with ``quiet`` (nothing is
    renaming), the headers on disk now as well.
    """
    from weightmap.format.header import read_header

    with weightmap.Checkpoint.open(root) as c:
        prefixes = {name.split(".")[0] for name in c.tensors}
        config = c.config
    assert config is not None
    assert prefixes == {config["renamed_by"]}, (prefixes, config)
    if quiet:
        headers = {n.split(".")[0] for p in root.glob("model-*") for n in read_header(p).tensors}
        assert headers == prefixes, (headers, prefixes)
    return str(config["renamed_by"])


_RACER = """
import os, sys, time, weightmap
root, rules, go = sys.argv[1], sys.argv[2], sys.argv[3]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.0005)
try:
    weightmap.remap(root, mapping=rules, inplace=True)
    print("ok")
except weightmap.WeightmapError as exc:
    print("refused", type(exc).__name__, exc)
"""


def test_two_inplace_renames_at_once_never_mix(tmp_path: Path) -> None:
    root = _sharded(tmp_path / "ckpt")
    for round in range(6):
        go = tmp_path / f"go{round}"
        state = _state(root)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RACER, str(root), _rename_to(p, state), str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for p in (f"a{round}", f"b{round}")
        ]
        for proc in procs:  # both interpreters started, weightmap imported, waiting
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        go.touch()
        outcomes = [proc.communicate(timeout=120) for proc in procs]
        for (out, err), proc in zip(outcomes, procs, strict=True):
            assert proc.returncode == 0, err  # no traceback, no stray OSError
            assert out.startswith(("ok", "refused")), out
        winners = [p for (out, _), p in zip(outcomes, ("a", "b"), strict=True) if out == "ok\n"]
        # The checkpoint is consistent, and holds the names of a process that succeeded.
        assert len(winners) >= 1, outcomes
        assert _state(root) in {f"{w}{round}" for w in winners}
        assert not (root / JOURNAL_NAME).exists()


# ---------------------------------------------------------------- 4. a shard that cannot be written


@pytest.mark.parametrize(
    "how", [pytest.param("immutable", marks=needs_root), pytest.param("readonly", marks=needs_user)]
)
def test_inplace_rename_checks_every_shard_before_the_first_write(
    tmp_path: Path, how: str, immutable: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _sharded(tmp_path / "ckpt")
    shards = sorted(root.glob("model-*.safetensors"))
    stuck = shards[2]
    if how == "immutable":
        try:
            _chattr("+i", stuck)
        except (OSError, subprocess.CalledProcessError):
            pytest.skip("this file system has no immutable flag")
        immutable.append(stuck)
    else:
        stuck.chmod(0o444)
    before = _hashes(root)
    with pytest.raises(weightmap.ExecutionError, match="nothing was changed") as err:
        weightmap.remap(root, mapping=_rename_to("x0", "t0"), inplace=True)
    assert stuck.name in str(err.value)
    assert _hashes(root) == before  # no shard rewritten, no journal
    assert _state(root) == "t0"
    # A journal left behind by a killed rename, with a shard that cannot be written by the
    # time `clean` runs: clean refuses before writing, and finishes once it can be written.
    if how == "immutable":
        _chattr("-i", stuck)
    else:
        stuck.chmod(0o644)
    from weightmap.execute import inplace

    monkeypatch.setattr(inplace, "_replay", lambda root, journal, folder: None)  # killed right here
    weightmap.remap(root, mapping=_rename_to("x0", "t0"), inplace=True)
    monkeypatch.undo()
    assert (root / JOURNAL_NAME).exists()
    if how == "immutable":
        _chattr("+i", stuck)
    else:
        stuck.chmod(0o444)
    before = _hashes(root)
    result = _run("clean", str(root))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert stuck.name in result.stderr and "nothing was changed" in result.stderr
    assert _hashes(root) == before
    if how == "immutable":
        _chattr("-i", stuck)
    else:
        stuck.chmod(0o644)
    assert _run("clean", str(root)).returncode == 0
    assert _state(root) == "x0"


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


# ---------------------------------------------------------------- 6. unremovable destination


def _make_unremovable(old: Path, how: str, made: list[Path]) -> None:
    if how == "immutable":
        try:
            _chattr("+i", old / "config.json")
        except (OSError, subprocess.CalledProcessError):
            pytest.skip("this file system has no immutable flag")
        made.append(old / "config.json")
    else:
        old.chmod(0o555)


@pytest.mark.parametrize(
    "how", [pytest.param("immutable", marks=needs_root), pytest.param("readonly", marks=needs_user)]
)
def test_overwrite_of_an_unremovable_destination_is_refused_before_work(
    ckpt: Path, tmp_path: Path, how: str, immutable: list[Path]
) -> None:
    out = tmp_path / "out"
    weightmap.remap(ckpt, out, mapping='weightmap 1\nkeep "**"\n')
    _make_unremovable(out, how, immutable)
    before = _hashes(out)
    seen: list[int] = []
    with pytest.raises(weightmap.ExecutionError, match="cannot be replaced") as err:
        weightmap.remap(
            ckpt, out, preset="eagle3-sglang", overwrite=True, progress=lambda d, t: seen.append(d)
        )
    assert "config.json" in str(err.value) and "nothing was written" in str(err.value)
    assert seen == []
    assert _hashes(out) == before
    assert [p.name for p in tmp_path.iterdir() if "weightmap-tmp" in p.name] == []
    out.chmod(0o755)


@needs_root
def test_an_old_output_that_cannot_be_removed_after_the_swap_is_reported(
    ckpt: Path, tmp_path: Path, immutable: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightmap.format import writer

    out = tmp_path / "out"
    weightmap.remap(ckpt, out, mapping='weightmap 1\nkeep "**"\n')
    _make_unremovable(out, "immutable", immutable)
    # Something made it unremovable after the check (a race): the swap happens, then removal
    # of the old output fails. The report must say where each one is.
    monkeypatch.setattr(writer, "removal_problem", lambda path: None)
    with pytest.raises(weightmap.ExecutionError) as err:
        weightmap.remap(ckpt, out, preset="eagle3-sglang", overwrite=True)
    message = str(err.value)
    assert "nothing was written" not in message
    left = [p for p in tmp_path.iterdir() if "weightmap-tmp" in p.name]
    assert len(left) == 1 and str(left[0]) in message
    assert f"{out} holds the new output" in message
    with weightmap.Checkpoint.open(out) as c:
        assert "midlayer.self_attn.q_proj.weight" in c.tensors
    assert (left[0] / "config.json").exists()


# ---------------------------------------------------------------- 7. verify


def _corrupting_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel copy writes one wrong byte into the output (a disk that lies); no clones,
    so every byte goes through it."""
    import weightmap.format.writer as writer_mod

    real = writer_mod.copy

    def copy(src_fd: int, src: int, fd: int, dst: int, length: int, what: str) -> None:
        real(src_fd, src, fd, dst, length, what)
        os.pwrite(fd, bytes([~os.pread(src_fd, 1, src)[0] & 0xFF]), dst)

    monkeypatch.setattr(writer_mod, "copy", copy)
    monkeypatch.setattr(writer_mod, "clone", lambda *args: False)


def test_a_verify_failure_leaves_nothing_under_the_final_name(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    weightmap.remap(ckpt, out, mapping='weightmap 1\nkeep "**"\n')
    before = _hashes(out)
    _corrupting_copy(monkeypatch)
    # A new destination: never created.
    with pytest.raises(weightmap.ExecutionError, match="verification failed") as err:
        weightmap.remap(ckpt, tmp_path / "new", preset="eagle3-sglang", verify=True)
    assert "bytes differ" in str(err.value) and "nothing was committed" in str(err.value)
    assert not (tmp_path / "new").exists()
    # An existing destination with --overwrite: the old output stays as it was.
    with pytest.raises(weightmap.ExecutionError, match="verification failed"):
        weightmap.remap(ckpt, out, preset="eagle3-sglang", verify=True, overwrite=True)
    assert _hashes(out) == before
    assert [p.name for p in tmp_path.iterdir() if "weightmap-tmp" in p.name] == []


def test_verify_without_checksums_never_reports_a_corrupt_output_as_fine(
    ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = weightmap.remap(ckpt, out, preset="eagle3-sglang")
    assert result.checksums == {}
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Without checksums there is nothing to compare the bytes with: refused, not "no problems".
    with pytest.raises(ValueError, match="checksums"):
        weightmap.verify(out, result.plan, result.checksums)
    # With the input, the expected bytes are recomputed.
    problems = weightmap.verify(out, result.plan, source=ckpt)
    assert len(problems) == 1 and "bytes differ" in problems[0]
    # With the checksums of a verified run, as before.
    good = weightmap.remap(ckpt, tmp_path / "good", preset="eagle3-sglang", verify=True)
    assert weightmap.verify(tmp_path / "good", good.plan, good.checksums) == []
    assert weightmap.verify(tmp_path / "good", good.plan, source=ckpt) == []
    assert len(weightmap.verify(out, good.plan, good.checksums)) == 1


# ---------------------------------------------------------------- 8. iter_tensors lifetime


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter: a segfault fails the test, not the suite."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )


_REFERENCE = """
import gc, torch, weightmap
from safetensors.torch import load_file
weightmap.remap("examples/eagle3-speculators", OUT, preset="eagle3-sglang", overwrite=True)
reference = load_file(OUT + "/model.safetensors")
def raw(t):
    return t.reshape(-1).view(torch.uint8)
def check(tensors, every=True):
    gc.collect()
    if every:
        assert set(tensors) == set(reference), sorted(set(tensors) ^ set(reference))
    for name, t in tensors.items():
        assert torch.equal(raw(t), raw(reference[name])), name
"""


def test_tensors_from_iter_tensors_outlive_the_iterator(tmp_path: Path) -> None:
    code = (
        _REFERENCE.replace("OUT", repr(str(tmp_path / "ref")))
        + """
check(dict(weightmap.iter_tensors("examples/eagle3-speculators", preset="eagle3-sglang")))
# A partly consumed iterator, dropped: what it handed out stays valid.
it = weightmap.iter_tensors("examples/eagle3-speculators", preset="eagle3-sglang")
first = dict([next(it), next(it)])
del it
gc.collect()
check(first, every=False)
# Checkpoint.view after the checkpoint is closed.
with weightmap.Checkpoint.open("examples/eagle3-speculators") as c:
    views = {n: c.view(n) for n in c.tensors}
gc.collect()
print(sum(float(v.double().sum()) for v in views.values() if v.is_floating_point()))
print("ok")
"""
    )
    result = _python(code)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert result.stdout.strip().endswith("ok")


def test_the_engine_example_of_the_docs_reads_its_stored_tensors(tmp_path: Path) -> None:
    text = (REPO / "docs" / "embedding.md").read_text()
    start = text.index("class Engine:")
    block = text[text.rindex("```python", 0, start) + len("```python") : text.index("```", start)]
    assert "engine.load_weights(weightmap.iter_tensors(" in block
    code = (
        _REFERENCE.replace("OUT", repr(str(tmp_path / "ref")))
        + block
        + """
# The iterator is gone; the engine holds the tensors and reads them now.
check(engine.params)
print("ok")
"""
    )
    result = _python(code)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert result.stdout.strip().endswith("ok")


# ---------------------------------------------------------------- 9. huge empty dimensions


def _empty_huge(folder: Path, shape: list[int]) -> Path:
    from sftools import entry, write_raw

    folder.mkdir()
    header = {"e": entry("F32", shape, 0, 0), "w": entry("F32", [2], 0, 8)}
    write_raw(folder / "model.safetensors", header, b"\1" * 8)
    return folder


def _reference_accepts(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "numpy") as f:
            f.keys()
    except (SafetensorError, OverflowError, ValueError):
        return False
    return True


@pytest.mark.parametrize(
    "shape",
    [
        [0, 2**63],
        [0, 2**64 - 1],
        [0, 2**32, 2**32],
        [0, 2**64],
        [0, 2**70],
        [2**32, 2**32, 0],
        [2**63, 2, 0],
    ],
)
def test_shapes_are_refused_exactly_where_the_reference_refuses(
    tmp_path: Path, shape: list[int]
) -> None:
    folder = _empty_huge(tmp_path / "ckpt", shape)
    accepted = _reference_accepts(folder / "model.safetensors")
    if accepted:
        with weightmap.Checkpoint.open(folder) as c:
            assert c.tensors["e"].shape == tuple(shape)
    else:
        with pytest.raises(weightmap.FormatError, match=r"\[overflow\]"):
            weightmap.Checkpoint.open(folder)


def test_a_zero_element_tensor_with_a_huge_dimension(tmp_path: Path) -> None:
    folder = _empty_huge(tmp_path / "ckpt", [0, 2**63])
    out = tmp_path / "out"
    mapping = tmp_path / "m.wm"
    mapping.write_text('weightmap 1\nrename "e" -> "empty"\nkeep "w"\n')
    result = _run("convert", str(folder), str(out), "--mapping", str(mapping), "--verify")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert _reference_accepts(out / "model.safetensors")
    with weightmap.Checkpoint.open(out) as c:
        assert c.tensors["empty"].shape == (0, 2**63)
    # torch cannot hold the shape: iter_tensors says so before the first tensor, not TypeError.
    with pytest.raises(weightmap.FormatError, match=r"'e'.*torch.*\[torch-shape\]"):
        weightmap.iter_tensors(folder, mapping=mapping)


# ---------------------------------------------------------------- 10. deep --set values


def test_a_deeply_nested_set_value_is_one_line(ckpt: Path, tmp_path: Path) -> None:
    deep = "[" * 5000 + "]" * 5000
    result = _run("convert", str(ckpt), str(tmp_path / "out"), "--preset", "eagle3-sglang",
                  "--set", f"l={deep}")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--set l" in result.stderr and "nests deeper than" in result.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 11. work, not allocations

_BOMB = "[[[[0] * 100] * 100] * 100] * 100"  # 400 list items allocated, 10**8 as values


@pytest.mark.parametrize(
    "program",
    [
        f'keep "**" where {_BOMB} == []',
        f'require {_BOMB} != [] else "x"\nkeep "**"',
        f'keep "**"\nconfig {{ bomb = {_BOMB} }}',
        f'param p = {_BOMB}\nkeep "**"',
        # The same through other kinds of aliasing: literals, comprehensions, param chains.
        'keep "**" where len([[[0] * 1000] * 1000 for i in [0] * 1000]) == 0',
        'param a = [0] * 300000\nparam b = [a, a, a, a]\nkeep "**"',
        'keep "**"\nconfig { a = [0] * 600000\n b = [config.a, config.a] }',
        'param a = [0] * 500000\nparam b = [x == a for x in [a] * 400000]\nkeep "**"',
    ],
    ids=[
        "where",
        "require",
        "config",
        "param",
        "comprehension",
        "literal",
        "config-alias",
        "equality",
    ],
)
def test_the_work_budget_counts_values_as_produced(example: Path, program: str) -> None:
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(weightmap.MappingError, match="builds more than 1,000,000"):
            weightmap.compile(example, mapping="weightmap 1\n" + program + "\n")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 2**20  # 9.7 GB before


@pytest.mark.parametrize("statement", ["warn", "require false else"])
def test_a_message_hole_is_bounded_too(example: Path, statement: str) -> None:
    import tracemalloc

    program = f'weightmap 1\n{statement} "{{{_BOMB}}}"\nkeep "**"\n'
    tracemalloc.start()
    try:
        # A hole that cannot be rendered within the budget leaves the message as written.
        if statement == "warn":
            warnings = weightmap.compile(example, mapping=program).warnings
        else:
            with pytest.raises(weightmap.MappingError) as err:
                weightmap.compile(example, mapping=program)
            warnings = (str(err.value),)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 2**20
    assert f"{{{_BOMB}}}" in warnings[0]


def test_values_nest_no_deeper_than_json_allows(example: Path) -> None:
    # A chain of params, each a list of the one before: copying the value into config.json
    # recursed past the stack (RecursionError).
    chain = "".join(f"param p{i} = [p{i - 1}]\n" for i in range(1, 1500))
    program = f"weightmap 1\nparam p0 = [0]\n{chain}unmatched keep\nconfig {{ x = p1499 }}\n"
    with pytest.raises(weightmap.MappingError, match="nested deeper than 64 levels"):
        weightmap.compile(example, mapping=program)


def test_values_within_the_budget_still_work(example: Path) -> None:
    program = (
        "weightmap 1\nparam a = [[0] * 100] * 100\nunmatched keep\n"
        "config { grid = a\n lengths = [len(row) for row in a] }\n"
    )
    plan = weightmap.compile(example, mapping=program)
    assert plan.config is not None and len(plan.config["grid"]) == 100


# ---------------------------------------------------------------- 12. include fan-out, size


def test_include_fan_out_is_bounded(tmp_path: Path) -> None:
    # 30 files of ~45 bytes, each including the next twice: 2**30 expansions, and no cycle.
    for i in range(30):
        body = f'include "f{i + 1}.wm"\n' * 2 if i < 29 else 'keep "**"\n'
        (tmp_path / f"f{i}.wm").write_text("weightmap 1\n" + body)
    result = _run("check", str(tmp_path / "f0.wm"))  # hung before (timeout: 120 s)
    assert result.returncode == 2, result.stderr
    assert "more than 100 includes" in result.stderr
    # A plain chain within the bound still works.
    (tmp_path / "f29.wm").write_text('weightmap 1\nkeep "**"\n')
    (tmp_path / "chain.wm").write_text('weightmap 1\ninclude "f29.wm"\ninclude "f29.wm"\n')
    assert len(weightmap.load_mapping(tmp_path / "chain.wm").program.stmts) == 2


def test_the_main_mapping_has_a_size_cap(tmp_path: Path) -> None:
    big = "weightmap 1\n" + 'keep "a"\n' * 120_000  # 1.2 MB of valid statements
    path = tmp_path / "big.wm"
    path.write_text(big)
    for source in (path, big):
        with pytest.raises(weightmap.MappingError, match="1,000,000 bytes"):
            weightmap.load_mapping(source)


def test_a_huge_string_literal_is_refused_before_parsing() -> None:
    import tracemalloc

    secret = "s3cr3t" * 100
    text = 'weightmap 1\nrename "' + secret + "a" * 10_000_000 + '" -> "b"\n'
    tracemalloc.start()
    try:
        with pytest.raises(weightmap.MappingError) as err:
            weightmap.load_mapping(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # parsing it took 1.8 GB
    assert secret not in str(err.value)
    # Within the size cap, a line that long is refused by its length, not parsed.
    text = 'weightmap 1\nrename "' + "a" * 200_000 + '" -> "b"\n'
    with pytest.raises(MappingSyntaxError, match=r"<string>:2:1: this line is 200,0\d\d char"):
        weightmap.load_mapping(text)


# ---------------------------------------------------------------- 13. unindexed shards


def test_a_shard_the_index_leaves_out_is_refused(tmp_path: Path) -> None:
    folder = _with_metadata(tmp_path / "ckpt", [None, None])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["t1"]  # total_size still counts both shards
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"\[unindexed-shard\]") as err:
        weightmap.Checkpoint.open(folder)
    assert "model-00002-of-00002.safetensors" in str(err.value)
    assert "regenerate the index" in str(err.value)
    out = tmp_path / "out"
    result = _run("convert", str(folder), str(out), "--mapping", 'weightmap 1\nkeep "**"\n')
    assert result.returncode == 1 and "unindexed-shard" in result.stderr
    assert not out.exists()
    # A file of another sharding (or a consolidated copy) is not part of this one: ignored.
    folder2 = _with_metadata(tmp_path / "ckpt2", [None, None])
    shutil.copy(
        folder2 / "model-00001-of-00002.safetensors", folder2 / "model-00001-of-00003.safetensors"
    )
    shutil.copy(folder2 / "model-00001-of-00002.safetensors", folder2 / "consolidated.safetensors")
    with weightmap.Checkpoint.open(folder2) as c:
        assert set(c.tensors) == {"t0", "t1"}


def test_an_index_promising_more_bytes_than_its_shards_hold_is_refused(tmp_path: Path) -> None:
    folder = _with_metadata(tmp_path / "ckpt", [None, None])
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["metadata"]["total_size"] = 10**9  # a shard is missing from folder and index alike
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"\[index-total-size\]") as err:
        weightmap.Checkpoint.open(folder)
    assert "1000000000" in str(err.value).replace(",", "")
    # Writers count total_size as tensor bytes, some as file sizes: both are consistent.
    files = sum((folder / n).stat().st_size for n in set(index["weight_map"].values()))
    for total in (16, files, 8):
        index["metadata"]["total_size"] = total
        path.write_text(json.dumps(index))
        with weightmap.Checkpoint.open(folder) as c:
            assert len(c) == 2


# ---------------------------------------------------------------- 14. NaN never written

_CONFIG_PARAM = "weightmap 1\nparam p = 1.5\nunmatched keep\nconfig { value = p }\n"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400", "[1, NaN]"])
def test_set_of_a_non_json_number_is_refused(ckpt: Path, tmp_path: Path, value: str) -> None:
    mapping = tmp_path / "m.wm"
    mapping.write_text(_CONFIG_PARAM)
    out = tmp_path / "out"
    result = _run("convert", str(ckpt), str(out), "--mapping", str(mapping), "--set", f"p={value}")
    assert result.returncode == 2, result.stderr
    assert "--set p" in result.stderr and "not a JSON number" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [1.0, float("-inf")]])
def test_params_and_edits_that_are_not_json_never_reach_config_json(
    ckpt: Path, tmp_path: Path, value: object
) -> None:
    out = tmp_path / "out"
    with pytest.raises(weightmap.MappingError, match="not a finite number"):
        weightmap.remap(ckpt, out, mapping=_CONFIG_PARAM, params={"p": value})
    # Arithmetic in the language cannot make one either.
    text = "weightmap 1\nunmatched keep\nconfig { value = 1e308 * 10.0 }\n"
    with pytest.raises(weightmap.MappingError, match="not a finite number"):
        weightmap.remap(ckpt, out, mapping=text)
    assert not out.exists()


def test_a_config_holding_nan_is_never_written_back(ckpt: Path, tmp_path: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["odd"] = {"value": float("nan")}
    (ckpt / "config.json").write_text(json.dumps(config))
    # Reading it is fine (inspect, compile without writing refuse only where they print it).
    result = _run("inspect", str(ckpt))
    assert result.returncode == 0, result.stderr
    # inspect --json prints strict JSON or refuses clearly: it refuses, naming the field.
    result = _run("inspect", "--json", str(ckpt))
    assert result.returncode == 1
    assert "odd.value" in result.stderr and "NaN" in result.stderr
    assert result.stdout == ""
    # A conversion would write it back into config.json: refused.
    out = tmp_path / "out"
    result = _run("convert", str(ckpt), str(out), "--preset", "eagle3-sglang")
    assert result.returncode == 2
    assert "odd.value" in result.stderr and "NaN" in result.stderr
    assert not out.exists()


def test_json_problem_names_any_field() -> None:
    from weightmap.format.text import json_problem

    # Found by the fuzzer: a key with a brace broke the message's formatting.
    assert json_problem({"{p}": [2**300]}) == "holds an integer over 256 bits at `{p}.0`"
    assert json_problem([[0] * 10] * 10, max_values=100) == "holds more than 100 values"


# ---------------------------------------------------------------- 15. readers during a rename

_FLIPPER = """
import sys, weightmap
root, rounds = sys.argv[1], int(sys.argv[2])
names = ["t0", "u0"]
for i in range(rounds):
    old, new = names[i % 2], names[(i + 1) % 2]
    weightmap.remap(root, inplace=True, mapping=(
        f'weightmap 1\\nrename "{old}.{{r*}}" -> "{new}.{{r}}"\\n'
        f'config {{ renamed_by = "{new}" }}\\n'))
print("done")
"""


def test_a_reader_never_sees_half_a_rename(tmp_path: Path) -> None:
    root = _sharded(tmp_path / "ckpt")
    writer = subprocess.Popen(
        [sys.executable, "-c", _FLIPPER, str(root), "40"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: set[str] = set()
    reads = 0
    try:
        while writer.poll() is None or reads == 0:
            # New names with the old config, or "was interrupted" while the writer runs,
            # both failed here before readers took the lock.
            seen.add(_state(root, quiet=False))
            reads += 1
            time.sleep(0.005)  # readers come and go; an endless stream of them would starve it
    finally:
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0 and out == "done\n", err
    assert seen == {"t0", "u0"}  # both states seen, never a third
    assert _state(root) == "t0"  # an even number of renames


def test_a_reader_waits_for_a_live_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl
    import threading

    root = _sharded(tmp_path / "ckpt", shards=2, per_shard=10)
    # Play a writer in the middle of its rewrite: the folder locked, a journal present.
    fd = os.open(root, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (root / JOURNAL_NAME).write_text("{}")
    opened: list[object] = []
    reader = threading.Thread(target=lambda: opened.append(_state(root)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # waiting, not told the rewrite "was interrupted"
    (root / JOURNAL_NAME).unlink()  # the writer finishes...
    os.close(fd)  # ...and lets go
    reader.join(30)
    assert opened == ["t0"]
    # A writer that stays away too long: the reader gives up with a clear error.
    from weightmap.fs import lock

    monkeypatch.setattr(lock, "LOCK_WAIT_SECONDS", 0.2)
    fd = os.open(root, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CheckpointError, match=r"in-place rename.*\[busy\]"):
            weightmap.Checkpoint.open(root)
    finally:
        os.close(fd)
    # A journal with no live writer is an interrupted rewrite, as before.
    (root / JOURNAL_NAME).write_text("{}")
    with pytest.raises(CheckpointError, match=r"\[interrupted-inplace\]"):
        weightmap.Checkpoint.open(root)


# ---------------------------------------------------------------- 16. smaller things


def _many_tensors(folder: Path, n: int) -> Path:
    from sftools import entry, write_raw

    folder.mkdir()
    header = {f"layer.{i}.weight": entry("F32", [1], 4 * i, 4 * i + 4) for i in range(n)}
    write_raw(folder / "model.safetensors", header, b"\0" * (4 * n))
    return folder


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path: Path, json_flag: list[str]) -> None:
    folder = _many_tensors(tmp_path / "many", 3000)  # far more output than a pipe holds
    proc = subprocess.Popen(
        [*EXE, "inspect", *json_flag, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    with proc:
        proc.stdout.readline()
        proc.stdout.close()  # what `| head -1` does
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 0, err
    assert err == ""


def test_a_dangling_symlink_destination_is_refused_before_work(ckpt: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.symlink_to(tmp_path / "nowhere")
    seen: list[int] = []
    with pytest.raises(weightmap.OutputExistsError, match="symbolic link") as err:
        weightmap.remap(ckpt, dest, preset="eagle3-sglang", progress=lambda d, t: seen.append(d))
    assert seen == []  # refused before the first byte was converted
    assert "appeared while" not in str(err.value)
    assert dest.is_symlink() and not (tmp_path / "nowhere").exists()
    # --overwrite replaces the link itself, never what it points to.
    weightmap.remap(ckpt, dest, preset="eagle3-sglang", overwrite=True)
    assert dest.is_dir() and not dest.is_symlink()


def test_a_folder_named_model_safetensors_is_named_as_such(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / "model.safetensors").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is a folder, not a file"):
        weightmap.Checkpoint.open(root)
    result = _run("inspect", str(root))
    assert "found model.safetensors" not in result.stderr
    assert "is a folder, not a file" in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling"])
def test_a_config_json_that_cannot_be_read_is_no_missing_config(ckpt: Path, kind: str) -> None:
    # Taken for absent, it would be converted without a config.json and without a word.
    config = ckpt / "config.json"
    config.unlink()
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "folder":
        config.mkdir()
    else:
        config.symlink_to("nowhere.json")
    rule = "dangling-link" if kind == "dangling" else "not-a-file"
    with pytest.raises(CheckpointError, match=rf"config\.json is .*\[{rule}\]"):
        weightmap.remap(ckpt, ckpt.parent / "out", mapping=KEEP_ALL_MAPPING)
    assert not (ckpt.parent / "out").exists()


def test_a_dangling_index_is_no_missing_index(ckpt: Path) -> None:
    (ckpt / "model.safetensors.index.json").symlink_to("gone.json")
    with pytest.raises(CheckpointError, match=r"gone\.json, which does not exist"):
        weightmap.Checkpoint.open(ckpt)


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_overwrite_replaces_an_old_output_folder_only(
    ckpt: Path, tmp_path: Path, kind: str
) -> None:
    # As root, `--overwrite` to /dev/null would otherwise make it a folder.
    dest = tmp_path / "dest"
    if kind == "file":
        dest.write_text("my notes\n")
    else:
        os.mkfifo(dest)
    with pytest.raises(
        weightmap.OutputExistsError, match=rf"is a {kind if kind == 'file' else 'special file'}"
    ):
        weightmap.remap(ckpt, dest, preset="eagle3-sglang", overwrite=True, progress=False)
    assert not dest.is_dir()
    if kind == "file":
        assert dest.read_text() == "my notes\n"
    result = _run("convert", str(ckpt), str(dest), "--preset", "eagle3-sglang", "--overwrite")
    assert result.returncode == 1 and "not a folder" in result.stderr
    # Without --overwrite the first message says so too, rather than suggest --overwrite.
    result = _run("convert", str(ckpt), str(dest), "--preset", "eagle3-sglang")
    assert result.returncode == 1 and "not a folder" in result.stderr


def test_control_characters_from_a_checkpoint_are_escaped_on_the_terminal(
    tmp_path: Path,
) -> None:
    # Escape sequences in names and config values would retitle the terminal or set the
    # clipboard (OSC 52) when printed raw.
    from safetensors.numpy import save_file

    root = tmp_path / "ckpt"
    root.mkdir()
    evil = "a\x1b]52;c;cHduZWQ=\x07b"
    save_file({evil: np.zeros(2, np.float32)}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"model_type": "\x1b[2Jx"}))
    shown = _run("inspect", str(root))
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "a\\x1b]52;c;cHduZWQ=\\x07b" in shown.stdout
    rules = tmp_path / "m.wm"
    rules.write_text('weightmap 1\nrename "zzz" -> "y"\n')
    failed = _run("convert", str(root), str(tmp_path / "out"), "--mapping", str(rules))
    assert failed.returncode == 2
    assert "\x1b" not in failed.stderr and "a\\x1b]52" in failed.stderr
    # JSON output escapes them itself (\\u001b), and stays JSON through the escaping.
    save_file({"d\x7fe\x85l": np.zeros(1, np.float32)}, str(root / "model.safetensors"))
    doc = _run("inspect", "--json", str(root))
    assert json.loads(doc.stdout)["tensors"][0]["name"] == "d\x7fe\x85l"


def test_a_name_with_a_line_break_stays_one_row_in_listings(tmp_path: Path) -> None:
    # "a\nline" printed raw read as two tensors, `a` and `line`, in inspect, diff and plan.
    from safetensors.numpy import save_file

    names = ["a\nline", "b\u2028c", "d\u202ee"]
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        kept = names if side == "a" else names[:1]
        save_file(
            {n: np.zeros(2, np.float32) for n in kept}, str(tmp_path / side / "model.safetensors")
        )
    shown = _run("inspect", str(tmp_path / "a"))
    assert shown.returncode == 0, shown.stderr
    rows = shown.stdout.splitlines()
    assert len(rows) == 5 and "a\\nline" in rows[1] and "b\\u2028c" in rows[2]
    assert "d\\u202ee" in rows[3]
    compared = _run("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert "only in A: b\\u2028c" in compared.stdout.splitlines()
    rules = tmp_path / "m.wm"
    rules.write_text('weightmap 1\ndrop "{x*}"\n')  # (such names cannot be output names)
    planned = _run("plan", str(tmp_path / "a"), "--mapping", str(rules))
    assert planned.returncode == 0, planned.stderr
    rows = planned.stdout.splitlines()
    assert f"  dropped a\\nline  ({rules}:2:1)" in rows
    assert f"  dropped b\\u2028c  ({rules}:2:1)" in rows


def test_a_fifo_as_the_mapping_is_named_as_such(ckpt: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "rules.wm"
    os.mkfifo(fifo)
    result = _run("check", str(fifo))
    assert result.returncode == 2
    assert "does not exist" not in result.stderr
    assert "not a regular file" in result.stderr
    result = _run("convert", str(ckpt), str(tmp_path / "o"), "--mapping", str(fifo))
    assert result.returncode == 2
    assert "not a regular file" in result.stderr
    # The library never blocks reading it either.
    with pytest.raises(weightmap.MappingError, match="not a regular file"):
        weightmap.load_mapping(fifo)


def _with_metadata(folder: Path, shards: list[dict[str, str] | None]) -> Path:
    from sftools import entry, write_raw

    folder.mkdir()
    weight_map = {}
    for i, meta in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, object] = {f"t{i}": entry("F32", [2], 0, 8)}
        if meta is not None:
            header["__metadata__"] = meta
        write_raw(folder / name, header, b"\1" * 8)
        weight_map[f"t{i}"] = name
    index = {"metadata": {"total_size": 8 * len(shards)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_input_metadata_is_carried_to_the_output(tmp_path: Path) -> None:
    from safetensors import safe_open

    src = _with_metadata(
        tmp_path / "src",
        [
            {"format": "pt", "origin": "trainer-7", "step": "100"},
            {"format": "pt", "origin": "trainer-7", "step": "200"},
        ],
    )
    out = tmp_path / "out"
    weightmap.remap(src, out, mapping='weightmap 1\nkeep "**"\n')
    # A rename keeps the input's shards; every output shard carries the keys all input shards
    # agree on (a key they disagree on is dropped).
    with weightmap.Checkpoint.open(out) as ckpt:
        shards = list(ckpt.files)
    assert shards
    for shard in shards:
        with safe_open(shard, "pt") as f:
            assert f.metadata() == {"format": "pt", "origin": "trainer-7"}
    # No metadata at all: the output says format pt, as before.
    bare = _with_metadata(tmp_path / "bare", [None])
    weightmap.remap(bare, tmp_path / "out2", mapping='weightmap 1\nkeep "**"\n')
    with safe_open(tmp_path / "out2" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


# ---------------------------------------------------------------- 11. one budget for config blocks


def test_config_blocks_share_one_budget() -> None:
    # 100 small blocks, each building 450,000 values: each used to get a fresh budget (14 s,
    # 650 MB before the edited config was refused); one budget for all stops it early.
    from weightmap.compiler.compile import compile_plan
    from weightmap.format.dtypes import TensorSpec

    blocks = "\n".join(f"config {{ x{i} = [[0] * 900] * 500 }}" for i in range(100))
    mapping = weightmap.load_mapping('weightmap 1\nkeep "a"\n' + blocks)
    with pytest.raises(MappingError, match=r"<string>:[3-7]:\d+: expression builds more than"):
        compile_plan(mapping, [TensorSpec("a", "F32", (1,))], {})


def test_a_long_string_literal_parses_in_small_memory() -> None:
    # The grammar's string terminal used one regex group per character (~200 bytes each).
    import tracemalloc

    text = 'weightmap 1\nrename "a" -> "' + "x" * 90_000 + '"\n'
    tracemalloc.start()
    try:
        weightmap.load_mapping(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20, peak


# ---------------------------------------------------------------- 17. links a folder plants


def _inplace_mapping() -> str:
    return 'weightmap 1\nrename "layers.0.{r*}" -> "midlayer.{r}"\nunmatched keep\n'


def test_inplace_temporaries_never_write_through_a_planted_link(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A downloaded folder may hold links named like the temporaries an in-place rename
    writes the journal and config through: the temporaries are created under fresh names,
    never opened through what is there."""
    import secrets

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious data, never to be touched")
    pid = os.getpid()
    for name in ("config.json", JOURNAL_NAME, "model.safetensors.index.json"):
        (ckpt / f".{name}.weightmap-tmp-{pid}-inplace").symlink_to(victim)  # the old fixed name
    mapping = tmp_path / "m.wm"
    mapping.write_text(_inplace_mapping())
    weightmap.remap(ckpt, mapping=mapping, inplace=True)
    assert victim.read_bytes() == b"precious data, never to be touched"
    with weightmap.Checkpoint.open(ckpt) as c:
        assert "midlayer.mlp.up_proj.weight" in c.tensors

    # Even a link at the very name drawn is not written through: the rename stops first.
    monkeypatch.setattr(secrets, "token_hex", lambda n: "feedbeef")
    (ckpt / f".{JOURNAL_NAME}.weightmap-tmp-{owner_tag()}-feedbeef-inplace").symlink_to(victim)
    mapping.write_text('weightmap 1\nrename "midlayer.{r*}" -> "layers.0.{r}"\nunmatched keep\n')
    before = _hashes(ckpt)
    with pytest.raises(weightmap.ExecutionError, match="cannot write the journal"):
        weightmap.remap(ckpt, mapping=mapping, inplace=True)
    assert victim.read_bytes() == b"precious data, never to be touched"
    assert _hashes(ckpt) == before


def test_clean_never_writes_a_journal_config_through_a_planted_link(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import secrets

    from weightmap.compiler.compile import compile_plan
    from weightmap.execute.inplace import inplace_headers
    from weightmap.language.mapping import load_mapping

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious data, never to be touched")
    with weightmap.Checkpoint.open(ckpt) as c:
        headers = inplace_headers(compile_plan(load_mapping(_inplace_mapping()), c.specs()), c)
    _journal(ckpt, {p.name: _b64(h) for p, h in headers.items()}, config='{"pwned": true}')
    monkeypatch.setattr(secrets, "token_hex", lambda n: "feedbeef")
    planted = ckpt / f".config.json.weightmap-tmp-{owner_tag()}-feedbeef-inplace"
    planted.symlink_to(victim)
    with pytest.raises(OSError):
        weightmap.recover(ckpt)
    assert victim.read_bytes() == b"precious data, never to be touched"
    # The journal stays, and replaying it again (the link gone) finishes the rename.
    planted.unlink()
    assert weightmap.recover(ckpt) is True
    assert json.loads((ckpt / "config.json").read_text()) == {"pwned": True}
    assert victim.read_bytes() == b"precious data, never to be touched"


@pytest.mark.parametrize("what", ["config.json", "index"])
def test_a_config_or_index_linked_out_of_the_folder_is_refused(
    ckpt: Path, tmp_path: Path, what: str
) -> None:
    """A config.json that is a link to a JSON file elsewhere (registry credentials, say)
    would be read as the checkpoint's and written into the output: refused, as a shard or side
    file leaving the folder is."""
    secret = tmp_path / "home" / "credentials.json"
    secret.parent.mkdir()
    if what == "config.json":
        secret.write_text('{"auths": {"registry": {"auth": "c2VjcmV0"}}}')
        (ckpt / "config.json").unlink()
        (ckpt / "config.json").symlink_to(secret)
        name = "config.json"
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(ckpt / "model.safetensors")
        (ckpt / "model.safetensors").unlink()
        save_file(tensors, ckpt / "model-00001-of-00001.safetensors")
        weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
        secret.write_text(json.dumps({"weight_map": weight_map, "auth": "c2VjcmV0"}))
        name = "model.safetensors.index.json"
        (ckpt / name).symlink_to(secret)
    with pytest.raises(CheckpointError, match=r"leaves the checkpoint's folder.*\[link-escape\]"):
        weightmap.Checkpoint.open(ckpt)
    out = tmp_path / "out"
    result = _run("convert", str(ckpt), str(out), "--preset", "eagle3-sglang")
    assert result.returncode != 0
    assert "link-escape" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()
    assert "c2VjcmV0" not in result.stderr


def test_a_journal_naming_a_hub_blob_is_refused(tmp_path: Path, example: Path) -> None:
    """In a hub cache, a snapshot's files are links into blobs/, shared by every revision:
    an in-place rename never rewrites one, so a journal that names one is not ours."""
    repo = tmp_path / "models--org--name"
    snap = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    data = (example / "model.safetensors").read_bytes()
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    (snap / "model.safetensors").symlink_to(blob)
    size = int.from_bytes(data[:8], "little")
    _journal(snap, {"model.safetensors": _b64(data[8 : 8 + size])})
    with pytest.raises(CheckpointError, match=r"outside the checkpoint's folder.*\[journal\]"):
        weightmap.recover(snap)
    assert blob.read_bytes() == data


def test_clean_does_not_hang_on_a_fifo_config(ckpt: Path) -> None:
    from weightmap.compiler.compile import compile_plan
    from weightmap.execute.inplace import inplace_headers
    from weightmap.language.mapping import load_mapping

    with weightmap.Checkpoint.open(ckpt) as c:
        headers = inplace_headers(compile_plan(load_mapping(_inplace_mapping()), c.specs()), c)
    _journal(ckpt, {p.name: _b64(h) for p, h in headers.items()}, config='{"a": 1}')
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")
    result = _run("clean", str(ckpt))  # (a hang fails on the subprocess's timeout)
    assert result.returncode == 0, result.stderr
    assert json.loads((ckpt / "config.json").read_text()) == {"a": 1}


def test_a_fifo_where_json_is_read_is_refused_without_waiting(tmp_path: Path) -> None:
    from weightmap.format.text import read_json_file

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=r"is a FIFO, not a regular file.*\[not-a-file\]"):
        read_json_file(fifo, "config.json")


def test_messages_quoting_other_libraries_carry_no_credentials() -> None:
    from weightmap.format.text import redacted
    from weightmap.inputs.hub import HubRepo

    message = (
        "500 Server Error: Internal Server Error for url: "
        "http://alice:s3cr3tpass@127.0.0.1:18765/api/models/org/name (token hf_abcdefghijkl)\n"
        "Request ID: 123"
    )
    shown = redacted(message)
    assert "s3cr3tpass" not in shown and "alice" not in shown and "hf_abcdefghijkl" not in shown
    assert "http://***@127.0.0.1:18765/api/models/org/name" in shown
    assert "\n" not in shown and "Request ID" not in shown
    assert len(redacted("x" * 5000)) == 300
    # A raw @ in the password: URL parsers split at the last @ before the host.
    assert redacted("proxy https://user:p@ss@proxy:8080/x, mail a@b.c") == (
        "proxy https://***@proxy:8080/x, mail a@b.c"
    )

    class ServerError(Exception):
        pass

    err = HubRepo("org/name")._translated(ServerError(message))
    assert "s3cr3tpass" not in str(err) and "hf_abcdefghijkl" not in str(err)
    assert "[hub]" in str(err)


def test_the_token_in_use_is_never_quoted_whatever_its_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A token with no hf_ prefix (an organization's, a mirror's) quoted by another library's
    message is hidden too: the value in use is known, whatever it looks like."""
    from weightmap.format.text import redacted
    from weightmap.inputs.hub import HubRepo

    assert redacted("a Zq9-token-Zq9 b", secrets=["Zq9-token-Zq9"]) == "a *** b"
    assert redacted("abc", secrets=["", "b"]) == "abc"  # (too short to be a secret)
    monkeypatch.setenv("HF_TOKEN", "org-Zq9x7Kp2Lm4")

    class ServerError(Exception):
        pass

    err = HubRepo("org/name")._translated(ServerError("401 for ?token=org-Zq9x7Kp2Lm4 at /api"))
    assert "org-Zq9x7Kp2Lm4" not in str(err) and "?token=*** at /api" in str(err)


@pytest.mark.parametrize("endpoint", ["huggingface.co", "ftp://mirror", "https://", "http://[::1"])
def test_a_malformed_hub_endpoint_is_named(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """An HF_ENDPOINT that is no http(s) address is refused, naming the variable and its
    value (credentials hidden), before any request."""
    from weightmap.inputs.hub import HubRepo

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(
        CheckpointError, match=r"HF_ENDPOINT=.*not an http\(s\) address.*\[hub-endpoint\]"
    ):
        HubRepo("org/name")._check_endpoint()
    monkeypatch.setenv("HF_ENDPOINT", "https://alice:s3cr3tpass@mirror.example")
    HubRepo("org/name")._check_endpoint()  # (an address: the request goes ahead)
    monkeypatch.setenv("HF_ENDPOINT", "alice:s3cr3tpass@mirror.example")
    with pytest.raises(CheckpointError) as info:
        HubRepo("org/name")._check_endpoint()
    assert "s3cr3tpass" not in str(info.value)


def test_inplace_refuses_a_hard_linked_shard(ckpt: Path, tmp_path: Path) -> None:
    """A shard with another name elsewhere (a `cp -al` backup) is one file: an in-place rename
    would change the backup too. Refused before anything is written."""
    backup = tmp_path / "backup"
    backup.mkdir()
    os.link(ckpt / "model.safetensors", backup / "model.safetensors")
    before = _hashes(ckpt, backup)
    mapping = tmp_path / "m.wm"
    mapping.write_text(_inplace_mapping())
    with pytest.raises(CheckpointError, match=r"2 hard links.*\[inplace-link\]"):
        weightmap.remap(ckpt, mapping=mapping, inplace=True)
    assert _hashes(ckpt, backup) == before
    # Given its own copy, the folder renames in place; the backup keeps its bytes.
    shutil.copy(ckpt / "model.safetensors", tmp_path / "own")
    os.replace(tmp_path / "own", ckpt / "model.safetensors")
    weightmap.remap(ckpt, mapping=mapping, inplace=True)
    assert _hashes(backup) == {k: v for k, v in before.items() if "backup" in k}


def test_links_that_stay_in_the_folder_or_the_hub_cache_are_read(
    ckpt: Path, tmp_path: Path
) -> None:
    """What link-escape must not refuse: a `config from` file in a subfolder, a config.json
    linked to a file inside the folder, and a hub cache snapshot's subfolder (diffusers'
    layout) whose files link into the repository's blobs/."""
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "params.json").write_text('{"dim": 8}')
    mapping = 'weightmap 1\nconfig from "sub/params.json"\nunmatched keep\n'
    plan = weightmap.compile(ckpt, mapping=weightmap.load_mapping(mapping))
    assert plan.input_config == {"dim": 8}
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "configs").mkdir()
    (ckpt / "config.json").rename(ckpt / "configs" / "real.json")
    (ckpt / "config.json").symlink_to(Path("configs") / "real.json")
    with weightmap.Checkpoint.open(ckpt) as c:
        assert c.config == config

    repo = tmp_path / "models--org--name"
    sub = repo / "snapshots" / ("a" * 40) / "text_encoder"
    (repo / "blobs").mkdir(parents=True)
    sub.mkdir(parents=True)
    for name in ("model.safetensors", "config.json"):
        data = ckpt / ("model.safetensors" if name != "config.json" else "configs/real.json")
        blob = repo / "blobs" / hashlib.sha256(data.read_bytes()).hexdigest()
        shutil.copy(data, blob)
        (sub / name).symlink_to(Path("../../../blobs") / blob.name)
    for given in (sub, sub / "model.safetensors"):
        with weightmap.Checkpoint.open(given) as c:
            assert c.config == config


def test_a_side_file_that_cannot_be_read_says_so_not_changed(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weightmap.inputs.sidefiles as sidefiles

    (ckpt / "tokenizer.json").write_text("{}")

    def denied(resolved: Path) -> int:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(sidefiles, "open_resolved", denied)
    with pytest.raises(CheckpointError, match=r"make it readable.*\[side-file\]"):
        sidefiles.open_side_file(ckpt, "tokenizer.json", 2)


@pytest.mark.parametrize(
    "template",
    [
        '"{p}.{i}"',  # a param: rendered through the scope
        '"{x}.{i}"',  # captures only (made long by a literal): the bulk path
    ],
)
def test_an_output_name_too_long_is_refused_as_it_is_made(tmp_path: Path, template: str) -> None:
    # A 1 KB mapping whose names render 64 KB each: refused only once every output was made,
    # a checkpoint of a few thousand tensors held gigabytes of names first.
    from safetensors.numpy import save_file as save_np

    folder = tmp_path / "ck"
    folder.mkdir()
    save_np(
        {f"layers.{i}.w": np.zeros(1, np.float32) for i in range(400)}, folder / "model.safetensors"
    )
    big = "x" * 1024
    params = [f'param p0 = "{big}"'] + [f"param p{k} = p{k - 1} + p{k - 1}" for k in range(1, 7)]
    literal = "y" * 65536 if "{x}" in template else ""
    mapping = "\n".join(
        [
            "weightmap 1",
            *params,
            "param p = p6",
            f'rename "{{x:layers}}.{{i:int}}.w" -> {template[:-1]}{literal}"',
        ]
    )
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(weightmap.MappingError, match="is longer than 1024 characters"):
            weightmap.compile(folder, mapping=mapping)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # 400 names of 64 KB held: 26 MB and more


@pytest.mark.parametrize(
    ("pattern", "loose"),
    [
        ("{a*}{b*}{c*}#", "{a*}, {b*}, {c*}"),  # twelve of them took minutes on a short name
        ("{a*}.{b*}.{c*}.w", "{a*}, {b*}, {c*}"),
        ("{a}_{b}_{c}_x", "{a}, {b}, {c}"),  # within one segment
        ("**.{a}{n:int}{b:x,xx}.{c*}.w", "**, {a}, {n:int}, {b:x,xx}, {c*}"),
        # Two that can end anywhere, then a part tried each way that scans: 1.7 s per name
        # of 1,024 characters. Or a long list of words tried each way.
        ("{a*}{b*}{x}.weight", "{a*}, {b*}"),
        ("{a*}{b*}{n:int}.weight", "{a*}, {b*}"),
        ("{a*}{b*}{w:" + ",".join(f"w{i:05d}" for i in range(2000)) + "}#", "{a*}, {b*}"),
    ],
)
def test_a_pattern_whose_match_can_take_a_power_of_the_name_is_refused(
    pattern: str, loose: str
) -> None:
    with pytest.raises(MappingSyntaxError) as info:
        weightmap.load_mapping(f'weightmap 1\nrename "{pattern}" -> "x"\nunmatched keep\n')
    said = str(info.value)
    assert "steps to match a name of 1,024 characters (at most 33,554,432)" in said
    assert f"parts that can end in more than one place ({loose})" in said


@pytest.mark.parametrize(
    "pattern",
    [
        "model.layers.{n}.{rest*}",  # a segment before a dot ends at the dot
        "{x*}.weight",
        "**.q_proj.weight",
        "verifier_**",  # the last part ends at the name's end
        "*.weight",
        "layers.{i:int}.w",
        "{prefix*}.layers.{i:int}.{rest*}",
        "{a*}.{b*}.weight",  # two: at most the square of a name's length
        "{x*}.{p}_proj.weight",
        "model.layers.{n}.mlp.experts.{e}.{w:gate_proj,up_proj,down_proj}.weight",
        # Two that can end anywhere before longer literals: a literal's try fails at its
        # first differing character, and is not charged its whole length each way.
        "{a*}.{b*}.weight_scale_inv",
        "{pre*}.{n:int}.{rest*}.input_layernorm.weight",
        "{pre*}.layers.{n}.{mid*}.post_attention_layernorm.weight",
        "{model*}.{sub*}.embed_tokens.weight",
        "**.experts.{e:int}.**.{w:weight,weight_scale_inv}",
        "{a*}.{b*}.lora_{ab:A,B}.weight",
    ],
)
def test_the_patterns_mappings_use_are_not_refused(pattern: str) -> None:
    weightmap.load_mapping(f'weightmap 1\nkeep "{pattern}"\nunmatched keep\n')


def test_file_patterns_count_their_parts_at_slashes(tmp_path: Path) -> None:
    # In a side-file pattern `*` and `{x}` stop at `/`, not at dots.
    weightmap.load_mapping('weightmap 1\nunmatched keep\nfiles {\n  drop "**/*.md"\n}\n')
    with pytest.raises(MappingSyntaxError, match=r"can take up to .* steps"):
        weightmap.load_mapping('weightmap 1\nunmatched keep\nfiles {\n  drop "{a}.{b}.{c}.md"\n}\n')


def test_an_input_name_no_output_may_have_is_never_matched(tmp_path: Path) -> None:
    from safetensors.numpy import save_file as save_np

    folder = tmp_path / "ck"
    folder.mkdir()
    long = "." * 2000 + "w"
    save_np(
        {long: np.zeros(1, np.float32), "b": np.zeros(1, np.float32)}, folder / "model.safetensors"
    )
    with pytest.raises(weightmap.MappingError) as info:
        weightmap.compile(folder, mapping='weightmap 1\ndrop "{a*}.{b*}.weight"\nunmatched keep\n')
    assert "1 input tensor name(s) longer than 1,024 characters" in str(info.value)
    assert "2,001 characters" in str(info.value)
