"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "eagle3-speculators"


@pytest.fixture
def example() -> Path:
    """The shipped speculators-layout EAGLE-3 example checkpoint."""
    return EXAMPLE
