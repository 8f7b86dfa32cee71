"""The built parser and parsed programs are cached per user, safely, and a broken cache never
breaks parsing."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from lark import Lark

import weightmap.language.parse as parse_mod
from weightmap.errors import MappingSyntaxError
from weightmap.language import cache as language_cache
from weightmap.language import grammar
from weightmap.language.resources import read_text

from conftest import REPO


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WEIGHTMAP_PARSER_CACHE", raising=False)
    real = grammar.parser  # (a test may replace it; the monkeypatch is undone after this)
    real.cache_clear()
    yield tmp_path
    real.cache_clear()


_texts = itertools.count()


def _parses() -> None:
    """Parse a program not parsed before, so that the parser itself is needed."""
    grammar.parser.cache_clear()
    parse_mod.parse_program(f'weightmap 1\n# {next(_texts)}\nrename "a.{{x}}" -> "b.{{x}}"\n')


def test_cache_written_then_used(cache_home: Path) -> None:
    _parses()
    (cache,) = (cache_home / "weightmap").glob("parser-*")
    assert cache.name.startswith("parser-py") and cache.suffix == ".pickle"
    assert (cache_home / "weightmap").stat().st_mode & 0o777 == 0o700
    before = cache.stat().st_mtime_ns
    _parses()
    assert cache.stat().st_mtime_ns == before  # loaded, not rebuilt


def test_broken_cache_is_replaced(cache_home: Path) -> None:
    _parses()
    (cache,) = (cache_home / "weightmap").glob("parser-*")
    cache.write_bytes(b"not a parser")
    _parses()
    assert grammar._load(str(cache)) is not None  # built again and written
    _parses()


def test_shared_folder_is_not_trusted(cache_home: Path) -> None:
    folder = cache_home / "weightmap"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)  # others could plant a pickle here
    assert grammar.cache_file("grammar") is None
    _parses()
    assert list(folder.iterdir()) == []


def test_cache_file_others_could_write_is_not_loaded(cache_home: Path) -> None:
    """A pickle runs code when loaded: a cache file that another user owns or could have
    written is left alone, even in a folder that passes the folder's checks."""
    folder = cache_home / "weightmap"
    folder.mkdir(mode=0o700)
    planted = folder / "program-planted.pickle"
    planted.write_bytes(pickle.dumps(("would", "load")))
    assert language_cache.load(str(planted)) == ("would", "load")  # ours, 0644: trusted
    os.chmod(planted, 0o666)
    assert language_cache.load(str(planted)) is None
    assert planted.exists()  # refused, not taken for a broken file of ours and removed
    os.chmod(planted, 0o644)
    if os.getuid() == 0:  # only root can give a file away
        os.chown(planted, 12345, 12345)
        assert language_cache.load(str(planted)) is None
        os.chown(planted, 0, 0)
    # Links to a file of ours elsewhere (a downloaded pickle, say): neither kind is followed.
    elsewhere = cache_home / "elsewhere.bin"
    planted.rename(elsewhere)
    assert language_cache.load(str(elsewhere)) == ("would", "load")
    planted.symlink_to(elsewhere)
    assert language_cache.load(str(planted)) is None
    planted.unlink()
    os.link(elsewhere, planted)
    assert language_cache.load(str(planted)) is None
    planted.unlink()
    os.mkfifo(planted)  # not a file: refused without waiting for a writer
    assert language_cache.load(str(planted)) is None
    # A refused file is replaced by the next save, with a private file of the cache's own.
    language_cache.save(("fresh",), str(planted))
    assert language_cache.load(str(planted)) == ("fresh",)
    assert planted.stat().st_mode & 0o777 == 0o600


def test_cache_folder_that_is_a_link_is_not_used(cache_home: Path) -> None:
    """A link in the cache folder's place is not followed: caches would be written, and old
    programs pruned, wherever it points."""
    target = cache_home / "somewhere"
    target.mkdir(mode=0o700)
    (target / "program-0.pickle").write_bytes(b"a file of the user's")
    (cache_home / "weightmap").symlink_to(target)
    assert language_cache.folder() is None
    assert grammar.cache_file("grammar") is None
    _parses()
    assert [p.name for p in target.iterdir()] == ["program-0.pickle"]


