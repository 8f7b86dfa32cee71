"""In-place renames: rewrite headers where they are, leaving every data byte untouched.

Only plans that rename (or keep) every input, each exactly once, qualify; the new header must
fit in the old header's bytes (JSON whitespace pads it), so the data offsets stay valid.

Crash safety: a write of more than one page can be cut short by a kill, which would leave a
header half old and half new. So the new headers (and the new index and config) are first
written to a journal, fsynced and renamed into place; only then are the headers overwritten,
and the journal is removed last. A checkpoint whose folder holds a journal is refused by
:meth:`Checkpoint.open` until :func:`recover` (``weightmap clean``) replays the journal, which
is idempotent, so no reader of ours ever sees a mixed header.

The journal is untrusted input: a downloaded folder may carry one written by anybody. Before
:func:`recover` writes a byte it checks the whole journal (its shape, every name confined to the
checkpoint's own shard files, every header a valid header for its file as it is on disk, index
and config valid JSON objects that agree with the headers); a journal that fails any check is
refused with the reason, and nothing is written.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightmap.errors import CheckpointError, ExecutionError, FormatError, PlanError
from weightmap.format.header import MAX_HEADER_SIZE, parse_header, read_header
from weightmap.format.names import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME
from weightmap.format.text import read_json_file, same_json
from weightmap.fs.atomic import replace_at
from weightmap.fs.cancel import CancelToken
from weightmap.fs.lock import folder_lock
from weightmap.fs.safeopen import open_folder
from weightmap.inputs.checkpoint import Checkpoint, resolve_shard
from weightmap.inputs.opening import read_folder_json
from weightmap.inputs.sidefiles import resolve_path
from weightmap.plan.nodes import Source
from weightmap.plan.plan import Plan

__all__ = [
    "Journal",
    "check_files_stay",
    "inplace_headers",
    "read_journal",
    "recover",
    "rewrite_inplace",
]

# A journal holds one header per shard; headers are capped at 100 MB each by the format, and
# base64 grows them by a third. Beyond this it cannot be one we wrote.
_MAX_JOURNAL_BYTES = 2 * 2**30


@dataclass(frozen=True)
class Journal:
    """A validated journal: each shard's new header (JSON bytes, exactly the old header's size,
    by the shard's resolved path), and the new index and config text (None: unchanged)."""

    files: dict[Path, bytes]
    index: str | None
    config: str | None


def _open_folder(root: Path) -> int:
    """The checkpoint's folder, opened once (``fs/safeopen.open_folder``) for every write of
    an in-place rewrite to go through."""
    try:
        return open_folder(resolve_path(root))
    except OSError as exc:
        raise ExecutionError(f"{root}: cannot open the folder ({exc.strerror})") from exc


def _fsync_folder(folder: int) -> None:
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=folder)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def inplace_headers(plan: Plan, ckpt: Checkpoint) -> dict[Path, bytes]:
    """The new header JSON bytes for each file (exactly the old size), or a PlanError why not."""
    if plan.dropped:
        names = ", ".join(d.name for d in plan.dropped[:3])
        raise PlanError(
            f"in-place mode cannot drop tensors ({names}): their bytes would leave a hole in the "
            "file; convert into a new folder instead"
        )
    renames: dict[str, str] = {}
    for out in plan.outputs:
        if not isinstance(out.node, Source):
            raise PlanError(
                f"in-place mode only renames, but {out.name!r} is computed "
                f"({out.node.describe()}); convert into a new folder instead"
            )
        if out.node.name in renames:
            raise PlanError(
                f"in-place mode cannot write input {out.node.name!r} twice (as "
                f"{renames[out.node.name]!r} and {out.name!r})"
            )
        renames[out.node.name] = out.name
    missing = [n for n in ckpt if n not in renames]
    if missing:
        raise PlanError(f"in-place mode must keep every tensor; the plan leaves out {missing[0]!r}")
    result: dict[Path, bytes] = {}
    for path, header in ckpt.headers.items():
        doc: dict[str, Any] = {}
        if header.metadata is not None:
            doc["__metadata__"] = dict(header.metadata)
        for name, info in header.tensors.items():
            doc[renames[name]] = {
                "dtype": info.dtype,
                "shape": list(info.shape),
                "data_offsets": [info.begin, info.end],
            }
        raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(raw) > header.header_size:
            raise PlanError(
                f"{path}: the renamed header needs {len(raw)} bytes but the file has room for "
                f"{header.header_size}; convert into a new folder instead"
            )
        result[path] = raw + b" " * (header.header_size - len(raw))
    return result


