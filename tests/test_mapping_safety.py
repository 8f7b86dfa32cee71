"""A mapping is data from a stranger (docs/safety.md, "What a mapping may write"): whatever it
says, the output folder is safe to enter and open, the work it causes is bounded once per
mapping, and the parser cache it goes through trusts nothing from the environment or the cache
folder that it has not checked."""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import weightmap
import weightmap.language.parse as parse_mod
from weightmap.errors import MappingError
from weightmap.language import ast as A
from weightmap.language import cache as language_cache
from weightmap.language import grammar

KEEP_ALL = "weightmap 1\nunmatched keep\n"


def _folder(tmp_path: Path, example: Path) -> Path:
    """A model folder with side files: a README, a tokenizer folder, custom code, a script."""
    src = tmp_path / "src"
    shutil.copytree(example, src)
    (src / "README.md").write_text("# a model\n")
    (src / "tok").mkdir()
    (src / "tok" / "vocab.json").write_text("{}\n")
    (src / "modeling_eagle.py").write_text("class Eagle: ...\n")
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    return src


def _files_mapping(*stmts: str, before: str = "") -> str:
    """A mapping that keeps every tensor, with ``before`` (lines) and a files block of
    ``stmts``; its first statement is on line 4 when ``before`` is empty."""
    body = "\n".join(f"    {s}" for s in stmts)
    return f"weightmap 1\nunmatched keep\n{before}files {{\n{body}\n}}\n"


# -- what a mapping may write: no hidden path, no name a tool acts on ---------------------------

# The four files of a repository whose core.fsmonitor runs a command on `git status`.
_GIT_REPO = ['".git/config"', '".git/HEAD"', '".git/refs/heads/k"', '".git/objects/info/k"']


@pytest.mark.parametrize("name", _GIT_REPO)
def test_a_mapping_cannot_add_a_git_repository(tmp_path: Path, example: Path, name: str) -> None:
    src = _folder(tmp_path, example)
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, mapping=_files_mapping(f'add {name} = "x"'))
    assert f"<string>:4:5: files: side file name {name[1:-1]!r} (added) has the hidden " in str(
        info.value
    )
    assert "choose a name without a leading dot" in str(info.value)


def test_the_planted_repository_is_refused_whole_and_nothing_is_written(
    tmp_path: Path, example: Path
) -> None:
    src = _folder(tmp_path, example)
    ran = tmp_path / "ran"
    values = [f'"[core]\\n\\tfsmonitor = touch {ran}\\n"', '"ref: refs/heads/k\\n"', '"0"', '"x"']
    stmts = [f"add {name} = {value}" for name, value in zip(_GIT_REPO, values, strict=True)]
    with pytest.raises(MappingError, match=r"cannot be applied \(4 problems\)"):
        weightmap.remap(src, tmp_path / "out", mapping=_files_mapping(*stmts), progress=False)
    assert not (tmp_path / "out").exists() and not ran.exists()


@pytest.mark.parametrize(
    ("stmt", "message"),
    [
        ('rename "README.md" -> ".git/config"', "'.git/config' (renamed from 'README.md') has"),
        ('add "tok/.git/config" = "x"', "'tok/.git/config' (added) has the hidden component"),
        ('rename "tok/{f}" -> "tok/.git/{f}"', "(renamed from 'tok/vocab.json') has the hidden"),
        ('add ".envrc" = "x"', "'.envrc' (added) has the hidden component '.envrc'"),
        ('add ".vscode/tasks.json" = {}', "has the hidden component '.vscode'"),
        ('add "a/.hg/hgrc" = "x"', "has the hidden component '.hg'"),
        ('add "__pycache__/m.cpython-312.pyc" = "x"', "the component '__pycache__', which a"),
        ('add "GIT~1/config" = "x"', "Windows file systems give `.git` this short name"),
        ('add "sub/Desktop.ini" = "x"', "Windows Explorer reads it when it shows the folder"),
        ('add "Autorun.inf." = "x"', "Windows reads it when it mounts a drive"),
    ],
)
def test_hidden_and_active_names_are_refused(
    tmp_path: Path, example: Path, stmt: str, message: str
) -> None:
    src = _folder(tmp_path, example)
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, mapping=_files_mapping(stmt), allow_code=True)
    assert "<string>:4:5: files: side file name " in str(info.value)
    assert message in str(info.value)


# -- code files: only when allowed, always listed -------------------------------------------------


@pytest.mark.parametrize(
    "stmt",
    [
        'add "modeling_x.py" = "import os\\n"',
        'rename "README.md" -> "sitecustomize.py"',
        'rename "modeling_eagle.py" -> "modeling_other.py"',
        'add "tok/tokenizer.cpython-312-x86_64-linux-gnu.so" = "x"',
        'add "json.PYC" = "x"',
        'add "Model.Py. " = "x"',
    ],
)
def test_code_files_are_refused_unless_allowed(tmp_path: Path, example: Path, stmt: str) -> None:
    src = _folder(tmp_path, example)
    with pytest.raises(MappingError) as info:
        weightmap.compile(src, mapping=_files_mapping(stmt))
    assert "<string>:4:5: files: side file name " in str(info.value)
    assert "is a code file that loaders run" in str(info.value)
    assert "--allow-code-files, or allow_code=True" in str(info.value)
    plan = weightmap.compile(src, mapping=_files_mapping(stmt), allow_code=True)
    assert [f.name for f in plan.files if f.code and f.origin is not None]


