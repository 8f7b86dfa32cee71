"""What a family of rank files must say to the code that lists a folder or a Hub repository.

Its own module so that both listings (``resolve`` for folders, ``hub`` for repositories) can
name it without importing each other; ``binding.FolderFamilies`` implements it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Family(Protocol):
    """Families of rank files read from one folder (``binding.FolderFamilies``)."""

    @property
    def configs(self) -> Sequence[str]:
        """The config files the families read from the folder."""

    def members(self, names: list[str], where: str) -> list[str]:
        """Of the folder's entries ``names``, the members (ranks checked; ``where`` names
        the folder in errors)."""
