"""The built parser is cached per user, safely, and a broken cache never breaks parsing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from lark import Lark

import weightmap.language.parse as parse_mod
from weightmap.language import grammar
from weightmap.language.resources import read_text

from conftest import REPO


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WEIGHTMAP_PARSER_CACHE", raising=False)
    grammar.parser.cache_clear()
    yield tmp_path
    grammar.parser.cache_clear()


def _parses() -> None:
    grammar.parser.cache_clear()
    parse_mod.parse_program('weightmap 1\nrename "a.{x}" -> "b.{x}"\n')


def test_cache_written_then_used(cache_home: Path) -> None:
    _parses()
    (cache,) = (cache_home / "weightmap").iterdir()
    assert cache.name.startswith("parser-py") and cache.suffix == ".pickle"
    assert (cache_home / "weightmap").stat().st_mode & 0o777 == 0o700
    before = cache.stat().st_mtime_ns
    _parses()
    assert cache.stat().st_mtime_ns == before  # loaded, not rebuilt


def test_broken_cache_is_replaced(cache_home: Path) -> None:
    _parses()
    (cache,) = (cache_home / "weightmap").iterdir()
    cache.write_bytes(b"not a parser")
    _parses()
    _parses()


def test_shared_folder_is_not_trusted(cache_home: Path) -> None:
    folder = cache_home / "weightmap"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)  # others could plant a pickle here
    assert grammar.cache_file("grammar") is None
    _parses()
    assert list(folder.iterdir()) == []


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
    (cache,) = (cache_home / "weightmap").iterdir()
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
