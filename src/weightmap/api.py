"""The Python API: remap, compile, iter_tensors, invert, load_mapping, presets, verify."""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from weightmap.compiler.compile import compile_plan
from weightmap.compiler.inverse import invert
from weightmap.errors import ExecutionError, WeightmapError
from weightmap.execute.cluster import execute_on_ray
from weightmap.execute.inplace import rewrite_inplace
from weightmap.execute.kernels import evaluate
from weightmap.execute.memory import check_torch_shapes, iter_outputs
from weightmap.execute.streaming import DEFAULT_CHUNK_BYTES, ExecutionStats, check_inputs, execute
from weightmap.format.checkpoint import Checkpoint
from weightmap.format.layout import Layouts
from weightmap.format.text import human_size
from weightmap.format.writer import CheckpointWriter
from weightmap.language.mapping import Mapping as RuleMapping
from weightmap.language.mapping import load_mapping, preset_names, resolve_mapping
from weightmap.plan.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = [
    "Result",
    "compile",
    "invert",
    "iter_tensors",
    "load_mapping",
    "presets",
    "remap",
    "verify",
]

PathLike = str | os.PathLike[str]
ProgressCallback = Callable[[int, int], None]
Executor = Literal["local", "ray"]
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Result:
    """What :func:`remap` did.

    ``paths`` are the files written (or rewritten in place); empty for a dry run.
    ``bytes_written`` (tensor data, headers aside) is the sum of ``bytes_cloned`` (shared with
    the input by a copy-on-write filesystem: no data moved, no disk space taken; see
    docs/safety.md), ``bytes_copied`` (copied by the kernel) and ``bytes_computed``.
    """

    plan: Plan
    dest: Path | None
    paths: tuple[Path, ...] = ()
    bytes_written: int = 0
    bytes_copied: int = 0
    bytes_cloned: int = 0
    bytes_computed: int = 0
    seconds: float = 0.0
    dry_run: bool = False
    inplace: bool = False
    verified: bool = False
    checksums: Mapping[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.dry_run:
            return f"dry run: {len(self.plan.outputs)} tensors planned, nothing written"
        where = "in place" if self.inplace else f"into {self.dest}"
        how = (
            ""
            if self.inplace
            else f" ({human_size(self.bytes_cloned)} cloned, {human_size(self.bytes_copied)} "
            f"copied, {human_size(self.bytes_computed)} computed)"
        )
        return (
            f"{len(self.plan.outputs)} tensors, {self.bytes_written:,} bytes {where} in "
            f"{self.seconds:.2f} s{how}" + (" (verified)" if self.verified else "")
        )


def presets() -> list[str]:
    """Names of the presets shipped in ``mappings/``."""
    return list(preset_names())


def compile(
    checkpoint: PathLike | Checkpoint,
    *,
    preset: str | None = None,
    mapping: PathLike | RuleMapping | None = None,
    params: Mapping[str, Any] | None = None,
) -> Plan:
    """Compile a mapping against a checkpoint's headers and config into a :class:`Plan`.

    Reads no tensor data; every problem is reported at once as a ``MappingError``.

    >>> plan = compile("examples/eagle3-speculators", preset="eagle3-sglang")
    >>> print(plan.explain())                                   # doctest: +SKIP
    """
    rules = resolve_mapping(preset, mapping)
    if isinstance(checkpoint, Checkpoint):
        return compile_plan(rules, checkpoint.specs(), checkpoint.config, params=dict(params or {}))
    with Checkpoint.open(checkpoint) as ckpt:
        return compile_plan(rules, ckpt.specs(), ckpt.config, params=dict(params or {}))


def _progress_fn(
    progress: bool | ProgressCallback | None, total: int
) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A per-chunk byte counter and a closer, from the ``progress`` argument."""
    if progress is None:
        progress = sys.stderr.isatty()
    if progress is False:
        return None, lambda: None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="weightmap", leave=False
        )

        def update(n: int) -> None:
            bar.update(n)

        return update, bar.close
    callback = progress
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        callback(done, total)

    return tick, lambda: None


def remap(
    checkpoint: PathLike,
    out: PathLike | None = None,
    *,
    preset: str | None = None,
    mapping: PathLike | RuleMapping | None = None,
    params: Mapping[str, Any] | None = None,
    max_shard_size: int | str = "5GB",
    dry_run: bool = False,
    inplace: bool = False,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool | ProgressCallback | None = None,
    workers: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    layout: Layouts = "clone",
    executor: Executor = "local",
    ray_address: str | None = None,
) -> Result:
    """Convert ``checkpoint`` with a preset or a mapping, writing the result into ``out``.

    - ``checkpoint``: a folder (``model.safetensors`` or shards + index, optional config.json)
      or one ``.safetensors`` file.
    - ``preset`` names a mapping from :func:`presets`; ``mapping`` is a file path or rule text.
      ``params`` overrides the mapping's ``param`` defaults.
    - ``dry_run=True`` compiles and returns the plan, writing nothing.
    - ``inplace=True`` rewrites the headers of a rename-only plan where they are (no ``out``).
    - The output is written atomically into ``out`` (a folder); an existing ``out`` is replaced
      only with ``overwrite=True`` and never when it holds the input.
    - ``verify=True`` re-reads the output before it is moved into place and checks names,
      dtypes, shapes and a checksum of every tensor taken while writing; a failure commits
      nothing.
    - ``progress``: None shows a bar when stderr is a terminal; True/False force it; a callable
      is called as ``progress(bytes_done, bytes_total)``.
    - ``workers``: writer threads (default: the cores, at most 8); ``chunk_bytes`` bounds the
      memory of computed tensors, all threads together (default 64 MiB).
    - ``layout="clone"`` (default) lays out each output shard so that unchanged bytes keep
      their input offsets modulo 4096, which a copy-on-write filesystem (XFS, btrfs) can share
      instead of copying; ``layout="reference"`` writes the bytes ``safetensors.save_file``
      writes. See docs/safety.md.
    - ``executor="ray"`` runs the conversion as tasks on a Ray cluster (the ``weightmap[ray]``
      extra; docs/scale.md): ``ray_address`` is the cluster's (None: ``RAY_ADDRESS``, a cluster
      started on this machine, or a new local one), ``workers`` how many tasks run at once
      (default: the cluster's CPUs), ``chunk_bytes`` the memory budget of each task. Input and
      output must be on a filesystem every node mounts at the same path. The bytes written are
      the local executor's.

    >>> weightmap.remap("examples/eagle3-speculators", "out", preset="eagle3-sglang")
    ... # doctest: +SKIP
    """
    start = time.perf_counter()
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    rules = resolve_mapping(preset, mapping)
    if inplace and out is not None:
        raise ValueError("inplace=True rewrites the checkpoint itself; do not pass out=")
    if not (dry_run or inplace) and out is None:
        raise ValueError("give out= (the destination folder), or dry_run=True / inplace=True")
    with Checkpoint.open(checkpoint) as ckpt:
        plan = compile_plan(rules, ckpt.specs(), ckpt.config, params=dict(params or {}))
        if dry_run:
            return Result(plan=plan, dest=None if out is None else Path(out), dry_run=True)
        if inplace:
            files = rewrite_inplace(plan, ckpt)
            return Result(
                plan=plan,
                dest=ckpt.root,
                paths=tuple(files),
                inplace=True,
                seconds=time.perf_counter() - start,
            )
        assert out is not None
        writer, stats = _write(
            plan,
            ckpt,
            out,
            progress,
            max_shard_size,
            overwrite,
            workers,
            chunk_bytes,
            verify,
            layout,
            executor,
            ray_address,
        )
    dest = Path(out)
    return Result(
        plan=plan,
        dest=dest,
        paths=tuple(dest / s.filename for s in writer.shards),
        bytes_written=stats.bytes_cloned + stats.bytes_copied + stats.bytes_computed,
        bytes_copied=stats.bytes_copied,
        bytes_cloned=stats.bytes_cloned,
        bytes_computed=stats.bytes_computed,
        seconds=time.perf_counter() - start,
        verified=verify,
        checksums=dict(stats.checksums or {}),
    )


def _write(
    plan: Plan,
    ckpt: Checkpoint,
    out: PathLike,
    progress: bool | ProgressCallback | None,
    max_shard_size: int | str,
    overwrite: bool,
    workers: int | None,
    chunk_bytes: int,
    checksum: bool,
    layout: Layouts,
    executor: Executor = "local",
    ray_address: str | None = None,
) -> tuple[CheckpointWriter, ExecutionStats]:
    """Run the executor asked for with the progress display the caller asked for."""
    total = sum(s.nbytes for s in plan.output_specs())
    tick, close = _progress_fn(progress, total)

    def check(folder: Path, stats: ExecutionStats) -> None:
        # The finished output, before it is moved into place: a failure commits nothing.
        problems = verify(folder, plan, stats.checksums or {})
        if problems:
            raise ExecutionError(
                f"{out}: verification failed: {'; '.join(problems[:5])}"
                + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                + "; nothing was committed (the destination was left as it was)"
            )

    run = execute if executor == "local" else partial(execute_on_ray, address=ray_address)
    try:
        return run(
            plan,
            ckpt,
            out,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            workers=workers,
            chunk_bytes=chunk_bytes,
            checksum=checksum,
            progress=tick,
            metadata={"format": "pt", **ckpt.metadata},
            before_commit=check if checksum else None,
            layout=layout,
        )
    finally:
        close()


def verify(
    dest: PathLike,
    plan: Plan,
    checksums: Mapping[str, int] | None = None,
    *,
    source: PathLike | Checkpoint | None = None,
) -> list[str]:
    """Re-read a written checkpoint; the list of ways it differs from ``plan`` (empty if none).

    Names, dtypes, shapes and config.json are compared with the plan. Bytes are compared with
    ``checksums`` (output name -> CRC-32, as ``Result.checksums`` holds after ``verify=True``)
    or, given ``source`` (the input checkpoint), with the outputs recomputed from it. Without
    either for every output that has bytes there is nothing to compare the bytes with, and
    ``verify`` raises ``ValueError`` rather than report a corrupt output as fine.

    >>> result = remap(src, "out", preset="eagle3-sglang", verify=True)   # doctest: +SKIP
    >>> verify("out", result.plan, result.checksums)                      # doctest: +SKIP
    []
    >>> verify("out", result.plan, source=src)                            # doctest: +SKIP
    []
    """
    checksums = dict(checksums or {})
    if source is None:
        unchecked = [s.name for s in plan.output_specs() if s.nbytes and s.name not in checksums]
        if unchecked:
            raise ValueError(
                f"no checksum for {len(unchecked)} output(s) (first: {unchecked[0]!r}), so their "
                "bytes cannot be verified: pass the checksums of a run with verify=True "
                "(Result.checksums), or source= the input checkpoint to recompute them"
            )
    elif isinstance(source, Checkpoint):
        checksums = _recomputed(plan, source)
    else:
        with Checkpoint.open(source) as ckpt:
            checksums = _recomputed(plan, ckpt)
    with Checkpoint.open(dest) as ckpt:
        return _differences(plan, ckpt, checksums)


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes as stored, without copying a view of the file."""
    import torch

    if t.numel() == 0:
        return 0
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def _recomputed(plan: Plan, ckpt: Checkpoint) -> dict[str, int]:
    """Each output's CRC-32, computed from the input one tensor at a time."""
    check_inputs(plan, ckpt)
    return {
        out.name: _crc(evaluate(out.node, ckpt.view, out.name))
        for out in plan.outputs
        if out.spec.nbytes
    }


def _differences(plan: Plan, ckpt: Checkpoint, checksums: Mapping[str, int]) -> list[str]:
    problems: list[str] = []
    expected = {s.name: s for s in plan.output_specs()}
    found = {s.name: s for s in ckpt.specs()}
    problems += [f"{n!r} is missing" for n in expected if n not in found]
    problems += [f"{n!r} is unexpected" for n in found if n not in expected]
    for name, spec in expected.items():
        got = found.get(name)
        if got is None:
            continue
        if got != spec:
            problems.append(
                f"{name!r} is {got.dtype}{list(got.shape)}, planned {spec.dtype}{list(spec.shape)}"
            )
            continue
        if spec.nbytes and _crc(ckpt.view(name)) != checksums[name]:
            problems.append(f"{name!r} bytes differ from what was written")
    if plan.config is not None and ckpt.config != plan.config:
        problems.append("config.json differs from the plan's")
    return problems


def iter_tensors(
    checkpoint: PathLike,
    *,
    preset: str | None = None,
    mapping: PathLike | RuleMapping | None = None,
    params: Mapping[str, Any] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of the remapped checkpoint lazily, one output at a time.

    Tensors whose bytes are unchanged (renames, keeps, reshapes, slices along the first
    dimension) are zero-copy views of the memory-mapped input — copy-on-write, so writing to
    them never touches the file. Computed tensors are built one at a time. This is the shape a
    serving engine's ``load_weights(weights: Iterable[tuple[str, Tensor]])`` consumes::

        model.load_weights(weightmap.iter_tensors(path, preset="eagle3-sglang"))

    The whole plan is compiled (and every problem reported) before the first tensor is yielded.
    """
    rules = resolve_mapping(preset, mapping)
    ckpt = Checkpoint.open(checkpoint)
    try:
        plan = compile_plan(rules, ckpt.specs(), ckpt.config, params=dict(params or {}))
        check_torch_shapes(plan)
    except WeightmapError:
        ckpt.close()
        raise
    return iter_outputs(plan, ckpt)
