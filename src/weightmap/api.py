"""The Python API: remap, compile, iter_tensors, invert, load_mapping, presets, verify."""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from weightmap.compiler.compile import compile_plan
from weightmap.errors import (
    CheckpointError,
    ExecutionError,
    MappingError,
    OutputExistsError,
    WeightmapError,
)
from weightmap.execute.kernels import evaluate
from weightmap.execute.memory import check_torch_shapes, iter_outputs
from weightmap.execute.sidefiles import check_side_files, write_side_files
from weightmap.execute.streaming import (
    DEFAULT_CHUNK_BYTES,
    ExecutionStats,
    check_inputs,
    check_workers,
    crc_of_ranges,
    descriptors,
    execute,
)
from weightmap.format.checkpoint import Checkpoint
from weightmap.format.fdlimit import has_room, make_room
from weightmap.format.gcpause import GcPause, gc_paused
from weightmap.format.layout import CONFIG_NAME, Layouts, check_layout, parse_size
from weightmap.format.sidefiles import FolderFiles, list_side_files
from weightmap.format.text import human_size
from weightmap.format.writer import CheckpointWriter, check_destination, destination_path
from weightmap.language.mapping import Mapping as RuleMapping
from weightmap.language.mapping import load_mapping, preset_names, resolve_mapping
from weightmap.plan.nodes import Source
from weightmap.plan.plan import Plan

# The Ray executor, in-place rewrites, inversion and the Hub are imported where they are used:
# `import weightmap` is paid by every command and every process that embeds it, and most
# conversions need none of them (a rename of a 4 GB drafter on a copy-on-write filesystem takes
# less time than importing them did).
if TYPE_CHECKING:
    import torch

    from weightmap.format.hub import HubRepo

