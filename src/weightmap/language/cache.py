"""The rule language's per-user caches, kept between processes: the built parser (see
``grammar.py``), the parsed program of each mapping text (see ``parse.py``), and the rows
``weightmap presets`` lists (see ``cli.py``: making them imports the whole language).

Building the parser takes ~0.1 s, and parsing a mapping with it ~0.06 s for a preset of 130
lines (lark's tree building, and the lexer's regular expressions compiled in each new
process): most of a conversion that only renames. Loading either from a pickle takes a few
milliseconds. Pickles run code when loaded, so the caches live only in a folder that this user
owns and nobody else can write (never a shared temporary folder, never one named by a relative
``XDG_CACHE_HOME``); every file is written to a temporary name and renamed into place, and one
that does not load is removed. ``WEIGHTMAP_PARSER_CACHE=0`` turns them all off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import pickle
import stat
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from weightmap.language.resources import PRESET_SUFFIX, data_dir, preset_names, read_text

__all__ = [
    "folder",
    "listing_key",
    "load",
    "load_listing",
    "program_file",
    "program_key",
    "prune_programs",
    "save",
    "save_listing",
    "versions",
]

# Parsed programs kept; past this many, the oldest go. A program is a few KB, and a user's
# mappings are few; code that makes mapping texts by the thousand (tests) must not fill a disk.
MAX_PROGRAMS = 256
_PROGRAM_PREFIX = "program-"
# The rows `weightmap presets` lists, with the key they were made under (one file, replaced).
_LISTING = "presets-listing.pickle"


def folder() -> str | None:
    """The cache folder (created, mode 0700), or None when caching is off or the folder is
    not this user's alone."""
    if os.environ.get("WEIGHTMAP_PARSER_CACHE", "1") == "0" or not hasattr(os, "getuid"):
        return None
    base = _cache_home()
    if base is None:
        return None
    path = os.path.join(base, "weightmap")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        # lstat: the folder itself, not what a link put in its place points to (pruning
        # would otherwise remove files wherever the link leads).
        st = os.lstat(path)
    except OSError:
        return None
    if not _private(st) or not stat.S_ISDIR(st.st_mode):
        return None
    return path


def _cache_home() -> str | None:
    """``XDG_CACHE_HOME``, or ``~/.cache`` where it is unset, empty or relative (the XDG spec
    says a relative path is invalid and ignored: ``XDG_CACHE_HOME=.cache`` would otherwise
    load pickles from a folder of the current directory, such as a downloaded repository's).
    None where even the home folder is not an absolute path (``HOME=.``)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return base if os.path.isabs(base) else None


def _private(st: os.stat_result) -> bool:
    """Owned by this user and writable by nobody else."""
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def versions() -> str:
    """The Python and lark versions, which a pickle of lark's objects depends on."""
    import lark  # (only where lark's objects are pickled: see _lark_source)

    return f"py{sys.version_info[0]}{sys.version_info[1]}-lark{lark.__version__}"


def _lark_source() -> bytes | None:
    """lark's package file, which sets its version: read, not imported, for a parsed
    program's key (a program loaded from the cache needs no parser, and importing lark takes
    a tenth of a second). None where it cannot be read (lark inside a zip, say): programs are
    then not cached, as a key without lark's version could load what another lark parsed."""
    try:
        spec = importlib.util.find_spec("lark")
        return None if spec is None or spec.origin is None else Path(spec.origin).read_bytes()
    except (ImportError, ValueError, OSError):
        return None


def load(path: str) -> Any | None:
    """The object pickled in ``path``, or None when there is none or it does not load (then
    the file is removed, to be written again).

    The file itself must be a regular file of this user's, writable by nobody else, and no
    link (symbolic or hard) to a file elsewhere: checked on the open file, so that a file
    swapped in after ``folder`` looked is never unpickled. Such a file is left for ``save``
    to replace.
    """
    try:
        # NOFOLLOW: a symbolic link fails (ELOOP); NONBLOCK: a FIFO does not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # none there, a link, or unreadable
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not _private(st) or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return None
            return pickle.load(f)
    except Exception:  # a broken cache must never stop a conversion
        pass
    with contextlib.suppress(OSError):
        os.unlink(path)
    return None


