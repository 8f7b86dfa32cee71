"""A checkpoint: one safetensors file, or shards with an index, plus an optional config.json.

Opening a checkpoint reads and validates every header and cross-checks the index, but reads
no tensor data. Tensor bytes are reached either as a byte range of a file (for copies in the
kernel) or as a memory-mapped, zero-copy torch view (for transforms).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import re
import threading
import weakref
from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, itemgetter, sub
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

from weightmap.errors import CheckpointError, FormatError
from weightmap.format.dtypes import DTYPES, SpecTable, TensorSpec, sized_specs
from weightmap.format.header import Header, TensorInfo, TensorTable, read_header_fd
from weightmap.format.names import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME, SINGLE_NAME
from weightmap.format.slots import shared
from weightmap.format.text import is_utf8
from weightmap.fs.fdlimit import make_room, open_now
from weightmap.fs.gcpause import gc_paused
from weightmap.fs.lock import folder_lock
from weightmap.inputs.opening import open_checked, read_folder_json
from weightmap.inputs.pickles import (
    PickleHeader,
    is_pickle,
    prefixed_header,
    read_pickle,
    release_pages,
)
from weightmap.inputs.sidefiles import cache_blobs, resolve_path
from weightmap.inputs.sniff import refuse_foreign, sniff_fd

if TYPE_CHECKING:
    import torch

__all__ = [
    "TORCH_DIM_MAX",
    "Checkpoint",
    "TensorLocation",
    "check_torch_shape",
    "refuse_escape",
    "resolve_shard",
]


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes live: ``length`` bytes at ``offset`` in ``path``."""

    path: Path
    offset: int
    length: int


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # ENAMETOOLONG and friends: not a shard we can read
        return False


def resolve_shard(root: Path, name: object, listed_in: Path, what: str = "weight_map") -> Path:
    """Resolve a shard name read from a file (an index, a journal), refusing anything that
    leaves the folder: separators, ``..``, absolute paths, and links pointing elsewhere.

    ``what`` names where the name came from, for the message.
    """
    if (
        not isinstance(name, str)
        or not name
        or "/" in name
        or "\\" in name
        or name in (".", "..")
        or "\x00" in name
        or Path(name).is_absolute()
        or not is_utf8(name)
    ):
        raise CheckpointError(
            f"{what} names shard {str(name)[:200]!r}; shards must be plain file names in the "
            "checkpoint's folder",
            path=listed_in,
            rule="shard-name",
        )
    path = root / name
    refuse_escape(root, path, listed_in)
    return path


def refuse_escape(root: Path, path: Path, listed_in: Path | None = None) -> Path | None:
    """Refuse (``shard-escape``) the weight file ``path`` of folder ``root`` where it is a link
    that leaves the folder (see :func:`_outside`); the error names ``listed_in`` (the
    index that names the file), or the file itself. Returns where the name leads, as checked
    (None for a loop of links: it is refused as it is opened)."""
    try:
        resolved = resolve_path(path)
        outside = _outside(root, resolved)
    except OSError as err:  # e.g. a name longer than the file system allows
        if err.errno == errno.ELOOP:
            return None
        raise CheckpointError(
            f"shard {path.name[:80]!r} cannot be resolved ({err.strerror})",
            path=listed_in or path,
            rule="shard-name",
        ) from None
    if outside is not None:
        raise CheckpointError(
            f"shard {path.name!r} is a link that leaves the checkpoint's folder (to {outside}); "
            "weightmap reads a checkpoint's weights from its own folder only: copy what it "
            "points to into the folder (or, for a checkpoint of one file, give the path it "
            "points to)",
            path=listed_in or path,
            rule="shard-escape",
        )
    return resolved


def open_weight(path: Path, resolved: Path | None) -> int:
    """The weight file ``path`` opened once, read-only, at ``resolved`` (where
    :func:`refuse_escape` found its name leads), one folder at a time without following a
    link (``fs/safeopen.open_resolved``): a part of the path swapped for a link since it was
    checked fails the open (``changed``), and what is read is the file that was checked.
    Every later read of the file (its kind, its header, its map, the copies of its bytes)
    goes through this descriptor, not the name."""
    if resolved is None:
        raise CheckpointError(
            "is a link that cannot be followed (a loop of links); fix or remove the link",
            path=path,
            rule="dangling-link",
        )
    try:
        return open_checked(resolved, path, f"shard {path.name!r}")
    except FileNotFoundError:
        if (broken := _broken_link(path)) is not None:
            raise CheckpointError(
                f"{broken}; fix or remove the link", path=path, rule="dangling-link"
            ) from None
        raise FormatError("file does not exist", path=path, rule="missing") from None


