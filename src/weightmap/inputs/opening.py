"""An input folder's small files (config, ``config from``, indexes, Hub refs), each opened once.

:func:`open_in_folder` resolves the name, checks where it leads (inside the folder, or into the
hub cache's ``blobs/`` its snapshot links to), opens that very path without following a link
(``fs/safeopen.py``) and checks the descriptor: a regular file. Whatever is read afterwards is
read through the descriptor, so a name swapped for a link between the check and the read
(a racer in a shared models folder) fails the open instead of leading to a credentials file.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from weightmap.errors import CheckpointError
from weightmap.format.text import read_json_file
from weightmap.fs.safeopen import kind, open_resolved, regular
from weightmap.inputs.sidefiles import inside_folder, resolve_path

__all__ = ["open_checked", "open_in_folder", "opened", "read_folder_json"]


def _changed(what: str, path: Path, err: OSError) -> CheckpointError:
    return CheckpointError(
        f"{what} changed while it was opened (it is a link now, or gone: {err.strerror}); "
        "nothing was read from it: run again once the folder holds still",
        path=path,
        rule="changed",
    )


def open_in_folder(
    root: Path, path: Path, what: str, where: str = "the checkpoint's folder"
) -> int:
    """A read-only descriptor of the regular file ``path`` of folder ``root``, opened once.

    Refused (``CheckpointError``): a link that cannot be followed (``dangling-link``), one
    that leaves the folder (``link-escape``), a name that changed between its check and its
    open (``changed``), anything but a regular file (``not-a-file``: a FIFO is refused at
    once, never waited on) and a file that cannot be opened (``unreadable``).
    """
    try:
        resolved = resolve_path(path)
        real_root = resolve_path(root)
    except OSError as err:  # a loop of links, made since the file was found: nothing to read
        raise CheckpointError(
            f"{what} is a link that cannot be followed ({err.strerror}); fix or remove the link",
            path=path,
            rule="dangling-link",
        ) from None
    if not inside_folder(resolved, real_root):
        raise CheckpointError(
            f"{what} is a link that leaves {where} (to {resolved}); put the file itself there "
            "if it belongs to this checkpoint",
            path=path,
            rule="link-escape",
        )
    try:
        fd = open_checked(resolved, path, what)
    except FileNotFoundError as err:  # (it was there when it was resolved)
        raise _changed(what, path, err) from None
    if regular(fd) is None:
        shown = kind(os.fstat(fd).st_mode)
        os.close(fd)
        raise CheckpointError(
            f"{what} is a {shown}, not a file; remove it or put the file there",
            path=path,
            rule="not-a-file",
        )
    return fd


def open_checked(resolved: Path, path: Path, what: str) -> int:
    """``open_resolved(resolved)``, its failures said as errors about ``path`` (``what``, in
    the message): a part of the path that is a link now (``changed``), too many open files
    (``too-many-files``), anything else (``unreadable``). ``FileNotFoundError`` is raised as
    it is: what a file that is not there means is the caller's to say."""
    try:
        return open_resolved(resolved)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _changed(what, path, err) from None
        if err.errno in (errno.EMFILE, errno.ENFILE):
            raise CheckpointError(
                f"{what} cannot be opened: too many open files ({err.strerror}); weightmap "
                "keeps each input file open while it reads it: raise the limit (ulimit -n) "
                "above the number of shards",
                path=path,
                rule="too-many-files",
            ) from None
        raise CheckpointError(
            f"{what} cannot be opened ({err.strerror}); make it readable",
            path=path,
            rule="unreadable",
        ) from None


@contextlib.contextmanager
def opened(
    root: Path, path: Path, what: str, where: str = "the checkpoint's folder"
) -> Iterator[int]:
    """:func:`open_in_folder`, closed when the block ends."""
    fd = open_in_folder(root, path, what, where)
    try:
        yield fd
    finally:
        os.close(fd)


def read_folder_json(root: Path, path: Path, what: str, *, unique_keys: bool = False) -> Any:
    """The JSON value in ``path`` of folder ``root``, read strictly through one descriptor
    (``unique_keys``: see ``read_json_file``)."""
    with opened(root, path, what) as fd:
        return read_json_file(path, what, fd=fd, unique_keys=unique_keys)
