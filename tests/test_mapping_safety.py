"""A mapping is data from a stranger (docs/safety.md, "What a mapping may write"): whatever it
says, the output folder is safe to enter and open, the work it causes is bounded once per
mapping, and the parser cache it goes through trusts nothing from the environment or the cache
folder that it has not checked."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import weightmap
import weightmap.language.parse as parse_mod
from weightmap.errors import MappingError
from weightmap.language import ast as A
from weightmap.language import cache as language_cache
from weightmap.language import grammar

# -- the work budget: once per mapping, files blocks included -----------------------------------


def _compile_files(example: Path, stmts: list[str], before: str = "") -> weightmap.Plan:
    body = "\n".join(f"    {s}" for s in stmts)
    return weightmap.compile(
        example, mapping=f"weightmap 1\nunmatched keep\n{before}files {{\n{body}\n}}\n"
    )


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
    # And the entry of A itself is still used for A.
    assert parse_mod.parse_program(a, "m.wm") == parse_mod.parse_program(a, "m.wm")