__all__ = [
    "Result",
    "compile",
    "invert",
    "iter_tensors",
    "load_mapping",
    "presets",
    "recover",
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


def _params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params`` as the compiler takes it: a dict; a MappingError (not a TypeError from
    ``dict()``) for anything that is no mapping of names to values."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise MappingError(f"params must be a dict of name to value, not {type(params).__name__}")
    return dict(params)


def presets() -> list[str]:
    """Names of the presets shipped in ``mappings/``."""
    return list(preset_names())


def recover(root: PathLike) -> bool:
    """Finish an interrupted in-place rewrite in ``root``; True if there was one to finish.

    The journal is validated in full first (docs/safety.md); a journal that fails is refused
    with a :class:`~weightmap.errors.CheckpointError` and nothing is written.
    """
    from weightmap.execute.inplace import recover as recover_folder  # (see the imports)

    return recover_folder(root)


def invert(
    mapping: PathLike | RuleMapping,
    *,
    check: PathLike | Checkpoint | Plan | None = None,
    params: Mapping[str, Any] | None = None,
) -> RuleMapping:
    """A mapping that undoes ``mapping``, or MappingError naming each rule that cannot be undone.

    Its ``text`` is generated source that parses back to it. See docs/language.md
    ("Inversion") for which rules invert and how. ``check``: a checkpoint (``mapping`` is
    compiled against it with ``params``) or that plan, which the inverse must give back:
    compiled against the conversion's output with the plan's params, it must make the input's
    names, dtypes, shapes and config.json again, or MappingError lists what differs (values
    are not compared; no tensor data is read).
    """
    from weightmap.compiler.inverse import invert as invert_mapping  # (see the imports)
    from weightmap.compiler.inverse import round_trip_problems

    rules = resolve_mapping(None, mapping)  # a file, rule text or a loaded mapping, as elsewhere
    inverse = invert_mapping(rules)
    if check is None:
        return inverse
    plan = check if isinstance(check, Plan) else compile(check, mapping=rules, params=params)
    problems = round_trip_problems(plan, inverse)
    if problems:
        raise MappingError(
            f"the inverse of {rules.name} does not give back this checkpoint (what only a "
            "checkpoint shows: see Inversion in docs/language.md):\n  " + "\n  ".join(problems)
        )
    return inverse


def compile(
    checkpoint: PathLike | Checkpoint,
    *,
    preset: str | None = None,
    mapping: PathLike | RuleMapping | None = None,
    params: Mapping[str, Any] | None = None,
    side_files: bool = True,
) -> Plan:
    """Compile a mapping against a checkpoint's headers and config into a :class:`Plan`.

    Reads no tensor data; every problem is reported at once as a ``MappingError``. The plan
    lists the side files a conversion would carry (``side_files=False``: none).

    >>> plan = compile("examples/eagle3-speculators", preset="eagle3-sglang")
    >>> print(plan.explain())                                   # doctest: +SKIP
    """
    rules = resolve_mapping(preset, mapping)
    if isinstance(checkpoint, Checkpoint):
        src = _Source(checkpoint.root, True)
        files = src.side_files(checkpoint, rules, side_files, None)
        return compile_plan(
            rules, checkpoint.specs(), checkpoint.config, params=_params(params), files=files
        )
    src = _Source.resolve(checkpoint, rules.config_file, progress=False)
    with Checkpoint.open(src.path, config_name=rules.config_file) as ckpt:
        files = src.side_files(ckpt, rules, side_files, None)
        return compile_plan(rules, ckpt.specs(), ckpt.config, params=_params(params), files=files)


def open_checkpoint(checkpoint: PathLike, *, config_name: str = CONFIG_NAME) -> Checkpoint:
    """Open a local checkpoint, or a Hub repository id's (its weights and config fetched
    into huggingface_hub's cache first)."""
    src = _Source.resolve(checkpoint, config_name, progress=sys.stderr.isatty())
    return Checkpoint.open(src.path, config_name=config_name)


@dataclass
class _Source:
    """What the caller named as the input: a local folder or file, or a Hub repository id
    (``org/name[@revision]``) resolved into huggingface_hub's cache."""

    path: PathLike
    folder: bool
    repo: HubRepo | None = None
    listing: dict[str, int] | None = None

    @classmethod
    def resolve(cls, checkpoint: PathLike, config_name: str, *, progress: bool) -> _Source:
        given = os.fspath(checkpoint)
        if Path(given).exists():
            return cls(checkpoint, Path(given).is_dir())
        # (imported here: see the imports)
        from weightmap.format.hub import HubRepo, looks_like_repo_id

        if not looks_like_repo_id(given):
            return cls(checkpoint, False)
        repo = HubRepo(given)
        listing = repo.files()
        wanted = repo.checkpoint_files(listing, config_name)
        return cls(repo.fetch(wanted, progress=progress), True, repo, listing)

    def side_files(
        self, ckpt: Checkpoint, rules: RuleMapping, carry: bool, out: PathLike | None
    ) -> FolderFiles | None:
        """The side files to carry: those of the input folder (or repository); none for a
        file given alone (its folder may be any folder) or when carrying is off."""
        if not carry or not self.folder:
            return None
        if self.repo is not None and self.listing is not None:
            return self.repo.side_files(self.listing, rules.config_file)
        exclude = [Path(out)] if out is not None else []
        return list_side_files(ckpt.root, config_name=rules.config_file, exclude=exclude)

    def fetch(self, plan: Plan, *, progress: bool) -> None:
        """Download the side files the plan carries from a repository (the cache first)."""
        wanted = [f.source for f in plan.files if f.source is not None]
        if self.repo is not None and wanted:
            self.repo.fetch(wanted, progress=progress, side=True)


def _progress_fn(
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
    side_files: bool = True,
    on_plan: Callable[[Plan], None] | None = None,
    layout: Layouts = "clone",
    executor: Executor = "local",
    ray_address: str | None = None,
) -> Result:
    """Convert ``checkpoint`` with a preset or a mapping, writing the result into ``out``.

    - ``checkpoint``: a folder (``model.safetensors`` or shards + index, or PyTorch's
      ``pytorch_model.bin``, sharded ``.bin`` + index, one ``.pt``/``.pth``; optional
      config.json), one such file, or a Hugging Face repository id ``org/name[@revision]``
      (with the ``hub`` extra: the cache first, then only the files the plan needs).
    - ``side_files``: carry the folder's other files (tokenizer, generation config, README...)
      into ``out``, byte for byte, as the mapping's ``files { }`` blocks say; False writes
      the weights and config.json alone.
    - ``on_plan(plan)`` is called once the plan is made, before any byte is written.
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
      memory of computed tensors, all threads together (default 32 MiB).
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
    if inplace:
        _check_inplace_options(verify, executor, max_shard_size, layout, overwrite, workers)
    else:
        # Checked now, dry run or not: a dry run passes only what the real run would.
        _check_write_options(max_shard_size, layout, workers)
    if out is not None:
        out = destination_path(Path(out))  # (`in/..` refused, a `..` in folders to make taken)
        _check_not_file_like(out)
    bars = progress is True or (progress is None and sys.stderr.isatty())
    src = _Source.resolve(checkpoint, rules.config_file, progress=bars)

    def convert(pause: GcPause) -> Result:
        with Checkpoint.open(src.path, config_name=rules.config_file) as ckpt:
            if inplace:
                _check_inplace_source(ckpt)
            if out is not None and src.folder and src.repo is None:
                _check_not_in_input(Path(out), ckpt.root)
            carried = src.side_files(ckpt, rules, side_files, out)
            if inplace and carried is not None:
                # Listed in place too, so that `exists file` sees what a conversion into a new
                # folder sees (a preset's config.json edits depend on it); without the warnings
                # about entries a copy would skip, since nothing is copied.
                carried = FolderFiles(carried.files)
            plan = compile_plan(
                rules, ckpt.specs(), ckpt.config, params=_params(params), files=carried
            )
            if inplace:
                # The folder's other files stay where they are: a files block that would change
                # them is refused, and the plan carries none.
                from weightmap.execute.inplace import check_files_stay

                check_files_stay(plan, [f.name for f in carried.files] if carried else [])
                plan = replace(plan, files=())
            if src.repo is not None or verify or executor != "local" or not plan.is_rename_only:
                pause.release()
            if on_plan is not None:
                on_plan(plan)
            if not dry_run:
                src.fetch(plan, progress=bars)
            if dry_run:
                if out is not None:
                    # What the writer would refuse before any work, the dry run refuses.
                    check_destination(Path(out), overwrite, ckpt.files)
                if inplace:
                    # The headers the rewrite would write, made and thrown away: what it
                    # refuses (a drop, a cast, a header without room) a dry run refuses too.
                    from weightmap.execute.inplace import inplace_headers

                    inplace_headers(plan, ckpt)
                return Result(plan=plan, dest=None if out is None else Path(out), dry_run=True)
            if inplace:
                from weightmap.execute.inplace import rewrite_inplace

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
            paths=(
                *(dest / s.filename for s in writer.shards),
                *(dest / f.name for f in plan.files),
            ),
            bytes_written=stats.bytes_cloned + stats.bytes_copied + stats.bytes_computed,
            bytes_copied=stats.bytes_copied,
            bytes_cloned=stats.bytes_cloned,
            bytes_computed=stats.bytes_computed,
            seconds=time.perf_counter() - start,
            verified=verify,
            checksums=dict(stats.checksums or {}),
        )

    # One pause of the collector over the conversion (format/gcpause.py): it ends once
    # convert() has returned, so that what the conversion made and dropped is never walked.
    # A conversion that only moves bytes makes no objects per byte, however long its copies
    # take; where it computes, verifies, downloads or runs on a cluster, the pause ends with
    # the plan, as that work may take minutes and make objects of other libraries.
    with gc_paused() as pause:
        return convert(pause)


def _check_write_options(max_shard_size: int | str, layout: str, workers: int | None) -> None:
    """Refuse, before any work, options the writer would refuse once the plan is made."""
    parse_size(max_shard_size)
    check_layout(layout)
    check_workers(workers)


_DEFAULT_SHARD = parse_size("5GB")  # (remap's default: given as such, it changes nothing)


def _check_inplace_options(
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


def _check_inplace_source(ckpt: Checkpoint) -> None:
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


def _check_not_file_like(out: Path) -> None:
    """Refuse a destination named like a file (``out/model.safetensors``) before any work."""
    if out.is_dir() or not out.name.lower().endswith(_FILE_SUFFIXES):
        return
    raise ValueError(
        f"{out} is named like a file, but the destination is a folder: weightmap writes "
        f"model.safetensors (or shards and an index), config.json and the side files inside "
        f"it; give the folder ({out.parent / out.stem}), or create a folder of that name "
        "first and pass overwrite=True (--overwrite)"
    )


def _check_not_in_input(out: Path, root: Path) -> None:
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
    """Run the executor asked for with the progress display the caller asked for; the side
    files go into the same temporary folder, before it is committed."""
    tick, close = _progress_fn(
        progress,
        lambda: sum(s.nbytes for s in plan.output_specs()) + sum(f.size for f in plan.files),
    )

    def check(folder: Path, stats: ExecutionStats) -> None:
        write_side_files(plan.files, ckpt.root, folder, tick)
        if not checksum:
            return
        # The finished output, before it is moved into place: a failure commits nothing.
        problems = _check_output(folder, plan, stats.checksums or {}, ckpt.root)
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
    if not has_room(len(ckpt.files) + len(plan.outputs)):
        total = sum(s.nbytes for s in plan.output_specs())
        shards = min(len(plan.outputs), total // parse_size(max_shard_size) + 1 + len(ckpt.files))
        make_room(len(ckpt.files) + shards)
    if executor == "local":
        run = execute
    else:
        from weightmap.execute.cluster import execute_on_ray  # (imported here: see the imports)

        run = partial(execute_on_ray, address=ray_address)
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
            before_commit=check,
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
    or, given ``source`` (the input checkpoint: a folder, a file or a Hub id, as :func:`remap`
    takes it), with the outputs recomputed from it. Without either for every output that has
    bytes there is nothing to compare the bytes with, and ``verify`` raises ``ValueError``
    rather than report a corrupt output as fine. Side files are compared with the plan
    (present, sizes, added text) and, given a ``source`` folder, with the input's files byte
    for byte.

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
        return _check_output(Path(dest), plan, checksums, None)
    if isinstance(source, Checkpoint):
        return _check_output(Path(dest), plan, _recomputed(plan, source), source.root)
    # Any input remap takes, a Hub id included (its carried side files fetched too, from the
    # cache first, to be compared byte for byte).
    src = _Source.resolve(source, CONFIG_NAME, progress=False)
    with Checkpoint.open(src.path) as ckpt:
        src.fetch(plan, progress=False)
        checksums = _recomputed(plan, ckpt)
    return _check_output(Path(dest), plan, checksums, ckpt.root)


def _check_output(
    dest: Path, plan: Plan, checksums: Mapping[str, int], files_root: Path | None
) -> list[str]:
    """The tensors and config of ``dest`` against the plan and checksums; its side files
    against the plan and, given ``files_root``, the input's files."""
    with Checkpoint.open(dest) as ckpt, descriptors() as fds:
        make_room(len(ckpt.files))
        problems = _differences(plan, ckpt, checksums, fds)
    return problems + check_side_files(plan.files, dest, files_root)


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
    """Each output's CRC-32, computed from the input one tensor at a time: an input tensor of
    a safetensors file taken whole (a rename, a keep) from its bytes, read with pread, which
    is what a torch view of it would hold; any other output through its values (and torch).

    Only the whole tensor: a slice's or a concatenation's byte ranges are the writer's own
    arithmetic, which recomputing from the values checks; and a PyTorch file's offsets are
    ours, where its values are torch's own reading of it.
    """
    check_inputs(plan, ckpt)
    safetensors = ckpt.format == "safetensors"
    found: dict[str, int] = {}
    with descriptors() as fds:
        for out in plan.outputs:
            if not out.spec.nbytes:
                continue
            node = out.node
            if safetensors and type(node) is Source and ckpt.has_range(node.name):
                found[out.name] = _stored_crc(ckpt, node.name, fds)
            else:
                found[out.name] = _crc(evaluate(node, ckpt.view, out.name))
    return found


def _stored_crc(ckpt: Checkpoint, name: str, fds: dict[Path, int]) -> int:
    """CRC-32 of tensor ``name`` of ``ckpt`` as stored: its byte range read with pread (no
    torch: checking a rename's output must not cost the seconds importing torch takes), or,
    for a tensor that is no byte range of its file, its values' bytes."""
    if not ckpt.has_range(name):
        return _crc(ckpt.view(name))
    loc = ckpt.location(name)
    return crc_of_ranges([(loc.path, loc.offset, loc.length)], fds)


def _differences(
    plan: Plan, ckpt: Checkpoint, checksums: Mapping[str, int], fds: dict[Path, int]
) -> list[str]:
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
        if spec.nbytes and _stored_crc(ckpt, name, fds) != checksums[name]:
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

    The whole plan is compiled (and every problem the compiler can see reported) before the
    first tensor is yielded; checks of values (an integer cast that overflows, mask positions
    out of range) raise ``ExecutionError`` when that tensor is reached. Two outputs of one
    input never share memory (a ``copy`` yields a copy); tensors a PyTorch checkpoint stores
    tied come out tied, as ``torch.load`` gives them.
    """
    rules = resolve_mapping(preset, mapping)
    src = _Source.resolve(checkpoint, rules.config_file, progress=sys.stderr.isatty())
    ckpt = Checkpoint.open(src.path, config_name=rules.config_file)
    try:
        # With the side files `remap` lists, though none is copied: `exists file` must see
        # them, or a mapping that tests for one would yield other tensors than it writes.
        files = src.side_files(ckpt, rules, True, None)
        plan = compile_plan(rules, ckpt.specs(), ckpt.config, params=_params(params), files=files)
        check_torch_shapes(plan)
    except WeightmapError:
        ckpt.close()
        raise
    make_room(len(ckpt.files))  # (a view of each input shard stays mapped while yielding)
    return iter_outputs(plan, ckpt)
