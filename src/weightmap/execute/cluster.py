"""The executor on a Ray cluster: the plan's work as Ray tasks, committed by the driver.

The driver (this process) checks the inputs, plans the output as the local executor does and
opens the writer, which creates the temporary folder beside the destination with every shard's
header and size (``distributed.py``). The work is split into tasks of about equal cost; at most
``workers`` run at once, costliest first. Each task runs on some node (``task.py``), writes
its units into the shards by path, syncs them and returns what it wrote. Tasks report their
bytes to a small progress actor, which the driver reads to move the progress bar.

A task whose worker dies (a killed process, a lost node) is run again by Ray, up to
``max_retries`` times: it writes the same bytes at the same offsets, and only the report of the
attempt that finished counts. A task that fails (an input changed, a full disk) fails the
conversion with the error it raised, as the local executor would raise it; the other tasks are
stopped, and the writer removes the temporary folder. Once every task has reported, the driver
checks that every byte arrived, and the writer fsyncs, verifies and commits exactly as for
the local executor.

Ray is imported only when this executor runs (the ``weightmap[ray]`` extra).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from weightmap.errors import ExecutionError, WeightmapError
from weightmap.execute import task as task_module
from weightmap.execute.distributed import execute_tasks
from weightmap.execute.partition import TaskReport, TaskSpec
from weightmap.execute.streaming import ExecutionStats, ProgressFn, check_inputs, check_workers
from weightmap.format.text import redacted
from weightmap.format.writer import CheckpointWriter
from weightmap.fs.cancel import CancelToken
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.plan import Plan

__all__ = ["execute_on_ray"]

# How long the driver waits for a task before it looks at the progress again (seconds).
_POLL = 0.2
# How long stopped tasks get to end before the temporary folder is removed (seconds).
_STOP_WAIT = 30.0


def _import_ray() -> ModuleType:
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise ExecutionError(
            "executor='ray' needs Ray, which is not installed: pip install 'weightmap[ray]'"
        ) from None


class _Progress:
    """The progress actor: each task's bytes written so far, the largest seen, by conversion.

    Tasks report running totals, not increments, and only the largest counts: an attempt run
    again after a crash starts from zero, and the bar neither counts its bytes twice nor goes
    back. One actor serves every conversion of a driver (starting one takes a process).
    """

    def __init__(self) -> None:
        self.done: dict[str, dict[int, int]] = {}

    def report(self, run: str, index: int, done: int) -> None:
        tasks = self.done.setdefault(run, {})
        tasks[index] = max(tasks.get(index, 0), done)

    def total(self, run: str) -> int:
        return sum(self.done.get(run, {}).values())

    def forget(self, run: str) -> None:
        self.done.pop(run, None)


_actor: tuple[str, Any] | None = None  # (the Ray job it belongs to, the progress actor)


def _progress_actor(ray: ModuleType) -> Any:
    """This driver's progress actor, started on first use without waiting for it to run (the
    tasks' reports queue up until it does)."""
    global _actor
    job = ray.get_runtime_context().get_job_id()
    if _actor is None or _actor[0] != job:
        _actor = (job, ray.remote(num_cpus=0)(_Progress).remote())
    return _actor[1]


def _forget_actor() -> None:
    global _actor
    _actor = None


def _entry(body: Callable[..., TaskReport]) -> Callable[[TaskSpec, Any], TaskReport]:
    """The function Ray runs: ``body`` (``task.run_task``) reporting to the progress actor.

    Made here, at each conversion, so that it travels to the workers with the body it was
    given (tests give one that kills its worker).
    """

    def run(spec: TaskSpec, progress: Any) -> TaskReport:
        if progress is None:
            return body(spec, None)
        return body(spec, lambda done: progress.report.remote(spec.folder, spec.index, done))

    return run


def _answers(address: str, timeout: float = 5.0, named: str = "") -> None:
    """Fail at once where nothing answers at a ``host:port`` (or ``ray://host:port``) address.

    Ray itself retries a cluster that is not there for minutes, logging a warning every few
    seconds; a mistyped address or a head node not started deserves one line now. Addresses
    that are not a host and a port (``auto``, ``local``) are left to Ray.
    """
    hostport = address.removeprefix("ray://").rpartition("@")[2]  # (no user:password@)
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 literal
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        given = f" ({named})" if named else ""
        raise ExecutionError(
            f"cannot connect to the Ray cluster at {redacted(address)}{given}: nothing answers "
            f"at {host}:{port} "
            f"({why}); start the head node there with `ray start --head`, or pass the address "
            "it prints"
        ) from None


