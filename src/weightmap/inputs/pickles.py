"""PyTorch checkpoints (``pytorch_model.bin``, ``.pt``, ``.pth``): read without running code,
in bounded memory.

A file is loaded with ``torch.load(weights_only=True, mmap=True)``: the restricted unpickler
builds tensors and plain containers and nothing else (a pickle that needs a class or a
function is refused), and every tensor is a view of the file mapped copy-on-write, so no
tensor byte is read until it is used.

Bytes without torch: ``torch.save`` writes a zip archive whose members are stored
uncompressed, one per storage (``<archive>/data/<key>``). A tensor that is contiguous in its
storage is therefore one byte range of the file: the storage member's data offset, plus the
tensor's storage offset times its element size, ``numel * itemsize`` bytes long. The
streaming executor copies such ranges in the kernel, as it does safetensors data. Which member
holds which storage is found by address: all storages are slices of one mapping of the whole
file, so a storage's address minus the mapping's start is its file offset, checked against
the archive's directory. A tensor that is not contiguous (a saved ``w.t()``) has no such
range; it is marked ``strided`` and read through its view (the executor computes it). Tensors
sharing a storage (tied embeddings) are ranges that overlap, which reading allows.

Refused with a one-line error that says what to do: the legacy (pre-zip) format, which
cannot be mapped; pickles that need code (custom classes, numpy arrays); TorchScript
archives; a big-endian archive; dtypes safetensors has no name for; anything that is not a
dict of tensors.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from weightmap.errors import CheckpointError
from weightmap.format.dtypes import DTYPES
from weightmap.format.header import Header, TensorInfo
from weightmap.format.text import is_utf8
from weightmap.fs.safeopen import fd_path, kind, open_resolved, regular
from weightmap.inputs.opening import open_in_folder
from weightmap.inputs.sidefiles import resolve_path

if TYPE_CHECKING:
    import torch

__all__ = [
    "PICKLE_SUFFIXES",
    "STATE_DICT_KEYS",
    "PickleHeader",
    "is_pickle",
    "prefixed_header",
    "read_pickle",
    "release_pages",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Training checkpoints keep the weights one level down; other entries (optimizer, epoch) are
# ignored.
STATE_DICT_KEYS = ("state_dict", "model", "module", "model_state_dict")
# data.pkl of a state dict is a few MB even for 100,000 tensors.
MAX_PICKLE_BYTES = 256 * 2**20
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
H = TypeVar("H", bound=Header)


@dataclass(frozen=True)
class PickleHeader(Header):
    """What a PyTorch checkpoint holds, in the shape of a safetensors :class:`Header`.

    ``TensorInfo.begin``/``end`` are file offsets (``data_start`` is 0); for the tensors in
    ``strided`` they only give the size, as those are no single byte range.
    """

    strided: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def data_start(self) -> int:
        """Offsets are absolute in a PyTorch checkpoint."""
        return 0


def prefixed_header(header: H, prefix: str) -> H:
    """``header`` with every tensor's name prefixed (``adapter:``): the same file, read as one
    of a mapping's several inputs, whose tensors share one namespace."""
    tensors = {prefix + n: info._replace(name=prefix + n) for n, info in header.tensors.items()}
    if isinstance(header, PickleHeader):
        strided = frozenset(prefix + n for n in header.strided)
        return replace(header, tensors=tensors, strided=strided)
    return replace(header, tensors=tensors)


def is_pickle(path: Path) -> bool:
    """True for the file names PyTorch checkpoints use (``.bin``, ``.pt``, ``.pth``)."""
    return path.name.endswith(PICKLE_SUFFIXES)


def _fail(path: Path, message: str, rule: str = "pickle") -> CheckpointError:
    return CheckpointError(message, path=path, rule=rule)


def _torch_dtypes() -> dict[Any, str]:
    import torch

    out = {}
    for dt in DTYPES.values():
        if dt.torch_name and dt.name != "F4" and hasattr(torch, dt.torch_name):
            out[getattr(torch, dt.torch_name)] = dt.name
    return out


