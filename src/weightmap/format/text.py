"""Text and JSON rules that every stage shares, written once.

Everything weightmap writes (headers, indexes, config.json, plans) is UTF-8 JSON, so every name
and value that may end up there is checked here: text that cannot be encoded as UTF-8 (a lone
surrogate escape decodes to such a ``str``), JSON nested deeper than later stages can walk, and
values that are not JSON at all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from weightmap.errors import CheckpointError

__all__ = [
    "MAX_INT_BITS",
    "MAX_JSON_DEPTH",
    "MAX_JSON_FILE",
    "is_utf8",
    "json_depth",
    "json_problem",
    "read_json_file",
]

# Integers in mapping values (params, config edits) stay within this many bits: far beyond any
# real config value, and small enough that arithmetic on them is instant.
MAX_INT_BITS = 256
# Real configs nest a few levels; json accepts nesting up to the recursion limit, deeper than
# later stages (copying, compiling, printing) can walk.
MAX_JSON_DEPTH = 64
# Index and config files are small; a huge one is hostile, and json would hold it all.
MAX_JSON_FILE = 256 * 1024 * 1024

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def human_size(n: int) -> str:
    """A byte count in decimal units, as the hub writes sizes.

    >>> human_size(999), human_size(4_325_000_000)
    ('999 B', '4.3 GB')
    """
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def is_utf8(text: str) -> bool:
    """True when ``text`` can be written as UTF-8 (no lone surrogate such as ``"\\ud800"``)."""
    return _LONE_SURROGATE.search(text) is None


def json_depth(value: object, limit: int) -> int:
    """Nesting depth of a decoded JSON value, stopping early once past ``limit``."""
    stack: list[tuple[object, int]] = [(value, 1)]
    deepest = 0
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``value`` cannot be written as strict, bounded JSON, or None if it can.

    Refused: objects that are not JSON (bytes, sets, arbitrary classes), keys that are not
    strings, ints over :data:`MAX_INT_BITS` bits (``repr`` of a 5000-digit int raises), lone
    surrogates, and nesting deeper than ``max_depth``. Iterative, so hostile depth cannot
    exhaust the stack.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            return f"nests deeper than {max_depth} levels"
        if v is None or isinstance(v, (bool, float)):
            continue
        if isinstance(v, int):
            if v.bit_length() > MAX_INT_BITS:
                return f"integer exceeds {MAX_INT_BITS} bits"
        elif isinstance(v, str):
            if not is_utf8(v):
                return "string holds a lone surrogate, which is not UTF-8"
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    return f"object key {k!r} is not a string"
                stack.append((k, depth + 1))
                stack.append((x, depth + 1))
        else:
            return f"{type(v).__name__} is not a JSON value"
    return None


def read_json_file(path: Path, what: str, *, max_size: int = MAX_JSON_FILE) -> Any:
    """Read a small JSON file strictly, or raise a :class:`CheckpointError` naming ``what``.

    Checked: bounded size, UTF-8, valid JSON, bounded depth, and nothing that could not be
    written back as UTF-8.
    """
    try:
        size = path.stat().st_size
        if size > max_size:
            raise CheckpointError(
                f"{what} is {size} bytes, over the {max_size}-byte limit",
                path=path,
                rule="json-too-large",
            )
        text = path.read_bytes().decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError:
        raise CheckpointError(f"{what} is not UTF-8", path=path, rule="json") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{what} is not valid JSON ({exc})", path=path, rule="json") from None
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise CheckpointError(
            f"{what} nests deeper than {MAX_JSON_DEPTH} levels", path=path, rule="json"
        )
    if not is_utf8(json.dumps(value, ensure_ascii=False)):
        raise CheckpointError(
            f"{what} holds a lone surrogate escape, which is not UTF-8", path=path, rule="json"
        )
    return value
