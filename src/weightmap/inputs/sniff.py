"""What a weights file is, from its first bytes rather than its name.

A safetensors file starts with its header's length (8 bytes, little-endian), and any other
file read as one gives a nonsense length ("header length 578712552184433488 exceeds the
cap"). Before that, the first bytes say what the file is: a zip archive (``PK\\x03\\x04``),
which ``torch.save`` writes (a member ``<name>/data.pkl``) and is then read as a PyTorch
checkpoint whatever its name (``model.ckpt``); any other zip, or a GGUF file (``GGUF``), is
named as what it is, with what to do.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Literal

from weightmap.errors import CheckpointError

__all__ = ["Kind", "refuse_foreign", "sniff"]

Kind = Literal["safetensors", "pytorch", "zip", "gguf"]

_ZIP = b"PK\x03\x04"
_GGUF = b"GGUF"


def sniff(path: Path) -> Kind:
    """What ``path`` holds, by its first bytes (and, for a zip, its list of members):
    ``"safetensors"`` for anything that is not recognised otherwise (its header is then
    checked as such)."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        return "safetensors"  # (the reader of the header says what is wrong with it)
    if head == _GGUF:
        return "gguf"
    if head != _ZIP:
        return "safetensors"
    try:
        with zipfile.ZipFile(path) as archive:
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
