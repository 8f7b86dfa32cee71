"""Stopping a run when asked: one token, handed from ``remap`` down to every loop that may
run long (the writer threads' chunks, the Ray driver's polling, the in-place commit).

The caller asks with a ``threading.Event`` it sets, or a zero-argument callable that returns
True; the command line's signal handlers ask through the same token. Code that does long
work calls :meth:`CancelToken.check` at each boundary (a chunk written, a piece copied, a
tensor yielded), which raises :class:`~weightmap.errors.Cancelled` once stopping was asked.

A short stretch that must not be cut in the middle (an in-place rename's journal replay) runs
under :meth:`CancelToken.shielded`: the command line's handlers then only record the signal,
and the stretch finishes.

A stretch in which this thread shares locks with threads it started (a pool's queue, its
semaphore, the events the threads wait on) runs under :meth:`CancelToken.polled`: a signal
there only cancels the token, which the threads and this one poll, and is raised once the
threads have ended. An exception raised from a signal handler lands between any two
bytecodes, and one that lands just after ``threading.Condition.__enter__`` took its lock (a
Python frame, so there is such a point) leaves the lock held for ever; the next thread to
take it, and whoever joins that thread, then wait for ever (a Ctrl-C as a pool started hung
1 conversion in 60 so).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from weightmap.errors import Cancelled

__all__ = ["CancelSource", "CancelToken", "as_token", "hand_off_releases", "keep_open_elsewhere"]

CancelSource = threading.Event | Callable[[], bool]


class CancelToken:
    """Whether stopping was asked: by :meth:`cancel`, or by ``source`` (an event set, a
    callable returning True; another token, for a token of one run inside a larger one)."""

    def __init__(self, source: CancelSource | CancelToken | None = None) -> None:
        # A flag, not a threading.Event: a signal handler sets it, and an Event's ``set``
        # takes a lock the interrupted code may hold (see the module docstring).
        self._asked = False
        self._source = source
        self._shields = 0
        self._polls = 0
        self._lock = threading.Lock()
        # The signal that asked (set by the command line's handlers), for the exit code.
        self.signal: int | None = None
        # Set once the run's output is in place: a stop asked after that stops nothing, and
        # must not be reported as "nothing was committed".
        self._committed = False

    def cancel(self, signal: int | None = None) -> None:
        """Ask to stop (``signal``: the signal number that asked, if one did)."""
        if signal is not None and self.signal is None:
            self.signal = signal
        self._asked = True

    @property
    def cancelled(self) -> bool:
        """True once stopping was asked, here or through the source."""
        if self._asked:
            return True
        source = self._source
        if source is None:
            return False
        if isinstance(source, threading.Event):
            return source.is_set()
        if isinstance(source, CancelToken):
            return source.cancelled
        return bool(source())

    def __call__(self) -> bool:
        return self.cancelled

    def check(self, what: str = "the conversion") -> None:
        """Raise :class:`~weightmap.errors.Cancelled` if stopping was asked (outside a
        shielded stretch)."""
        if self.cancelled and not self.shielding:
            raise Cancelled(f"{what} was cancelled; nothing was committed")

    def mark_committed(self) -> None:
        """Say the run's output is in place (and so on up to the token this one is of)."""
        self._committed = True
        if isinstance(self._source, CancelToken):
            self._source.mark_committed()

    @property
    def committed(self) -> bool:
        """True once :meth:`mark_committed` was called here or on a token of this one."""
        return self._committed

    @property
    def shielding(self) -> bool:
        """True while a stretch that must finish runs (see :meth:`shielded`)."""
        return self._shields > 0

    @property
    def polling(self) -> bool:
        """True while a stretch polls this token (see :meth:`polled`): a signal handler that
        honours the token cancels it there rather than raise."""
        return self._polls > 0

    def _poll(self, step: int) -> None:
        # Said of this token and of each it is of: the command line's handlers hold the
        # outermost one, and a run polls its own.
        token: CancelToken | None = self
        while token is not None:
            with token._lock:
                token._polls += step
            source = token._source
            token = source if isinstance(source, CancelToken) else None

    @contextmanager
    def polled(self) -> Iterator[None]:
        """A stretch in which this thread shares locks with threads of its own, and polls
        this token instead of being interrupted (see the module docstring).

        The command line's handlers only cancel the token in it. Where Python's own SIGINT
        handler is this process's (a program that embeds the library, in its main thread),
        it is replaced for the stretch by one that cancels the token, and the
        KeyboardInterrupt it held back is raised as the stretch ends. A stop asked during
        the stretch and not yet raised by a check in it is raised as it ends (``check``).
        Not for use inside :meth:`shielded`: the interrupt held back would be raised there.
        """
        held: list[int] = []
        swapped = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if swapped:

            def hold(signum: int, frame: object) -> None:
                held.append(signum)
                self.cancel()

            signal.signal(signal.SIGINT, hold)
        self._poll(1)
        try:
            yield
        except Cancelled:
            if not held:
                raise
        finally:
            self._poll(-1)
            if swapped:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            if held:
                raise KeyboardInterrupt
        self.check()

    @contextmanager
    def shielded(self) -> Iterator[None]:
        """A stretch that must not be cut in the middle: signal handlers that honour the
        token only record the signal until it ends (checks inside it do not raise either)."""
        with self._lock:
            self._shields += 1
        try:
            yield
        finally:
            with self._lock:
                self._shields -= 1


def as_token(cancel: CancelSource | CancelToken | None) -> CancelToken:
    """The token for ``remap``'s ``cancel`` argument (a new one, never cancelled, for None);
    TypeError for anything that cannot say whether to stop."""
    if isinstance(cancel, CancelToken):
        return cancel
    if cancel is None or isinstance(cancel, threading.Event) or callable(cancel):
        return CancelToken(cancel)
    raise TypeError(
        "cancel must be a threading.Event or a callable taking no arguments that returns "
        f"True to stop, got {type(cancel).__name__}"
    )


# Set once the command line was told to stop by a signal: see keep_open_elsewhere.
_hand_off = False


def hand_off_releases() -> None:
    """From now on, files removed after ``keep_open_elsewhere`` are released by another
    process. Only the command line turns this on, once a signal stopped it: the process is
    about to end, and nothing else of it waits for those files."""
    global _hand_off
    _hand_off = True


def keep_open_elsewhere(fds: Sequence[int]) -> None:
    """Where ``hand_off_releases`` was called: a child process keeps ``fds`` open until this
    process has ended, then closes them. Nothing otherwise.

    Removing a file of a stopped conversion frees its pages, and the kernel first waits for
    every write already on its way to the disk (``start_writeback`` keeps hundreds of MB in
    flight): seconds, in which the process could not exit. With the child holding the files,
    the caller's unlink only removes their names, at once; the child, with nothing else open,
    pays for the pages after this process is gone.
    """
    if not _hand_off or not fds or not hasattr(os, "fork"):
        return
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        return  # (then the caller releases the files itself, as without a signal)
    if pid != 0:
        return
    try:  # the child: only system calls from here, and never a return into the caller
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        start = 0
        for fd in sorted(set(fds)):  # everything else closed: the pipes of whoever started
            os.closerange(start, fd)  # the command must see their end when it exits
            start = fd + 1
        os.closerange(start, 1 << 20)
        deadline = time.monotonic() + 600
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os._exit(0)