def _connect(ray: ModuleType, address: str | None) -> bool:
    """Connect to the cluster at ``address`` (None: ``RAY_ADDRESS``, a cluster started on this
    machine, or a new local one); True if this call started the connection."""
    if ray.is_initialized():
        return False
    # Ray reads RAY_ADDRESS where no address is given: a dead one there is just as slow.
    env = os.environ.get("RAY_ADDRESS")
    if address:
        _answers(address)
    elif env:
        _answers(env, named="RAY_ADDRESS")
    options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    if not (address or "").startswith("ray://"):  # Ray Client takes no local-cluster options
        options["include_dashboard"] = False  # a new local cluster starts faster without it
    # ray.init installs its own SIGTERM handler (sys.exit(15)), which would end a stopped
    # conversion with another code, and skip the clean-up the caller's handler starts.
    ours = (
        {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        ray.init(address=address, **options)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = redacted(address) if address else "the default address"
        raise ExecutionError(
            f"cannot connect to the Ray cluster at {where}: {redacted(str(exc))}"
        ) from exc
    finally:
        for sig, handler in ours.items():
            signal.signal(sig, handler)
    return True


def execute_on_ray(
    plan: Plan,
    ckpt: Checkpoint,
    dest: str | os.PathLike[str],
    *,
    address: str | None = None,
    workers: int | None = None,
    max_retries: int = 3,
    cancel: CancelToken | None = None,
    **options: Any,
) -> tuple[CheckpointWriter, ExecutionStats]:
    """Write ``plan`` applied to ``ckpt`` into ``dest`` with tasks on a Ray cluster.

    ``address`` is the cluster's (None: ``RAY_ADDRESS``, a cluster started on this machine with
    ``ray start``, or a new local one); ``workers`` is how many tasks run at once (default: the
    cluster's CPUs); a task's worker may die ``max_retries`` times. The other ``options`` are
    those of ``distributed.execute_tasks`` (those of ``streaming.execute``; ``chunk_bytes``
    bounds the memory of computed tensors in each task). The input checkpoint and ``dest``
    must be on a filesystem that every node mounts at the same path. The output is byte for
    byte the local executor's. Once ``cancel`` is cancelled (or the driver is interrupted),
    the tasks are cancelled within one poll and the temporary folder removed.
    """
    ray = _import_ray()
    check_inputs(plan, ckpt)
    check_workers(workers)
    connected = ray.is_initialized()
    try:
        _connect(ray, address)
        slots = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))

        def run(tasks: list[TaskSpec], progress: ProgressFn | None) -> list[TaskReport]:
            return _run(ray, tasks, slots, progress, max_retries, str(dest), cancel)

        return execute_tasks(plan, ckpt, dest, run=run, slots=slots, cancel=cancel, **options)
    finally:
        # (Also where a stop came during ray.init: the cluster it was starting goes too.)
        if not connected and ray.is_initialized():
            ray.shutdown()


def _run(
    ray: ModuleType,
    tasks: list[TaskSpec],
    slots: int,
    progress: ProgressFn | None,
    max_retries: int,
    dest: str,
    cancel: CancelToken | None = None,
) -> list[TaskReport]:
    """Run the tasks, at most ``slots`` at once, in order; their reports. ``cancel`` is
    checked at each poll: once it is cancelled, the tasks are cancelled (``_stop``)."""
    remote = ray.remote(
        num_cpus=1,
        max_retries=max_retries,
        retry_exceptions=False,
        # Over every node, not packed onto the first: each brings its own disk and network.
        scheduling_strategy="SPREAD",
    )(_entry(task_module.run_task))
    actor = None if progress is None else _progress_actor(ray)
    run = tasks[0].folder if tasks else ""  # names this conversion to the actor
    asked = None  # the total asked of the actor, not yet answered
    queue = list(reversed(tasks))  # popped from the end: costliest first
    pending: dict[Any, TaskSpec] = {}
    reports: list[TaskReport] = []
    shown = 0
    # Ray's driver runs threads of its own beside this one: as with the writer threads, a
    # signal here only cancels the token, which the loop polls every _POLL seconds (see
    # CancelToken.polled), rather than raise in the middle of Ray's code.
    token = cancel if cancel is not None else CancelToken()
    try:
        with token.polled():
            while queue or pending:
                token.check()
                while queue and len(pending) < slots:
                    spec = queue.pop()
                    pending[remote.remote(spec, actor)] = spec
                done, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL)
                for ref in done:
                    pending.pop(ref)
                    reports.append(_result(ray, ref, max_retries, dest))
                if progress is not None and actor is not None:
                    asked = asked or actor.total.remote(run)
                    if ray.wait([asked], timeout=0)[0]:
                        try:
                            total, asked = ray.get(asked), None
                        except ray.exceptions.RayError:
                            # The actor is gone: the bar waits for the reports, which are what
                            # counts; the next conversion starts another actor.
                            _forget_actor()
                            actor = None
                            continue
                        if total > shown:
                            progress(total - shown)
                            shown = total
    except BaseException:
        _stop(ray, list(pending))
        raise
    finally:
        if actor is not None:
            actor.forget.remote(run)
    if progress is not None:
        # The reports are what counts; the last progress messages may still be on their way.
        written = sum(n for r in reports for n in r.written.values())
        if written > shown:
            progress(written - shown)
    return reports


def _result(ray: ModuleType, ref: Any, max_retries: int, dest: str) -> TaskReport:
    """A finished task's report; its error raised as the local executor raises it."""
    try:
        report: TaskReport = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, WeightmapError | OSError):
            raise cause from exc
        raise
    except ray.exceptions.RayError as exc:
        # Retries spent: the worker died every time (killed, out of memory, its node lost).
        raise ExecutionError(
            f"{dest}: a task failed {max_retries + 1} times, its worker lost each time "
            f"({type(exc).__name__}); nothing was written under that name"
        ) from exc
    return report


def _stop(ray: ModuleType, refs: list[Any]) -> None:
    """Stop running tasks and wait until they are gone, before the folder is removed."""
    for ref in refs:
        ray.cancel(ref, force=True)
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=_STOP_WAIT)
