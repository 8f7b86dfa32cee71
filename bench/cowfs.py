"""Copy-on-write filesystems to measure on: loop-mounted XFS (reflink) and btrfs images.

``mounted(kind, folder)`` makes a sparse image file, formats it and mounts it through a loop
device, and unmounts and deletes it afterwards; it needs root and ``mkfs.xfs`` /
``mkfs.btrfs``, and says why not (``Unavailable``) where it cannot. ``shared_bytes`` reads a
file's extents with the FIEMAP ioctl and counts the bytes in extents the filesystem marks
shared, which is how a clone shows: both files point at the same blocks. Also imported by
``tests/test_cow.py``; only the standard library here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

KINDS = ("xfs", "btrfs")
_MKFS = {
    "xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"],
    "btrfs": ["mkfs.btrfs", "-q", "-f"],
}
# linux/fiemap.h
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_EXTENT_SHARED = 0x2000
_HEAD = struct.Struct("=QQLLLL")  # start, length, flags, mapped, count, reserved
_EXTENT = struct.Struct("=QQQQQLLLL")  # logical, physical, length, 2 reserved, flags, 3 reserved
_BATCH = 256


class Unavailable(Exception):
    """Why a filesystem image cannot be made or mounted here (a reason to skip)."""


def why_not(kind: str) -> str | None:
    """None when ``mounted(kind, ...)`` can work here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "loop-mounting a filesystem image needs root"
    tool = _MKFS[kind][0]
    if shutil.which(tool) is None:
        package = "xfsprogs" if kind == "xfs" else "btrfs-progs"
        return f"{tool} is not installed (Debian package {package})"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount are not installed"
    return None


@contextlib.contextmanager
def mounted(kind: str, folder: Path, size: str = "20G") -> Iterator[Path]:
    """A fresh ``kind`` filesystem of ``size`` (a sparse image in ``folder``), mounted."""
    reason = why_not(kind)
    if reason is not None:
        raise Unavailable(reason)
    folder.mkdir(parents=True, exist_ok=True)
    image, mnt = folder / f"{kind}.img", folder / f"{kind}-mnt"
    mnt.mkdir(exist_ok=True)
    try:
        subprocess.run(["truncate", "-s", size, str(image)], check=True, capture_output=True)
        made = subprocess.run([*_MKFS[kind], str(image)], capture_output=True, text=True)
        if made.returncode:
            raise Unavailable(f"{_MKFS[kind][0]} failed: {made.stderr.strip()[-200:]}")
        done = subprocess.run(
            ["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True
        )
        if done.returncode:
            raise Unavailable(f"mounting the {kind} image failed: {done.stderr.strip()[-200:]}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()
        with contextlib.suppress(OSError):
            image.unlink()


def extents(path: Path) -> list[tuple[int, int, int]]:
    """``(logical offset, length, flags)`` of every extent of a file (FIEMAP, synced first)."""
    out: list[tuple[int, int, int]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        start = 0
        while True:
            buf = bytearray(_HEAD.size + _BATCH * _EXTENT.size)
            _HEAD.pack_into(buf, 0, start, 2**64 - 1 - start, _FIEMAP_FLAG_SYNC, 0, _BATCH, 0)
            fcntl.ioctl(fd, _FS_IOC_FIEMAP, buf)
            mapped = _HEAD.unpack_from(buf, 0)[3]
            if not mapped:
                return out
            for i in range(mapped):
                logical, _, length, _, _, flags, *_ = _EXTENT.unpack_from(
                    buf, _HEAD.size + i * _EXTENT.size
                )
                out.append((logical, length, flags))
                if flags & _FIEMAP_EXTENT_LAST:
                    return out
            start = out[-1][0] + out[-1][1]
    finally:
        os.close(fd)


def shared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents the filesystem marks shared (cloned), file size at most."""
    size = path.stat().st_size
    total = 0
    for logical, length, flags in extents(path):
        if flags & _FIEMAP_EXTENT_SHARED:
            total += max(0, min(logical + length, size) - logical)
    return total


def folder_shared(folder: Path, block: int = 4096) -> tuple[int, int, int]:
    """``(bytes in shared extents, bytes, header blocks)`` over the ``*.safetensors`` files of
    a folder; header blocks are the bytes of the blocks that hold a header (which differs from
    the input's, so cannot be shared), up to the block where the data starts."""
    files = sorted(folder.glob("*.safetensors"))
    headers = 0
    for path in files:
        with path.open("rb") as f:
            start = 8 + struct.unpack("<Q", f.read(8))[0]
        headers += -(-start // block) * block
    return sum(shared_bytes(p) for p in files), sum(p.stat().st_size for p in files), headers
