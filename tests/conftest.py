"""Shared fixtures."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightmap.format import layout as layout_mod

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "eagle3-speculators"

sys.path.insert(0, str(REPO / "bench"))
import cowfs  # noqa: E402  (bench/cowfs.py: mounting images, reading extents)


@pytest.fixture
def example() -> Path:
    """The shipped speculators-layout EAGLE-3 example checkpoint."""
    return EXAMPLE


@pytest.fixture(params=["clone", "reference"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The writer's layout, for the tests that compare executors over generated plans. The
    clone layout runs with a 64-byte block: generated tensors are small, and a 64-byte block
    gives them the arrangement (input order, padded header, congruent offsets) that 4096-byte
    blocks give larger tensors. The layout is planned by the driver alone, so Ray workers need
    not see the patch."""
    if request.param == "clone":
        monkeypatch.setattr(layout_mod, "CLONE_BLOCK", 64)
    return str(request.param)


def cow_mount(kind: str, factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A loop-mounted copy-on-write filesystem of ``kind`` (one of ``cowfs.KINDS``) for a
    fixture to yield from, or a skip saying why it cannot be mounted here (not root, no
    mkfs, no loop device)."""
    try:
        with cowfs.mounted(kind, factory.mktemp(kind), size="512M") as mnt:
            yield mnt
    except cowfs.Unavailable as exc:
        pytest.skip(f"no {kind} mount: {exc}")
