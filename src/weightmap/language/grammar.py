"""The grammar (``grammars/weightmap.lark``) and its LALR parser, built once per process and
kept between processes in the per-user cache (``cache.py``).

lark is confined to this module, ``hints.py`` and ``syntax.py``; its exceptions never leave them.
"""

from __future__ import annotations

import contextlib
import copyreg
import hashlib
import importlib
import os
import types
from functools import lru_cache
from typing import Any

from lark import Lark
from lark.parsers import lalr_analysis

from weightmap.fs.gcpause import gc_paused
from weightmap.language import cache as _cache
from weightmap.language.resources import read_text

__all__ = ["cache_file", "parser"]


def cache_file(grammar: str) -> str | None:
    """Where to keep the built parser between processes, or None to build it every time.

    Building the LALR tables takes ~0.1 s; loading the built parser takes ~0.01 s. The name
    carries the Python and lark versions and a hash of the grammar (see ``cache.py`` for where
    and how the cache is kept).
    """
    folder = _cache.folder()
    if folder is None:
        return None
    digest = hashlib.sha256(grammar.encode()).hexdigest()[:16]
    name = f"parser-{_cache.versions()}-{digest}-{_CACHE_FORM}.pickle"
    return os.path.join(folder, name)


# What _compact does to the parser before it is pickled: a new form gets a new file, rather
# than loading an older one that is slower to unpickle.
_CACHE_FORM = "c2"


# The built parser is pickled whole: lark's own cache stores a serialized form that takes
# ~30 ms to turn back into objects on every start, five times what unpickling them takes.
# Two kinds of object need telling how: modules (lark keeps a reference to `re`), by name;
# and the parse table's Shift/Reduce markers, which lark tests by identity, as the very
# objects of lark's module rather than copies.
_REDUCERS: dict[Any, Any] = {
    **copyreg.dispatch_table,
    types.ModuleType: lambda m: (importlib.import_module, (m.__name__,)),
    lalr_analysis.Action: lambda a: (getattr, (lalr_analysis, a.name)),
}


def _compact(built: Lark) -> None:
    """Make ``built`` quicker to unpickle, without changing how it parses.

    The LALR table's ~18,000 entries hold ~1,400 distinct actions: each equal ``(action,
    argument)`` pair becomes one shared tuple, which pickle then writes once and refers to.
    ``grammar`` (the grammar file's own parse trees, some 2,000 objects) is only read while
    lark builds the parser.
    """
    states = built.parser.parser._parse_table.states
    shared: dict[Any, Any] = {}
    for row in states.values():
        for token, action in row.items():
            row[token] = shared.setdefault(action, action)
    with contextlib.suppress(AttributeError):
        del built.grammar


def _load(cache: str) -> Lark | None:
    """The parser pickled in ``cache``, or None when there is none or it is not one (then it
    is removed, to be written again)."""
    loaded = _cache.load(cache)
    if loaded is None or isinstance(loaded, Lark):
        return loaded
    with contextlib.suppress(OSError):
        os.unlink(cache)
    return None


# How lark builds the parser from the grammar.
_OPTIONS: dict[str, Any] = {
    "parser": "lalr",
    "propagate_positions": True,
    "start": ["start", "expr"],
}


@lru_cache(maxsize=1)
def parser() -> Lark:
    grammar = read_text("grammars", "weightmap.lark")
    cache = cache_file(grammar)
    if cache is not None:
        # Unpickling the tables allocates many objects; with torch imported, the collector
        # walking torch's objects meanwhile would cost several times the load itself.
        with gc_paused():
            loaded = _load(cache)
        if loaded is not None:
            return loaded
    built = Lark(grammar, **_OPTIONS)
    _compact(built)  # (built or loaded, the parser is the same object graph)
    if cache is not None:
        with contextlib.suppress(Exception):  # a cache that cannot be written is no error
            _cache.save(built, cache, _REDUCERS)
    return built
