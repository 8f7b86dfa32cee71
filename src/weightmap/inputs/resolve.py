"""What the caller named as an input, resolved: a local folder or file, or a Hugging Face
repository id (``org/name[@revision]``) whose files are fetched into huggingface_hub's cache.

The first step of every conversion (``api.remap``, ``iter_tensors``, ``verify``): it decides
where the checkpoint's files are and which side files come with them, before anything is
compiled.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weightmap.inputs.sidefiles import FolderFiles, list_side_files

if TYPE_CHECKING:
    from weightmap.inputs.checkpoint import Checkpoint
    from weightmap.inputs.hub import HubRepo

__all__ = ["ResolvedInput"]

PathLike = str | os.PathLike[str]


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
    def resolve(cls, checkpoint: PathLike, config_name: str, *, progress: bool) -> ResolvedInput:
        """A local path as it is; a Hub id with its weights and config fetched (the cache
        first), its side files listed but not fetched."""
        given = os.fspath(checkpoint)
        if Path(given).exists():
            return cls(checkpoint, Path(given).is_dir())
        # (imported here: huggingface_hub is an optional extra, slow to import)
        from weightmap.inputs.hub import HubRepo, looks_like_repo_id

        if not looks_like_repo_id(given):
            return cls(checkpoint, False)
        repo = HubRepo(given)
        listing = repo.files()
        wanted = repo.checkpoint_files(listing, config_name)
        return cls(repo.fetch(wanted, progress=progress), True, repo, listing)

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

    def fetch(self, wanted: Iterable[str], *, progress: bool) -> None:
        """Download the side files ``wanted`` (paths in the repository) from a repository, the
        cache first; nothing for a local input."""
        names = list(wanted)
        if self.repo is not None and names:
            self.repo.fetch(names, progress=progress, side=True)
