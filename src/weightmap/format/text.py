"""Text and JSON rules that every stage shares, written once.

Everything weightmap writes (headers, indexes, config.json, plans) is strict UTF-8 JSON, so
every name and value that may end up there is checked here: text that cannot be encoded as UTF-8
(a lone surrogate escape decodes to such a ``str``), JSON nested deeper than later stages can
walk, NaN and Infinity (which Python's json reads and writes but JSON does not have), and values
that are not JSON at all.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any

from weightmap.errors import CheckpointError
from weightmap.fs.safeopen import kind, read_bounded, regular

__all__ = [
    "MAX_INT_BITS",
    "MAX_JSON_DEPTH",
    "MAX_JSON_FILE",
    "MAX_JSON_VALUES",
    "JsonRefused",
    "field_path",
    "is_utf8",
    "json_depth",
    "json_problem",
    "nesting_exceeds",
    "one_line",
    "read_json_file",
    "redacted",
    "same_json",
    "strict_json",
]

# Integers in mapping values (params, config edits) stay within this many bits: far beyond any
# real config value, and small enough that arithmetic on them is instant.
MAX_INT_BITS = 256
# Real configs nest a few levels; json accepts nesting up to the recursion limit, deeper than
# later stages (copying, compiling, printing) can walk.
MAX_JSON_DEPTH = 64
# Index and config files are small; a huge one is hostile, and json would hold it all.
MAX_JSON_FILE = 256 * 1024 * 1024
# Values (numbers, strings, list items, object entries) in one JSON value weightmap writes:
# real configs hold a few hundred. Counted as written, so a list repeated by reference counts
# every time it appears.
MAX_JSON_VALUES = 1_000_000

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


# Control characters but tab and newline: C0, DEL and C1 (which some terminals read as CSI).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    r"""``text`` with every control character but tab and newline written as an escape.

    Names and values in messages come from checkpoints and configs made by strangers, and an
    escape sequence printed raw can retitle the terminal, rewrite what it shows or (OSC 52)
    set the clipboard.

    >>> printable("a\x1b]0;pwned\x07b")
    'a\\x1b]0;pwned\\x07b'
    """
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# What would break a one-line listing: line and paragraph breaks (U+0085, U+2028, U+2029),
# tab, and the bidirectional overrides and isolates that reorder what follows them.
_BREAKS = re.compile("[\t\n\r\x85\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def one_line(text: str) -> str:
    r"""``text`` as ``printable`` writes it, and with line breaks, tabs and bidirectional
        controls as escapes too: a name in a table or a listing stays one row, as it reads.

        >>> one_line("a
    b‮c")
        'a\nb\u202ec'
    """
    return _BREAKS.sub(lambda m: m.group().encode("unicode_escape").decode(), printable(text))


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


# The types of JSON's scalars as json.loads gives them.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def json_depth(value: object, limit: int) -> int:
    """Nesting depth of a decoded JSON value, stopping early once past ``limit``.

    A scalar counts 1 and a container one more than its deepest item (an empty one 1):
    ``json_depth({"a": [1]}, 64) == 3``. Walked level by level over the containers only, as
    an index holds 100,000 strings and few containers.
    """
    depth, n = 1, 1
    level: list[Any] = [value] if isinstance(value, dict | list) else []
    while level and depth <= limit:
        below: list[Any] = []
        for item in level:
            items = item.values() if isinstance(item, dict) else item
            if items:
                depth = n + 1
                # The items' types looked through at C speed first: most hold no container.
                if not _SCALARS.issuperset(map(type, items)):
                    below.extend(v for v in items if isinstance(v, dict | list))
        level, n = below, n + 1
    return depth


# A JSON string (escapes included), and everything that is not a bracket.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def nesting_exceeds(text: str, limit: int) -> bool:
    """True when the brackets of JSON ``text`` nest deeper than ``limit``.

    A scan of the text, for before ``json.loads``, whose decoder is recursive: brackets nested
    a few thousand deep exhaust its stack (``RecursionError``). The strings are cut out and the
    depth is the running sum over the brackets left, all at C speed (a 100 MB header is read
    in well under a second); a string left open (no valid document has one) takes the
    character walk instead.
    """
    outside = _JSON_STRING.sub("", text)
    if '"' in outside:
        return _walk_exceeds(text, limit)
    brackets = _NOT_BRACKET.sub("", outside)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def _walk_exceeds(text: str, limit: int) -> bool:
    """``nesting_exceeds`` character by character, for text with an unterminated string."""
    depth = 0
    in_string = False
    escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _shown(path: tuple[str | int, ...]) -> str:
    return ".".join(str(k) for k in path)[:200]


def _where(what: str, path: tuple[str | int, ...]) -> str:
    """``holds NaN at `a.b``` for a value inside another, ``is NaN`` for the value itself."""
    return f"holds {what} at `{_shown(path)}`" if path else f"is {what}"


def _non_finite(v: float) -> str:
    return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")


def json_problem(
    value: Any, max_depth: int = MAX_JSON_DEPTH, max_values: int = MAX_JSON_VALUES
) -> str | None:
    """Why ``value`` cannot be written as strict, bounded JSON, or None if it can.

    Refused: objects that are not JSON (bytes, sets, arbitrary classes), keys that are not
    strings, NaN and infinities, ints over :data:`MAX_INT_BITS` bits (``repr`` of a 5000-digit
    int raises), lone surrogates, nesting deeper than ``max_depth``, and more than
    ``max_values`` values as written (a list that appears twice counts twice). Iterative, so
    hostile depth cannot exhaust the stack; the walk stops at the first problem.

    >>> json_problem({"rope": {"factor": float("nan")}})
    'holds NaN at `rope.factor`, which is not a finite number (JSON has no NaN or Infinity)'
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    count = 0
    while stack:
        v, path = stack.pop()
        count += 1
        if count > max_values:
            return f"holds more than {max_values:,} values"
        if len(path) >= max_depth:
            return f"nests deeper than {max_depth} levels"
        if v is None or isinstance(v, bool):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                return (
                    f"{_where(_non_finite(v), path)}, which is not a finite number (JSON has "
                    "no NaN or Infinity)"
                )
        elif isinstance(v, int):
            if v.bit_length() > MAX_INT_BITS:
                return _where(f"an integer over {MAX_INT_BITS} bits", path)
        elif isinstance(v, str):
            if not is_utf8(v):
                return f"{_where('a lone surrogate', path)}, which is not UTF-8"
        elif isinstance(v, list):
            stack.extend((x, (*path, i)) for i, x in enumerate(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    return f"object key {k!r} is not a string"
                if not is_utf8(k):
                    return f"{_where('a key with a lone surrogate', path)}, which is not UTF-8"
                stack.append((x, (*path, k)))
        else:
            return f"{_where(f'a {type(v).__name__}', path)}, which is not a JSON value"
    return None


class JsonRefused(ValueError):
    """Text that Python's json would read but that is not strict, bounded JSON."""


def strict_json(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode ``text`` as strict JSON.

    Raises :class:`JsonRefused` for what Python's json accepts but JSON does not have (``NaN``,
    ``Infinity``, numbers beyond a 64-bit float such as ``1e400``), for nesting deeper than
    ``max_depth`` and for anything :func:`json_problem` refuses; ``ValueError`` for text that
    is not JSON at all.

    >>> strict_json("[1, 2.5]")
    [1, 2.5]
    """

    def constant(name: str) -> Any:
        raise JsonRefused(f"{name} is not a JSON number (JSON has no NaN or Infinity)")

    def number(literal: str) -> float:
        result = float(literal)
        if not math.isfinite(result):
            raise JsonRefused(
                f"{literal[:40]} is not a JSON number weightmap can keep: it is beyond a 64-bit "
                "float"
            )
        return result

    if nesting_exceeds(text, max_depth):
        raise JsonRefused(f"the value nests deeper than {max_depth} levels")
    value = json.loads(text, parse_constant=constant, parse_float=number)
    why = json_problem(value, max_depth)
    if why is not None:
        raise JsonRefused(f"the value {why}")
    return value


# Credentials a URL may carry (scheme://user:password@host) and Hugging Face access tokens.
# (Up to the last @ before the path: a password may hold a raw @, as URL parsers split there.)
_URL_USERINFO = re.compile(r"(?<=//)[^/\s]*@")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{8,}")
_MIN_SECRET = 6


def redacted(text: str, limit: int = 300, secrets: Iterable[str] = ()) -> str:
    """Another library's message made fit for ours: its first line (our errors are one line),
    credentials in URLs, Hugging Face tokens and each of ``secrets`` (the token in use, in
    whatever form it has) replaced by ``***``, at most ``limit`` characters. Such messages
    quote request URLs, which may carry a user and password (an ``HF_ENDPOINT`` or proxy set
    so), and end up in logs."""
    lines = text.strip().splitlines()
    line = lines[0] if lines else ""
    # Longest first, so that a secret inside another is not left half shown; short values
    # (an empty variable, a one-letter test value) would blank out ordinary words.
    for secret in sorted({s for s in secrets if len(s) >= _MIN_SECRET}, key=len, reverse=True):
        line = line.replace(secret, "***")
    line = _HF_TOKEN.sub("hf_***", _URL_USERINFO.sub("***@", line))
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_json_file(
    path: Path,
    what: str,
    *,
    max_size: int = MAX_JSON_FILE,
    fd: int | None = None,
    unique_keys: bool = False,
) -> Any:
    """Read a small JSON file strictly, or raise a :class:`CheckpointError` naming ``what``.

    Checked: a regular file (never a FIFO or device, which are refused without waiting on
    them), bounded size, UTF-8, valid JSON, bounded depth, and nothing that could not be
    written back as UTF-8. ``fd``, when given, is the file already opened and checked by the
    caller (``inputs/opening.py``): it is read through that descriptor alone, and left open.
    Without it, ``path`` is opened once here and a link at its last part is refused.
    ``unique_keys``: an object that holds a key twice is refused too (JSON readers disagree on
    which value counts; Python's keeps the last).
    """
    if fd is not None:
        return _read_json_fd(fd, path, what, max_size, unique_keys)
    try:
        own = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise CheckpointError(
            f"{what} is a symbolic link, which is not followed here; put the file there",
            path=path,
            rule="link-escape",
        ) from None
    try:
        return _read_json_fd(own, path, what, max_size, unique_keys)
    finally:
        os.close(own)


def _read_json_fd(fd: int, path: Path, what: str, max_size: int, unique_keys: bool = False) -> Any:
    st = regular(fd)
    if st is None:
        shown = kind(os.fstat(fd).st_mode)
        raise CheckpointError(
            f"{what} is a {shown}, not a regular file; remove it or put the file there",
            path=path,
            rule="not-a-file",
        )
    if st.st_size > max_size:
        raise CheckpointError(
            f"{what} is {st.st_size} bytes, over the {max_size}-byte limit",
            path=path,
            rule="json-too-large",
        )
    data = read_bounded(fd, st.st_size)
    if len(data) != st.st_size:
        raise CheckpointError(
            f"{what} changed while it was read; try again", path=path, rule="changed"
        )
    return _parse_json_bytes(data, path, what, unique_keys)


def _parse_json_bytes(data: bytes, path: Path, what: str, unique_keys: bool = False) -> Any:
    try:
        text = data.decode("utf-8")
        value = json.loads(text)
    except UnicodeDecodeError:
        raise CheckpointError(f"{what} is not UTF-8", path=path, rule="json") from None
    except (ValueError, RecursionError) as exc:
        if "integer string conversion" in str(exc):
            # Valid JSON that Python will not turn into an int (its advice names a Python
            # call, which is no help to whoever runs the command).
            raise CheckpointError(
                f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits,"
                " far past any real value: fix the file",
                path=path,
                rule="json",
            ) from None
        raise CheckpointError(f"{what} is not valid JSON ({exc})", path=path, rule="json") from None
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise CheckpointError(
            f"{what} nests deeper than {MAX_JSON_DEPTH} levels", path=path, rule="json"
        )
    # A lone surrogate can only come from a \u escape (the UTF-8 decoder refuses encoded
    # ones), so the text without one needs no second look.
    if "\\u" in text and not is_utf8(json.dumps(value, ensure_ascii=False)):
        raise CheckpointError(
            f"{what} holds a lone surrogate escape, which is not UTF-8", path=path, rule="json"
        )
    if unique_keys and _keys(value) != text.count(":"):
        # (Every key is followed by a colon outside any string, so there are never fewer
        # colons than keys: counted first, the common case costs one pass over the text;
        # where there are more, colons inside strings, the text is decoded again to find a
        # key named twice, if there is one.)
        twice = _key_twice(text)
        if twice is not None:
            raise CheckpointError(
                f"{what} holds the key {twice[:200]!r} twice in one object: JSON readers "
                "disagree on which value counts; remove one",
                path=path,
                rule="json-duplicate-key",
            )
    return value


def _keys(value: Any) -> int:
    """The keys of every object in a decoded JSON value, together."""
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            count += len(item)
            # (The types seen first, by C calls: an index's weight map holds 100,000 strings.)
            if not _CONTAINERS.isdisjoint(set(map(type, item.values()))):
                stack += [v for v in item.values() if type(v) in _CONTAINERS]
        elif type(item) is list:
            stack += [v for v in item if type(v) in _CONTAINERS]
    return count


_CONTAINERS = frozenset({dict, list})


class _Twice(Exception):
    pass


def unique_object(
    pairs: list[tuple[str, Any]], twice: Callable[[str], Exception]
) -> dict[str, Any]:
    """The object of JSON ``pairs`` (an ``object_pairs_hook``), raising ``twice(key)`` for a
    key that comes again. The dict is made at C speed; only where it is shorter than the pairs
    are they looked through (a header's hook runs once per tensor)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise twice(key)
            seen.add(key)
    return result


def _key_twice(text: str) -> str | None:
    """A key that some object of the JSON ``text`` holds twice, if any."""
    try:
        json.loads(text, object_pairs_hook=partial(unique_object, twice=_Twice))
    except _Twice as exc:
        return str(exc.args[0])
    return None


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def same_json(a: Any, b: Any) -> bool:
    """Whether two values are the same JSON: ``true`` is not ``1`` and ``10000`` is not
    ``10000.0`` (Python's ``==`` says they are), a NaN equals a NaN, key order aside."""
    try:
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    except (TypeError, ValueError):  # (keys of mixed types: not from JSON)
        return bool(a == b)


def field_path(prefix: str, key: object) -> str:
    """A config field's path for a message: ``rope_scaling.factor``; a key that is no plain
    name is quoted (``auto_map[""]``, ``a["b.c"]``), so that no two fields read alike."""
    text = str(key)
    if _PLAIN_KEY.fullmatch(text):
        return f"{prefix}.{text}" if prefix else text
    return f"{prefix}[{json.dumps(text, ensure_ascii=False)}]"
