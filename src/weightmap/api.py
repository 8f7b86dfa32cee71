"""The Python API: remap, compile, iter_tensors, invert, load_mapping, presets, verify."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightmap.binding import bind_inputs, check_bindings, main_family, main_is_family_folder
from weightmap.compiler.compile import compile_plan
from weightmap.errors import MappingError, WeightmapError
from weightmap.execute.options import DEFAULT_CHUNK_BYTES
from weightmap.format.names import CONFIG_NAME
from weightmap.format.options import Layouts
from weightmap.fs.cancel import CancelSource, CancelToken, as_token
from weightmap.fs.fdlimit import make_room, open_now
from weightmap.fs.gcpause import gc_paused
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.inputs.resolve import ResolvedInput
from weightmap.inputs.sidefiles import FolderFiles
from weightmap.language.mapping import Mapping as RuleMapping
from weightmap.language.mapping import load_mapping, preset_names, resolve_mapping
from weightmap.modes import (
    EXECUTORS,
    Executor,
    ProgressCallback,
    Result,
    WriteOptions,
    check_inplace_options,
    check_inplace_source,
    check_not_file_like,
    check_not_in_input,
    check_write_options,
    run_dry,
    run_inplace,
    run_local,
    run_ray,
)
from weightmap.plan.plan import Plan

# The executors and the writer (modes.py), the Ray executor, in-place rewrites, iter_tensors'
# and verify's evaluators, inversion and the Hub are imported where they are used:
# `import weightmap` is paid by every command and every process that embeds it, and most
# conversions need none of them (a rename of a 4 GB drafter on a copy-on-write filesystem takes
# less time than importing them did).
if TYPE_CHECKING:
    import torch

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
    allow_code: bool = False,
    inputs: Mapping[str, PathLike] | None = None,
) -> Plan:
    """Compile a mapping against a checkpoint's headers and config into a :class:`Plan`.

    Reads no tensor data; every problem is reported at once as a ``MappingError``. The plan
    lists the side files a conversion would carry (``side_files=False``: none), and which of
    them are code files; ``allow_code`` as :func:`remap` takes it.

    >>> plan = compile("examples/eagle3-speculators", preset="eagle3-sglang")
    >>> print(plan.explain())                                   # doctest: +SKIP
    """
    rules = resolve_mapping(preset, mapping)
    if isinstance(checkpoint, Checkpoint):
        if rules.inputs:
            raise ValueError(
                f"{rules.name} reads several inputs: give the main checkpoint's path, not an "
                "opened Checkpoint, with inputs="
            )
        src = ResolvedInput(checkpoint.root, True)
        return _compile_for(src, checkpoint, rules, _params(params), side_files, allow_code)
    src = _resolve(checkpoint, rules, inputs, progress=False)
    with _opened(src, rules, inputs, progress=False) as (ckpt, seen):
        return _compile_for(src, ckpt, rules, _params(params), side_files, allow_code, seen=seen)


def _resolve(
    checkpoint: PathLike,
    rules: RuleMapping,
    inputs: Mapping[str, PathLike] | None,
    *,
    progress: bool,
    cancel: CancelToken | None = None,
) -> ResolvedInput:
    """The main input found: a Hub id's checkpoint files fetched, or, where the mapping reads a
    family of rank files from it, the members and configs."""
    family = main_family(rules.inputs, inputs)
    return ResolvedInput.resolve(
        checkpoint, rules.config_file, progress=progress, cancel=cancel, family=family
    )


@contextmanager
def _opened(
    src: ResolvedInput,
    rules: RuleMapping,
    inputs: Mapping[str, PathLike] | None,
    *,
    progress: bool,
    cancel: CancelToken | None = None,
) -> Iterator[tuple[Checkpoint, dict[str, Any]]]:
    """The main input opened, joined with the inputs the mapping declares (bound by
    ``inputs``; binding.py), and what expressions see under each declared input's name."""
    if inputs is not None and not isinstance(inputs, Mapping):
        raise MappingError(
            f"inputs must be a dict of input name to path, not {type(inputs).__name__}"
        )
    bindings = check_bindings(rules.inputs, inputs, rules.name)
    if not rules.inputs:
        with Checkpoint.open(src.path, config_name=rules.config_file) as ckpt:
            yield ckpt, {}
        return
    if main_is_family_folder(rules.inputs, bindings):
        main = Checkpoint.empty(Path(src.path), rules.config_file)
    else:
        main = Checkpoint.open(src.path, config_name=rules.config_file)
    try:
        bound = bind_inputs(main, rules.inputs, bindings, progress=progress, cancel=cancel)
        try:
            yield bound.ckpt, bound.values
        finally:
            bound.close()
    finally:
        main.close()


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
    allow_code: bool = False,
    on_plan: Callable[[Plan], None] | None = None,
    layout: Layouts = "clone",
    executor: Executor = "local",
    ray_address: str | None = None,
    cancel: CancelSource | CancelToken | None = None,
    inputs: Mapping[str, PathLike] | None = None,
) -> Result:
    """Convert ``checkpoint`` with a preset or a mapping, writing the result into ``out``.

    - ``checkpoint``: a folder (``model.safetensors`` or shards + index, or PyTorch's
      ``pytorch_model.bin``, sharded ``.bin`` + index, one ``.pt``/``.pth``; optional
      config.json), one such file, or a Hugging Face repository id ``org/name[@revision]``
      (with the ``hub`` extra: the cache first, then only the files the plan needs).
    - ``side_files``: carry the folder's other files (tokenizer, generation config, README...)
      into ``out``, byte for byte, as the mapping's ``files { }`` blocks say; False writes
      the weights and config.json alone.
    - ``allow_code``: the mapping's ``files`` blocks may add or rename into code files that
      loaders run (``*.py``, which transformers' ``trust_remote_code`` imports); refused by
      default. Code files carried under their own name are carried either way; the plan lists
      every code file the output will hold. See docs/safety.md.
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
    - ``inputs``: the checkpoints a mapping of several inputs reads besides ``checkpoint``
      (its ``input NAME`` statements), by name: ``{"adapter": "lora/"}``, each a folder, a
      file or a Hub id; a family of rank files (``input ranks files "..."``) is a folder,
      ``checkpoint``'s own unless given. See "Several inputs" in docs/language.md.
    - ``cancel``: a ``threading.Event`` or a callable taking no arguments, checked between
      chunks (and between the steps before them); once it is set or returns True, the run
      stops within a chunk and raises :class:`~weightmap.errors.Cancelled`: queued work is
      dropped, the temporary folder removed, nothing committed (an in-place rename stops only
      before its journal is written; after that, its few small writes finish). A
      ``KeyboardInterrupt`` stops the writer threads the same way.

    >>> weightmap.remap("examples/eagle3-speculators", "out", preset="eagle3-sglang")
    ... # doctest: +SKIP
    """
    start = time.perf_counter()
    token = as_token(cancel)
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}: use one of {', '.join(EXECUTORS)}")
    rules = resolve_mapping(preset, mapping)
    if inplace and out is not None:
        raise ValueError("inplace=True rewrites the checkpoint itself; do not pass out=")
    if not (dry_run or inplace) and out is None:
        raise ValueError("give out= (the destination folder), or dry_run=True / inplace=True")
    if inplace:
        check_inplace_options(verify, executor, max_shard_size, layout, overwrite, workers)
    else:
        # Checked now, dry run or not: a dry run passes only what the real run would.
        check_write_options(max_shard_size, layout, workers)
    dest = None
    if out is not None:
        from weightmap.format.writer import destination_path

        dest = destination_path(Path(out))  # (`in/..` refused)
        check_not_file_like(dest)
    bars = progress is True or (progress is None and sys.stderr.isatty())

    # resolve the input -> compile -> run in the chosen mode.
    src = _resolve(checkpoint, rules, inputs, progress=bars, cancel=token)
    token.check()
    # One pause of the collector over the conversion (fs/gcpause.py): it ends once the mode
    # has returned, so that what the conversion made and dropped is never walked. A
    # conversion that only moves bytes makes no objects per byte, however long its copies
    # take; where it computes, verifies, downloads or runs on a cluster, the pause ends with
    # the plan, as that work may take minutes and make objects of other libraries.
    if inplace and rules.inputs:
        raise ValueError(
            f"{rules.name} reads several inputs, which an in-place rename cannot: write a new "
            "folder (out=)"
        )
    if inplace and rules.outputs:
        raise ValueError(
            f"{rules.name} writes output family {rules.outputs[0].name!r} (files of their own),"
            " which an in-place rename cannot: write a new folder (out=)"
        )
    with (
        gc_paused() as pause,
        _opened(src, rules, inputs, progress=bars, cancel=token) as (ckpt, seen),
    ):
        if inplace:
            check_inplace_source(ckpt)
        if dest is not None and src.folder and src.repo is None:
            check_not_in_input(dest, ckpt.root)
        plan = _compile_for(
            src, ckpt, rules, _params(params), side_files, allow_code, dest, inplace, seen
        )
        if src.repo is not None or verify or executor != "local" or not plan.is_rename_only:
            pause.release()
        if on_plan is not None:
            on_plan(plan)
        if dry_run:
            return run_dry(plan, ckpt, dest, overwrite=overwrite, inplace=inplace)
        token.check()
        carried = (f.source for f in plan.files if f.source is not None)
        src.fetch(carried, progress=bars, cancel=token)
        token.check()
        if inplace:
            return run_inplace(plan, ckpt, start, token)
        assert dest is not None
        options = WriteOptions(
            dest,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            verify=verify,
            progress=progress,
            workers=workers,
            chunk_bytes=chunk_bytes,
            layout=layout,
            ray_address=ray_address,
            cancel=token,
        )
        run = run_local if executor == "local" else run_ray
        return run(plan, ckpt, options, start)


