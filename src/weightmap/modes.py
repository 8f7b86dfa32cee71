"""The four ways :func:`weightmap.remap` runs a compiled plan: a dry run, an in-place header
rewrite, and a new output folder written on this machine or by tasks on a Ray cluster.

``api.remap`` is the pipeline (resolve the input, compile, run in the chosen mode); this module
holds each mode and the checks of the options it takes, so that every option is refused before
any work when the chosen mode would ignore it or the writer would refuse it later.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from weightmap.errors import CheckpointError, ExecutionError, OutputExistsError
from weightmap.execute.options import DEFAULT_CHUNK_BYTES, check_workers
from weightmap.format.options import Layouts, check_layout, parse_size
from weightmap.format.text import human_size
from weightmap.fs.cancel import CancelToken
from weightmap.fs.fdlimit import has_room, make_room, open_now
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.plan import Plan

# The executor, the writer and the checks of a written output are imported by the modes that
# write a new folder: an in-place rename (the one a command-line user times in milliseconds)
# and a dry run write none, and importing them took an eighth of an in-place call.
if TYPE_CHECKING:
    from weightmap.execute.streaming import ExecutionStats
    from weightmap.format.writer import CheckpointWriter

__all__ = [
    "EXECUTORS",
    "Executor",
    "ProgressCallback",
    "Result",
    "WriteOptions",
    "check_inplace_options",
    "check_inplace_source",
    "check_not_file_like",
    "check_not_in_input",
    "check_write_options",
    "run_dry",
    "run_inplace",
    "run_local",
    "run_ray",
]

ProgressCallback = Callable[[int, int], None]
Executor = Literal["local", "ray"]
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Result:
    """What :func:`remap` did.

    ``paths`` are the weights files written, then the side files carried or added (in place:
    the weights files whose headers were rewritten); ``config.json`` and the index, written
    beside them, are not listed. Empty for a dry run.
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


@dataclass(frozen=True)
class WriteOptions:
    """How a new output folder is written: remap's options of that name."""

    out: Path
    max_shard_size: int | str = "5GB"
    overwrite: bool = False
    verify: bool = False
    progress: bool | ProgressCallback | None = None
    workers: int | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    layout: Layouts = "clone"
    ray_address: str | None = None
    cancel: CancelToken | None = None


# ---------------------------------------------------------------- the modes


def run_dry(
    plan: Plan, ckpt: Checkpoint, out: Path | None, *, overwrite: bool, inplace: bool
) -> Result:
    """Write nothing, but refuse what the real run would refuse before its first byte."""
    if out is not None:
        from weightmap.format.writer import check_destination

        check_destination(out, overwrite, ckpt.files)
    if inplace:
        # The headers the rewrite would write, made and thrown away: what it refuses (a drop,
        # a cast, a header without room) a dry run refuses too.
        from weightmap.execute.inplace import inplace_headers  # (rarely used: imported here)

        inplace_headers(plan, ckpt)
    return Result(plan=plan, dest=out, dry_run=True)


def run_inplace(
    plan: Plan, ckpt: Checkpoint, start: float, cancel: CancelToken | None = None
) -> Result:
    """Rewrite the headers of a rename-only plan where they are, locked and journaled
    (``cancel``: checked up to the journal's commit; the replay after it always finishes)."""
    from weightmap.execute.inplace import rewrite_inplace  # (rarely used: imported here)

    files = rewrite_inplace(plan, ckpt, cancel=cancel)
    return Result(
        plan=plan,
        dest=ckpt.root,
        paths=tuple(files),
        inplace=True,
        seconds=time.perf_counter() - start,
    )


def run_local(plan: Plan, ckpt: Checkpoint, options: WriteOptions, start: float) -> Result:
    """Write a new output folder with this machine's threads (``execute/streaming.py``)."""
    from weightmap.execute.streaming import execute

    return _write(plan, ckpt, options, execute, start)


def run_ray(plan: Plan, ckpt: Checkpoint, options: WriteOptions, start: float) -> Result:
    """Write a new output folder as tasks on a Ray cluster (``execute/cluster.py``): the same
    bytes as :func:`run_local`."""
    from weightmap.execute.cluster import execute_on_ray  # (the optional extra: imported here)

    return _write(plan, ckpt, options, partial(execute_on_ray, address=options.ray_address), start)


