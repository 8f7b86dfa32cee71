"""Helpers to build safetensors files byte by byte, valid or deliberately broken."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def header_bytes(header: dict[str, Any] | bytes, *, pad: bool = True) -> bytes:
    """The 8-byte length prefix plus the header, padded with spaces to a multiple of 8."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_raw(path: Path, header: dict[str, Any] | bytes, data: bytes = b"", **kw: Any) -> Path:
    """Write a file from a header (dict or raw bytes) and a data buffer."""
    path.write_bytes(header_bytes(header, **kw) + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    """One header entry."""
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