def _members(path: Path, source: Path) -> tuple[dict[str, tuple[int, int]], bytes | None]:
    """``{key: (data offset, size)}`` of the storage members, and the byteorder record
    (nothing for a file that is no zip archive: loading it says what it is). ``source`` is
    the name to read (the opened file's), ``path`` the one to show."""
    import zipfile  # (here: a checkpoint of safetensors alone never needs it)

    try:
        if not zipfile.is_zipfile(source):
            return {}, None
        with zipfile.ZipFile(source) as z, source.open("rb") as f:
            infos = z.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise _fail(path, "is a zip archive but not a PyTorch checkpoint (no data.pkl)")
            if pickles[0].file_size > MAX_PICKLE_BYTES:
                raise _fail(
                    path,
                    f"its pickle is {pickles[0].file_size:,} bytes, over the "
                    f"{MAX_PICKLE_BYTES:,}-byte limit (a state dict's is a few MB)",
                    "pickle-too-large",
                )
            # torch.save stores every member uncompressed; a compressed one would be inflated
            # by the loader, unbounded (200 KB of deflate is 824 MB of pickle).
            compressed = next((i for i in infos if i.compress_type != zipfile.ZIP_STORED), None)
            if compressed is not None:
                raise _fail(
                    path,
                    f"member {compressed.filename!r} is compressed, which torch.save never "
                    "does (a compressed member inflates without bound when loaded); save the "
                    "state dict again with torch.save",
                    "pickle-compressed",
                )
            prefix = pickles[0].filename[: -len("data.pkl")]
            byteorder = None
            members = {}
            for info in infos:
                if info.filename == prefix + "byteorder":
                    byteorder = z.read(info)
                if not info.filename.startswith(prefix + "data/"):
                    continue
                f.seek(info.header_offset)
                local = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
                if local[0] != b"PK\x03\x04":
                    raise _fail(path, f"storage {info.filename} is not stored uncompressed")
                start = info.header_offset + _LOCAL_HEADER.size + local[-2] + local[-1]
                members[info.filename[len(prefix) + 5 :]] = (start, info.file_size)
            return members, byteorder
    except CheckpointError:
        raise
    except (
        zipfile.BadZipFile,
        struct.error,
        OSError,
        ValueError,
        NotImplementedError,
        EOFError,
    ) as err:
        # ValueError covers UnicodeDecodeError (a damaged member name).
        raise _fail(path, f"is a damaged zip archive ({type(err).__name__}: {err})") from None