def _outside(root: Path, resolved: Path) -> Path | None:
    """``resolved`` (where a shard of folder ``root`` leads) where it is out of the folder;
    None if it stays in it.

    A link may point anywhere; it is followed only if it stays in the folder, or, in a hub
    cache's snapshot (or a subfolder of one), leads into that repository's ``blobs/`` folder
    (the cache is a farm of such links).
    """
    real_root = resolve_path(root)
    blobs = cache_blobs(real_root)
    in_cache = blobs is not None and resolved.parent == blobs
    # (A link to a file in a subfolder stays in the folder as well.)
    return None if resolved.is_relative_to(real_root) or in_cache else resolved


# torch sizes are signed 64-bit; the format's are u64, so an empty tensor may have a
# dimension torch cannot hold (`[0, 2**63]`).
TORCH_DIM_MAX = 2**63 - 1


def check_torch_shape(name: str, shape: tuple[int, ...], path: Path | None = None) -> None:
    """Refuse a shape torch cannot represent, with a FormatError (rule ``torch-shape``)."""
    if any(d > TORCH_DIM_MAX for d in shape):
        raise FormatError(
            f"shape {list(shape)[:8]} has a dimension over 2**63 - 1, which the format allows "
            "but a torch tensor cannot have; convert the checkpoint into a new folder instead "
            "(the converter never makes a torch tensor of an empty one)",
            path=path,
            tensor=name,
            rule="torch-shape",
        )


_SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.(?P<ext>safetensors|bin)")
# PyTorch checkpoints, as transformers names them; Meta's model-parallel shards.
PICKLE_SINGLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
# A PEFT adapter folder's weights (read when the folder holds no model weights): the
# `adapter` input of a LoRA merge.
ADAPTER_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_CONSOLIDATED = re.compile(r"consolidated\.(\d+)\.pth")
# The columns of a checkpoint's table that its specs are made of (``Checkpoint.specs``).
_INFO = itemgetter(1)
_NAME, _DTYPE, _SHAPE = attrgetter("name"), attrgetter("dtype"), attrgetter("shape")
_BEGIN, _END = attrgetter("begin"), attrgetter("end")


def _check_complete(
    root: Path, index_path: Path, index: dict[str, Any], headers: Mapping[Path, Header]
) -> None:
    """Refuse an index that leaves out a shard of its own series, or promises more bytes.

    A tensor the index does not name is never read, so a shard left out of the index would
    be dropped without a word. A shard belongs to the series when its name has the indexed
    shards' stem and count (``model-00002-of-00002`` beside ``model-00001-of-00002``); other
    ``.safetensors`` files (a consolidated copy, another sharding) are not part of it.
    """
    series = {
        (m["stem"], m["n"], m["ext"])
        for p in headers
        if (m := _SHARD_NAME.fullmatch(p.name)) is not None
    }
    indexed = {p.name for p in headers}
    for candidate in sorted([*root.glob("*.safetensors"), *root.glob("*.bin")]):
        m = _SHARD_NAME.fullmatch(candidate.name)
        if m and (m["stem"], m["n"], m["ext"]) in series and candidate.name not in indexed:
            raise CheckpointError(
                f"{candidate.name} is in the folder but the index names no tensor in it, so its "
                f"tensors would be lost; regenerate the index if it belongs to this checkpoint "
                f"(every tensor listed in {index_path.name}), or move it out of the folder",
                path=index_path,
                rule="unindexed-shard",
            )
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if not isinstance(total, int) or isinstance(total, bool):
        return
    if any(isinstance(h, PickleHeader) for h in headers.values()):
        # Tied tensors share one storage in a pickle and are counted twice in total_size.
        return
    # Writers count total_size as the tensor bytes, some as the file sizes: more than the
    # files hold in all means shards are missing from the index and the folder alike.
    held = sum(h.file_size for h in headers.values())
    if total > held:
        stored = sum(t.nbytes for h in headers.values() for t in h.tensors.values())
        raise CheckpointError(
            f"the index's total_size is {total:,} bytes but its shards hold {stored:,} bytes of "
            f"tensors ({held:,} bytes with headers): shards are missing; download them, or "
            "correct total_size if the checkpoint is complete",
            path=index_path,
            rule="index-total-size",
        )


