"""The grammar (``grammars/weightmap.lark``) and its LALR parser, built once per process.

lark is confined to this module, ``hints.py`` and ``parse.py``; its exceptions never leave them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from functools import lru_cache
from typing import Any

import lark
from lark import Lark

from weightmap.language.resources import read_text

__all__ = ["cache_file", "parser"]


def cache_file(grammar: str) -> str | None:
    """Where to keep the built parser between processes, or None to build it every time.

    Building the LALR tables takes ~0.1 s, most of a small conversion; loading them takes
    ~0.01 s. The cache is a pickle, so it lives only in a folder that this user owns and
    nobody else can write (never a shared temporary folder), and its name carries the lark
    version and a hash of the grammar. ``WEIGHTMAP_PARSER_CACHE=0`` turns it off.
    """
    if os.environ.get("WEIGHTMAP_PARSER_CACHE", "1") == "0" or not hasattr(os, "getuid"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "weightmap")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder)
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None
    digest = hashlib.sha256(grammar.encode()).hexdigest()[:16]
    return os.path.join(folder, f"parser-lark{lark.__version__}-{digest}.cache")


@lru_cache(maxsize=1)
def parser() -> Lark:
    grammar = read_text("grammars", "weightmap.lark")
    cache = cache_file(grammar)
    options: dict[str, Any] = {
        "parser": "lalr",
        "propagate_positions": True,
        "start": ["start", "expr"],
    }
    if cache is not None:
        # Unpickling the tables allocates many objects; with torch imported, the collector
        # walking torch's objects meanwhile costs ~75 ms of an ~85 ms load.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return Lark(grammar, cache=cache, **options)
        except Exception:  # a broken cache must never stop a conversion
            with contextlib.suppress(OSError):
                os.unlink(cache)
        finally:
            if gc_was_enabled:
                gc.enable()
    return Lark(grammar, **options)
