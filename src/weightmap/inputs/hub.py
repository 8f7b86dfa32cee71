"""Hugging Face Hub repositories as inputs: ``org/name`` or ``org/name@revision``.

Resolved through ``huggingface_hub`` (the optional extra ``weightmap[hub]``), into its own
cache, so a model converted once is never downloaded again:

1. the repository's file list comes from the Hub, or, offline (``HF_HUB_OFFLINE=1``) or when
   the Hub cannot be reached, from the cached snapshot of that revision;
2. :meth:`HubRepo.fetch` downloads only the files asked for (the weights, their index, the
   config; then the side files the plan keeps), with huggingface_hub's progress bar, and
   returns the snapshot folder (``models--org--name/snapshots/<commit>/``, whose files are
   links into the repository's ``blobs/``), which is read like any checkpoint folder.

Every failure is one line: the extra missing, a repository or revision that does not exist, a
gated repository, and files that are not cached while the machine is offline.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import os
import re
import stat
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from weightmap.errors import Cancelled, CheckpointError
from weightmap.format.names import CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from weightmap.format.text import read_json_file, redacted
from weightmap.fs.atomic import replace_at
from weightmap.fs.cancel import CancelToken
from weightmap.fs.safeopen import kind, open_folder, read_bounded
from weightmap.inputs.checkpoint import ADAPTER_NAMES, PICKLE_INDEX, PICKLE_SINGLE
from weightmap.inputs.opening import opened, read_folder_json
from weightmap.inputs.sidefiles import (
    MAX_DEPTH,
    MAX_SIDE_FILES,
    FileSpec,
    FolderFiles,
    bad_file_name,
    inside_folder,
    replaced_reason,
    resolve_path,
)

if TYPE_CHECKING:
    from weightmap.inputs.family import Family


__all__ = ["HubRepo", "looks_like_repo_id"]

_REPO_ID = re.compile(
    r"(?P<id>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<rev>[\w.-]+(?:/[\w.-]+)*))?"
)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = ("1", "true", "yes", "on")
# A ref holds a 40-character commit id; more is no ref (a link to /dev/zero never ends).
# Entries of the cache folder read for a did-you-mean: a cache holds a few hundred at most.
_MAX_CACHE_ENTRIES = 10_000
_MAX_REF = 256


def looks_like_repo_id(spec: str) -> bool:
    """True for ``org/name`` and ``org/name@revision`` (checked after the path was not found)."""
    return _REPO_ID.fullmatch(spec) is not None and ".." not in spec


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors  # submodules the lazy package needs loaded
    except ImportError:
        return None
    return huggingface_hub


def _fnmatch_literal(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself (allow_patterns are patterns)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


class HubRepo:
    """One revision of a Hub model repository, read through huggingface_hub's cache."""

    def __init__(self, spec: str) -> None:
        m = _REPO_ID.fullmatch(spec) if ".." not in spec else None
        if m is None:  # (a revision is a branch, tag or commit: never a path out of refs/)
            raise ValueError(f"not a repository id: {spec!r}")
        self.spec = spec
        self.repo_id: str = m["id"]
        self.revision: str = m["rev"] or "main"
        self.hub = _hub()
        if self.hub is None:
            raise self._fail(
                "is not a local folder or file; read as a Hugging Face repository id it needs "
                "huggingface_hub: pip install 'weightmap[hub]' (or give a local path)",
                "hub-missing",
            )
        self.offline = self._offline()
        self.commit: str | None = None

    def _fail(self, message: str, rule: str) -> CheckpointError:
        return CheckpointError(message, path=self.spec, rule=rule)

    def _offline(self) -> bool:
        env = os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE
        return env or bool(getattr(self.hub.constants, "HF_HUB_OFFLINE", False))

    def _cache(self) -> Path:
        default = self.hub.constants.HF_HUB_CACHE
        return Path(os.environ.get("HF_HUB_CACHE") or default)

    def _storage(self) -> Path:
        return self._cache() / f"models--{self.repo_id.replace('/', '--')}"

    def _cached_near(self) -> str | None:
        """The cached repository whose id is closest to this one (a typo: ``tiny-lama`` for
        ``tiny-llama``), or None. The cache folder's entries are read, at most a few
        thousand of them (a cache is no place to spend seconds)."""
        try:
            with os.scandir(self._cache()) as entries:
                ids = [
                    e.name[len("models--") :].replace("--", "/", 1)
                    for e in itertools.islice(entries, _MAX_CACHE_ENTRIES)
                    if e.name.startswith("models--")
                ]
        except OSError:
            return None
        near = difflib.get_close_matches(self.repo_id, ids, n=1, cutoff=0.8)
        return near[0] if near and near[0] != self.repo_id else None

    def cached_snapshot(self) -> Path | None:
        """The cached snapshot folder of this revision, or None when it is not cached.

        Refused: a ref that is no small regular file (a FIFO is never waited on, a link to
        ``/dev/zero`` never read), and a snapshot folder that is a link out of the cache.
        """
        storage = self._storage()
        commit = self.commit or (self.revision if _COMMIT.fullmatch(self.revision) else None)
        if commit is None:
            commit = self._read_ref(storage, self.revision)
            if commit is None:
                return None
        if not _COMMIT.fullmatch(commit):
            return None
        folder = storage / "snapshots" / commit
        if not folder.is_dir():
            return None
        self._check_snapshot(folder)
        return folder

    def _read_ref(self, storage: Path, revision: str) -> str | None:
        """The commit ``refs/<revision>`` names, read once through a checked descriptor and
        bounded; None where there is no such ref."""
        ref = storage / "refs" / revision
        if not (ref.exists() or ref.is_symlink()):
            return None
        with opened(storage, ref, f"the cache's refs/{revision}", "the cache") as fd:
            data = read_bounded(fd, _MAX_REF)
        if len(data) > _MAX_REF:
            raise CheckpointError(
                f"the cache's refs/{revision} holds more than {_MAX_REF} bytes, not a commit id; "
                "remove it (it is written again on the next download)",
                path=ref,
                rule="hub-ref",
            )
        return data.decode("ascii", "replace").strip()

    def _check_snapshot(self, folder: Path) -> None:
        """Refuse a snapshot folder that is a link to a folder outside the repository's part
        of the cache: its files would be read as the repository's."""
        try:
            real = resolve_path(folder)
            storage = resolve_path(self._storage())
        except OSError as err:
            raise CheckpointError(
                f"the cached snapshot cannot be followed ({err.strerror})",
                path=folder,
                rule="dangling-link",
            ) from None
        if real.parent != storage / "snapshots":
            raise self._fail(
                f"its cached snapshot {folder} is a link to a folder outside the cache (to "
                f"{real}); remove the link and download the revision again",
                "hub-snapshot-link",
            )

    def files(self) -> dict[str, int]:
        """Every file of the revision and its size: from the Hub, or from the cache offline."""
        if not self.offline:
            try:
                return self._remote_files()
            except CheckpointError:
                raise
            except Exception as err:  # no connection: the cache decides
                if not self._connection_problem(err):
                    raise self._translated(err) from None
                self.offline = True
        folder = self.cached_snapshot()
        if folder is None:
            near = self._cached_near()
            raise self._fail(
                f"this repository is not in the local Hugging Face cache ({self._cache()}) and "
                f"the Hub {'is off (HF_HUB_OFFLINE=1)' if self._offline() else 'cannot be reached'}"
                + (f"; did you mean {near}? (that one is cached)" if near else "")
                + "; download it while online, or give a local folder",
                "hub-offline",
            )
        listed = self._cached_tree(folder)
        if listed is not None:
            return listed
        return _snapshot_listing(folder)

    @staticmethod
    def _cached_tree(folder: Path) -> dict[str, int] | None:
        """The revision's whole file list as huggingface_hub cached it on an earlier download
        (``trees/<commit>.json``, huggingface_hub 2.x), or None where there is none.

        Offline, the snapshot folder holds only what was downloaded: a side file left behind
        then (a first run with side files off) would be missing from the output without a
        word. With the whole list, the fetch names it instead.
        """
        path = folder.parent.parent / "trees" / f"{folder.name}.json"
        if not path.is_file():
            return None
        try:
            tree = read_json_file(path, "huggingface_hub's cached file list")
        except CheckpointError:
            return None  # unreadable or malformed: the snapshot's own files are the list
        if not isinstance(tree, dict) or tree.get("format_version") != 1:
            return None
        files = tree.get("files")
        if not isinstance(files, dict):
            return None
        listed: dict[str, int] = {}
        for name, info in files.items():
            size = info.get("size") if isinstance(info, dict) else None
            if not isinstance(name, str) or type(size) is not int or size < 0:
                return None
            listed[name] = size
        return dict(sorted(listed.items()))

    def _remote_files(self) -> dict[str, int]:
        self._check_endpoint()
        api = self.hub.HfApi()
        info = api.repo_info(self.repo_id, revision=self.revision)
        self.commit = info.sha
        out = {}
        for entry in api.list_repo_tree(self.repo_id, recursive=True, revision=self.commit):
            size = getattr(entry, "size", None)
            if size is not None and not hasattr(entry, "tree_id"):
                out[entry.path] = int(size)
        return out

    def _check_endpoint(self) -> None:
        """Refuse an ``HF_ENDPOINT`` that is no http(s) address, naming the variable: the
        request would otherwise fail with a message about a URL the user never typed."""
        endpoint = os.environ.get("HF_ENDPOINT")
        if endpoint is None:
            return
        try:
            parts = urlsplit(endpoint)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # (a malformed port or IPv6 address)
            ok = False
        if not ok:
            # Whatever stands before an @ may be a user and password, with or without a scheme.
            shown = endpoint if "@" not in endpoint else "***@" + endpoint.rsplit("@", 1)[1]
            raise self._fail(
                f"HF_ENDPOINT={redacted(shown, 120, self._secrets())!r} is not an http(s) "
                "address: set it to the Hub's (such as https://huggingface.co) or a mirror's, "
                "or unset it",
                "hub-endpoint",
            )

    def _secrets(self) -> list[str]:
        """The access token in use, wherever huggingface_hub finds it (the variables, or the
        file that `hf auth login` writes): quoted messages never show it, whatever its form."""
        found = [os.environ.get(name, "") for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")]
        get_token = getattr(self.hub, "get_token", None)
        if get_token is not None:
            # (A token file that cannot be read: no token to hide.)
            with contextlib.suppress(Exception):
                found.append(get_token() or "")
        return found

    def _connection_problem(self, err: Exception) -> bool:
        errors = self.hub.errors
        if isinstance(err, getattr(errors, "OfflineModeIsEnabled", ())):
            return True
        if isinstance(err, getattr(errors, "HfHubHTTPError", ())):
            return False
        return isinstance(err, (OSError, ConnectionError)) or "Connect" in type(err).__name__

    def _translated(self, err: Exception) -> CheckpointError:
        errors = self.hub.errors
        name = type(err).__name__
        if isinstance(err, getattr(errors, "RevisionNotFoundError", ())):
            return self._fail(f"the repository has no revision {self.revision!r}", "hub-revision")
        if isinstance(err, getattr(errors, "GatedRepoError", ())):
            return self._fail(
                "is a gated repository: accept its terms on the Hub and log in (hf auth login)",
                "hub-gated",
            )
        if isinstance(err, getattr(errors, "RepositoryNotFoundError", ())):
            return self._fail(
                "is no repository on the Hub (or a private one: log in with hf auth login)",
                "hub-not-found",
            )
        shown = redacted(str(err), secrets=self._secrets())
        return self._fail(f"the Hub refused the request ({name}: {shown})", "hub")

    def fetch(
        self,
        names: list[str],
        *,
        progress: bool = True,
        side: bool = False,
        cancel: CancelToken | None = None,
    ) -> Path:
        """The snapshot folder, holding at least ``names`` (downloaded where missing);
        ``side``: they are side files, which the error for a missing one says can be left out.

        Downloaded one file at a time, ``cancel`` checked before each and while each comes
        in (``_downloaded``): huggingface_hub's download of several files runs a pool of its
        own that finishes every queued file before it returns, so a conversion asked to stop
        would go on downloading until then. A file already cached costs one look-up of the
        revision.
        """
        if self.offline or not names:
            folder = self.cached_snapshot()
        else:
            kwargs: dict[str, Any] = {}
            if not progress:
                from tqdm.auto import tqdm

                class _Quiet(tqdm):  # type: ignore[type-arg]  # huggingface_hub's bar, silenced
                    def __init__(self, *args: Any, **kw: Any) -> None:
                        kw["disable"] = True
                        super().__init__(*args, **kw)

                kwargs["tqdm_class"] = _Quiet
            if self.commit is not None:
                # huggingface_hub would download into a snapshot folder that is a link, out
                # of the cache too: refused before a byte is fetched.
                known = self._storage() / "snapshots" / self.commit
                if known.is_dir():
                    self._check_snapshot(known)
            folder = None
            token = cancel if cancel is not None else CancelToken()
            for name in names:
                token.check("the download")
                try:
                    folder = Path(
                        _downloaded(
                            partial(
                                self.hub.snapshot_download,
                                self.repo_id,
                                revision=self.commit or self.revision,
                                allow_patterns=[_fnmatch_literal(name)],
                                **kwargs,
                            ),
                            token,
                        )
                    )
                except Exception as err:
                    if isinstance(err, Cancelled):
                        raise
                    raise self._translated(err) from None
            if folder is not None:  # (names is not empty here)
                self._remember_revision(folder)
        if folder is not None:
            self._check_snapshot(folder)
        # (A FIFO or device is there, not missing: opening it says what it is.)
        missing = sorted(n for n in names if folder is None or not (folder / n).exists())
        if missing or folder is None:
            raise self._fail(
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                f"{'is' if len(missing) == 1 else 'are'} not in the local Hugging Face cache "
                f"({self._cache()}) and the Hub cannot be used "
                f"({'HF_HUB_OFFLINE=1' if self._offline() else 'no connection'}): download "
                "while online, or give a local folder"
                + (", or leave the side files out (--no-side-files)" if side else ""),
                "hub-offline",
            )
        return folder

    def _remember_revision(self, folder: Path) -> None:
        """Record in the cache which commit the revision (a branch or tag) named.

        The download asks for the commit the revision resolved to, so that a branch moving
        meanwhile cannot mix two commits; huggingface_hub then writes no ``refs/<revision>``
        (it does only for a revision that is not the commit), and offline, where the ref is
        all there is to go by, the cached snapshot would not be found. Written as
        huggingface_hub writes it (the commit alone, through a temporary file and a rename); a
        cache this user cannot write is left as it is.
        """
        commit = self.commit
        if commit is None or self.revision == commit or folder.name != commit:
            return
        *folders, name = self.revision.split("/")
        with contextlib.suppress(OSError, CheckpointError):
            if self._read_ref(folder.parent.parent, self.revision) == commit:
                return
            # In a shared cache another user may plant a link at any name in refs/: the
            # folders are made and entered without following one, and the ref is replaced
            # as replace_at replaces a file (never written through a link).
            refs = open_folder(resolve_path(folder.parent.parent), ("refs", *folders))
            try:
                replace_at(refs, name, commit.encode())
            finally:
                os.close(refs)

    def checkpoint_files(
        self, files: dict[str, int], config_name: str, folder: str = ""
    ) -> list[str]:
        """What opening the checkpoint reads, as ``Checkpoint.open`` looks for it: an index and
        its shards, or one weights file; and the config. The index is fetched to find the
        shards. ``folder`` (ending in ``/``): the checkpoint is that folder of the repository,
        ``files`` its listing (names inside it); the names returned are inside it too."""
        configs = [n for n in dict.fromkeys((CONFIG_NAME, config_name)) if n in files]
        # Checkpoint.open's order, so that a repository holding both forms (model.safetensors
        # and a PyTorch index, say) is read from the same files as a local copy of it.
        for name in (INDEX_NAME, SINGLE_NAME, PICKLE_INDEX, PICKLE_SINGLE, *ADAPTER_NAMES):
            if name not in files:
                continue
            if name in (SINGLE_NAME, PICKLE_SINGLE, *ADAPTER_NAMES):
                return [name, *configs]
            index_name = name
            index_path = self.fetch([folder + index_name]) / folder / index_name
            index = read_folder_json(index_path.parent, index_path, "the index", unique_keys=True)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                # As opening the folder would say it, before the shards are downloaded.
                raise CheckpointError(
                    'index must be a JSON object with a "weight_map" object',
                    path=index_path,
                    rule="index",
                )
            shards = sorted({s for s in weight_map.values() if isinstance(s, str) and "/" not in s})
            absent = [s for s in shards if s not in files]
            if absent and not self.offline:
                raise self._fail(
                    f"{folder}{index_name} names shard(s) the repository does not have: "
                    f"{', '.join(absent[:5])}",
                    "missing-shard",
                )
            return [index_name, *shards, *configs]
        pickles = sorted(n for n in files if "/" not in n and n.endswith((".pt", ".pth")))
        if len(pickles) != 1:
            found = f": it has {', '.join(pickles[:4])}" if pickles else ""
            where = f"its folder {folder[:-1]!r}" if folder else "it"
            raise self._fail(
                f"holds no checkpoint weightmap reads in {where} ({SINGLE_NAME} or its index, "
                f"{PICKLE_SINGLE} or its index, or one .pt/.pth file){found}",
                "layout",
            )
        return [pickles[0], *configs]

    def family_files(self, files: dict[str, int], family: Family, config_name: str) -> list[str]:
        """What opening families of rank files or folders at the repository's top reads: the
        members (Meta's ``consolidated.NN.pth``, say; their ranks checked on the listing,
        before any download), of a member folder what opening it as a checkpoint reads (as
        ``checkpoint_files``), and the configs."""
        tops = sorted({name.split("/")[0] for name in files})
        wanted: list[str] = []
        for member in family.members(tops, self.spec):
            if member in files:
                wanted.append(member)
                continue
            # A folder (listed by the names under it): each is a checkpoint of its own.
            folder = member + "/"
            inside = {n[len(folder) :]: size for n, size in files.items() if n.startswith(folder)}
            wanted += [folder + n for n in self.checkpoint_files(inside, config_name, folder)]
        names = (CONFIG_NAME, config_name, *family.configs)
        return [*wanted, *(n for n in dict.fromkeys(names) if n in files)]

    def side_files(self, files: dict[str, int], config_name: str) -> FolderFiles:
        """The repository's side files (``inputs/sidefiles.py`` says which), not yet fetched."""
        if len(files) > MAX_SIDE_FILES:
            raise self._fail(
                f"the repository holds {len(files):,} files, more than the {MAX_SIDE_FILES:,} a "
                "conversion carries; to convert the weights alone, turn side files off "
                "(--no-side-files, side_files=False)",
                "too-many-files",
            )
        kept = [
            FileSpec(name, size)
            for name, size in sorted(files.items())
            if replaced_reason(name, config_name) is None
            and bad_file_name(name) is None
            and name.count("/") < MAX_DEPTH
        ]
        # What the cache holds already is judged as a local folder's files are, at plan time:
        # a link out of the cache or a FIFO is skipped with a warning, never copied later.
        folder = self.cached_snapshot()
        skipped: list[str] = []
        if folder is not None:
            for spec in list(kept):
                why = _cached_problem(folder, spec.name)
                if why is not None:
                    kept.remove(spec)
                    skipped.append(f"side file {spec.name!r} is not carried: {why}")
        return FolderFiles(tuple(kept), tuple(skipped))


# How often the thread waiting on a download looks at its token (seconds).
_POLL = 0.05


def _downloaded(download: Callable[[], str], cancel: CancelToken) -> str:
    """``download()`` (huggingface_hub's, of one file) run in a thread of its own while this
    one polls ``cancel``: a stop asked mid-file raises ``Cancelled`` at once.

    huggingface_hub downloads even one file in a pool of its own, and waits in it for the
    whole file: a KeyboardInterrupt in this thread waited for that file anyway (the pool's
    shutdown), and could leave one of the pool's locks held, hanging the process (see
    CancelToken.polled). Stopped, the download is left to its thread, a daemon: it goes on
    into the cache (huggingface_hub writes a file under a temporary name, and resumes it on
    the next download) until the file is complete. The interpreter's exit waits for it
    (huggingface_hub's pool threads are joined then); the command line's exits at once.
    """
    done: list[str] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(download())
        except BaseException as exc:  # (handed to the waiting thread)
            failed.append(exc)

    thread = threading.Thread(target=run, name="weightmap-download", daemon=True)
    with cancel.polled():
        thread.start()
        while thread.is_alive():
            cancel.check("the download")
            thread.join(_POLL)
    if failed:
        raise failed[0]
    return done[0]


def _snapshot_listing(folder: Path) -> dict[str, int]:
    """Every file of a cached snapshot and its size, links into blobs/ followed; a FIFO,
    device or socket is listed too (size 0), so that it is named where it is read instead of
    dropped (a link to nothing, a blob never downloaded, is left out)."""
    listed: dict[str, int] = {}
    for p in sorted(folder.rglob("*")):
        try:
            st = p.stat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            listed[p.relative_to(folder).as_posix()] = st.st_size if stat.S_ISREG(st.st_mode) else 0
    return listed


def _cached_problem(folder: Path, name: str) -> str | None:
    """Why the cached side file ``name`` of snapshot ``folder`` is not carried (the local
    folder's rules), or None; None too for a file not cached yet (checked when it is copied)."""
    path = folder / name
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        real = resolve_path(path)
        st = os.stat(path)
    except OSError:
        return "it is a link to nothing"
    if not inside_folder(real, resolve_path(folder)):
        return f"it is a link that leaves the cache (to {real})"
    if not stat.S_ISREG(st.st_mode):
        return f"it is a {kind(st.st_mode)}, not a regular file"
    return None
