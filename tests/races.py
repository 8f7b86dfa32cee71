"""A racer in a shared folder, for tests: a file swapped for a link at a chosen moment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def swap_after_check(
    monkeypatch: pytest.MonkeyPatch,
    victim: Path,
    target: Path,
    owner: Any = Path,
    name: str = "resolve",
) -> list[Path]:
    """Turn ``victim`` into a link to ``target`` right after its name is first resolved by
    ``owner.name`` (by default ``Path.resolve``: the first check, before anything opens it);
    returns the list the swap is recorded in."""
    real = getattr(owner, name)
    swapped: list[Path] = []

    def racing(path: Path, *args: Any) -> Any:
        out = real(path, *args)
        if path == victim and not swapped:
            victim.unlink()
            victim.symlink_to(target)
            swapped.append(victim)
        return out

    monkeypatch.setattr(owner, name, racing)
    return swapped
