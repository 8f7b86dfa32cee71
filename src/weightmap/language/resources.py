"""Package data: the grammar and the presets.

In a built wheel ``grammars/`` and ``mappings/`` are shipped inside the package (see
pyproject's force-include); in a source checkout (an editable install, or tests run from the
tree) they sit at the repository's top level. Both are looked up through importlib.resources
first, so an installed wheel never reads from a stray checkout.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:  # pragma: no cover - Python 3.10
    from importlib.abc import Traversable

__all__ = ["PRESET_SUFFIX", "data_dir", "preset_names", "read_text"]

_REPO_ROOT = Path(__file__).resolve().parents[3]
PRESET_SUFFIX = ".wm"


def data_dir(folder: str) -> Traversable:
    """The ``grammars`` or ``mappings`` folder, from the installed package or the checkout."""
    packaged = resources.files("weightmap").joinpath(folder)
    if packaged.is_dir():
        return packaged
    local = _REPO_ROOT / folder
    if local.is_dir():
        return local
    raise FileNotFoundError(
        f"weightmap's {folder}/ folder is missing from the installation; reinstall weightmap"
    )


def read_text(folder: str, name: str) -> str:
    """Read one file of package data as UTF-8 text."""
    return data_dir(folder).joinpath(name).read_text(encoding="utf-8")


def preset_names() -> list[str]:
    """The names of the presets shipped with weightmap (``mappings/<name>.wm``), sorted."""
    try:
        folder = data_dir("mappings")
    except FileNotFoundError:
        return []
    return sorted(
        p.name[: -len(PRESET_SUFFIX)] for p in folder.iterdir() if p.name.endswith(PRESET_SUFFIX)
    )