def _load(path: Path, source: Path) -> Any:
    import pickle
    import warnings

    import torch

    with source.open("rb") as f:
        magic = f.read(4)
    if not magic.startswith(b"PK"):
        if magic[:1] == b"\x80":
            raise _fail(
                path,
                "is a PyTorch checkpoint in the legacy (pre-1.6, non-zip) format, which cannot be "
                'memory-mapped; save it again in the zip format first (python -c "import torch; '
                f"torch.save(torch.load('{path.name}', weights_only=True), 'model.pt')\")",
                "pickle-legacy",
            )
        raise _fail(path, "is neither a PyTorch checkpoint (a zip archive) nor safetensors")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. TypedStorage deprecation in old archives
            return torch.load(source, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        # torch's wording changes between releases: "Unsupported global: GLOBAL x.y" (2.4
        # on), "Trying to load unsupported GLOBAL x.y whose module x is blocked" (2.13).
        found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", str(err))
        what = f" ({found.group(1)})" if found else ""
        raise _fail(
            path,
            f"holds objects that loading would have to run code for{what}, and weightmap never "
            "runs code from a checkpoint; if you trust the file, load it yourself and save the "
            "state dict alone (torch.save(model.state_dict(), ...) or safetensors' save_file)",
            "pickle-code",
        ) from None
    except Exception as err:  # a damaged archive makes torch raise anything; none may leak
        # (Named as the caller named it, not by the descriptor's name it was read through.)
        shown = str(err).replace(str(source), str(path))
        text = shown.splitlines()[0][:200] if shown else type(err).__name__
        if "TorchScript" in text:
            text = "a TorchScript archive, not a state dict; save model.state_dict() instead"
        raise _fail(path, f"cannot be read as a PyTorch checkpoint: {text}") from None


def _state_dict(path: Path, obj: Any) -> dict[str, torch.Tensor]:
    import torch

    if isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        nested = [k for k in STATE_DICT_KEYS if isinstance(obj.get(k), dict)]
        if len(nested) == 1:
            obj = obj[nested[0]]
    if not isinstance(obj, dict):
        raise _fail(path, f"holds a {type(obj).__name__}, not a dict of tensors (a state dict)")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        shown = ", ".join(repr(k)[:80] for k in bad[:5])
        raise _fail(
            path,
            f"is not a state dict: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} ({shown}) "
            f"are not tensors named by strings (weights nested under one of "
            f"{', '.join(STATE_DICT_KEYS)} are found)",
        )
    return obj


def _check_dense(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse what has no single storage of plain values to read: sparse and nested tensors
    and tensors not in CPU memory (asking their storage raises torch's own errors); and
    names that cannot be written as UTF-8 (a lone surrogate), as a safetensors header's are."""
    import torch

    for name, t in tensors.items():
        if not is_utf8(name):
            raise _fail(path, f"tensor name {name!r} holds a lone surrogate escape", "header-utf8")
        if t.is_nested:
            raise _fail(path, f"tensor {name!r} is a nested tensor; save its components as tensors")
        if t.layout != torch.strided or t.device.type != "cpu":
            raise _fail(
                path,
                f"tensor {name!r} is not a dense tensor ({t.layout}); save it dense "
                "(tensor.to_dense()) to convert it",
            )


def _check_size(path: Path, name: str, t: torch.Tensor, file_size: int) -> None:
    """Refuse a tensor larger than the whole file: only a view with zero (or overlapping)
    strides can be, and the conversion writes its every byte (a stride-0 view of one value
    may claim 2**64 bytes, past what a file offset holds), as the safetensors rule refuses
    sizes past what the file holds."""
    size = int(t.numel()) * t.element_size()
    if size <= file_size:
        return
    beyond = " (past 2**63, more than any file can hold)" if size >= 2**63 else ""
    raise _fail(
        path,
        f"tensor {name!r} of shape {list(t.shape)[:8]} is {size:,} bytes{beyond}, more than the "
        f"whole file holds ({file_size:,} bytes): a view with zero strides, which the "
        "conversion would write out in full; save it with .clone() if it is meant to be that "
        "large",
        "overflow",
    )


def _storage_offsets(
    tensors: Mapping[str, torch.Tensor], members: dict[str, tuple[int, int]]
) -> dict[int, int] | None:
    """File offset of each storage, by its address; None where the addresses do not line up
    with the archive (then every tensor is read through its view)."""
    ptrs: dict[int, int] = {}
    for t in tensors.values():
        st = t.untyped_storage()
        if st.nbytes():
            ptrs[st.data_ptr()] = st.nbytes()
    sizes = {start: size for start, size in members.values() if size}
    if not ptrs or not sizes:
        return None
    # The mapping's start is the lowest storage's address minus its member's offset; which
    # member that is, is not known (storages of an ignored optimizer may come first), so each
    # is tried, and only a start under which every storage is a member of its size is taken.
    lowest = min(ptrs)
    for first in sorted(sizes):
        base = lowest - first
        if all(sizes.get(ptr - base, -1) >= nbytes for ptr, nbytes in ptrs.items()):
            return {ptr: ptr - base for ptr in ptrs}
    return None


def _open(p: Path) -> int:
    """The file, opened once where its name leads now, without waiting on a FIFO."""
    try:
        fd = open_resolved(resolve_path(p))
    except FileNotFoundError:
        raise _fail(p, "file does not exist", "missing") from None
    except OSError as err:
        raise _fail(p, f"cannot be opened ({err.strerror})", "unreadable") from None
    if regular(fd) is None:
        shown = kind(os.fstat(fd).st_mode)
        os.close(fd)
        raise _fail(p, f"is a {shown}, not a file; remove it or put the file there", "not-a-file")
    return fd


def read_pickle(
    path: str | os.PathLike[str], within: Path | None = None, *, fd: int | None = None
) -> tuple[PickleHeader, dict[str, torch.Tensor]]:
    """Read a PyTorch checkpoint: its header (names, dtypes, shapes, byte ranges) and its
    tensors, each a copy-on-write view of the memory-mapped file.

    ``within``: the folder the file must stay in (a shard an index names), checked on the
    file as it is opened, not on its name beforehand. ``fd``: the file, already opened and
    checked by the caller, who keeps it (read through it, and left open).
    """
    p = Path(path)
    own = fd is None
    if fd is None:
        fd = _open(p) if within is None else open_in_folder(within, p, f"shard {p.name!r}")
    try:
        st = os.fstat(fd)
        # Every later read goes through the descriptor's own name: a file swapped since it
        # was opened is never the one read.
        source = fd_path(fd, p)
        members, byteorder = _members(p, source)
        tensors = _state_dict(p, _load(p, source))
    finally:
        if own:
            os.close(fd)  # (torch's map of the file keeps it)
    if byteorder not in (None, b"little"):
        raise _fail(p, "was saved on a big-endian machine; weightmap reads little-endian data")
    names = _torch_dtypes()
    _check_dense(p, tensors)
    offsets = _storage_offsets(tensors, members)
    infos: dict[str, TensorInfo] = {}
    strided = set()
    for name, t in tensors.items():
        _check_size(p, name, t, st.st_size)
        resolved = t.is_conj() or t.is_neg()
        if resolved:
            # A lazily conjugated or negated view: its storage holds the values before the
            # conjugation or negation, so its bytes are not its values. Resolved here (a copy
            # in memory, of such rare tensors alone) and read as a view, never as a range.
            t = tensors[name] = t.resolve_conj().resolve_neg()
        dtype = names.get(t.dtype)
        if dtype is None:
            raise _fail(p, f"tensor {name!r} is {t.dtype}, which safetensors has no name for")
        size = int(t.numel()) * t.element_size()
        storage = t.untyped_storage()
        begin = int(t.storage_offset()) * t.element_size()
        if (
            not resolved
            and offsets is not None
            and storage.data_ptr() in offsets
            and t.is_contiguous()
        ):
            begin += offsets[storage.data_ptr()]
        elif size:
            strided.add(name)
        infos[name] = TensorInfo(name, dtype, tuple(t.shape), begin, begin + size)
    header = PickleHeader(
        path=str(p),
        header_size=0,
        tensors=MappingProxyType(infos),
        metadata=None,
        file_size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        strided=frozenset(strided),
    )
    return header, tensors


_MADV_DONTNEED = 4  # Linux; mmap.MADV_DONTNEED where Python defines it


def release_pages(
    header: PickleHeader, tensors: Mapping[str, torch.Tensor], begin: int, end: int
) -> None:
    """Drop from this process the mapped pages of bytes ``[begin, end)`` of the file.

    torch maps the whole file once; its start is found from a tensor with a byte range (its
    address minus its file offset) and must be page-aligned, or nothing is done. As
    ``Checkpoint.release`` for safetensors: the bytes stay in the page cache, a later read maps
    them again, and anything written through a view of those pages is lost, so only for
    readers that never write to their views.
    """
    anchor = next(
        (n for n, info in header.tensors.items() if info.nbytes and n not in header.strided), None
    )
    import ctypes

    if anchor is None or end <= begin or not hasattr(ctypes, "CDLL"):
        return
    base = tensors[anchor].data_ptr() - header.tensors[anchor].begin
    page = mmap.PAGESIZE
    if base % page:
        return
    start = begin - begin % page
    stop = min(end + -end % page, header.file_size + -header.file_size % page)
    if stop <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(base + start, stop - start, getattr(mmap, "MADV_DONTNEED", _MADV_DONTNEED))
    except (AttributeError, OSError):  # no madvise here: the pages stay, which is only memory
        return
