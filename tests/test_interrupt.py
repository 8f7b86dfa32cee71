"""Stopping when asked: a signal to the command line, ``cancel=`` from Python, Ctrl-C in a
program that embeds the library, an in-place rename, and a Ray run.

The command-line tests convert a checkpoint of a few hundred MB with a cast (computed, not a
clone or a copy), measure a run to the end, and send the signal at several points of other
runs: each must stop with the shell's code, say so, leave neither the destination nor a
temporary folder, and end long before the run to the end would have.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import weightmap
from weightmap import cli
from weightmap.execute import cluster, streaming
from weightmap.fs import cancel as fs_cancel
from weightmap.fs.cancel import CancelToken, as_token
from weightmap.inputs.checkpoint import Checkpoint

# 128 tensors of 16 MiB of float32: 2 GiB in, 1 GiB of bfloat16 out (seconds of work on
# two cores, a fraction of a second to stop).
_TENSORS, _ROWS, _COLS = 128, 1024, 4096
_RENAME = 'weightmap 1\nrename "layers.{i}.weight" -> "l.{i}.w"'
# A transpose and a cast: computed in chunks, the slowest common work per byte.
_CAST = 'weightmap 1\ntranspose "**"\ncast "**" to bf16\nconfig { torch_dtype = "bfloat16" }\n'


@dataclass(frozen=True)
class Big:
    folder: Path
    mapping: Path
    work: float  # seconds from the output's temporary folder appearing to the end of a full run


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _start(big: Big, dest: Path) -> subprocess.Popen[str]:
    args = ["convert", str(big.folder), str(dest), "--mapping", str(big.mapping)]
    return subprocess.Popen(
        [sys.executable, "-m", "weightmap", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # (a hang's stacks: see below)
    )


def _wait_for_temporary(proc: subprocess.Popen[str], parent: Path, known: set[str]) -> float:
    """The moment a new entry (the output's temporary folder) appears in ``parent``."""
    while proc.poll() is None:
        if _entries(parent) - known:
            return time.monotonic()
        time.sleep(0.005)
    raise AssertionError(f"the conversion ended before it started writing: {proc.communicate()}")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Big]:
    root = tmp_path_factory.mktemp("interrupt")
    folder = root / "big"
    folder.mkdir()
    block = np.full((_ROWS, _COLS), 1.5, dtype=np.float32)
    save_file({f"layers.{i}.weight": block for i in range(_TENSORS)}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"torch_dtype": "float32"}')
    mapping = root / "cast.wm"
    mapping.write_text(_CAST)
    # The run to the end, measured as the interrupted ones are: from its temporary folder.
    work = Big(folder, mapping, 0.0)
    dest = root / "full"
    known = _entries(root)
    proc = _start(work, dest)
    began = _wait_for_temporary(proc, root, known)
    _, err = proc.communicate(timeout=120)
    ended = time.monotonic()
    assert proc.returncode == 0, err
    assert (dest / "model.safetensors").stat().st_size > _TENSORS * _ROWS * _COLS * 2
    shutil.rmtree(dest)
    yield Big(folder, mapping, ended - began)
    shutil.rmtree(root)  # (hundreds of MB: not left for pytest's own clean-up)