def test_cache_can_be_turned_off(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTMAP_PARSER_CACHE", "0")
    _parses()
    assert not (cache_home / "weightmap").exists()


def test_cached_parser_parses_as_built(cache_home: Path) -> None:
    """The parser loaded from the cache, compacted before it was pickled, gives the same trees
    as lark's own parser built from the grammar, for every shipped preset and every golden
    program (lark tells its parse actions apart by identity: copies of them would fail on the
    first reduce)."""
    texts = [p.read_text() for p in sorted((REPO / "mappings").glob("*.wm"))]
    texts += [p.read_text() for p in sorted((REPO / "tests" / "data" / "lang").rglob("*.wm"))]
    assert len(texts) > 20
    grammar.parser.cache_clear()
    grammar.parser()  # builds and writes the cache
    (cache,) = (cache_home / "weightmap").glob("parser-*")
    cached = grammar._load(str(cache))
    assert cached is not None
    # lark's own parser, as built from the grammar: not the compacted one parser() returns.
    built = Lark(read_text("grammars", "weightmap.lark"), **grammar._OPTIONS)
    assert hasattr(built, "grammar") and not hasattr(cached, "grammar")
    for text in texts:
        try:
            want = built.parse(text, start="start")
        except Exception as exc:  # an invalid program: the cached parser fails the same way
            with pytest.raises(type(exc)):
                cached.parse(text, start="start")
            continue
        assert cached.parse(text, start="start") == want
    assert cached.parse("a * (2 + b)", start="expr") == built.parse("a * (2 + b)", start="expr")


# -- parsed programs ------------------------------------------------------------------------

_PROGRAM = 'weightmap 1\nrename "model.{rest*}" -> "{rest}" where shape[0] > 1\nunmatched drop\n'


def _no_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, a program that is parsed rather than loaded fails the test."""

    def refused() -> None:
        raise AssertionError("parsed again: the cached program was not used")

    monkeypatch.setattr(grammar, "parser", refused)


def test_program_cache_written_then_used(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = parse_mod.parse_program(_PROGRAM, "m.wm")
    (kept,) = (cache_home / "weightmap").glob("program-*.pickle")
    _no_parser(monkeypatch)
    again = parse_mod.parse_program(_PROGRAM, "m.wm")
    assert again == first and again is not first
    assert again.stmts[0].loc.file == "m.wm"
    # The label is part of the program (its locations name it): another label is parsed.
    with pytest.raises(AssertionError, match="parsed again"):
        parse_mod.parse_program(_PROGRAM, "other.wm")
    assert list((cache_home / "weightmap").glob("program-*.pickle")) == [kept]


def test_program_cache_takes_only_the_program_it_names(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that does not load, or loads as something else (another label's program, any
    other object), is not used: the text is parsed and the file written again."""
    want = parse_mod.parse_program(_PROGRAM, "m.wm")
    (kept,) = (cache_home / "weightmap").glob("program-*.pickle")
    other = parse_mod.parse_program(_PROGRAM, "other.wm")
    for planted in (b"not a program", pickle.dumps(other), pickle.dumps({"stmts": []})):
        kept.write_bytes(planted)
        assert parse_mod.parse_program(_PROGRAM, "m.wm") == want
        # Kept with its text's key (see test_mapping_safety.py).
        assert pickle.loads(kept.read_bytes()) == (
            language_cache.program_key(_PROGRAM, "m.wm"),
            want,
        )


def test_program_cache_keeps_no_errors(cache_home: Path) -> None:
    bad = 'weightmap 1\nrename "a.{x}" -> \n'
    for _ in range(2):
        with pytest.raises(MappingSyntaxError, match="unexpected"):
            parse_mod.parse_program(bad, "bad.wm")
    assert list((cache_home / "weightmap").glob("program-*")) == []


def test_program_cache_is_keyed_by_the_code(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program parsed by other code (another grammar, parser or AST classes) is another
    entry: an upgrade never loads what the old code made."""
    here = language_cache.program_file(_PROGRAM, "m.wm")
    monkeypatch.setattr(language_cache, "_code_digest", lambda: "other code")
    there = language_cache.program_file(_PROGRAM, "m.wm")
    assert here is not None and there is not None and here != there


def test_program_cache_is_pruned(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(language_cache, "MAX_PROGRAMS", 8)
    texts = [f'weightmap 1\nrename "a{i}.{{x}}" -> "b.{{x}}"\n' for i in range(20)]
    for i, text in enumerate(texts):
        parse_mod.parse_program(text, "m.wm")
        # Written in order: the newest files sort last by time.
        path = language_cache.program_file(text, "m.wm")
        assert path is not None
        os.utime(path, ns=(i * 10**9, i * 10**9))
    left = sorted((cache_home / "weightmap").glob("program-*.pickle"))
    assert 6 <= len(left) <= 8
    newest = language_cache.program_file(texts[-1], "m.wm")
    assert newest is not None and Path(newest) in left
    oldest = language_cache.program_file(texts[0], "m.wm")
    assert oldest is not None and Path(oldest) not in left


def test_program_cache_turned_off_with_the_parser_cache(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTMAP_PARSER_CACHE", "0")
    assert language_cache.program_file(_PROGRAM, "m.wm") is None
    parse_mod.parse_program(_PROGRAM, "m.wm")
    assert not (cache_home / "weightmap").exists()


def test_program_key_follows_lark_without_importing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key of a parsed program carries lark's package file (which sets its version), read
    rather than imported: another lark is another key."""
    digest = language_cache._code_digest.__wrapped__  # (the lru_cache'd function itself)
    here = digest()
    source = language_cache._lark_source()
    assert source is not None and b"__version__" in source
    monkeypatch.setattr(language_cache, "_lark_source", lambda: b'__version__ = "0.0.1"')
    assert digest() != here


# What `import weightmap` and a rename with a mapping parsed before must not import: lark (and
# the parser it builds), the Ray executor, in-place rewrites, inversion, the Hub. They took
# more time to import than a rename of a 4 GB drafter takes on a copy-on-write filesystem.
_DEFERRED = (
    "lark",
    "weightmap.language.syntax",
    "weightmap.language.grammar",
    "weightmap.execute.cluster",
    "weightmap.execute.inplace",
    "weightmap.compiler.inverse",
    "weightmap.inputs.hub",
)

_PROBE = """
import json, sys
import weightmap
imported = [m for m in {deferred!r} if m in sys.modules]
weightmap.remap({src!r}, {out!r}, mapping={mapping!r}, progress=False)
print(json.dumps([imported, [m for m in {deferred!r} if m in sys.modules]]))
"""


def test_a_rename_imports_no_parser_nor_other_executors(
    cache_home: Path, example: Path, tmp_path: Path
) -> None:
    mapping = tmp_path / "m.wm"
    mapping.write_text(
        'weightmap 1\nrename "layers.{i:int}.{rest*}" -> "midlayer.{rest}"\nkeep "**"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    found = []
    for run in range(2):  # the first parses the mapping (and caches it); the second loads it
        code = _PROBE.format(
            deferred=_DEFERRED,
            src=str(example),
            out=str(tmp_path / f"out{run}"),
            mapping=str(mapping),
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        found.append(json.loads(done.stdout.splitlines()[-1]))
    assert found[0][0] == [] and "lark" in found[0][1]  # parsed: lark was needed
    assert found[1] == [[], []]  # loaded from the cache: nothing deferred was imported


def test_programs_are_not_cached_where_lark_cannot_be_read(
    cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lark inside a zip (say): a key without lark's version could load a program another
    lark parsed, so programs are parsed every time instead."""
    monkeypatch.setattr(language_cache, "_lark_source", lambda: None)
    language_cache._code_digest.cache_clear()
    try:
        assert language_cache.program_file(_PROGRAM, "m.wm") is None
        parse_mod.parse_program(_PROGRAM, "m.wm")
        assert list((cache_home / "weightmap").glob("program-*")) == []
    finally:
        language_cache._code_digest.cache_clear()
