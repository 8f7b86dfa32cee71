"""The built parser is cached per user, safely, and a broken cache never breaks parsing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import weightmap.language.parse as parse_mod
from weightmap.language import grammar


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
    assert cache.name.startswith("parser-lark")
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