@pytest.mark.parametrize(
    ("signum", "when"),
    [
        (signal.SIGINT, "planned"),  # the plan printed, torch still loading: nothing open yet
        (signal.SIGINT, "started"),  # the temporary folder just made
        (signal.SIGINT, "mid"),  # the first progress line (a tenth of the work or more done)
        (signal.SIGTERM, "mid"),
    ],
)
def test_a_signal_stops_the_conversion_at_once(
    big: Big, tmp_path: Path, signum: signal.Signals, when: str
) -> None:
    dest = tmp_path / "out"
    proc = _start(big, dest)
    assert proc.stdout is not None and proc.stderr is not None
    left = big.work  # what a run to the end still had to do when the signal was sent
    if when == "planned":
        assert proc.stdout.readline().startswith("plan: ")
    elif when == "started":
        _wait_for_temporary(proc, tmp_path, set())
    else:
        began = _wait_for_temporary(proc, tmp_path, set())
        line = proc.stderr.readline()
        done = re.fullmatch(r"weightmap: (\d+)% \(.*\)\n", line)
        assert done is not None, line + proc.stderr.read()
        # The rest at this run's own pace so far (the machine is shared: its pace varies), or
        # at the full run's, whichever is less.
        fraction = int(done[1]) / 100
        pace = (time.monotonic() - began) / fraction
        left = min(big.work, pace) * (1 - fraction)
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # Killed and waited for here: a process left running (its pipes open) would fail
        # whichever test the collector happens to run in next.
        proc.send_signal(signal.SIGABRT)  # (faulthandler prints each thread's stack)
        try:
            out, err = proc.communicate(timeout=10)
        finally:
            proc.kill()
            proc.communicate()
        raise AssertionError(f"still running 60 s after the signal: {err}") from None
    stopped = time.monotonic() - sent
    assert proc.returncode == 128 + signum, (out, err)
    assert "weightmap: interrupting...\n" in err
    assert err.rstrip().endswith("weightmap: interrupted; nothing was committed")
    assert "Traceback" not in err and " into " not in out  # (no summary of a finished run)
    assert not dest.exists()
    assert _entries(tmp_path) == set(), "a temporary was left behind"
    # Stopped before finishing: the process ended well before a run to the end would have
    # (the code before this test waited for every queued chunk, then for the release of what
    # it had written). Not a fixed number: the machine is shared, its pace varies.
    assert stopped < left / 2, f"{stopped:.2f} s to stop; a full run had {left:.2f} s left"


