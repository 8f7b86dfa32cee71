"""The executors' options, checked before any work: the memory budget of computed tensors
and the number of writer threads. Kept apart from ``streaming.py`` so that the modes that run
no executor (a dry run, an in-place rename) need not import it.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_CHUNK_BYTES", "check_workers", "default_workers"]

# The memory computed tensors may take at once, over all threads.
DEFAULT_CHUNK_BYTES = 32 * 2**20


def check_workers(workers: int | None) -> None:
    """ValueError for a number of workers that is not a count of at least 1 (None: the
    default)."""
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be at least 1, got {workers}")


def default_workers() -> int:
    """A sensible thread count: the cores, at most 8 (the disk is the limit beyond that)."""
    return max(1, min(8, os.cpu_count() or 1))
