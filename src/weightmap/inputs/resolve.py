"""What the caller named as an input, resolved: a local folder or file, or a Hugging Face
repository id (``org/name[@revision]``) whose files are fetched into huggingface_hub's cache.

The first step of every conversion (``api.remap``, ``iter_tensors``, ``verify``): it decides
where the checkpoint's files are and which side files come with them, before anything is
compiled.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weightmap.errors import CheckpointError
from weightmap.format.names import CONFIG_NAME
from weightmap.inputs.sidefiles import FolderFiles, list_side_files

if TYPE_CHECKING:
    from weightmap.fs.cancel import CancelToken
    from weightmap.inputs.checkpoint import Checkpoint
    from weightmap.inputs.family import Family
    from weightmap.inputs.hub import HubRepo

__all__ = ["ResolvedInput", "check_local_path", "open_checkpoint"]

PathLike = str | os.PathLike[str]


# What only a local path starts with: never a Hub id.
_LOCAL_PREFIXES = ("./", "../", "/", "~")


def check_local_path(given: str) -> None:
    """Refuse a path that does not exist but is plainly meant as a local one: it starts with
    ``./``, ``../``, ``/`` or ``~``, or its folder exists here (``sub/llama-bf1`` where
    ``sub/`` is a folder). Taken for a Hub id, a typo would be looked up on the Hub, and the
    error would be about the Hub. Names close to it in its folder are offered."""
    path = Path(given)
    if path.is_symlink():
        from weightmap.inputs.checkpoint import refuse_missing

        refuse_missing(path)  # a link to nothing: the link is what to fix, said as such
    if not (given.startswith(_LOCAL_PREFIXES) or ("/" in given and path.parent.is_dir())):
        return
    parent = path.expanduser().parent
    try:
        names = [p.name for p in parent.iterdir()] if parent.is_dir() else []
    except OSError:
        names = []
    close = difflib.get_close_matches(
        path.name, [n for n in names if n != path.name], n=1, cutoff=0.6
    )
    shown = given.rstrip("/").rpartition("/")[0]
    hint = f"; did you mean {shown}/{close[0]}?" if close else ""
    nor = "" if parent.is_dir() else f" (nor is {parent} a folder)"
    raise CheckpointError(f"no such file or folder{nor}{hint}", path=given, rule="missing")


@dataclass
class ResolvedInput:
    """A checkpoint as the caller named it, found: ``path`` is what ``Checkpoint.open`` takes;
    ``folder`` says whether it is a folder (whose side files may be carried); ``repo`` and
    ``listing`` are the Hub repository and its files, for an id."""

    path: PathLike
    folder: bool
    repo: HubRepo | None = None
    listing: dict[str, int] | None = None

    @classmethod
    def resolve(
        cls,
        checkpoint: PathLike,
        config_name: str,
        *,
        progress: bool,
        cancel: CancelToken | None = None,
        family: Family | None = None,
    ) -> ResolvedInput:
        """A local path as it is; a Hub id with its weights and config fetched (the cache
        first, ``cancel`` checked between files), its side files listed but not fetched.

        ``family``: the folder holds families of rank files and no checkpoint of its own; of a
        Hub id, the members are fetched with the configs (``config.json``, ``config_name`` and
        the families' own)."""
        given = os.fspath(checkpoint)
        if given.startswith("~") and Path(given).expanduser().exists():
            checkpoint = given = os.path.expanduser(given)  # (quoted, so no shell expanded it)
        if Path(given).exists():
            return cls(checkpoint, Path(given).is_dir())
        check_local_path(given)
        # (imported here: huggingface_hub is an optional extra, slow to import)
        from weightmap.inputs.hub import HubRepo, looks_like_repo_id

        if not looks_like_repo_id(given):
            return cls(checkpoint, False)
        repo = HubRepo(given)
        listing = repo.files()
        if family is None:
            wanted = repo.checkpoint_files(listing, config_name)
        else:
            wanted = repo.family_files(listing, family, config_name)
        return cls(repo.fetch(wanted, progress=progress, cancel=cancel), True, repo, listing)

    def side_files(
        self, ckpt: Checkpoint, config_name: str, carry: bool, out: PathLike | None
    ) -> FolderFiles | None:
        """The side files to carry: those of the input folder (or repository); none for a
        file given alone (its folder may be any folder) or when carrying is off. ``out``, a
        destination inside the input folder, is left out."""
        if not carry or not self.folder:
            return None
        if self.repo is not None and self.listing is not None:
            return self.repo.side_files(self.listing, config_name)
        exclude = [Path(out)] if out is not None else []
        return list_side_files(ckpt.root, config_name=config_name, exclude=exclude)

    def fetch(
        self, wanted: Iterable[str], *, progress: bool, cancel: CancelToken | None = None
    ) -> None:
        """Download the side files ``wanted`` (paths in the repository) from a repository, the
        cache first, ``cancel`` checked between files; nothing for a local input."""
        names = list(wanted)
        if self.repo is not None and names:
            self.repo.fetch(names, progress=progress, side=True, cancel=cancel)


def open_checkpoint(checkpoint: PathLike, *, config_name: str = CONFIG_NAME) -> Checkpoint:
    """Open a local checkpoint, or a Hub repository id's (its weights and config fetched
    into huggingface_hub's cache first)."""
    from weightmap.inputs.checkpoint import Checkpoint

    src = ResolvedInput.resolve(checkpoint, config_name, progress=sys.stderr.isatty())
    return Checkpoint.open(src.path, config_name=config_name)