def _broken_link(path: Path) -> str | None:
    """What is wrong with ``path`` if it is a symbolic link that leads to nothing: a link to
    a missing file, or a loop of links (``a -> b -> a``, or a link to itself); else None."""
    try:
        if not path.is_symlink():
            return None
        target = os.readlink(path)
    except OSError:  # too long a name, or gone since: no link to speak of
        return None
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"is a symbolic link to {target} that leads back to itself (a loop of links)"
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"is a symbolic link to {target}, which does not exist"
    return None


def _refuse_not_file(path: Path, name: str) -> None:
    """Refuse ``path`` if something other than a regular file (or a link to one) is there."""
    if (broken := _broken_link(path)) is not None:
        raise CheckpointError(
            f"{name} {broken}; fix or remove the link",
            path=path,
            rule="dangling-link",
        )
    if path.exists() and not path.is_file():
        kind = "folder" if path.is_dir() else "special file (a FIFO, socket or device)"
        raise CheckpointError(
            f"{name} is a {kind}, not a file; remove it or put the file there",
            path=path,
            rule="not-a-file",
        )


def _read_config(root: Path, name: str, required: bool = False) -> dict[str, Any] | None:
    """The JSON object in ``root / name``; None when it is absent and not ``required``."""
    config_path = root / name
    if not config_path.is_file():
        # Absent means absent: a folder, FIFO or link to nothing under the name is a broken
        # checkpoint, not one without a config (which would be converted without a word).
        _refuse_not_file(config_path, name)
        if not required:
            return None
        raise CheckpointError(
            f"the mapping reads its config from {name} (`config from`), which the folder does "
            "not have",
            path=root,
            rule="missing-config",
        )
    loaded = read_folder_json(root, config_path, name)
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"{name} holds a JSON {type(loaded).__name__}, not an object",
            path=config_path,
            rule="config",
        )
    return loaded


def _close_all(fds: MutableMapping[Path, int]) -> None:
    """Close every descriptor of ``fds`` and empty it."""
    while fds:
        _path, fd = fds.popitem()
        with contextlib.suppress(OSError):
            os.close(fd)


class _Descriptors:
    """A checkpoint's weight files as opened once (``open_weight``), and whether it closes
    them: a joined checkpoint (several inputs, ``join.py``) reads through its parts' own
    descriptors, which the parts close."""

    def __init__(self) -> None:
        self.fds: MutableMapping[Path, int] = {}
        self.owned = True
        self.parts: list[Checkpoint] = []  # (a joined checkpoint's: whose descriptors it reads)

    def close(self) -> None:
        if self.owned:
            _close_all(self.fds)
            return
        # Borrowed: only let go of them (the parts close their own).
        self.parts = []
        self.fds = {}


def refuse_missing(p: Path) -> None:
    """Raise the error of a checkpoint path that is not there (a dangling link said as one)."""
    if p.exists():
        return
    if (broken := _broken_link(p)) is not None:
        # Not "does not exist": the name is there, and the link is what to fix.
        raise CheckpointError(f"{broken}; fix or remove the link", path=p, rule="dangling-link")
    raise CheckpointError("does not exist", path=p, rule="missing")


