"""In-place renames: rewrite headers where they are, leaving every data byte untouched.

Only plans that rename (or keep) every input, each exactly once, qualify; the new header must
fit in the old header's bytes (JSON whitespace pads it), so the data offsets stay valid.

Crash safety: a write of more than one page can be cut short by a kill, which would leave a
header half old and half new. So the new headers (and the new index and config) are first
written to a journal, fsynced and renamed into place; only then are the headers overwritten,
and the journal is removed last. A checkpoint whose folder holds a journal is refused by
:meth:`Checkpoint.open` until :func:`recover` (``weightmap clean``) replays the journal, which
is idempotent, so no reader of ours ever sees a mixed header.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from weightmap.errors import ExecutionError, PlanError
from weightmap.format.atomic import TMP_MARKER, fsync_dir
from weightmap.format.checkpoint import Checkpoint
from weightmap.format.layout import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME
from weightmap.plan.nodes import Source
from weightmap.plan.plan import Plan

__all__ = ["inplace_headers", "recover", "rewrite_inplace"]


def _replace_small(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}-inplace")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


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


def rewrite_inplace(plan: Plan, ckpt: Checkpoint) -> list[Path]:
    """Apply a rename-only plan to ``ckpt``'s files in place; returns the files changed."""
    headers = inplace_headers(plan, ckpt)
    root = ckpt.root
    journal: dict[str, Any] = {
        "files": {p.name: base64.b64encode(h).decode() for p, h in headers.items()},
        "index": None,
        "config": None,
    }
    if ckpt.index_path is not None:
        weight_map = {
            out.name: ckpt.file_of(out.node.sources()[0].name).name for out in plan.outputs
        }
        old = json.loads(ckpt.index_path.read_text())
        old["weight_map"] = dict(sorted(weight_map.items()))
        journal["index"] = json.dumps(old, indent=2, sort_keys=True) + "\n"
    if plan.config is not None and plan.config != ckpt.config:
        journal["config"] = json.dumps(plan.config, indent=2, ensure_ascii=False) + "\n"
    # Data unchanged since the plan was made? The header sizes are what we overwrite.
    for path, header in ckpt.headers.items():
        if path.stat().st_size != header.file_size:
            raise ExecutionError(f"{path}: file changed since its header was read")
    _replace_small(root / JOURNAL_NAME, json.dumps(journal).encode())
    fsync_dir(root)
    _replay(root, journal)
    return list(headers)


def _replay(root: Path, journal: dict[str, Any]) -> None:
    for name, b64 in journal["files"].items():
        data = base64.b64decode(b64)
        fd = os.open(root / name, os.O_WRONLY)
        try:
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], 8 + written)
            os.fsync(fd)
        finally:
            os.close(fd)
    if journal["index"] is not None:
        _replace_small(root / INDEX_NAME, journal["index"].encode())
    if journal["config"] is not None:
        _replace_small(root / CONFIG_NAME, journal["config"].encode("utf-8"))
    (root / JOURNAL_NAME).unlink()
    fsync_dir(root)


def recover(root: str | os.PathLike[str]) -> bool:
    """Finish an interrupted in-place rewrite in ``root``; True if there was one to finish."""
    folder = Path(root)
    path = folder / JOURNAL_NAME
    if not path.exists():
        return False
    try:
        journal = json.loads(path.read_text())
        _ = journal["files"], journal["index"], journal["config"]
    except (ValueError, KeyError, TypeError):
        # The journal is renamed into place only once complete, so a broken one means the
        # rewrite never started: nothing was touched.
        path.unlink()
        return False
    _replay(folder, journal)
    return True