def test_a_signal_after_the_summary_leaves_the_finished_command_s_exit(tmp_path: Path) -> None:
    """Once the summary is printed the output is in place: the process ends with the command's
    own code at once, rather than spend half a second unloading torch, in which a Ctrl-C
    ended it by the signal (-2) or with a traceback from torch's teardown."""
    src = _small(tmp_path)
    mapping = tmp_path / "cast.wm"
    mapping.write_text('weightmap 1\ncast "**" to f16\n')  # (computed: torch is loaded)
    for attempt in range(3):
        dest = tmp_path / f"out{attempt}"
        args = ["convert", str(src), str(dest), "--mapping", str(mapping)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightmap", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        summary = ""
        while " into " not in summary and (line := proc.stdout.readline()):
            summary = line
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert " into " in summary, summary + out + err
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "interrupt" not in err, err
        assert (dest / "model.safetensors").is_file()


def test_the_cli_puts_its_handlers_back() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert cli.main(["presets"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, which raises KeyboardInterrupt, as a program started from
    a terminal has it: one started with SIGINT ignored (a background job of a shell script,
    as some CI runners start their steps) keeps it ignored, and a Ctrl-C there raises
    nothing, in weightmap or anywhere."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's signal handlers used in this process: what they switch on for the
    rest of a stopped command (the hand-off of the output's files) is switched off after."""
    monkeypatch.setattr(fs_cancel, "_hand_off", False)


@pytest.mark.usefixtures("handlers")
def test_the_cli_handler_waits_out_a_shielded_stretch() -> None:
    token = CancelToken()
    with cli._stop_on_signals(token):
        with token.shielded():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # (the handler runs between two bytecodes; no exception here)
            token.check()  # a check inside the stretch does not stop it either
        assert token.cancelled and token.signal == signal.SIGTERM
        with pytest.raises(weightmap.Cancelled):
            token.check()
    token = CancelToken()
    with pytest.raises(KeyboardInterrupt), cli._stop_on_signals(token):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    assert token.signal == signal.SIGINT


@pytest.mark.usefixtures("handlers")
def test_the_cli_handler_only_cancels_a_polled_stretch() -> None:
    token = CancelToken()
    run = CancelToken(token)  # (a run's own token, of the command's: the stretch polls it)
    with cli._stop_on_signals(token):
        with pytest.raises(weightmap.Cancelled), run.polled():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # (no exception here: the handler only cancelled)
            assert token.cancelled and run.cancelled and token.polling
        assert not token.polling
    assert token.signal == signal.SIGTERM


@pytest.mark.usefixtures("python_sigint")
def test_python_s_own_handler_is_held_back_for_a_polled_stretch_and_put_back() -> None:
    token = CancelToken()
    reached: list[str] = []
    with pytest.raises(KeyboardInterrupt), token.polled():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        reached.append("the end of the stretch")
        token.check()  # (the Cancelled a thread of the run would raise: the interrupt wins)
    assert reached == ["the end of the stretch"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with CancelToken().polled():  # (nothing held back from the stretch before)
        pass


def test_a_handler_of_the_program_s_own_is_left_in_place() -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGINT, mine)
    try:
        with CancelToken().polled():
            assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("handlers")
def test_a_signal_while_the_shards_are_fsynced_stops_after_the_threads(tmp_path: Path) -> None:
    from weightmap.format.transfer import fsyncing

    fds = [os.open(tmp_path / f"{i}", os.O_CREAT | os.O_WRONLY, 0o600) for i in range(3)]
    try:
        token = CancelToken()
        with (
            cli._stop_on_signals(token),
            pytest.raises(weightmap.Cancelled),
            fsyncing(fds, token),
        ):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert not [t for t in threading.enumerate() if t.name.startswith("weightmap")]
    finally:
        for fd in fds:
            os.close(fd)


# ---------------------------------------------------------------- from Python


def _small(tmp_path: Path, n: int = 8) -> Path:
    """Eight float32 tensors of 1 MiB: many chunks each at a small chunk_bytes."""
    folder = tmp_path / "small"
    folder.mkdir()
    save_file(
        {f"layers.{i}.weight": np.full((256, 1024), i, dtype=np.float32) for i in range(n)},
        folder / "model.safetensors",
    )
    return folder


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", ["event", "callable"])
def test_cancel_from_a_progress_callback(tmp_path: Path, workers: int, kind: str) -> None:
    src = _small(tmp_path)
    event = threading.Event()
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if done >= total * 0.3:
            event.set()

    cancel: Any = event if kind == "event" else event.is_set
    with pytest.raises(weightmap.Cancelled, match="nothing was committed"):
        weightmap.remap(
            src,
            tmp_path / "out",
            mapping='weightmap 1\ncast "**" to f16',
            progress=progress,
            cancel=cancel,
            workers=workers,
            chunk_bytes=64 * 1024,
        )
    assert not (tmp_path / "out").exists()
    assert _entries(tmp_path) == {"small"}
    total = 8 * 256 * 1024 * 2
    # Stopped within a chunk per thread of the request, far from the end.
    assert max(seen) < total * 0.3 + workers * 64 * 1024
    assert isinstance(weightmap.Cancelled("x"), weightmap.WeightmapError)


@pytest.mark.usefixtures("python_sigint")
def test_keyboard_interrupt_in_the_main_thread_stops_the_writer_threads(tmp_path: Path) -> None:
    """Ctrl-C in a program that embeds the library (Python's own handler, no CLI): the
    KeyboardInterrupt reaches the caller once the running chunks end, not after the queue."""
    src = _small(tmp_path)
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(done)
        if len(seen) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, from a writer thread

    with pytest.raises(KeyboardInterrupt):
        weightmap.remap(
            src,
            tmp_path / "out",
            mapping='weightmap 1\ncast "**" to f16',
            progress=progress,
            workers=2,
            chunk_bytes=64 * 1024,
        )
    after = len(seen)
    assert not [t for t in threading.enumerate() if t.name.startswith("weightmap")]
    time.sleep(0.1)
    assert len(seen) == after  # nothing runs on
    assert after < 8 * 256 * 1024 * 2 // (32 * 1024) // 2  # chunks of 32 KiB: far from all
    assert _entries(tmp_path) == {"small"}


def test_no_task_runs_before_every_worker_has_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C from the first task (its progress callback) must not land while the next
    worker is being started: interrupted in ``Thread.start``, the pool never learns of that
    worker, and the run returns with it still running. A slow start shows whether the first
    task waited for it."""
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name.endswith("_1"):  # the pool's second worker
            time.sleep(0.3)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    workers_seen: list[int] = []

    def task() -> None:
        workers_seen.append(
            len([t for t in threading.enumerate() if t.name.startswith("weightmap")])
        )

    streaming._run_all([task] * 4, 2, CancelToken())
    assert workers_seen[0] == 2


def test_an_interrupt_while_the_gate_opens_does_not_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt inside the gate's ``set`` (before its flag is set) left the workers
    waiting at it and the shutdown joining them for ever: the shutdown opens it again."""

    class Gate(threading.Event):
        tries = 0

        def set(self) -> None:
            Gate.tries += 1
            if Gate.tries == 1:
                raise KeyboardInterrupt
            super().set()

    monkeypatch.setattr(streaming, "_Gate", Gate)
    ran: list[int] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            streaming._run_all([lambda: ran.append(1)] * 4, 2, CancelToken())
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=run)  # (a hang shows as a thread still alive)
    t.start()
    t.join(10)
    assert not t.is_alive()
    assert [type(e) for e in failed] == [KeyboardInterrupt]
    assert ran == []  # (the run was stopped before any task: none ran after the gate opened)


# A signal at each point where the calling thread has just taken a threading.Condition's lock
# (Thread.start, the pool's semaphore, the events the workers wait on): the handler runs
# before ``Condition.__enter__`` (a Python frame) returns, and an exception raised there left
# the lock held for ever. Each run stops; none hangs or leaves a thread running.
_SIGNAL_IN_A_CONDITION = """
import faulthandler, os, signal, sys, threading, time
from weightmap import Cancelled, cli
from weightmap.execute import streaming
from weightmap.fs import cancel
from weightmap.fs.cancel import CancelToken

cancel._hand_off = False
MAIN = threading.get_ident()  # (not current_thread(): a thread being started has none yet)
real_enter = threading.Condition.__enter__
at = {"count": 0, "signal_at": 0}

def enter(self):
    got = real_enter(self)
    if threading.get_ident() == MAIN:
        at["count"] += 1
        if at["count"] == at["signal_at"]:
            os.kill(os.getpid(), signal.SIGINT)
    return got

threading.Condition.__enter__ = enter

def task():
    for _ in range(10):
        time.sleep(0.002)
        halt.check()

cli_handlers = sys.argv[1] == "cli"
if not cli_handlers:
    signal.signal(signal.SIGINT, signal.default_int_handler)
stops = []
sys.excepthook = lambda *e: (sys.__excepthook__(*e), os._exit(1))  # (not joining a stuck thread)
while True:
    faulthandler.dump_traceback_later(30, exit=True)  # (a hang ends the process, and says where)
    at["count"], at["signal_at"] = 0, at["signal_at"] + 1
    token = CancelToken()
    halt = CancelToken(token)
    try:
        if cli_handlers:
            with cli._stop_on_signals(token):
                streaming._run_all([task] * 6, 3, halt)
        else:
            streaming._run_all([task] * 6, 3, halt)
    except (KeyboardInterrupt, Cancelled) as exc:
        stops.append(type(exc).__name__)
    else:
        if at["count"] < at["signal_at"]:
            break  # (a run with no signal: every point was tried)
        stops.append("finished")
    faulthandler.cancel_dump_traceback_later()
    left = [t.name for t in threading.enumerate() if t.name.startswith("weightmap")]
    assert not left, f"a signal at entry {at['signal_at']} left {left} running"
    if not cli_handlers:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (put back)
print(" ".join(stops), flush=True)
"""


@pytest.mark.parametrize("handlers", ["cli", "python"])
def test_a_signal_where_a_thread_lock_was_just_taken_stops_the_run(handlers: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_A_CONDITION, handlers],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    stops = r.stdout.split()
    assert len(stops) >= 5  # (Thread.start, the semaphore, the gate, the tasks' events)
    # Each signal stopped the run: the CLI's handlers as Cancelled, which the command line
    # reports as interrupted; Python's own as the KeyboardInterrupt the program expects.
    assert set(stops) == {"Cancelled" if handlers == "cli" else "KeyboardInterrupt"}, stops


def test_iter_tensors_stops_between_tensors(tmp_path: Path) -> None:
    src = _small(tmp_path)
    event = threading.Event()
    tensors = weightmap.iter_tensors(src, mapping='weightmap 1\ncast "**" to f16', cancel=event)
    names = [next(tensors)[0], next(tensors)[0]]
    event.set()
    with pytest.raises(weightmap.Cancelled):
        next(tensors)
    assert names == ["layers.0.weight", "layers.1.weight"]
    with pytest.raises(StopIteration):
        next(tensors)  # (closed: the input is released)


def test_inplace_cancelled_before_its_journal_changes_nothing(tmp_path: Path) -> None:
    src = _small(tmp_path, 2)
    before = (src / "model.safetensors").read_bytes()
    with pytest.raises(weightmap.Cancelled):
        weightmap.remap(src, mapping=_RENAME, inplace=True, cancel=lambda: True)
    assert (src / "model.safetensors").read_bytes() == before
    assert _entries(src) == {"model.safetensors"}


@pytest.mark.usefixtures("handlers")
def test_inplace_signal_during_the_replay_lets_it_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal once the journal is written: the few writes after it finish, and the
    checkpoint is renamed, its journal gone (never left half-way for `clean`)."""
    from weightmap.execute import inplace

    src = _small(tmp_path, 2)
    replay = inplace._replay

    def interrupted(root: Path, journal: inplace.Journal, folder: int) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        replay(root, journal, folder)

    monkeypatch.setattr(inplace, "_replay", interrupted)
    token = CancelToken()
    with cli._stop_on_signals(token):
        weightmap.remap(src, mapping=_RENAME, inplace=True, cancel=token)
    assert token.signal == signal.SIGINT
    assert _entries(src) == {"model.safetensors"}
    with Checkpoint.open(src) as ckpt:
        assert sorted(ckpt) == ["l.0.w", "l.1.w"]


def test_cancel_that_cannot_say_is_refused() -> None:
    with pytest.raises(TypeError, match=r"threading\.Event or a callable"):
        as_token(True)  # type: ignore[arg-type]


# ---------------------------------------------------------------- Ray


class _FakeRay:
    """What the driver's loop asks of Ray, with tasks that never finish."""

    def __init__(self) -> None:
        self.cancelled: list[int] = []
        self.handlers: list[Any] = []
        self.polls: list[Any] = []
        self.exceptions = SimpleNamespace(RayError=RuntimeError, RayTaskError=RuntimeError)
        self._next = 0

    def remote(self, **_: Any) -> Any:
        def wrap(fn: Any) -> Any:
            def submit(*_: Any) -> int:
                self._next += 1
                return self._next

            return SimpleNamespace(remote=submit)

        return wrap

    def wait(self, refs: list[int], **_: Any) -> tuple[list[int], list[int]]:
        self.handlers.append(signal.getsignal(signal.SIGINT))  # (the driver's, as it polls)
        time.sleep(0.01)
        return [], refs

    def cancel(self, ref: int, force: bool = False) -> None:
        if not self.cancelled:
            self.polls = list(self.handlers)  # (what the loop saw, before the tasks' stop)
        self.cancelled.append(ref)


def test_a_cancelled_ray_run_cancels_its_tasks() -> None:
    ray = _FakeRay()
    tasks = [SimpleNamespace(folder="f", index=i) for i in range(5)]
    token = CancelToken()
    timer = threading.Timer(0.1, token.cancel)
    timer.start()
    with pytest.raises(weightmap.Cancelled):
        cluster._run(ray, tasks, 2, None, 0, "out", token)  # type: ignore[arg-type]
    timer.join()
    assert ray.cancelled == [1, 2]  # the two running; the other three never started


@pytest.mark.usefixtures("handlers", "python_sigint")
@pytest.mark.parametrize("handlers_of", ["cli", "python"])
def test_a_signal_to_the_ray_driver_cancels_its_tasks(handlers_of: str) -> None:
    """The driver polls its token beside Ray's own threads: a signal cancels it (the command
    line's handlers) or is raised once the tasks are cancelled (Python's own)."""
    ray = _FakeRay()
    tasks = [SimpleNamespace(folder="f", index=i) for i in range(5)]
    token = CancelToken()
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
    expected = weightmap.Cancelled if handlers_of == "cli" else KeyboardInterrupt
    with contextlib.ExitStack() as stack:
        if handlers_of == "cli":
            stack.enter_context(cli._stop_on_signals(token))
        timer.start()
        with pytest.raises(expected):
            cluster._run(ray, tasks, 2, None, 0, "out", token)  # type: ignore[arg-type]
    timer.join()
    assert ray.cancelled == [1, 2]
    if handlers_of == "python":
        # Held back while the driver polled beside Ray's threads, and put back after.
        assert ray.polls and signal.default_int_handler not in ray.polls
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_cli_says_an_interrupted_inplace_rename_was_committed(tmp_path: Path) -> None:
    src = _small(tmp_path, 2)
    mapping = tmp_path / "rename.wm"
    mapping.write_text(_RENAME + "\n")
    code = (
        "import os, signal, sys, time\n"
        "from weightmap.execute import inplace\n"
        "replay = inplace._replay\n"
        "def interrupted(root, journal, folder):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.05)\n"
        "    replay(root, journal, folder)\n"
        "inplace._replay = interrupted\n"
        "from weightmap.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "convert", str(src), "--inplace", "--mapping", str(mapping)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 143, r.stderr
    assert "weightmap: interrupting...\n" in r.stderr
    assert r.stderr.rstrip().endswith(
        "weightmap: interrupted after the work was committed; it is complete"
    )
    with Checkpoint.open(src) as ckpt:
        assert sorted(ckpt) == ["l.0.w", "l.1.w"]


class _Boom(Exception):
    pass


def test_a_task_failing_while_meanwhile_runs_stops_it_and_is_the_error_raised() -> None:
    """``meanwhile`` (the index written while the copies run) is stopped at its next check
    once a task fails, and the task's error is raised, not the stop."""
    steps: list[int] = []

    def failing() -> None:
        raise _Boom("the task's own error")

    def meanwhile(check: Any) -> None:
        for i in range(200):
            check()
            steps.append(i)
            time.sleep(0.01)

    start = time.perf_counter()
    with pytest.raises(_Boom, match="the task's own error"):
        streaming._run_all([failing] + [lambda: None] * 3, 2, CancelToken(), meanwhile)
    assert len(steps) < 200  # stopped, not run to its end (2 s)
    assert time.perf_counter() - start < 1.5


def test_an_error_of_meanwhile_cancels_the_tasks_and_is_raised() -> None:
    halt = CancelToken()
    ran: list[int] = []

    def task() -> None:
        time.sleep(0.05)
        halt.check()
        ran.append(1)

    def meanwhile(check: Any) -> None:
        raise _Boom("meanwhile's error")

    with pytest.raises(_Boom, match="meanwhile's error"):
        streaming._run_all([task] * 8, 2, halt, meanwhile)
    assert halt.cancelled
    assert len(ran) < 8
    assert not [t for t in threading.enumerate() if t.name.startswith("weightmap")]


def test_the_calling_thread_never_takes_a_future_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt landing while the calling thread holds a future's lock leaves it
    held: the next worker to take it, and the shutdown waiting for that worker, wait for ever
    (a Ctrl-C hung 1 run in 40 so). The calling thread looks at no future, failing or not."""
    from concurrent.futures import Future

    touched: list[str] = []
    for name in ("done", "result", "exception", "add_done_callback", "cancel", "cancelled"):
        real = getattr(Future, name)

        def spy(self: Any, *args: Any, _real: Any = real, _name: str = name) -> Any:
            if threading.current_thread() is threading.main_thread():
                touched.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(Future, name, spy)

    def failing() -> None:
        time.sleep(0.01)
        raise _Boom("a task's error")

    streaming._run_all([lambda: None] * 50, 2, CancelToken(), lambda check: check())
    with pytest.raises(_Boom):
        streaming._run_all([failing] + [lambda: time.sleep(0.001)] * 200, 2, CancelToken())
    assert touched == []


# -- the move into place is one stretch: a stop seen there waits for it, and says so ----------


_SIGNAL_AT = (
    "import os, signal, sys, time\n"
    "from weightmap.format import writer\n"
    "{patch}"
    "real = writer.CheckpointWriter.{method}\n"
    "def interrupted(self, *args):\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "    time.sleep(0.05)\n"
    "    return real(self, *args)\n"
    "writer.CheckpointWriter.{method} = interrupted\n"
    "from weightmap.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize(
    ("method", "renameat2"),
    [
        ("_remove_old", True),  # the old output being removed, the new one in place
        ("_remove_old", False),  # (without renameat2: two renames, as on NFS)
        ("_move_into_place", True),  # before the first rename
        ("_move_into_place", False),
    ],
)
def test_a_signal_during_the_move_into_place_waits_for_it(
    tmp_path: Path, method: str, renameat2: bool
) -> None:
    # Cut there, an overwrite left the old output under a temporary name (or, between two
    # plain renames, the destination missing), and said "nothing was committed" of an
    # output in place.
    src = _small(tmp_path, 2)
    out = tmp_path / "out"
    weightmap.remap(src, out, mapping=_RENAME, progress=False)
    (out / "old-only.txt").write_text("the old output's\n")
    patch = "" if renameat2 else "writer.renameat2 = lambda *a: False\n"
    code = _SIGNAL_AT.format(patch=patch, method=method)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "convert",
            str(src),
            str(out),
            "--overwrite",
            "--mapping",
            "weightmap 1\nunmatched keep\n",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 143, r.stderr
    assert r.stderr.rstrip().endswith(
        "weightmap: interrupted after the work was committed; it is complete"
    ), r.stderr
    with Checkpoint.open(out) as ckpt:
        assert sorted(ckpt) == ["layers.0.weight", "layers.1.weight"]  # the new output, whole
    assert not (out / "old-only.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", src.name])


def test_a_cancel_while_the_output_is_verified_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading a large output back took seconds in which a cancel was not looked at, and the
    # output was committed after it.
    import weightmap.execute.verify as verify

    src = _small(tmp_path, 4)
    stop = threading.Event()
    real = verify.stored_crc

    def slow(*args: Any) -> int:
        stop.set()  # (asked as the first tensor is read back)
        return real(*args)

    monkeypatch.setattr(verify, "stored_crc", slow)
    out = tmp_path / "out"
    with pytest.raises(weightmap.Cancelled):
        weightmap.remap(src, out, mapping=_RENAME, verify=True, cancel=stop, progress=False)
    assert stop.is_set() and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]


def test_once_stopped_a_second_signal_is_ignored_not_raised(tmp_path: Path) -> None:
    # The handlers the command line put back ran a second Ctrl-C waiting during the clean-up
    # as Python's default: a KeyboardInterrupt traceback, and the second signal's exit code.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    token = CancelToken()
    try:
        with cli._stop_on_signals(token):
            token.cancel(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        with cli._stop_on_signals(CancelToken()):
            pass
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # (what was there before)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_connecting_to_ray_keeps_the_command_lines_signal_handlers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ray.init installs sys.exit(15) for SIGTERM: a stopped --ray run exited 15, or was
    # killed by SIGABRT, without its clean-up.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")

    def ours(signum: int, frame: object) -> None:
        pass

    class FakeRay:
        initialized = False

        def is_initialized(self) -> bool:
            return self.initialized

        def init(self, **kwargs: Any) -> None:
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))
            self.initialized = True

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGTERM, ours)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        assert cluster._connect(FakeRay(), None)  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


# ------------------------------------------------------------ a Ctrl-C before the command runs

# Importing the command line raises KeyboardInterrupt, as Python's default SIGINT handler does
# when Ctrl-C comes while the interpreter imports it (before weightmap has any handler).
_CTRL_C_AT_IMPORT = (
    "import sys\n"
    "class CtrlC:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'weightmap.cli':\n"
    "            raise KeyboardInterrupt\n"
    "sys.meta_path.insert(0, CtrlC())\n"
    "from weightmap.__main__ import main\n"
    "sys.exit(main())\n"
)


def test_ctrl_c_while_the_command_line_is_imported_ends_quietly(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AT_IMPORT, "presets"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip() == "weightmap: interrupted before it started; nothing was done"
    assert r.stdout == ""


def test_ctrl_c_while_the_arguments_are_parsed_ends_quietly(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from weightmap import cli\n"
        "def parser():\n"
        "    raise KeyboardInterrupt\n"
        "cli._parser = parser\n"
        "from weightmap.__main__ import main\n"
        "sys.exit(main())\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "presets"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == "weightmap: interrupted before it started; nothing was done"
    assert r.stdout == ""


def test_the_weightmap_command_starts_through_the_quiet_entry_point() -> None:
    """The installed ``weightmap`` script imports the command line inside ``__main__.main``,
    where a Ctrl-C during the import is caught; ``weightmap.cli:main`` could not catch it."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "weightmap"]
    assert script.value == "weightmap.__main__:main"


def test_python_dash_m_runs_the_command_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "weightmap", "presets"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "eagle3-sglang" in r.stdout
