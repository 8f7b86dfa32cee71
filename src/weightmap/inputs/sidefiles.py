"""Side files: the other files of a model folder, carried into the output byte for byte.

A model folder is more than its weights and config.json: the tokenizer (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, ``tokenizer.model``), the chat template,
``generation_config.json``, ``preprocessor_config.json``, custom code behind ``auto_map``,
``README.md``. :func:`list_side_files` says which of them a conversion carries:

- every regular file of the folder and its subfolders, named by its path relative to the
  folder (``tokenizer/vocab.json``);
- not the files the conversion replaces: ``config.json`` (and a JSON file read as the config
  instead, such as Meta's ``params.json``), weights in any format (``.safetensors``, ``.bin``,
  ``.pt``, ``.pth``, ...: they hold the unconverted tensors) and their indexes;
- not hidden files and folders (``.git``, ``.cache``, ``.gitattributes``, weightmap's own
  journal and temporaries);
- a symbolic link is followed when it ends at a regular file inside the folder that would be
  carried under its own name or, in a hub cache's ``snapshots/<revision>/``, in that
  repository's ``blobs/`` (the file is copied, not the link); a link that leaves the folder, a
  link to a hidden file, the config, weights or an index, a dangling link, a link to a folder,
  a FIFO, a socket or a device is skipped with a warning.

:func:`copy_file` copies one file in the kernel (``copy_file_range``), never through memory,
holes left holes, and refuses a source that changed while it was copied.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from weightmap.errors import CheckpointError, ExecutionError
from weightmap.format.names import CONFIG_NAME
from weightmap.fs.safeopen import kind, open_resolved

__all__ = [
    "MAX_DEPTH",
    "MAX_SIDE_FILES",
    "WEIGHT_SUFFIXES",
    "FileSpec",
    "FolderFiles",
    "allocated",
    "bad_file_name",
    "cache_blobs",
    "copy_file",
    "data_ranges",
    "file_state",
    "inside_folder",
    "list_side_files",
    "open_side_file",
    "replaced_reason",
    "resolve_path",
    "same_bytes",
]

# Weights in the formats people publish; any of them beside the converted output would be the
# old tensors under old names.
WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz", ".onnx",
)  # fmt: skip
# A model folder holds tens of files; a walk that finds more is not in one (a home folder).
MAX_SIDE_FILES = 10_000
MAX_DEPTH = 16
MAX_NAME_CHARS = 1024
_COPY_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class FileSpec:
    """One side file of the input: its path relative to the folder, and its size."""

    name: str
    size: int


@dataclass(frozen=True)
class FolderFiles:
    """The side files of a folder, and a warning for each entry skipped for safety."""

    files: tuple[FileSpec, ...] = ()
    skipped: tuple[str, ...] = ()


def replaced_reason(name: str, config_name: str = CONFIG_NAME) -> str | None:
    """Why the conversion does not carry the file ``name`` (a relative path), or None.

    >>> replaced_reason("pytorch_model-00001-of-00002.bin"), replaced_reason("tokenizer.json")
    ('weights', None)
    """
    parts = PurePosixPath(name).parts
    if any(p.startswith(".") for p in parts):
        return "hidden"
    if name in (CONFIG_NAME, config_name):
        return "config"
    lower = parts[-1].lower()
    if lower.endswith(".index.json"):
        lower = lower[: -len(".index.json")]
        if lower.endswith(WEIGHT_SUFFIXES):
            return "index"
    if lower.endswith(WEIGHT_SUFFIXES):
        return "weights"
    return None


def bad_file_name(name: str) -> str | None:
    """Why ``name`` cannot be an output side file's name, or None if it can.

    A relative path of plain components inside the output folder: no absolute path, ``..``,
    ``.``, empty components, backslashes or control characters, and not a file the conversion
    itself writes (config.json, weights, indexes).
    """
    if not name:
        return "is empty"
    if len(name) > MAX_NAME_CHARS:
        return f"is longer than {MAX_NAME_CHARS} characters"
    if any(ord(ch) < 32 or ch == "\x7f" for ch in name) or "\\" in name:
        return "contains a control character or a backslash"
    if name.startswith("/"):
        return "is an absolute path; side files are named relative to the output folder"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, `.` or `..` component"
    if any(len(p.encode("utf-8", "replace")) > 255 for p in parts):
        return "has a component longer than 255 bytes"
    if parts[0].startswith(".weightmap"):
        return "is reserved for weightmap's own files"
    if replaced_reason(name) in ("config", "weights", "index"):
        return "is written by the conversion itself (config.json, weights and indexes)"
    for depth in range(1, len(parts)):
        # A folder under such a name could not be made beside the file of that name: the
        # writer would fail once every tensor is written.
        folder = "/".join(parts[:depth])
        if replaced_reason(folder) in ("config", "weights", "index"):
            return (
                f"is inside a folder named {folder!r}, the name of a file the conversion "
                "writes itself (config.json, weights and indexes)"
            )
    return None


def cache_blobs(root: Path) -> Path | None:
    """The ``blobs/`` folder whose files a hub cache snapshot's links point to, or None:
    ``root`` (resolved) is a snapshot folder ``snapshots/<revision>``, or a folder inside one
    (diffusers repositories keep a model per subfolder)."""
    for folder in (root, *root.parents[:2]):
        if folder.parent.name == "snapshots":
            return folder.parent.parent / "blobs"
    return None


def resolve_path(path: Path) -> Path:
    """``path.resolve()``, with a loop of symbolic links raised as ``OSError(ELOOP)``.

    Python before 3.13 raises ``RuntimeError`` for a loop, even when not strict: a checkpoint
    folder holding ``a -> b -> a`` would otherwise end a listing with a traceback. Callers
    catch ``OSError`` and treat a loop as they treat a link to nothing.
    """
    try:
        return path.resolve()
    except RuntimeError:  # "Symlink loop from ..." (3.11, 3.12)
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None


def inside_folder(resolved: Path, root: Path) -> bool:
    """Whether ``resolved`` (a resolved path) lies in the resolved folder ``root``, or is a
    file of the hub cache blobs its snapshot links to."""
    blobs = cache_blobs(root)
    return resolved.is_relative_to(root) or (blobs is not None and resolved.parent == blobs)


class _Walk:
    """The state of one listing: what was found, what was skipped and why."""

    def __init__(self, root: Path, config_name: str, exclude: Iterable[Path]) -> None:
        self.root = resolve_path(root)
        self.config_name = config_name
        self.exclude = {_entry_path(p) for p in exclude}
        self.files: list[FileSpec] = []
        self.skipped: list[str] = []
        self.seen = 0

    def skip(self, name: str, why: str) -> None:
        self.skipped.append(f"side file {name!r} is not carried: {why}")

    def count(self) -> None:
        self.seen += 1
        if self.seen > MAX_SIDE_FILES:
            raise CheckpointError(
                f"the folder holds more than {MAX_SIDE_FILES:,} files and folders, far more than "
                "a model folder; is it the right folder? To convert the weights alone, turn side "
                "files off (--no-side-files, side_files=False)",
                path=self.root,
                rule="too-many-files",
            )

    def folder(self, path: Path, rel: str, depth: int) -> None:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as err:
            self.skip(rel or ".", f"the folder cannot be read ({err.strerror})")
            return
        for entry in entries:
            self.count()
            name = f"{rel}/{entry.name}" if rel else entry.name
            if replaced_reason(name, self.config_name) is not None:
                continue
            self.entry(entry, name, depth)

    def entry(self, entry: os.DirEntry[str], name: str, depth: int) -> None:
        path = Path(entry.path)
        # The walk descends through the resolved root and real folders only, so ``path`` has
        # no link before its last part: a link that cannot be resolved is the entry itself.
        try:
            real = resolve_path(path)
        except OSError:
            real = path
        if real in self.exclude:
            return
        try:
            link = entry.is_symlink()
            st = os.stat(path) if link else entry.stat(follow_symlinks=False)
        except OSError as err:
            # A loop of links leads nowhere, as a dangling link does: skipped alike.
            why = "it is a link in a loop of links" if err.errno == errno.ELOOP else None
            self.skip(name, why or "it is a link to nothing")
            return
        if link and not inside_folder(real, self.root):
            self.skip(name, f"it is a link that leaves the folder (to {real})")
        elif link and stat.S_ISDIR(st.st_mode):
            # Before the target's name is looked at: a link to the folder itself (``latest ->
            # .``, ``sub/up -> ..``) has no name inside it.
            self.skip(name, "it is a link to a folder (links to folders are not followed)")
        elif link and (why := _target_reason(real, self.root, self.config_name)):
            self.skip(name, why)
        elif stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                self.skip(name, f"it is nested deeper than {MAX_DEPTH} folders")
            else:
                self.folder(path, name, depth + 1)
        elif not stat.S_ISREG(st.st_mode):
            self.skip(name, f"it is a {kind(st.st_mode)}, not a regular file")
        elif len(name) > MAX_NAME_CHARS or bad_file_name(name) is not None:
            self.skip(name[:200], "its name cannot be written")
        else:
            self.files.append(FileSpec(name, st.st_size))


def _entry_path(path: Path) -> Path:
    """Where ``path`` leads, or, for a link that leads nowhere (a loop), the entry itself in
    its resolved folder: an output folder given as such a link is still left out."""
    try:
        return resolve_path(path)
    except OSError:
        try:
            return resolve_path(path.parent) / path.name
        except OSError:
            return path.absolute()


def _target_reason(resolved: Path, root: Path, config_name: str = CONFIG_NAME) -> str | None:
    """Why a link inside the folder that ends at ``resolved`` is not followed, or None.

    A link is no way around the listing's own rules: one to ``.git/config`` (which may hold a
    token in a remote's URL) would carry a hidden file, one to the weights would carry the
    unconverted tensors under another name."""
    if not resolved.is_relative_to(root):
        return None  # a hub cache blob, named by its hash: the link's own name was checked
    target = resolved.relative_to(root).as_posix()
    if target == ".":
        return "it is a link to the folder itself"
    reason = replaced_reason(target, config_name)
    if reason is None:
        return None
    what = {"hidden": "a hidden file", "config": "the config", "index": "an index"}
    return (
        f"it is a link to {target!r}, {what.get(reason, 'weights')}, which is not carried "
        "under its own name either"
    )


def list_side_files(
    root: str | os.PathLike[str], *, config_name: str = CONFIG_NAME, exclude: Iterable[Path] = ()
) -> FolderFiles:
    """The side files of the folder ``root`` (see the module docstring), sorted by name.

    ``config_name`` is the file read as the config (not carried); ``exclude`` lists paths to
    leave out (an output folder inside the input folder).
    """
    walk = _Walk(Path(root), config_name, exclude)
    walk.folder(walk.root, "", 0)
    return FolderFiles(tuple(walk.files), tuple(walk.skipped))


def _changed(name: str, err: OSError, root: Path) -> CheckpointError:
    return CheckpointError(
        f"side file {name!r} cannot be opened ({err.strerror}); the folder changed since the "
        "plan was made: run the conversion again",
        path=root,
        rule="changed",
    )


def open_side_file(root: Path, name: str, size: int) -> int:
    """A read-only descriptor of side file ``name``, checked as the listing checked it.

    Refused (``CheckpointError``): a name that leaves the folder, a link that now points
    elsewhere, anything but a regular file, and a size other than the planned one (rule
    ``changed``: the folder changed since the plan was made).
    """
    try:
        real_root = resolve_path(root)
        path = real_root / name
        resolved = resolve_path(path)
    except OSError as err:  # a loop of links now, where the listing found a file
        raise _changed(name, err, root) from None
    if bad_file_name(name) is not None or not inside_folder(resolved, real_root):
        raise CheckpointError(f"side file {name!r} leaves the folder", path=root, rule="side-file")
    if resolved != path and (why := _target_reason(resolved, real_root)) is not None:
        # The listing skipped such links: one that points there now was changed since.
        raise CheckpointError(
            f"side file {name!r} is not carried: {why}; the folder changed since the plan was "
            "made: run the conversion again",
            path=root,
            rule="changed",
        )
    try:
        fd = open_resolved(resolved)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            raise CheckpointError(
                f"side file {name!r} cannot be opened ({err.strerror}); make it readable, or "
                "leave the side files out (--no-side-files, side_files=False)",
                path=root,
                rule="side-file",
            ) from None
        raise _changed(name, err, root) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise CheckpointError(
            f"side file {name!r} changed since the plan was made (now {st.st_size:,} bytes, "
            f"planned {size:,}); run the conversion again",
            path=root,
            rule="changed",
        )
    return fd


def copy_file(src_fd: int, dst: Path, size: int, source: Path | None = None) -> None:
    """Copy ``size`` bytes of ``src_fd`` into the new file ``dst``, in the kernel if possible,
    and fsync it; ``dst`` gets the source's read and write permission bits, never an
    executable bit.

    ``copy_file_range`` moves the bytes inside the kernel (or shares extents on file systems
    that can), so a large side file never passes through memory; where it is unavailable,
    bounded chunks go through user space. Only the source's data is copied (``SEEK_DATA``):
    its holes stay holes, as ``copy_file_range`` would fill them on many file systems (a
    sparse 20 GiB file written out in full). The source is refused (``CheckpointError``,
    rule ``changed``) if its size, times or inode differ after the copy from before it: a
    file rewritten or appended to meanwhile is not committed torn. ``source`` is the
    file copied, for messages.
    """
    before = os.fstat(src_fd)
    if before.st_size != size:
        # Grown (or cut) since it was opened and measured: only the planned bytes would be
        # copied, and the check after the copy compares with this state, not the plan's.
        raise CheckpointError(
            f"changed before it was copied ({before.st_size:,} bytes, planned {size:,}); nothing "
            "was committed: run the conversion again once it holds still",
            path=source or dst.name,
            rule="changed",
        )
    # Created private, then given the source's read and write bits: a 0600 secret must not
    # come out world-readable. No executable bit (nor setuid, setgid, sticky): an output folder
    # holds nothing to run, whatever a mapping renames a file to (docs/safety.md).
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, stat.S_IMODE(before.st_mode) & 0o666)
        os.ftruncate(fd, size)  # the length; what is not copied below stays a hole
        kernel = hasattr(os, "copy_file_range")
        for begin, end in data_ranges(src_fd, size):
            kernel = _copy_range(src_fd, fd, begin, end, kernel, dst.name)
        os.fsync(fd)
    finally:
        os.close(fd)
    if file_state(os.fstat(src_fd)) != file_state(before):
        raise CheckpointError(
            "changed while it was copied (it was rewritten or grew); nothing was committed: run "
            "the conversion again once it holds still",
            path=source or dst.name,
            rule="changed",
        )


def _copy_range(src_fd: int, fd: int, begin: int, end: int, kernel: bool, what: str) -> bool:
    """Copy bytes ``[begin, end)`` at the same offsets; whether the kernel copy still works."""
    done = begin
    while done < end:
        n = 0
        if kernel:
            try:
                n = os.copy_file_range(src_fd, fd, end - done, done, done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                kernel = False
        if not kernel:
            chunk = os.pread(src_fd, min(end - done, _COPY_CHUNK), done)
            view = memoryview(chunk)
            while view:
                written = os.pwrite(fd, view, done + len(chunk) - len(view))
                view = view[written:]
            n = len(chunk)
        if n == 0:
            raise ExecutionError(
                f"{what}: the source ended after {done:,} of {end:,} bytes (it changed while it "
                "was copied); nothing was committed"
            )
        done += n
    return kernel


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The byte ranges of the first ``size`` bytes of ``fd`` that hold data, holes left out
    (``SEEK_DATA``/``SEEK_HOLE``); the whole file where the file system cannot tell."""
    ranges: list[tuple[int, int]] = []
    position = 0
    while position < size:
        try:
            begin = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole from here on
                break
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return [(0, size)] if size else []
            raise
        if begin >= size:
            break
        try:
            end = min(os.lseek(fd, begin, os.SEEK_HOLE), size)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            break  # cut below `begin` since SEEK_DATA: caught by the state check afterwards
        ranges.append((begin, end))
        position = end
    # A file that grew meanwhile ends in a hole here: caught by the state check afterwards.
    return ranges


def file_state(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten, appended to or replaced: its device, inode,
    size and modification and change times. Compared before and after a copy."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def allocated(st: os.stat_result) -> int:
    """The bytes of disk a copy of the file takes: its allocated blocks, never more than its
    size (a sparse file's holes take none, and stay holes in the copy)."""
    return min(st.st_size, st.st_blocks * 512) if hasattr(st, "st_blocks") else st.st_size


def same_bytes(a: int, b: Path, size: int) -> bool:
    """True when the file ``b`` holds exactly the ``size`` bytes of descriptor ``a``.

    Read in bounded chunks, never whole.
    """
    try:
        fd = os.open(b, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size != size:
            return False
        done = 0
        while done < size:
            want = min(_COPY_CHUNK, size - done)
            x, y = os.pread(a, want, done), os.pread(fd, want, done)
            if x != y or not x:
                return False
            done += len(x)
        return True
    finally:
        os.close(fd)