def test_carried_code_files_are_carried_and_listed(tmp_path: Path, example: Path) -> None:
    """A .py the input already holds is the user's download: carried, without allow_code,
    under its own name (a rename onto itself too), and listed as a code file."""
    src = _folder(tmp_path, example)
    for mapping in (KEEP_ALL, _files_mapping('rename "{m}.py" -> "{m}.py"')):
        result = weightmap.remap(
            src, tmp_path / "out", mapping=mapping, overwrite=True, progress=False
        )
        assert (tmp_path / "out" / "modeling_eagle.py").read_text() == "class Eagle: ...\n"
        text = result.plan.explain()
        assert "file modeling_eagle.py  17 bytes, " in text and ", code\n" in text
        assert "code files: 1 (loaders run them" in text and text.count(", code") == 1
        doc = result.plan.to_dict()
        assert [f["name"] for f in doc["files"] if f.get("code")] == ["modeling_eagle.py"]
        assert weightmap.Plan.from_json(result.plan.to_json()) == result.plan


def test_allowed_code_files_are_written_and_listed(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    mapping = _files_mapping('add "configuration_x.py" = "X = 1\\n"')
    result = weightmap.remap(
        src, tmp_path / "out", mapping=mapping, allow_code=True, progress=False
    )
    assert (tmp_path / "out" / "configuration_x.py").read_text() == "X = 1\n"
    assert "code files: 2 (" in result.plan.explain()
    assert "configuration_x.py, modeling_eagle.py" in result.plan.explain()
    # iter_tensors makes the plan remap makes: refused alike, allowed alike.
    with pytest.raises(MappingError, match="is a code file that loaders run"):
        weightmap.iter_tensors(src, mapping=mapping)
    tensors = weightmap.iter_tensors(src, mapping=mapping, allow_code=True)
    assert next(iter(tensors))[0]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightmap", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_refuses_code_files_unless_allowed(tmp_path: Path, example: Path) -> None:
    src = _folder(tmp_path, example)
    rules = tmp_path / "m.wm"
    rules.write_text(_files_mapping('add "modeling_x.py" = "import os\\n"'))
    out = tmp_path / "out"
    r = _cli("convert", str(src), str(out), "--mapping", str(rules), "--no-progress")
    assert r.returncode != 0 and not out.exists()
    assert f"{rules}:4:5: files: side file name 'modeling_x.py' (added) is a code file" in r.stderr
    assert "--allow-code-files" in r.stderr and "Traceback" not in r.stderr
    r = _cli("plan", str(src), "--mapping", str(rules), "--allow-code-files")
    assert r.returncode == 0, r.stderr
    assert "code files: 2 (" in r.stdout and "file modeling_x.py  10 bytes, added" in r.stdout
    r = _cli("check", str(rules), str(src))
    assert r.returncode != 0 and "is a code file" in r.stderr
    r = _cli("convert", str(src), str(out), "--mapping", str(rules), "--allow-code-files")
    assert r.returncode == 0, r.stderr
    # The summary names them, where the plan itself is not shown.
    assert "side file(s), 2 of them code (modeling_eagle.py, modeling_x.py)" in r.stdout
    assert (out / "modeling_x.py").read_text() == "import os\n"


# -- no executable bit ---------------------------------------------------------------------------


def test_nothing_written_is_executable(tmp_path: Path, example: Path) -> None:
    """An executable input file comes out without its exec bits, carried or renamed, and so
    does everything else the output holds; read and write bits are kept."""
    src = _folder(tmp_path, example)
    (src / "tok" / "vocab.json").chmod(0o750)
    (src / "secret.txt").write_text("s")
    (src / "secret.txt").chmod(0o700)
    mapping = _files_mapping('rename "run.sh" -> "run.txt"', 'add "NOTICE" = "x"')
    weightmap.remap(src, tmp_path / "out", mapping=mapping, progress=False)
    out = tmp_path / "out"
    modes = {
        p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in out.rglob("*")
        if p.is_file()
    }
    assert "run.txt" in modes and "modeling_eagle.py" in modes
    assert {n: m for n, m in modes.items() if m & 0o111} == {}
    assert modes["run.txt"] == 0o644 and modes["secret.txt"] == 0o600
    assert modes["tok/vocab.json"] == 0o640


# -- the work budget: once per mapping, files blocks included -----------------------------------


def _compile_files(example: Path, stmts: list[str], before: str = "") -> weightmap.Plan:
    return weightmap.compile(example, mapping=_files_mapping(*stmts, before=before))


def test_files_statements_share_one_budget(example: Path) -> None:
    """Each `add` used to get a budget of its own: N statements, N times the work (a 2 KB
    mapping made 576 MB). Each of these three builds well under the limit; together they pass
    it, and the error is at the statement that does."""
    stmts = [f'add "f{i}.json" = [0] * 200000' for i in range(3)]
    with pytest.raises(MappingError, match=r"<string>:5:\d+: expression builds more than"):
        _compile_files(example, stmts)
    # One of them alone is fine.
    plan = _compile_files(example, stmts[:1])
    assert [f.name for f in plan.files if f.source is None] == ["f0.json"]


def test_an_added_value_counts_as_built(example: Path) -> None:
    """`add "f" = big` builds nothing (a param's value is built once, when the mapping loads)
    but writes it: repeated, it is the same value written N times, all counted."""
    stmts = [f'add "c{i}.json" = big' for i in range(12)]
    before = "param big = [0] * 100000\n"
    with pytest.raises(MappingError, match=r"<string>:1[45]:\d+: expression builds more than"):
        _compile_files(example, stmts, before)
    assert len(_compile_files(example, stmts[:8], before).files) == 8


def test_config_and_files_blocks_share_the_budget(example: Path) -> None:
    before = "config { a = [0] * 300000 }\n"
    with pytest.raises(MappingError, match=r"<string>:5:\d+: expression builds more than"):
        _compile_files(example, ['add "f.json" = [0] * 300000'], before)


def test_renames_share_the_budget(example: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(example, src)
    for i in range(3):
        (src / f"n{i}.txt").write_text("x")
    # The add spends 999,991 (the list built, then the file written); three names of five
    # characters each pass the rest.
    stmts = ['add "big.json" = [0] * 333330', 'rename "n{i}.txt" -> "m{i}-{i}{i}{i}{i}.txt"']
    with pytest.raises(MappingError, match=r"<string>:5:\d+: expression builds more than"):
        _compile_files(src, stmts)


# -- the parser cache: environment validated, entries checked against the text ------------------


@pytest.fixture
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A home folder of its own, the current directory elsewhere, the cache on."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("WEIGHTMAP_PARSER_CACHE", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    grammar.parser.cache_clear()
    yield work
    grammar.parser.cache_clear()


_TEXT = 'weightmap 1\n# relative cache\nrename "a.{x}" -> "b.{x}"\n'


def test_a_relative_xdg_cache_home_is_ignored(
    cache_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XDG_CACHE_HOME=.cache in a downloaded repository's folder: the pickle shipped there, of
    the user's own and private as the checks want, is never loaded (it would run code)."""
    monkeypatch.setenv("XDG_CACHE_HOME", "cache")
    expected = language_cache.program_file(_TEXT, "m.wm")
    assert expected is not None and os.path.isabs(expected)
    assert expected.startswith(str(cache_env.parent / "home" / ".cache" / "weightmap"))
    planted = cache_env / "cache" / "weightmap"
    planted.mkdir(parents=True, mode=0o700)
    ran = cache_env / "payload-ran"
    payload = pickle.dumps(_Payload(str(ran)))
    (planted / os.path.basename(expected)).write_bytes(payload)
    (planted / f"parser-{language_cache.versions()}.pickle").write_bytes(payload)
    program = parse_mod.parse_program(_TEXT, "m.wm")
    assert program.file == "m.wm"
    assert not ran.exists()
    # Nothing was written there either: the cache went to the home folder's.
    assert sorted(p.name for p in planted.iterdir()) == sorted(
        [os.path.basename(expected), f"parser-{language_cache.versions()}.pickle"]
    )
    assert Path(expected).is_file()


def test_a_relative_home_turns_the_cache_off(
    cache_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", "home")
    assert language_cache.folder() is None
    parse_mod.parse_program(_TEXT, "m.wm")
    assert list(cache_env.iterdir()) == []


class _Payload:
    """A pickle that makes a folder when loaded: proof that it was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


def test_a_cache_entry_of_another_text_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file holds the program of text A, under the name of text B (same label): B is
    parsed, not A's program returned."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WEIGHTMAP_PARSER_CACHE", raising=False)
    a = 'weightmap 1\n# a\nrename "a.{x}" -> "b.{x}"\n'
    b = 'weightmap 1\n# b\nrename "a.{x}" -> "c.{x}"\n'
    parse_mod.parse_program(a, "m.wm")
    file_a, file_b = (language_cache.program_file(t, "m.wm") for t in (a, b))
    assert file_a is not None and file_b is not None and Path(file_a).is_file()
    shutil.copyfile(file_a, file_b)
    os.chmod(file_b, 0o600)
    program = parse_mod.parse_program(b, "m.wm")
    rule = program.stmts[0]
    assert isinstance(rule, A.Rule)
    assert rule.outputs[0].text == "c.{x}"
    # B's entry is written again, for B; A's own entry is still used for A (not rewritten).
    assert pickle.loads(Path(file_b).read_bytes())[0] == language_cache.program_key(b, "m.wm")
    written = os.stat(file_a).st_mtime_ns
    again = parse_mod.parse_program(a, "m.wm").stmts[0]
    assert isinstance(again, A.Rule) and again.outputs[0].text == "b.{x}"
    assert os.stat(file_a).st_mtime_ns == written