def _compile_for(
    src: ResolvedInput,
    ckpt: Checkpoint,
    rules: RuleMapping,
    params: dict[str, Any],
    side_files: bool,
    allow_code: bool,
    dest: Path | None = None,
    inplace: bool = False,
    seen: dict[str, Any] | None = None,
) -> Plan:
    """The plan of ``rules`` over ``ckpt``, with the side files the chosen mode carries
    (``dest``: an output folder inside the input one, left out of them)."""
    carried = src.side_files(ckpt, rules.config_file, side_files, dest)
    if inplace and carried is not None:
        # Listed in place too, so that `exists file` sees what a conversion into a new folder
        # sees (a preset's config.json edits depend on it); without the warnings about
        # entries a copy would skip, since nothing is copied.
        carried = FolderFiles(carried.files)
    plan = compile_plan(
        rules,
        ckpt.specs(),
        ckpt.config,
        params=params,
        files=carried,
        allow_code=allow_code,
        inputs_seen=seen,
    )
    if inplace:
        # The folder's other files stay where they are: a files block that would change them
        # is refused, and the plan carries none.
        from weightmap.execute.inplace import check_files_stay  # (see the imports)

        check_files_stay(plan, [f.name for f in carried.files] if carried else [])
        plan = replace(plan, files=())
    return plan


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
    from weightmap.execute.verify import check_output, recomputed

    checksums = dict(checksums or {})
    if source is None:
        unchecked = [s.name for s in plan.output_specs() if s.nbytes and s.name not in checksums]
        if unchecked:
            raise ValueError(
                f"no checksum for {len(unchecked)} output(s) (first: {unchecked[0]!r}), so their "
                "bytes cannot be verified: pass the checksums of a run with verify=True "
                "(Result.checksums), or source= the input checkpoint to recompute them"
            )
        return check_output(Path(dest), plan, checksums, None)
    if isinstance(source, Checkpoint):
        return check_output(Path(dest), plan, recomputed(plan, source), source.root)
    # Any input remap takes, a Hub id included (its carried side files fetched too, from the
    # cache first, to be compared byte for byte).
    src = ResolvedInput.resolve(source, CONFIG_NAME, progress=False)
    with Checkpoint.open(src.path) as ckpt:
        src.fetch((f.source for f in plan.files if f.source is not None), progress=False)
        checksums = recomputed(plan, ckpt)
    return check_output(Path(dest), plan, checksums, ckpt.root)