class Checkpoint:
    """A validated safetensors checkpoint.

    ``Checkpoint.open(path)`` takes a folder (with ``model.safetensors`` or shards plus
    ``model.safetensors.index.json``, and optionally ``config.json``) or a single ``.safetensors``
    file (whose folder's ``config.json`` is used if present).

    >>> ckpt = Checkpoint.open("examples/eagle3-speculators")
    >>> len(ckpt.tensors)
    16
    """

    def __init__(
        self,
        root: Path,
        headers: Mapping[Path, Header],
        tensors: Mapping[str, tuple[Path, TensorInfo]] | None,
        config: dict[str, Any] | None,
        index_path: Path | None,
    ) -> None:
        self.root = root
        self.headers: Mapping[Path, Header] = MappingProxyType(dict(headers))
        # None: made from the headers when a name is first looked up (see _tensors).
        self._located: Mapping[str, tuple[Path, TensorInfo]] | None = (
            None if tensors is None else MappingProxyType(dict(tensors))
        )
        self._config = config
        self.index_path = index_path
        self._maps: dict[Path, mmap.mmap] = {}
        # Each weight file, opened once (open_weight): read through it alone. Closed by close(),
        # or when the checkpoint is freed unclosed.
        self._held = _Descriptors()
        weakref.finalize(self, self._held.close)
        self._loaded: dict[Path, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        # The tensors that are no byte range (strided PyTorch tensors): none in safetensors.
        self._strided = frozenset(
            name for h in self.headers.values() if isinstance(h, PickleHeader) for name in h.strided
        )
        self._specs: Sequence[TensorSpec] | None = None
        # The prefix each file's tensors carry in this checkpoint (``adapter:``, a mapping's
        # other inputs: binding.py); a PyTorch file read again is renamed the same way.
        self.prefixes: Mapping[Path, str] = MappingProxyType({})

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def empty(cls, root: Path, config_name: str = CONFIG_NAME) -> Checkpoint:
        """The folder ``root`` as a checkpoint of no tensors: its config (``config_name``,
        required unless it is config.json) and, to the executor, its side files. The main
        input of a mapping whose tensors all come from its declared inputs (the rank files of
        a Meta folder, read as a family)."""
        if not root.is_dir():
            raise CheckpointError(
                "is not a folder: a mapping that reads its rank files from the main input "
                "needs the folder that holds them",
                path=root,
                rule="layout",
            )
        with folder_lock(root, exclusive=False):
            cls._check_journal(root)
            config = _read_config(root, config_name, required=config_name != CONFIG_NAME)
        return cls(root, {}, {}, config, None)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        config_name: str = CONFIG_NAME,
        rank_file: bool = False,
    ) -> Checkpoint:
        """Open and validate a checkpoint folder or file.

        Headers, index and config are read under the folder's shared lock (see
        ``fs/lock.py``), so they are all from before or all from after an in-place
        rename; a rename in progress is waited for. ``config_name`` is the JSON file read as
        the config (a mapping's ``config from "params.json"``): config.json is optional,
        another file named this way must exist. ``rank_file``: ``path`` is one rank file of a
        family (``consolidated.03.pth``) that a mapping reads with its siblings, which is
        otherwise refused.
        """
        p = Path(path)
        refuse_missing(p)
        if not p.is_file() and not p.is_dir():
            raise CheckpointError(
                "is neither a file nor a folder; give a checkpoint folder or a .safetensors file",
                path=p,
                rule="layout",
            )
        with folder_lock(p.parent if p.is_file() else p, exclusive=False), gc_paused():
            if rank_file and p.is_file():
                cls._check_journal(p.parent)
                ckpt = cls._from_files(p.parent, [p], None)
            else:
                ckpt = cls._open_unlocked(p)
        if config_name != CONFIG_NAME:
            try:
                ckpt._config = _read_config(ckpt.root, config_name, required=True)
            except BaseException:
                ckpt.close()  # (its files, not kept open as long as the error is)
                raise
        return ckpt

    @classmethod
    def _open_unlocked(cls, p: Path) -> Checkpoint:
        if p.is_file():
            cls._check_journal(p.parent)
            cls._refuse_model_parallel(p)
            return cls._from_files(p.parent, [p], None)
        root = p
        cls._check_journal(root)
        index = root / INDEX_NAME
        single = root / SINGLE_NAME
        for special in (index, single, root / PICKLE_INDEX, root / PICKLE_SINGLE):
            _refuse_not_file(special, special.name)
        if index.is_file():
            return cls._from_index(root, index)
        if single.is_file():
            return cls._from_files(root, [single], None)
        if (root / PICKLE_INDEX).is_file():
            return cls._from_index(root, root / PICKLE_INDEX)
        if (root / PICKLE_SINGLE).is_file():
            return cls._from_files(root, [root / PICKLE_SINGLE], None)
        for name in ADAPTER_NAMES:
            _refuse_not_file(root / name, name)
            if (root / name).is_file():
                return cls._from_files(root, [root / name], None)
        pickles = sorted(
            q for q in root.iterdir() if q.name.endswith((".pt", ".pth")) and _is_file(q)
        )
        if len(pickles) == 1:
            cls._refuse_model_parallel(pickles[0])
            return cls._from_files(root, pickles, None)
        if pickles:
            cls._refuse_model_parallel(pickles[0])
        found = sorted(q.name for q in root.glob("*.safetensors") if _is_file(q))
        found += [q.name for q in pickles]
        hint = (
            f"; found {', '.join(found[:5])}{' ...' if len(found) > 5 else ''} — pass one file "
            "directly, or add an index"
            if found
            else ""
        )
        raise CheckpointError(
            f"folder has neither {SINGLE_NAME} nor {INDEX_NAME} (nor {PICKLE_SINGLE}, its index "
            f"or a single .pt/.pth file){hint}",
            path=p,
            rule="layout",
        )

    @staticmethod
    def _refuse_model_parallel(path: Path) -> None:
        """Meta's ``consolidated.NN.pth`` shards each hold a slice of every tensor."""
        if not _CONSOLIDATED.fullmatch(path.name):
            return
        shards = sorted(q.name for q in path.parent.glob("consolidated.*.pth"))
        if len(shards) > 1:
            raise CheckpointError(
                f"holds {len(shards)} model-parallel shards ({shards[0]} ... {shards[-1]}): each "
                "holds a slice of every tensor, split along a dimension that depends on the "
                "layer, so no one shard is a checkpoint; read them all as one family of inputs "
                "(`--preset llama-meta-ranks-to-hf` joins and converts Meta's Llama ranks), or "
                'write a mapping with `input ranks files "consolidated.{r}.pth"`',
                path=path.parent,
                rule="model-parallel",
            )

    @staticmethod
    def _check_journal(root: Path) -> None:
        # Called under the folder's shared lock: a live writer would hold it exclusively, so
        # a journal here is one whose writer died.
        if (root / JOURNAL_NAME).exists() or (root / JOURNAL_NAME).is_symlink():
            raise CheckpointError(
                "an in-place rewrite of this checkpoint was interrupted; run "
                f"`weightmap clean {root}` to finish it before reading the checkpoint",
                path=root,
                rule="interrupted-inplace",
            )

    @classmethod
    def _from_index(cls, root: Path, index_path: Path) -> Checkpoint:
        # (A tensor named twice in the weight map, maybe in two shards: refused, not the last
        # of the two taken.)
        index = read_folder_json(root, index_path, index_path.name, unique_keys=True)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise CheckpointError(
                'index must be a JSON object with a "weight_map" object',
                path=index_path,
                rule="index",
            )
        weight_map: dict[str, Any] = index["weight_map"]
        shard_names: dict[str, Path] = {}
        try:
            # The shards in order of first mention, found at C speed (an index lists every
            # tensor); a value that is no string is refused below by resolve_shard.
            listed: Iterable[Any] = dict.fromkeys(weight_map.values())
        except TypeError:  # a list or object among the values: not hashable
            listed = weight_map.values()
        for shard in listed:
            if not isinstance(shard, str) or shard not in shard_names:
                shard_names[shard] = resolve_shard(root, shard, index_path)
        missing = [name for name, p in shard_names.items() if not _is_file(p)]
        for name in missing:
            # A folder, FIFO or broken link under the name is no missing shard: said as what
            # it is (and a FIFO is never opened).
            with contextlib.suppress(OSError):  # too long a name, say: missing, below
                _refuse_not_file(shard_names[name], f"shard {name!r}")
        if missing:
            raise CheckpointError(
                f"index names shard(s) that do not exist: {', '.join(sorted(missing))}",
                path=index_path,
                rule="missing-shard",
            )
        # Each shard's names taken out of the index as its header is read, and compared at C
        # speed (an index lists every tensor): the index's own copy of every name, and its
        # shard's, go as the headers' come, and no second table of every name is made.
        shard_of = {path: shard for shard, path in shard_names.items()}
        problems: list[str] = []

        def take(path: Path, header: Header) -> None:
            shard = shard_of[path]
            indexed = list(map(weight_map.pop, header.tensors, repeat(None)))
            if indexed.count(shard) == len(indexed):
                return
            for tensor, where in zip(header.tensors, indexed, strict=True):
                if where is None:
                    problems.append(f"{tensor!r} is stored in {path.name} but not indexed")
                elif where != shard:
                    problems.append(f"{tensor!r} is indexed in {where} but stored in {path.name}")

        ckpt = cls._from_files(root, list(shard_names.values()), index_path, take)
        try:
            problems[:0] = [f"{tensor!r} is in the index but in no shard" for tensor in weight_map]
            if problems:
                shown = "; ".join(problems[:10])
                more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
                raise CheckpointError(
                    f"index disagrees with the shards' headers: {shown}{more}",
                    path=index_path,
                    rule="index-mismatch",
                )
            _check_complete(root, index_path, index, ckpt.headers)
        except BaseException:
            ckpt.close()  # (its files, not kept open as long as the error is)
            raise
        return ckpt

    @classmethod
    def _from_files(
        cls,
        root: Path,
        files: list[Path],
        index_path: Path | None,
        each: Callable[[Path, Header], None] | None = None,
    ) -> Checkpoint:
        """The checkpoint of these files (``each(path, header)`` called as each is read)."""
        headers: dict[Path, Header] = {}
        # Every name met so far, to refuse one stored twice (by C calls: a checkpoint may hold
        # 100,000 tensors). The table of names to entries is made only when first asked for.
        seen: set[str] = set()
        loaded: dict[Path, dict[str, torch.Tensor]] = {}
        fds: dict[Path, int] = {}
        # Every file stays open while the checkpoint is, and its map holds a descriptor of its
        # own: room for them all beside what the process holds open already (other inputs, a
        # family's members, the other side of a diff), first (a soft limit of 1,024 open files
        # and a checkpoint of more shards, fs/fdlimit.py).
        make_room(open_now() + 2 * len(files))
        try:
            for f in files:
                header: Header
                # Whatever found it (an index, the folder's usual names, the caller), a weight
                # file that is a link must stay in its folder, or lead into the hub cache's
                # blobs: a downloaded folder's model.safetensors linked to a private checkpoint
                # elsewhere would otherwise be converted into an output its user may publish.
                # Then it is opened once, where it was checked to lead, and read through that
                # descriptor alone from here to the last byte copied.
                fd = fds[f] = open_weight(f, refuse_escape(root, f))
                # (By its bytes, whatever its name.)
                kind = "pytorch" if is_pickle(f) else sniff_fd(fd, f)
                if kind == "pytorch":
                    header, loaded[f] = read_pickle(f, fd=fd)
                else:
                    refuse_foreign(f, kind)
                    header = read_header_fd(fd, f)
                if not seen.isdisjoint(header.tensors):
                    name = next(n for n in header.tensors if n in seen)
                    first = next(p for p, h in headers.items() if name in h.tensors)
                    raise CheckpointError(
                        f"tensor is stored in both {first.name} and {f.name}",
                        path=f,
                        tensor=name,
                        rule="duplicate-name",
                    )
                headers[f] = header
                seen.update(header.tensors)
                if each is not None:
                    each(f, header)
            ckpt = cls(root, headers, None, _read_config(root, CONFIG_NAME), index_path)
        except BaseException:
            _close_all(fds)
            raise
        ckpt._fds.update(fds)
        ckpt._loaded = loaded
        return ckpt

    # -- metadata ------------------------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any] | None:
        """A fresh copy of config.json, or None when the checkpoint has none."""
        return None if self._config is None else json.loads(json.dumps(self._config))

    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` entries every file agrees on.

        A key whose value differs between shards describes no single file, so it is left out
        (one file missing a key does not drop it: it says nothing against it).
        """
        merged: dict[str, str] = {}
        conflicts: set[str] = set()
        for header in self.headers.values():
            for key, value in (header.metadata or {}).items():
                if merged.setdefault(key, value) != value:
                    conflicts.add(key)
        return {k: v for k, v in merged.items() if k not in conflicts}

    @property
    def files(self) -> tuple[Path, ...]:
        """The safetensors files, in index order."""
        return tuple(self.headers)

    @property
    def tensors(self) -> Mapping[str, TensorInfo]:
        """Every tensor by name, file by file, in data order."""
        return MappingProxyType({name: info for name, (_, info) in self._tensors.items()})

    def specs(self) -> Sequence[TensorSpec]:
        """Every tensor's name, dtype and shape, in storage order."""
        # Made once: the compiler and the executor both ask, and 100,000 specs take a while.
        if self._specs is None:
            # A safetensors entry's byte range was checked against its dtype and shape when
            # the header was read: its size need not be counted again. A strided PyTorch
            # tensor's range is its storage's, not its size.
            strided = self._strided
            tables = [h.tensors for h in self.headers.values()]
            if self._located is None and all(isinstance(t, TensorTable) for t in tables):
                # Straight from the headers' columns, as columns: no spec made per tensor.
                columns = cast(list[TensorTable], tables)
                self._specs = SpecTable(
                    tuple(chain.from_iterable(t.names for t in columns)),
                    tuple(chain.from_iterable(t.dtypes for t in columns)),
                    tuple(chain.from_iterable(t.shapes for t in columns)),
                    tuple(shared(list(chain.from_iterable(map(TensorTable.sizes, columns))))),
                )
                return self._specs
            if not strided:
                infos = list(map(_INFO, self._tensors.values()))
                sizes = shared(list(map(sub, map(_END, infos), map(_BEGIN, infos))))
                fields = (map(_NAME, infos), map(_DTYPE, infos), map(_SHAPE, infos), sizes)
                with gc_paused():  # (made column by column: no Python step per tensor)
                    self._specs = tuple(sized_specs(len(infos), *fields))
                return self._specs
            with gc_paused():
                self._specs = tuple(
                    TensorSpec(info.name, info.dtype, info.shape)
                    if info.name in strided
                    else TensorSpec.sized(info.name, info.dtype, info.shape, info.end - info.begin)
                    for _, info in self._tensors.values()
                )
        return self._specs

    def file_of(self, name: str) -> Path:
        """The file that stores tensor ``name``."""
        return self._lookup(name)[0]

    @property
    def format(self) -> str:
        """``"safetensors"``, or ``"pytorch"`` for a checkpoint of PyTorch pickles."""
        pickled = any(isinstance(h, PickleHeader) for h in self.headers.values())
        return "pytorch" if pickled else "safetensors"

    @property
    def strided(self) -> frozenset[str]:
        """The tensors that are no byte range of their file (:meth:`has_range` is False)."""
        return self._strided

    @property
    def _tensors(self) -> Mapping[str, tuple[Path, TensorInfo]]:
        """Every tensor by name: its file and entry, made on first use (file by file, in data
        order), as a conversion that only moves bytes reads the headers' columns instead."""
        if self._located is None:
            located: dict[str, tuple[Path, TensorInfo]] = {}
            with gc_paused():
                for path, header in self.headers.items():
                    # (name, (file, entry)) pairs made by C calls; repeat is endless.
                    pairs = zip(repeat(path), header.tensors.values())
                    located.update(zip(header.tensors, pairs, strict=False))
            self._located = MappingProxyType(located)
        return self._located

    def stored(self) -> Mapping[str, tuple[Path, TensorInfo]]:
        """Every tensor by name: the file that stores it and its header entry (read-only;
        the checkpoint's own table, for the executors' loops over every tensor)."""
        return self._tensors

    def has_range(self, name: str) -> bool:
        """True when tensor ``name`` is one byte range of its file (:meth:`location`); False
        for a PyTorch tensor that is not contiguous in its storage (read it with :meth:`view`)."""
        self._lookup(name)  # (a KeyError for a name the checkpoint lacks)
        return name not in self._strided

    def location(self, name: str) -> TensorLocation:
        """The byte range of tensor ``name`` in its file (see :meth:`has_range`)."""
        path, info = self._lookup(name)
        if not self.has_range(name):
            raise ValueError(f"tensor {name!r} is not one byte range of {path.name}")
        return TensorLocation(path, self.headers[path].data_start + info.begin, info.nbytes)

    def __iter__(self) -> Iterator[str]:
        if self._located is not None:
            return iter(self._located)
        return chain.from_iterable(h.tensors for h in self.headers.values())

    def __len__(self) -> int:
        if self._located is not None:
            return len(self._located)
        return sum(len(h.tensors) for h in self.headers.values())

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def _lookup(self, name: str) -> tuple[Path, TensorInfo]:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"checkpoint {self.root} has no tensor {name!r}") from None

    # -- data ------------------------------------------------------------------------------------

    def _map(self, path: Path) -> mmap.mmap:
        with self._lock:
            mm = self._maps.get(path)
            if mm is None:
                fd = self.reading(path)
                size = os.fstat(fd).st_size
                if size != self.headers[path].file_size:
                    raise FormatError(
                        f"file changed since it was opened ({size} bytes, expected "
                        f"{self.headers[path].file_size})",
                        path=path,
                        rule="changed",
                    )
                # ACCESS_COPY gives a writable buffer (torch.frombuffer warns on read-only
                # ones) whose pages stay shared with the page cache until written, which we
                # never do. (The map holds a descriptor of its own.)
                mm = self._maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            return mm

    @property
    def _fds(self) -> MutableMapping[Path, int]:
        return self._held.fds

    def adopt(self, path: Path, fd: int) -> None:
        """Read ``path``, one of this checkpoint's files, through ``fd``, which the checkpoint
        now owns (a checkpoint made from headers read elsewhere: a task on another node)."""
        self._fds[path] = fd

    def borrow(self, others: Iterable[Checkpoint]) -> None:
        """Read through the weight files of ``others`` as they opened them (a join of them):
        their descriptors, which they, not this checkpoint, close. Looked up in theirs at each
        read, never copied: once one of them is closed, its files are closed here too (a
        descriptor number copied could by then name another file)."""
        parts = list(others)
        self._held.owned = False
        self._held.parts = parts  # (kept alive with this checkpoint)
        self._held.fds = ChainMap(*(part._fds for part in parts))

    def reading(self, path: Path) -> int:
        """The descriptor ``path``, one of this checkpoint's weight files, is read through; a
        ``CheckpointError`` (``closed``) once the checkpoint is closed (never the file's name
        opened again)."""
        fd = self._fds.get(path)
        if fd is None:
            raise CheckpointError.closed(path)
        return fd

    @property
    def descriptors(self) -> Mapping[Path, int]:
        """Each weight file as this checkpoint opened it once, and reads it through: the
        checkpoint's own descriptors (read through them; never close them). Empty once
        closed."""
        return MappingProxyType(self._fds)

    def view(self, name: str) -> torch.Tensor:
        """A zero-copy torch tensor over the memory-mapped bytes of ``name``.

        The view stays valid for as long as it is referenced, after :meth:`close` too: it
        keeps its memory map alive. Copy-on-write, so writing to it never touches the file.
        F4 tensors come back as ``float4_e2m1fn_x2`` with the last dimension halved (two values
        per byte); dtypes that torch lacks (F6, and F8_E8M0 or F4 before the torch release
        that added them) come back as raw ``uint8`` bytes.
        """
        import torch

        path, info = self._lookup(name)
        if isinstance(self.headers[path], PickleHeader):
            return self._pickled(path)[name]
        check_torch_shape(name, info.shape, path)
        loc = self.location(name)
        mm = self._map(path)
        if loc.length == 0:
            raw = torch.empty(0, dtype=torch.uint8)
        else:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=loc.length, offset=loc.offset)
        dt = DTYPES[info.dtype]
        # F8_E8M0 and F4 are recent in torch (2.7, 2.8): an older build has no such dtype.
        known = dt.torch_name is not None and hasattr(torch, dt.torch_name)
        if known and dt.name == "F4" and info.shape and info.shape[-1] % 2 == 0:
            shape = (*info.shape[:-1], info.shape[-1] // 2)
            return raw.view(dt.torch()).reshape(shape)
        if not known or dt.name == "F4":
            # No torch dtype (F6, or this build lacks it), or F4 with an odd last dimension:
            # raw bytes only.
            return raw
        return raw.view(dt.torch()).reshape(info.shape)

    def _pickled(self, path: Path) -> dict[str, torch.Tensor]:
        with self._lock:
            tensors = self._loaded.get(path)
            if tensors is None:
                header, tensors = read_pickle(path, fd=self.reading(path))
                prefix = self.prefixes.get(path)
                if prefix:
                    header = prefixed_header(header, prefix)
                    tensors = {prefix + n: t for n, t in tensors.items()}
                if header != self.headers[path]:
                    raise FormatError("file changed since it was opened", path=path, rule="changed")
                self._loaded[path] = tensors
            return tensors

    def release(self, path: Path, begin: int, end: int) -> None:
        """Unmap from this process the pages that hold bytes ``[begin, end)`` of ``path``.

        The bytes stay in the page cache, and a later read through a view maps them again, so
        a reader that streams through a file keeps its resident memory to what it is reading.
        ``madvise(MADV_DONTNEED)`` also throws away anything written through a view of those
        pages (the map is copy-on-write): only for readers that never write to their views,
        never on a checkpoint whose views were handed out.
        """
        header = self.headers.get(path)
        if isinstance(header, PickleHeader):
            with self._lock:
                tensors = self._loaded.get(path)
            if tensors is not None:
                release_pages(header, tensors, begin, end)
            return
        with self._lock:
            mm = self._maps.get(path)
        if mm is None or end <= begin:
            return
        start = begin - begin % mmap.PAGESIZE
        stop = min(len(mm), end + -end % mmap.PAGESIZE)
        if stop > start:
            mm.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        """Let go of the memory maps; views handed out earlier stay valid.

        A view keeps its map alive (torch holds a reference to the buffer it was made from),
        and the map is unmapped when the last view of it is freed. Unmapping here instead would
        leave every view pointing at unmapped memory, and reading one would end the process.
        """
        with self._lock:
            self._maps.clear()
            self._loaded.clear()
            self._held.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.root)!r}, {len(self)} tensors in {len(self.headers)} file(s))"
