"""Pausing Python's cyclic garbage collector while the objects of a large plan are built.

Opening a checkpoint, compiling a plan and laying out its shards make a few small objects per
tensor (100,000 tensors and more in a large MoE checkpoint) and no reference cycles. Each
allocation burst sets off the collector, whose passes walk the whole growing heap and free
nothing: a third of the time of those steps on an 18,624-tensor rename. Reference counting
still frees what is dropped; the collector runs again once the last pause ends.

A pause ends with a pass over every object made during it that is still alive, so several
pauses in a row pay that pass several times over the same objects: ``remap`` holds one pause
over the whole of a conversion that moves bytes without computing any (``release`` ends it
early for the others), and what the conversion made and dropped is not walked at all.

The pause is process-wide, as the collector is: pauses nest and overlap across threads, and
the collector is enabled again only when the last one ends, and only if it was enabled when
the first began.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["GcPause", "gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


class GcPause:
    """One pause, as a context manager; ``release`` ends it before the block does."""

    def __init__(self) -> None:
        self._held = False

    def __enter__(self) -> GcPause:
        global _depth, _was_enabled
        with _lock:
            if _depth == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _depth += 1
        self._held = True
        return self

    def release(self) -> None:
        """End this pause now (once; the end of the block then does nothing)."""
        global _depth
        if not self._held:
            return
        self._held = False
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

    def __exit__(self, *exc: object) -> None:
        self.release()


def gc_paused() -> GcPause:
    """A pause of the cyclic garbage collector for a ``with`` block (see the module docstring)."""
    return GcPause()
