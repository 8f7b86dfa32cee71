"""Mapping text -> :class:`~weightmap.language.ast.Program`, through the per-user cache.

A program parsed before, from the same text under the same label by the same code, is loaded
from the cache (``cache.py``), kept there with the hash of its text, which is checked; only a
text not seen before is parsed (``syntax.py``). lark, its parser and the tree builder are
imported then and only then: they take a fifth of a second to import, as long as a rename of a
4 GB drafter takes on a copy-on-write filesystem.
"""

from __future__ import annotations

import contextlib
import os

from weightmap.fs.gcpause import gc_paused
from weightmap.language import ast as A
from weightmap.language import cache as _cache

__all__ = ["parse_program"]


def parse_program(text: str, file: str = "<string>") -> A.Program:
    """Parse mapping source text into a :class:`Program`; MappingSyntaxError on any error.

    A program parsed before, from the same text under the same label by the same code, is
    loaded from the per-user cache (``cache.py``): parsing takes ~0.06 s for a preset of 130
    lines, loading it ~0.002 s. Only programs that parse are kept; an error is found anew.
    """
    where = _cache.program_file(text, file)
    key = _cache.program_key(text, file)
    if where is not None:
        with gc_paused():  # (many small objects, no cycles: see fs/gcpause.py)
            found = _cache.load(where)
        # Kept as (key, program): used only for the very text and label that produced it. A
        # file that holds anything else (another text's program, under this name) is not.
        if type(found) is tuple and len(found) == 2 and found[0] == key:
            program = found[1]
            if type(program) is A.Program and program.file == file:
                return program
    from weightmap.language.syntax import parse_text  # (lark: see the module docstring)

    program = parse_text(text, file)
    if where is not None:
        with contextlib.suppress(Exception):  # a cache that cannot be written is no error
            _cache.save((key, program), where)
            _cache.prune_programs(os.path.dirname(where))
    return program
