"""Which output names weightmap writes, and why it refuses the few it does.

A safetensors key is any JSON string. Loaders address tensors by name: PyTorch state dicts use
dotted module paths, Keras and Flax checkpoints use ``encoder/layers_0/kernel``, and weightmap
writes whatever the mapping says as long as a file can hold it and a reader can tell it apart.
Refused, each for a reason a user can act on:

- the empty name (nothing can load or address it);
- ``__metadata__`` (the header's reserved key: it would be read as metadata), as a whole name
  or as the name a family member's file holds (``out:0:__metadata__``, see outputs.py);
- control characters (``\\n``, ``\\x00``...): valid JSON, but no real checkpoint has them, they
  corrupt logs and listings, and they almost always mean a template went wrong;
- lone surrogates (not UTF-8: the header could not be written);
- names over 1024 characters (far past any real name; a runaway template would otherwise blow
  up the header).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from weightmap.format.text import is_utf8
from weightmap.language import ast as A
from weightmap.plan.parts import output_names
from weightmap.plan.plan import OutputTensor

__all__ = ["MAX_NAME_CHARS", "bad_name", "check_names"]

MAX_NAME_CHARS = 1024
# C0, DEL and C1 (U+0080-U+009F, which some terminals read as escape sequences).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Control characters or a lone surrogate (see is_utf8): what no output name may hold.
_UNWRITABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def bad_name(name: str) -> str | None:
    """Why ``name`` cannot be an output tensor's name, or None if it can."""
    if not name:
        return "is empty"
    if name == "__metadata__":
        return "is reserved by safetensors for the header's metadata"
    if _UNWRITABLE.search(name):  # one scan for the common, good name; then which it is
        if _CONTROL.search(name):
            return "contains control characters"
        if not is_utf8(name):
            return "contains a lone surrogate, which is not UTF-8"
    if len(name) > MAX_NAME_CHARS:
        return f"is longer than {MAX_NAME_CHARS} characters"
    return None


def check_names(outputs: Sequence[OutputTensor], report: Callable[[A.Loc, str], None]) -> None:
    """Report every output whose name cannot be written (collisions are caught as they happen,
    see route.py)."""
    names = output_names(outputs)
    # All the names at once, at C speed, for the common case where every one is good (a
    # checkpoint may hold 100,000): a joined string holds an unwritable character where one
    # of the names does. An ASCII string is printable exactly where it has no control
    # character, and that test is several times faster than the regex's scan.
    joined = "".join(names)
    if (
        names
        and min(map(len, names)) > 0
        and max(map(len, names)) <= MAX_NAME_CHARS
        and "__metadata__" not in names
        and (joined.isprintable() if joined.isascii() else not _UNWRITABLE.search(joined))
    ):
        return
    for o in outputs:
        why = bad_name(o.name)
        if why:
            report(o.origin, f"output name {o.name[:80]!r} {why}")
