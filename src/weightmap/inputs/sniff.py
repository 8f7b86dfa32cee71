"""What a weights file is, from its first bytes rather than its name.

A safetensors file starts with its header's length (8 bytes, little-endian), and any other
file read as one gives a nonsense length ("header length 578712552184433488 exceeds the
cap"). Before that, the first bytes say what the file is: a zip archive (``PK\\x03\\x04``),
which ``torch.save`` writes (a member ``<name>/data.pkl``) and is then read as a PyTorch
checkpoint whatever its name (``model.ckpt``); any other zip, or a GGUF file (``GGUF``), is
named as what it is, with what to do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from weightmap.errors import CheckpointError
from weightmap.fs.safeopen import fd_path, open_resolved, regular
from weightmap.inputs.sidefiles import resolve_path

__all__ = ["Kind", "refuse_foreign", "sniff", "sniff_fd"]

Kind = Literal["safetensors", "pytorch", "zip", "gguf"]

_ZIP = b"PK\x03\x04"
_GGUF = b"GGUF"


def sniff(path: Path) -> Kind:
    """What ``path`` holds, by its first bytes (and, for a zip, its list of members):
    ``"safetensors"`` for anything that is not recognised otherwise (its header is then
    checked as such, and the header's reader names what is wrong: a FIFO, a device, a link
    that leaves the folder).

    The file is opened as every input file is (``fs/safeopen.py``): without following a link
    anywhere in its resolved path and without waiting on a FIFO, and only a regular file is
    read, through that descriptor.
    """
    try:
        fd = open_resolved(resolve_path(path))
    except OSError:
        return "safetensors"  # (the reader of the header says what is wrong with it)
    try:
        return sniff_fd(fd, path)
    finally:
        os.close(fd)


def sniff_fd(fd: int, path: Path) -> Kind:
    """:func:`sniff` of the file open as ``fd`` (``path``: its name, in errors), read with
    ``pread`` and through the descriptor's own name only."""
    if regular(fd) is None:
        return "safetensors"  # (the header's reader refuses a FIFO or a device)
    head = os.pread(fd, 4, 0)
    if head == _GGUF:
        return "gguf"
    if head != _ZIP:
        return "safetensors"
    import zipfile  # (only for a zip archive: safetensors never needs it)

    try:
        # Through the descriptor's own name: the file read is the one checked.
        with zipfile.ZipFile(fd_path(fd, path)) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return "zip"
    # torch.save's archive: one top folder holding data.pkl (and data/, version...).
    if any(n.count("/") == 1 and n.endswith("/data.pkl") for n in names):
        return "pytorch"
    return "zip"


def refuse_foreign(path: Path, kind: Kind) -> None:
    """A CheckpointError naming a file weightmap cannot read (a GGUF file, a zip that is not
    a PyTorch checkpoint) and what to do; nothing for the kinds it reads."""
    if kind == "gguf":
        raise CheckpointError(
            "this is a GGUF file, not a safetensors or PyTorch checkpoint; "
            "weightmap reads safetensors and PyTorch checkpoints: convert from the model's "
            "original (Hugging Face) weights instead",
            path=path,
            rule="gguf",
        )
    if kind == "zip":
        raise CheckpointError(
            "this is a zip archive but not a PyTorch checkpoint (torch.save's archive holds a "
            "data.pkl); unpack it and give the folder or the weights file inside",
            path=path,
            rule="zip",
        )