def iter_tensors(
    checkpoint: PathLike,
    *,
    preset: str | None = None,
    mapping: PathLike | RuleMapping | None = None,
    params: Mapping[str, Any] | None = None,
    allow_code: bool = False,
    cancel: CancelSource | CancelToken | None = None,
    inputs: Mapping[str, PathLike] | None = None,
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
    tied come out tied, as ``torch.load`` gives them. ``allow_code`` as :func:`remap` takes
    it: the plan is the one ``remap`` would make, though no side file is written. ``cancel``
    (a ``threading.Event`` or a callable, as for :func:`remap`) is checked before each tensor:
    once it is set, the next step raises :class:`~weightmap.errors.Cancelled` and the input is
    closed. ``inputs`` as :func:`remap` takes it.
    """
    from weightmap.execute.memory import check_torch_shapes, iter_outputs

    token = as_token(cancel)
    rules = resolve_mapping(preset, mapping)
    src = _resolve(checkpoint, rules, inputs, progress=sys.stderr.isatty())
    opened = _opened(src, rules, inputs, progress=sys.stderr.isatty(), cancel=token)
    ckpt, seen = opened.__enter__()
    try:
        # With the side files `remap` lists, though none is copied: `exists file` must see
        # them, or a mapping that tests for one would yield other tensors than it writes.
        plan = _compile_for(src, ckpt, rules, _params(params), True, allow_code, seen=seen)
        check_torch_shapes(plan)
    except WeightmapError:
        opened.__exit__(None, None, None)
        raise
    # (A view of each input shard stays mapped while yielding: a descriptor per map, beside
    # the files the checkpoint holds open.)
    make_room(open_now() + len(ckpt.files))
    # The opened inputs go with the iterator: dropped here, the checkpoint would be closed as
    # they were freed, its files with it, before the first tensor was read.
    return _closing(iter_outputs(plan, ckpt, token), opened)


def _closing(
    tensors: Iterator[tuple[str, torch.Tensor]], opened: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, then the inputs closed (``_opened``), however the loop ends."""
    try:
        yield from tensors
    finally:
        opened.__exit__(None, None, None)