def save(obj: object, path: str, dispatch_table: dict[Any, Any] | None = None) -> None:
    """Write ``obj`` pickled to ``path`` whole or not at all (a temporary file, then a
    rename). ``dispatch_table`` tells the pickler how to write objects it cannot by itself."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    if dispatch_table is not None:
        pickler.dispatch_table = dispatch_table
    pickler.dump(obj)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cache-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getvalue())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@lru_cache(maxsize=1)
def _code_digest() -> str | None:
    """A hash of everything a parsed program depends on: the grammar and the language
    package's code (the parser and the classes a program is made of), so that a program parsed
    by other code is never taken for this code's. None where the code cannot be read (an
    installation without source files, lark inside a zip): then programs are not cached."""
    # errors.py too: it defines Loc, which every node of a program carries.
    sources = [
        *sorted(Path(__file__).parent.glob("*.py")),
        Path(__file__).parent.parent / "errors.py",
    ]
    lark_source = _lark_source()
    if not sources or lark_source is None:
        return None
    h = hashlib.sha256(f"py{sys.version_info[0]}{sys.version_info[1]}".encode())
    h.update(lark_source + b"\0")
    h.update(read_text("grammars", "weightmap.lark").encode())
    for source in sources:
        h.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return h.hexdigest()


def program_key(text: str, file: str) -> str:
    """The full hash of a mapping text and its label, kept with the program parsed from them
    and compared when it is loaded: a cache file is named by a shortened hash, and one that
    holds another text's program (copied in, or left by a collision) must not be used."""
    # The label is part of the program (every location names its file).
    h = hashlib.sha256(file.encode("utf-8", "surrogatepass") + b"\0")
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def program_file(text: str, file: str) -> str | None:
    """Where the program parsed from ``text`` (errors and plans labelled ``file``) is kept, or
    None when programs are not cached."""
    where = folder()
    code = _code_digest()
    if where is None or code is None:
        return None
    h = hashlib.sha256(f"{code}\0{program_key(text, file)}".encode())
    return os.path.join(where, f"{_PROGRAM_PREFIX}{h.hexdigest()[:32]}.pickle")


def prune_programs(where: str, keep: int | None = None) -> None:
    """Past ``keep`` (default ``MAX_PROGRAMS``) parsed programs, remove the oldest (by when
    they were written) down to three quarters of it, so that a run of new texts prunes once in
    a while, not every time."""
    keep = MAX_PROGRAMS if keep is None else keep
    with contextlib.suppress(OSError):
        found = [e for e in os.scandir(where) if e.name.startswith(_PROGRAM_PREFIX) and e.is_file()]
        if len(found) <= keep:
            return
        found.sort(key=lambda e: e.stat().st_mtime_ns)
        for entry in found[: len(found) - keep * 3 // 4]:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def listing_key(maker: bytes) -> str | None:
    """The key of the presets' listing: a hash of every preset file, the language's code
    (``_code_digest``) and ``maker``, the code that makes the rows; None where the code cannot
    be read (then the listing is not cached)."""
    code = _code_digest()
    if code is None:
        return None
    h = hashlib.sha256(code.encode() + b"\0" + maker + b"\0")
    try:
        folder = data_dir("mappings")
        for name in preset_names():
            text = folder.joinpath(name + PRESET_SUFFIX).read_bytes()
            h.update(name.encode() + b"\0" + text + b"\0")
    except OSError:
        return None
    return h.hexdigest()


def load_listing(key: str | None) -> Any | None:
    """The listing saved under ``key``, or None (no cache, none saved, or another key's)."""
    where = folder()
    if where is None or key is None:
        return None
    found = load(os.path.join(where, _LISTING))
    if isinstance(found, tuple) and len(found) == 2 and found[0] == key:
        return found[1]
    return None


def save_listing(key: str | None, rows: object) -> None:
    """Keep ``rows`` as the listing of ``key`` (nothing where there is no cache)."""
    where = folder()
    if where is None or key is None:
        return
    with contextlib.suppress(OSError):
        save((key, rows), os.path.join(where, _LISTING))