def check_files_stay(plan: Plan, present: Iterable[str]) -> None:
    """Refuse a plan whose ``files`` blocks change the folder's other files (``present``, as
    listed for the plan): in place they stay as they are, so a drop, rename or add the
    mapping asks for could not happen, and the rename would go ahead without it."""
    carried = {f.source for f in plan.files if f.source is not None}
    changes = [f"dropped: {name}" for name in sorted(set(present) - carried)]
    changes += [
        f"renamed: {f.source} -> {f.name}"
        for f in plan.files
        if f.source is not None and f.source != f.name
    ]
    changes += [f"added: {f.name}" for f in plan.files if f.source is None]
    if changes:
        more = f"; and {len(changes) - 5} more" if len(changes) > 5 else ""
        shown = "; ".join(changes[:5]) + more
        raise PlanError(
            "in-place mode leaves the folder's other files as they are, but the mapping's files "
            f"block changes them ({shown}); convert into a new folder instead (or turn side "
            "files off: --no-side-files, side_files=False)"
        )


def rewrite_inplace(
    plan: Plan, ckpt: Checkpoint, *, cancel: CancelToken | None = None
) -> list[Path]:
    """Apply a rename-only plan to ``ckpt``'s files in place; returns the files changed.

    Under the folder's exclusive lock, before the first write: the checkpoint must still be
    the one the plan was made from (another rename may have finished in between), and every
    file to be rewritten or replaced must be writable.

    ``cancel`` is checked last before the journal is written, where stopping changes nothing;
    from the journal on, the rewrite is one shielded stretch of a few small writes, which a
    signal to the command line does not cut (an interrupt that gets in all the same, as
    Python's default Ctrl-C may, leaves the journal, which ``recover`` finishes).
    """
    headers = inplace_headers(plan, ckpt)
    root = ckpt.root
    with folder_lock(root, exclusive=True):
        _check_unchanged(ckpt)
        journal: dict[str, Any] = {
            "files": {p.name: base64.b64encode(h).decode() for p, h in headers.items()},
            "index": None,
            "config": None,
        }
        if ckpt.index_path is not None:
            weight_map = {
                out.name: ckpt.file_of(out.node.sources()[0].name).name for out in plan.outputs
            }
            # Through one checked descriptor, as Checkpoint.open read it: this text is written
            # back, so a name swapped for a link (to a credentials file) must not be followed.
            old = read_folder_json(root, ckpt.index_path, ckpt.index_path.name)
            if not isinstance(old, dict):
                raise CheckpointError(
                    "the index changed since the checkpoint was opened (it is no JSON object "
                    "now); nothing was changed: run the rename again",
                    path=ckpt.index_path,
                    rule="changed",
                )
            old["weight_map"] = dict(sorted(weight_map.items()))
            journal["index"] = json.dumps(old, indent=2, sort_keys=True) + "\n"
        # Compared with config.json as it is, not with the config the plan read: a mapping's
        # `config from "params.json"` reads another file, and the conversion into a new folder
        # writes config.json from it whether or not the mapping edits it.
        if plan.config is not None and not same_json(plan.config, _config_json(root)):
            journal["config"] = (
                json.dumps(plan.config, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
            )
        work = Journal(dict(headers), journal["index"], journal["config"])
        _check_writable(root, work, "rename in place")
        token = cancel or CancelToken()  # (the caller's own: its handlers see the shield)
        token.check("the in-place rename")
        folder = _open_folder(root)
        try:
            with token.shielded():
                try:
                    replace_at(folder, JOURNAL_NAME, json.dumps(journal).encode())
                    _fsync_folder(folder)
                except OSError as exc:
                    raise ExecutionError(
                        f"{root}: cannot write the journal ({exc.strerror}); nothing was changed"
                    ) from exc
                _replay(root, work, folder)
                token.mark_committed()  # (a stop seen after this stops nothing)
        finally:
            os.close(folder)
    return list(headers)


def _config_json(root: Path) -> Any:
    """The folder's config.json as JSON, or None when it is absent or unreadable (then the
    plan's config is written over it, as the conversion would write it)."""
    path = root / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        return read_json_file(path, CONFIG_NAME)
    except (CheckpointError, OSError):
        return None


def _check_unchanged(ckpt: Checkpoint) -> None:
    """Refuse if the checkpoint differs from when ``ckpt`` was opened (its headers as read)."""
    root = ckpt.root
    # A link to nothing (or a loop) under the journal's name is a journal too: as
    # Checkpoint.open says, `clean` is what deals with it.
    if (root / JOURNAL_NAME).exists() or (root / JOURNAL_NAME).is_symlink():
        raise CheckpointError(
            "an in-place rewrite of this checkpoint was interrupted; run "
            f"`weightmap clean {root}` to finish it first",
            path=root,
            rule="interrupted-inplace",
        )
    for path, header in ckpt.headers.items():
        try:
            now = read_header(path)
        except FormatError:
            now = None
        if now != header or now is None or now.mtime_ns != header.mtime_ns:
            raise ExecutionError(
                f"{path}: the file changed since the checkpoint was opened (another in-place "
                "rename?); nothing was changed: run the rename again"
            )


def _check_writable(root: Path, journal: Journal, what: str) -> None:
    """Every file the journal rewrites or replaces must be writable, before the first write.

    Shards are rewritten where they are, so each must open for writing; the index and config
    are replaced by rename, which only an immutable or append-only file refuses (EPERM); the
    journal itself is written in the folder.
    """
    problems: list[str] = []
    for path in journal.files:
        try:
            # NONBLOCK: a FIFO in a shard's place must not hang us under the folder's lock.
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            problems.append(f"{path.name} ({exc.strerror})")
    for name, text in ((INDEX_NAME, journal.index), (CONFIG_NAME, journal.config)):
        if text is None or not (root / name).exists():
            continue
        try:
            # The entry itself, as the rename will replace it: a link is not followed (ELOOP)
            # and a FIFO does not block (ENXIO); only EPERM (immutable) stops the rename.
            os.close(os.open(root / name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
        except OSError as exc:
            if exc.errno == errno.EPERM:
                problems.append(f"{name} ({exc.strerror})")
    if not os.access(root, os.W_OK | os.X_OK):
        problems.append("the folder itself (the journal is written there)")
    if problems:
        raise ExecutionError(
            f"{root}: cannot {what}: cannot write {', '.join(problems[:5])}; nothing was "
            "changed. Make them writable (chmod u+w; chattr -i for an immutable file), or "
            "convert into a new folder"
        )


def _open_shard_for_header(root: Path, path: Path, folder: int) -> int:
    """A shard of ``root`` (``path``: where its name resolved to, a file of the folder itself,
    as the checks before allowed), opened for its header to be written where it is: by its
    name in the folder open as ``folder``, without following a link, never waiting on a FIFO,
    a regular file with no other name. A shard swapped for a link to another file (in a shared
    folder) would have that file written into; one with a second name (a backup made with
    ``cp -al``) would have that copy changed too."""
    fd, why = -1, None
    try:
        # A link to another file of the folder (weights-v2.safetensors, by any spelling of
        # its path) is that file: the entry of that name in the folder held, opened without
        # following a link, whatever the folder's own name leads to by now.
        resolved = path.resolve()
        if resolved.parent != root.resolve():
            why = f"it is a link out of the folder (to {resolved})"
        else:
            flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(resolved.name, flags, dir_fd=folder)
    except (OSError, RuntimeError) as exc:  # (RuntimeError: a loop, before Python 3.13)
        why = f"it cannot be opened ({getattr(exc, 'strerror', None) or 'a loop of links'})"
    if fd >= 0:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            why = "it is not a regular file"
        elif st.st_nlink != 1:
            why = f"it has {st.st_nlink} names (hard links): rewriting it would change them all"
    if why is not None:
        if fd >= 0:
            os.close(fd)
        raise ExecutionError(
            f"{path}: cannot rewrite its header: {why}, though it was checked before (the "
            f"folder changed); the journal {JOURNAL_NAME} is kept: put the shard back and run "
            "`weightmap clean` to finish the rename"
        )
    return fd


def _replay(root: Path, journal: Journal, folder: int) -> None:
    """Write the journal's headers, index and config, then remove it: every write through
    ``folder``, the checkpoint's folder opened once."""
    for path, data in journal.files.items():
        fd = _open_shard_for_header(root, path, folder)
        try:
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], 8 + written)
            os.fsync(fd)
        finally:
            os.close(fd)
    if journal.index is not None:
        replace_at(folder, INDEX_NAME, journal.index.encode())
    if journal.config is not None:
        replace_at(folder, CONFIG_NAME, journal.config.encode("utf-8"))
    os.unlink(JOURNAL_NAME, dir_fd=folder)
    _fsync_folder(folder)


def _refuse(journal_path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"refusing to replay this journal: {why}. Nothing was written. weightmap writes a "
        "journal only during `convert --inplace`; if none ran here, the file did not come from "
        f"weightmap: delete {journal_path.name} and check the folder's files",
        path=journal_path,
        rule="journal",
    )


def _shard_header_size(path: Path, journal_path: Path) -> tuple[int, int]:
    """The header size recorded in a shard's first 8 bytes, and the shard's size."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
    except OSError as err:
        raise _refuse(journal_path, f"cannot read shard {path.name} ({err.strerror})") from None
    if len(prefix) < 8:
        raise _refuse(journal_path, f"shard {path.name} is shorter than a header")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_SIZE or 8 + n > size:
        raise _refuse(journal_path, f"shard {path.name} has no valid header length")
    return n, size


def _journal_header(
    root: Path, name: object, b64: object, journal_path: Path
) -> tuple[Path, bytes]:
    """One ``files`` entry: a shard of this checkpoint and a valid header of the right size."""
    try:
        path = resolve_shard(root, name, journal_path, what="the journal")
    except CheckpointError as err:
        raise _refuse(journal_path, err.detail) from None
    shown = str(name)[:80]
    if not str(name).endswith(".safetensors") or not path.is_file():
        raise _refuse(journal_path, f"{shown!r} is not a safetensors shard of this checkpoint")
    resolved = path.resolve()
    if path.stat().st_nlink != 1:
        # As `convert --inplace` refuses it (inplace-link): a backup made with `cp -al`
        # shares the file, and would be rewritten with it.
        raise _refuse(journal_path, f"{shown!r} has another name (a hard link)")
    if resolved.parent != root.resolve():
        # A hub cache's link into blobs/ reads fine, but an in-place rename never rewrites one
        # (the blob is named by its content, and every revision holding it shares it), so no
        # journal of ours names one.
        raise _refuse(
            journal_path,
            f"{shown!r} is a link to {resolved}, outside the checkpoint's folder, which an "
            "in-place rename never rewrites",
        )
    if not isinstance(b64, str):
        raise _refuse(journal_path, f"the header for {shown!r} is not a base64 string")
    try:
        data = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(journal_path, f"the header for {shown!r} is not valid base64") from None
    size, file_size = _shard_header_size(path, journal_path)
    if len(data) != size:
        raise _refuse(
            journal_path,
            f"the header for {shown!r} has {len(data)} bytes but the shard's header has {size}",
        )
    try:
        parse_header(data, header_size=size, file_size=file_size, path=str(path))
    except FormatError as err:
        raise _refuse(
            journal_path, f"the header for {shown!r} is not valid ({err.detail}) [{err.rule}]"
        ) from None
    return resolved, data


def _journal_text(value: object, what: str, journal_path: Path) -> str | None:
    """The new index or config: null, or the text of a JSON object."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise _refuse(journal_path, f"its {what} is not text")
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):
        raise _refuse(journal_path, f"its {what} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise _refuse(journal_path, f"its {what} is not a JSON object")
    return value


def _check_index(index: str, headers: dict[Path, bytes], journal_path: Path) -> None:
    """The new index must list exactly the tensors of the new headers, each in its shard."""
    weight_map = json.loads(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise _refuse(journal_path, "its index has no weight_map object")
    expected: dict[str, str] = {}
    for path, data in headers.items():
        for name in json.loads(data):
            if name != "__metadata__":
                expected[name] = path.name
    listed = {k: v for k, v in weight_map.items() if isinstance(v, str)}
    if listed != expected:
        raise _refuse(journal_path, "its index does not list the tensors of its headers")


def read_journal(root: Path) -> Journal:
    """Read and validate ``root``'s journal; CheckpointError (rule ``journal``) if it is wrong."""
    journal_path = root / JOURNAL_NAME
    if journal_path.is_symlink():
        # Never followed (weightmap writes the journal as a file); a link to nothing or a
        # loop is refused here too, not taken for "no journal", which would leave the
        # checkpoint refused by every command with nothing to clean.
        try:
            target = f" to {os.readlink(journal_path)}"
        except OSError:
            target = ""
        raise _refuse(journal_path, f"it is a symbolic link{target}, not a regular file")
    if not journal_path.is_file():
        raise _refuse(journal_path, "it is not a regular file")
    try:
        doc = read_json_file(journal_path, "the journal", max_size=_MAX_JOURNAL_BYTES)
    except CheckpointError as err:
        raise _refuse(journal_path, err.detail) from None
    if not isinstance(doc, dict) or set(doc) != {"files", "index", "config"}:
        raise _refuse(journal_path, 'it is not an object with "files", "index" and "config"')
    files = doc["files"]
    if not isinstance(files, dict) or not files:
        raise _refuse(journal_path, '"files" is not a non-empty object of shard headers')
    headers: dict[Path, bytes] = {}
    for name, b64 in files.items():
        path, data = _journal_header(root, name, b64, journal_path)
        if path in headers:
            raise _refuse(journal_path, f"shard {name!r} appears twice")
        headers[path] = data
    index = _journal_text(doc["index"], "index", journal_path)
    config = _journal_text(doc["config"], "config", journal_path)
    if index is not None:
        _check_index(index, headers, journal_path)
    return Journal(headers, index, config)


def recover(root: str | os.PathLike[str]) -> bool:
    """Finish an interrupted in-place rewrite in ``root``; True if there was one to finish.

    The journal is validated in full first (see the module docstring); a journal that fails is
    refused with a :class:`~weightmap.errors.CheckpointError` and nothing is written.
    """
    folder = Path(root)
    with folder_lock(folder, exclusive=True):
        # Checked under the lock: a rename that was running when we were called has finished
        # (and removed its journal) by the time we hold it.
        if not (folder / JOURNAL_NAME).exists() and not (folder / JOURNAL_NAME).is_symlink():
            return False
        # Opened before the journal is read: what is checked and what is written are in this
        # folder, even if its name is swapped for a link meanwhile (another user of a shared
        # folder racing us).
        held = _open_folder(folder)
        try:
            journal = read_journal(folder)
            _check_writable(folder, journal, "finish the interrupted rename")
            _replay(folder, journal, held)
        finally:
            os.close(held)
    return True