def _write(
    plan: Plan,
    ckpt: Checkpoint,
    options: WriteOptions,
    run: Callable[..., tuple[CheckpointWriter, ExecutionStats]],
    start: float,
) -> Result:
    """Run an executor with the progress display asked for; the side files go into the same
    temporary folder, and the output is checked (``verify``), before it is committed."""
    from weightmap.execute.sidefiles import write_side_files
    from weightmap.execute.verify import check_output

    out = options.out
    tick, close = progress_fn(
        options.progress,
        lambda: plan.output_nbytes() + sum(f.size for f in plan.files),
    )

    token = options.cancel or CancelToken()

    def before_commit(folder: Path, stats: ExecutionStats) -> None:
        token.check()
        write_side_files(plan.files, ckpt.root, folder, tick)
        token.check()
        if not options.verify:
            return
        # The finished output, before it is moved into place: a failure commits nothing. A
        # stop asked meanwhile is honoured between tensors (reading back 3 GB takes seconds).
        problems = check_output(folder, plan, stats.checksums or {}, ckpt.root, token.check)
        token.check()
        if problems:
            raise ExecutionError(
                f"{out}: verification failed: {'; '.join(problems[:5])}"
                + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                + "; nothing was committed (the destination was left as it was)"
            )

    # One descriptor per input shard and per output shard, open together (a rename keeps the
    # input's sharding): hundreds of shards outgrow a soft limit of 1,024.
    # The shards are counted only where even one per output would not fit (a pass over every
    # output's size, on the path of every conversion otherwise).
    # Beside what is open already (each input file, held while the checkpoint is), each
    # input's map (computed outputs read through one, a descriptor of its own) and each
    # output shard.
    if not has_room(open_now() + len(ckpt.files) + len(plan.outputs)):
        total = plan.output_nbytes()
        per_shard = parse_size(options.max_shard_size)
        shards = min(len(plan.outputs), total // per_shard + 1 + len(ckpt.files))
        make_room(open_now() + len(ckpt.files) + shards)
    try:
        writer, stats = run(
            plan,
            ckpt,
            out,
            max_shard_size=options.max_shard_size,
            overwrite=options.overwrite,
            workers=options.workers,
            chunk_bytes=options.chunk_bytes,
            checksum=options.verify,
            progress=tick,
            metadata={"format": "pt", **ckpt.metadata},
            before_commit=before_commit,
            layout=options.layout,
            cancel=options.cancel,
        )
    finally:
        close()
    return Result(
        plan=plan,
        dest=out,
        paths=(*(out / s.filename for s in writer.shards), *(out / f.name for f in plan.files)),
        bytes_written=stats.bytes_cloned + stats.bytes_copied + stats.bytes_computed,
        bytes_copied=stats.bytes_copied,
        bytes_cloned=stats.bytes_cloned,
        bytes_computed=stats.bytes_computed,
        seconds=time.perf_counter() - start,
        verified=options.verify,
        checksums=dict(stats.checksums or {}),
    )


def progress_fn(
    progress: bool | ProgressCallback | None, count: Callable[[], int]
) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A per-chunk byte counter and a closer, from the ``progress`` argument; ``count()`` is
    the total, asked for only where something shows it (it sums every output's size)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if progress is False:
        return None, lambda: None
    total = count()
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


# ---------------------------------------------------------------- checks of the options


def check_write_options(max_shard_size: int | str, layout: str, workers: int | None) -> None:
    """Refuse, before any work, options the writer would refuse once the plan is made."""
    parse_size(max_shard_size)
    check_layout(layout)
    check_workers(workers)


_DEFAULT_SHARD = parse_size("5GB")  # (remap's default: given as such, it changes nothing)


def check_inplace_options(
    verify: bool,
    executor: Executor,
    max_shard_size: int | str = "5GB",
    layout: str = "clone",
    overwrite: bool = False,
    workers: int | None = None,
) -> None:
    """Refuse options an in-place rename would otherwise ignore without a word."""
    # An in-place rename keeps every file, shard and byte where it is, with one writer.
    ignored = [
        name
        for name, given in (
            ("max_shard_size (--max-shard-size)", parse_size(max_shard_size) != _DEFAULT_SHARD),
            ("layout (--layout)", layout != "clone"),
            ("overwrite (--overwrite)", overwrite),
            ("workers (--workers)", workers is not None),
        )
        if given
    ]
    if ignored:
        raise ValueError(
            f"an in-place rename rewrites headers and keeps the shards, their layout and every "
            f"data byte where they are, so {', '.join(ignored)} would do nothing: leave "
            f"{'it' if len(ignored) == 1 else 'them'} out, or convert into a new folder"
        )
    if verify:
        raise ValueError(
            "verify=True checks a new output before it is committed, and an in-place rename "
            "writes no tensor bytes: leave verify off (no --verify), or convert into a new folder"
        )
    if executor != "local":
        raise ValueError(
            f"executor={executor!r} runs a conversion into a new folder, and an in-place rename "
            "only rewrites headers, on this machine: leave the executor local (no --ray), or "
            "convert into a new folder"
        )


def check_inplace_source(ckpt: Checkpoint) -> None:
    """Refuse, before the plan is made or shown, files an in-place rename must not rewrite."""
    if ckpt.format != "safetensors":
        raise CheckpointError(
            "in-place renames rewrite safetensors headers; a PyTorch checkpoint is "
            "converted into a new folder (give an output folder instead)",
            path=ckpt.root,
            rule="inplace-format",
        )
    # A Hub id's files (or a cache snapshot's, given as a folder) are links into the cache's
    # blobs/: the rewrite would change a blob named by its content, which every revision that
    # holds the file shares.
    root = ckpt.root.resolve()
    linked = [p for p in ckpt.files if p.resolve().parent != root]
    if linked:
        raise CheckpointError(
            f"{linked[0].name} is a link to {linked[0].resolve()}, outside the checkpoint's "
            "folder (a Hugging Face cache keeps one file there for every revision that holds "
            "it): an in-place rename would rewrite that file; convert into a new folder instead",
            path=ckpt.root,
            rule="inplace-link",
        )
    # A file with several names (a hard-linked copy, `cp -al`) is one file: rewriting it in
    # place would change every copy, a backup included.
    shared = [(p, n) for p in ckpt.files if (n := os.stat(p).st_nlink) > 1]
    if shared:
        path, count = shared[0]
        raise CheckpointError(
            f"{path.name} has {count} hard links (names elsewhere for the same file, such as a "
            "copy made with cp -al): an in-place rename would change the file under every one "
            "of them; convert into a new folder, or give this folder its own copy first "
            f"(cp {path.name} {path.name}.tmp && mv {path.name}.tmp {path.name})",
            path=ckpt.root,
            rule="inplace-link",
        )


# Names that say "a file": a destination called so is almost always meant as the output file,
# while weightmap writes a folder.
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".gguf", ".h5")


def check_not_file_like(out: Path) -> None:
    """Refuse a destination named like a file (``out/model.safetensors``) before any work."""
    if out.is_dir() or not out.name.lower().endswith(_FILE_SUFFIXES):
        return
    raise ValueError(
        f"{out} is named like a file, but the destination is a folder: weightmap writes "
        f"model.safetensors (or shards and an index), config.json and the side files inside "
        f"it; give the folder ({out.parent / out.stem}), or create a folder of that name "
        "first and pass overwrite=True (--overwrite)"
    )


def check_not_in_input(out: Path, root: Path) -> None:
    """Refuse to replace an existing destination inside the input folder: what it holds is
    part of the input (a tokenizer folder, the file a `config from` reads), left out of the
    side files only because it is the destination, and replacing it would delete it."""
    if not (out.exists() or out.is_symlink()):
        return  # a new folder inside the input one replaces nothing
    # Where the entry itself lies (a link in the folder is part of it, wherever it points).
    entry, real_root = out.parent.resolve() / out.name, root.resolve()
    if entry == real_root or not entry.is_relative_to(real_root):
        return  # (the input itself, or a folder that holds it, is refused by the writer)
    raise OutputExistsError(
        f"{out} already exists inside the input folder {root}: replacing it would delete part "
        "of the input; choose a destination outside the input folder (or remove it yourself "
        "if it is an old output)"
    )
