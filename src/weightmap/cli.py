"""The ``weightmap`` command line: a thin layer over the library.

Known errors become one line on stderr and an exit code (2 for usage and mapping errors, 1 for
data problems such as malformed files or a diff that finds differences); ``--debug`` or
``WEIGHTMAP_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, cast

from weightmap.errors import (
    Cancelled,
    CheckpointError,
    CompileError,
    MappingError,
    MappingSyntaxError,
    WeightmapError,
)
from weightmap.format.text import JsonRefused, json_problem, one_line, printable, strict_json
from weightmap.format.text import human_size as _human
from weightmap.fs.cancel import CancelToken, hand_off_releases

if TYPE_CHECKING:
    from weightmap.language import ast as A
    from weightmap.language.mapping import Mapping
    from weightmap.plan.plan import Plan

# The rest of weightmap (the compiler, the executors, the mapping parser, torch) is imported
# by the command that uses it: `weightmap --help` and `weightmap presets` should start as fast
# as the interpreter does (docs/benchmarks.md, start-up).
# What the parser shows, kept equal to format/layout.py's and loads.py's (tests/test_cli.py).
_LAYOUTS = ("clone", "reference")
_LIBRARIES = ("transformers",)

__all__ = ["main"]


class UsageError(Exception):
    """A command line that cannot be run as given (exit code 2)."""


class _Printable:
    """Standard output with control characters written as escapes (``printable``): tensor
    names, config values and file names come from checkpoints made by strangers, and every
    command prints some of them."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(printable(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _err(message: str) -> None:
    """A line on stderr, control characters escaped as on stdout."""
    print(printable(message), file=sys.stderr)


_SET_HELP = (
    "set a mapping parameter (VALUE is JSON if it parses, else a string; a param whose default "
    'is a string takes VALUE as typed: --set version=3 gives "3")'
)


def _params(items: Sequence[str] | None, rules: Mapping | None = None) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs; a VALUE that parses as JSON is taken as JSON, else a string.

    What Python's json would read but JSON does not have (``NaN``, ``Infinity``, ``1e400``,
    nesting thousands deep) is refused: it could only end up as non-JSON in config.json. A
    number given to a param whose default is a string is that string (``--set version=3``
    of a ``param version = ""``): what was typed is what the param takes.
    """
    out: dict[str, Any] = {}
    strings = {
        k for k, v in (rules.param_defaults if rules is not None else {}).items() if type(v) is str
    }
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set takes KEY=VALUE, got {item[:80]!r}")
        try:
            parsed = strict_json(value)
            if key.strip() in strings and type(parsed) in (int, float):
                parsed = value
            out[key.strip()] = parsed
        except JsonRefused as why:
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise UsageError(
                f"--set {key.strip()}={shown}: {why}; give a finite, shallow JSON value, or "
                f"quote it to pass a string: --set '{key.strip()}=\"{shown}\"'"
            ) from None
        except ValueError:
            out[key.strip()] = value
    return out


def _mapping_of(args: argparse.Namespace) -> Mapping:
    from weightmap.language.mapping import preset_names, resolve_mapping

    if (args.preset is None) == (args.mapping is None):
        hint = ""
        # A local input: the presets that would apply (a malformed one is said when it is
        # converted, not here).
        with contextlib.suppress(WeightmapError, OSError):
            if args.preset is None and Path(str(args.src)).exists():
                fit = [n for n in preset_names() if _applies(n, str(args.src))[0]]
                hint = (
                    f"; presets that apply to {args.src}: {', '.join(fit) or 'none'} "
                    f"(`weightmap presets --for {args.src}` says why the others do not)"
                )
        raise UsageError("give exactly one of --preset NAME or --mapping FILE" + hint)
    return resolve_mapping(args.preset, args.mapping)


def _named_mapping(spec: str) -> Mapping:
    """A command's MAPPING argument: a mapping file if one exists there, else a preset name."""
    from weightmap.language.mapping import preset_names, resolve_mapping

    if Path(spec).exists() and not Path(spec).is_dir():
        # A file, or something that is not one (a FIFO): the mapping loader says which.
        return resolve_mapping(mapping=Path(spec))
    if Path(spec).is_dir() and spec not in preset_names():
        # Likely a checkpoint given where the mapping goes (`check CKPT MAPPING`).
        raise UsageError(
            f"{spec} is a folder, not a mapping file or a preset; give the mapping first, "
            "then the checkpoint"
        )
    if spec not in preset_names() and ("/" in spec or spec.endswith(".wm")):
        raise UsageError(
            f"{spec}: no such mapping file (and no preset by that name; presets: "
            f"{', '.join(preset_names()) or 'none'})"
        )
    return resolve_mapping(preset=spec)


def _summary(plan: Plan) -> str:
    total = plan.output_nbytes()
    # Code files named even where the plan itself is not shown (a conversion without --dry-run).
    code = [one_line(f.name) for f in plan.files if f.code]
    more = ", ..." if len(code) > 3 else ""
    return (
        f"plan: {len(plan.inputs)} input tensors -> {len(plan.outputs)} outputs"
        f" ({len(plan.dropped)} dropped), {total:,} bytes ({_human(total)})"
        + ("; config.json edited" if plan.config_changed else "")
        + (f"; {len(plan.files)} side file(s)" if plan.files else "")
        + (f", {len(code)} of them code ({', '.join(code[:3])}{more})" if code else "")
    )


class _ProgressLines:
    """Progress as lines on stderr, where it is not a terminal (a log file, a pipe): a bar
    there would be one line rewritten, so a long run would show nothing until its end.

    A line at each tenth of the work (and every 30 s between tenths), once the run has
    lasted half a second: a shorter run prints none. Timed from the run's start, not from the
    first chunk written: a run whose first chunk takes seconds (a matrix product) still says
    where it is when that chunk is done.
    """

    QUIET_SECONDS = 0.5
    EVERY_SECONDS = 30.0

    def __init__(self) -> None:
        self._start = self._last = time.monotonic()
        self._shown = 0  # tenths
        self._lock = threading.Lock()  # (called from the writer threads)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        with self._lock:
            tenths = done * 10 // total if total else 10
            if now - self._start < self.QUIET_SECONDS or tenths >= 10:
                return
            if tenths > self._shown or now - self._last >= self.EVERY_SECONDS:
                self._shown, self._last = max(tenths, self._shown), now
                _err(f"weightmap: {done * 100 // total}% ({_human(done)} of {_human(total)})")


def _warn(plan: Plan) -> None:
    for w in plan.warnings:
        _err(f"weightmap: warning: {w}")


# -- commands ----------------------------------------------------------------------------------


def _cmd_convert(args: argparse.Namespace) -> int:
    from weightmap.api import remap
    from weightmap.loads import check_loads

    rules = _mapping_of(args)
    if args.inplace and args.dst is not None:
        raise UsageError("--inplace rewrites SRC itself; give no DST")
    if not (args.inplace or args.dry_run) and args.dst is None:
        raise UsageError("give DST (the output folder), or --inplace / --dry-run")
    quiet = args.quiet
    progress: bool | _ProgressLines | None = False if (args.no_progress or quiet) else None
    if progress is None and not sys.stderr.isatty():
        progress = _ProgressLines()

    def show(plan: Plan) -> None:
        # Before any work, so the summary and warnings come before the progress bar (a dry
        # run's plan table lists them itself: said once).
        if quiet or not args.dry_run:
            _warn(plan)
        if args.check_loads is not None:  # refused here, before a byte is written
            report = check_loads(plan, args.check_loads, trust_remote_code=args.trust_remote_code)
            report.raise_for_problems()
        if not quiet:
            print(_summary(plan), flush=True)
            if args.dry_run:
                print(plan.explain())

    result = remap(
        args.src,
        args.dst,
        mapping=rules,
        params=_params(args.set, rules),
        max_shard_size=args.max_shard_size,
        dry_run=args.dry_run,
        inplace=args.inplace,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=progress,
        workers=args.workers,
        side_files=not args.no_side_files,
        allow_code=args.allow_code_files,
        on_plan=show,
        layout=args.layout,
        executor="ray" if args.ray or args.ray_address else "local",
        ray_address=args.ray_address,
        cancel=args.cancel,
        inputs=_inputs(args.input),
    )
    if not quiet:
        print(result)
    return 0


# The outputs (and dropped inputs) `weightmap plan` lists without --all.
_PLAN_ROWS = 50


def _cmd_plan(args: argparse.Namespace) -> int:
    from weightmap.api import compile as compile_plan_for

    rules = _mapping_of(args)
    plan = compile_plan_for(
        args.src,
        mapping=rules,
        params=_params(args.set, rules),
        side_files=not args.no_side_files,
        allow_code=args.allow_code_files,
        inputs=_inputs(args.input),
    )
    if args.json:
        doc = plan.to_dict()
        why = json_problem(doc)
        if why is not None:
            # Python's json would write a lone surrogate escape (a side file whose name is not
            # UTF-8), which strict JSON readers refuse: said, as inspect --json says it.
            raise CheckpointError(
                f"the plan {why}; plan --json prints strict JSON only: rename the file (or plan "
                "without --json)",
                path=Path(str(args.src)),
                rule="json",
            )
        print(json.dumps(doc, indent=2))
        return 0
    # (The plan table lists the warnings itself: said once, not on stderr too.)
    print(_summary(plan))
    # A summary unless asked for every tensor: printing 100,000 rows took longer than the
    # conversion they describe.
    print(plan.explain(None if args.all else _PLAN_ROWS))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from weightmap.inputs.resolve import open_checkpoint

    with open_checkpoint(args.checkpoint) as ckpt:
        rows = [
            (name, info.dtype, list(info.shape), info.nbytes, ckpt.file_of(name).name)
            for name, info in ckpt.tensors.items()
        ]
        total = sum(r[3] for r in rows)
        if args.json:
            doc = {
                "checkpoint": str(ckpt.root),
                "files": [p.name for p in ckpt.files],
                "tensors": [
                    {"name": n, "dtype": d, "shape": s, "bytes": b, "file": f}
                    for n, d, s, b, f in rows
                ],
                "total_tensors": len(rows),
                "total_bytes": total,
                "config": ckpt.config,
            }
            why = json_problem(doc["config"])
            if why is not None:
                # Python's json would print NaN or Infinity, which no JSON reader takes.
                raise CheckpointError(
                    f"config.json {why}; inspect --json prints strict JSON only: fix config.json "
                    "(or inspect without --json)",
                    path=ckpt.root,
                    rule="config",
                )
            print(json.dumps(doc, indent=2, allow_nan=False))
            return 0
        rows.sort(key=lambda r: r[0])
        # Escaped before the widths are taken: a name with a line break stays one row.
        rows = [(one_line(n), d, sh, b, one_line(f)) for n, d, sh, b, f in rows]
        shapes = [str(r[2]) for r in rows]
        w_name = max([len(r[0]) for r in rows] + [4])
        w_shape = max([len(s) for s in shapes] + [5])
        print(f"{'name':<{w_name}}  {'dtype':<11}  {'shape':<{w_shape}}  {'bytes':>12}  file")
        for (name, dt, _, size, file), shape in zip(rows, shapes, strict=True):
            print(f"{name:<{w_name}}  {dt:<11}  {shape:<{w_shape}}  {size:>12,}  {file}")
        print(
            f"{len(rows)} tensors, {total:,} bytes ({_human(total)}) in {len(ckpt.files)} file(s)"
        )
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from weightmap.inputs.diff import diff_checkpoints
    from weightmap.inputs.resolve import open_checkpoint

    # Side files compared between two folders only (a file given alone has no side files).
    folders = Path(args.a).is_dir() and Path(args.b).is_dir()
    with open_checkpoint(args.a) as a, open_checkpoint(args.b) as b:
        d = diff_checkpoints(a, b, side_files=folders)
    for name in d.only_a:
        print(f"only in A: {one_line(name)}")
    for name in d.only_b:
        print(f"only in B: {one_line(name)}")
    for name, x, y in d.changed:
        print(f"changed:   {one_line(name)}: {x} -> {y}")
    for name in d.bytes_differ:
        print(f"bytes differ: {one_line(name)}")
    for line in d.config:
        print(f"config {one_line(line)}")
    for line in d.files:
        print(f"file {one_line(line)}")
    # Each kind counted apart: a renamed tensor is one only in A and one only in B, not two
    # of one kind, and a sum would count it twice against the tensors either side holds.
    kinds = [
        (len(d.only_a), "only in A"),
        (len(d.only_b), "only in B"),
        (len(d.changed), "with another dtype or shape"),
        (len(d.bytes_differ), "with other bytes"),
        (len(d.config), "config difference(s)"),
        (len(d.files), "side file difference(s)"),
    ]
    print(
        f"{d.equal} tensor{'' if d.equal == 1 else 's'} identical"
        + "".join(f", {n} {what}" for n, what in kinds if n)
        + ("" if any(n for n, _ in kinds) else ", 0 differ")
    )
    return 0 if d.same else 1


def _description(text: str) -> str:
    """A preset's description: its first comment paragraph, whole, as one line."""
    lines: list[str] = []
    for line in text.splitlines()[1:]:
        stripped = line.strip()
        if not stripped.startswith("#") or (lines and stripped.lstrip("# ") == ""):
            break
        if stripped.lstrip("# "):
            lines.append(stripped.lstrip("# ").strip())
    return " ".join(lines)


def _requires(stmts: Sequence[A.Stmt]) -> list[str]:
    from weightmap.language import ast as A

    out: list[str] = []
    for st in stmts:
        if isinstance(st, A.Require):
            out.append(st.message.text.replace("{{", "{").replace("}}", "}"))
        elif isinstance(st, A.If):
            out += _requires(st.then) + _requires(st.orelse)
    return out


def _model_types(stmts: Sequence[A.Stmt]) -> list[str] | None:
    """The model types a preset's top-level requires accept (``config.model_type in [...]``
    or ``== "..."``, alone or in an ``and``), or None when they do not say."""
    from weightmap.language import ast as A

    def accepted(cond: A.Expr) -> list[str] | None:
        if not isinstance(cond, A.BinOp):
            return None
        if cond.op == "and":
            return accepted(cond.left) or accepted(cond.right)
        left, right = cond.left, cond.right
        if not (isinstance(left, A.Attr) and isinstance(left.obj, A.ConfigRef)):
            return None
        if left.name != "model_type":
            return None
        if cond.op == "==" and isinstance(right, A.Lit):
            return [str(right.value)]
        if cond.op == "in" and isinstance(right, A.ListExpr):
            return [str(i.value) for i in right.items if isinstance(i, A.Lit)]
        return None

    for st in stmts:
        if isinstance(st, A.Require) and (types := accepted(st.cond)) is not None:
            return types
    return None


def _param_requires(stmts: Sequence[A.Stmt], params: Collection[str]) -> set[str]:
    """The locations of the requires that read a param: a --set may lift them."""
    from weightmap.language import ast as A

    out: set[str] = set()
    for st in stmts:
        if isinstance(st, A.Require) and A.reads_names(st.cond, params):
            out.add(str(st.loc))
        elif isinstance(st, A.If):
            out |= _param_requires(st.then, params) | _param_requires(st.orelse, params)
    return out


def _applies(name: str, checkpoint: str) -> tuple[bool, str]:
    """Whether preset ``name`` compiles against ``checkpoint`` with its default params, and
    why not: the first refusal (a refusal a param can lift is said as one)."""
    from weightmap.api import compile as compile_plan_for
    from weightmap.language.mapping import load_preset

    preset = load_preset(name)
    try:
        compile_plan_for(checkpoint, preset=name)
    except CompileError as exc:
        # A refusal about the checkpoint alone says no; one that reads a param may only need
        # that param set (the Llama version, the verifier's name).
        settable = _param_requires(preset.program.stmts, preset.param_defaults)
        no = [p for p in exc.problems if str(p.loc) not in settable]
        # A refusal the preset words itself says more than an error it met on the way.
        said = sorted(no or exc.problems, key=lambda p: not p.message.startswith("requirement"))
        first = said[0].message.removeprefix("requirement failed: ")
        return False, ("" if no else "applies once a parameter is set: ") + one_line(first)
    except (MappingError, CheckpointError) as exc:
        return False, one_line(getattr(exc, "detail", None) or str(exc))
    return True, "applies"


def _preset_rows() -> list[tuple[str, str, str, str]]:
    """Each preset's name, description, parameters and model types, as ``presets`` lists them.

    Making them loads every preset, which imports the rule language: half of the command's
    time. They are kept in the per-user cache (``language/cache.py``) under a hash of all
    they are made from (the preset files, the language's code, this module), and made again
    when any of it changes."""
    from weightmap.language import cache

    key = cache.listing_key(Path(__file__).read_bytes())
    kept = cache.load_listing(key)
    if isinstance(kept, list) and all(
        isinstance(row, tuple) and len(row) == 4 and all(isinstance(x, str) for x in row)
        for row in kept
    ):
        return kept
    from weightmap.language.mapping import load_preset, preset_names

    rows = []
    for name in preset_names():
        preset = load_preset(name)
        params = ", ".join(f"{k}={json.dumps(v)}" for k, v in preset.param_defaults.items())
        types = _model_types(preset.program.stmts)
        rows.append(
            (name, _description(preset.text), params or "(none)", ", ".join(types or ["any"]))
        )
    cache.save_listing(key, rows)
    return rows


def _cmd_presets(args: argparse.Namespace) -> int:
    if args.for_checkpoint is not None:
        if args.name is not None:
            raise UsageError("give a preset NAME or --for CHECKPOINT, not both")
        from weightmap.inputs.checkpoint import refuse_missing
        from weightmap.inputs.resolve import ResolvedInput
        from weightmap.language.mapping import preset_names

        # Found (a Hub id fetched) once: a path that is not there, or a Hub out of reach, is
        # one error and exit 1, not the same "no" for every preset and exit 0.
        found = ResolvedInput.resolve(args.for_checkpoint, "config.json", progress=False)
        refuse_missing(Path(found.path))
        names = preset_names()
        width = max([len(n) for n in names] + [4])
        for name in names:
            ok, why = _applies(name, args.for_checkpoint)
            print(f"{name:<{width}}  {why if ok or why.startswith('applies') else 'no: ' + why}")
        return 0
    if args.name is None:
        rows = _preset_rows()
        width = max([len(row[0]) for row in rows] + [4])
        for name, description, params, types in rows:
            print(f"{name:<{width}}  {description}")
            print(f"{'':<{width}}  params: {params}")
            print(f"{'':<{width}}  model types: {types}")
        return 0
    from weightmap.language.mapping import load_preset

    preset = load_preset(args.name)
    print(preset.text.rstrip())
    print()
    print("parameters:")
    for key, value in preset.param_defaults.items():
        print(f"  {key} = {json.dumps(value)}")
    if not preset.param_defaults:
        print("  (none)")
    print("refuses:")
    for message in _requires(preset.program.stmts):
        print(f"  - {message}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from weightmap.api import compile as compile_plan_for
    from weightmap.loads import check_loads

    if args.loads is not None and args.checkpoint is None:
        # `check OUT --loads transformers`: the one argument is the checkpoint to load.
        _params(args.set)
        report = check_loads(args.mapping, args.loads, trust_remote_code=args.trust_remote_code)
        print(f"{args.mapping}: {report}")
        return 0 if report.ok else 1
    rules = _named_mapping(args.mapping)
    _params(args.set)  # checked with or without a checkpoint, as plan and convert check them
    if args.checkpoint is None:
        print(f"{args.mapping}: parses; give a checkpoint to check it against one")
        return 0
    plan = compile_plan_for(
        args.checkpoint,
        mapping=rules,
        params=_params(args.set, rules),
        allow_code=args.allow_code_files,
        inputs=_inputs(args.input),
    )
    _warn(plan)
    print(f"{args.mapping}: ok against {args.checkpoint}: {_summary(plan)}")
    if args.loads is not None:
        report = check_loads(plan, args.loads, trust_remote_code=args.trust_remote_code)
        print(f"its output {report}")
        return 0 if report.ok else 1
    return 0


def _cmd_invert(args: argparse.Namespace) -> int:
    from weightmap.api import invert

    inverse = invert(_named_mapping(args.mapping), check=args.checkpoint, params=_params(args.set))
    print(inverse.text.rstrip())
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    from weightmap.api import recover
    from weightmap.format.names import JOURNAL_NAME
    from weightmap.fs.atomic import remove_path, temporaries

    folder = Path(args.path)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder")
    actions = 0
    journal = folder / JOURNAL_NAME
    # A link to nothing (or a loop) under the journal's name counts: every command refuses
    # the checkpoint for it, so clean must say what to do with it (recover refuses it).
    if (journal.exists() or journal.is_symlink()) and recover(folder):
        print(f"finished an interrupted in-place rewrite of {folder}")
        actions += 1
    failed = 0
    kept = []
    for path, why in temporaries(folder):
        if why is not None:
            kept.append(f"left {path}: {why}")
            continue
        try:
            remove_path(path)
        except OSError as exc:  # another user's, or in a read-only folder: say so, go on
            _err(f"weightmap: could not remove {path}: {exc.strerror or exc}")
            failed += 1
            continue
        print(f"removed {path}")
        actions += 1
    if not actions and not failed:
        print(f"nothing to clean in {folder}")
    # What stays is named too: a leftover of another container (a restarted one has a new pid
    # namespace) would otherwise take its disk space silently.
    for line in kept:
        print(line)
    return 1 if failed else 0


# -- parser --------------------------------------------------------------------------------------


def _loads_args(p: argparse.ArgumentParser, flag: str, what: str) -> None:
    p.add_argument(
        flag,
        metavar="LIBRARY",
        default=None,
        help=f"{what} ({', '.join(_LIBRARIES)}) into the model its config.json names, built "
        "without weights (exit 1 listing missing, unexpected and mismatched tensors)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the load check run the model code config.json's auto_map names",
    )


def _mapping_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", metavar="NAME", help="a preset (see `weightmap presets`)")
    p.add_argument("--mapping", metavar="FILE", help="a mapping file")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help=_SET_HELP,
    )
    _input_arg(p)


def _input_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        action="append",
        metavar="NAME=PATH",
        help="bind an input the mapping declares (`input NAME`): a folder, a file or a Hub "
        "id, e.g. --input adapter=./lora (repeat for more)",
    )


def _inputs(items: Sequence[str] | None) -> dict[str, str] | None:
    """``--input NAME=PATH`` pairs, each name once."""
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path:
            raise UsageError(f"--input takes NAME=PATH, got {item[:80]!r}")
        if name.strip() in out:
            raise UsageError(f"--input {name.strip()} is given twice")
        out[name.strip()] = path
    return out


_SRC_HELP = (
    "a checkpoint folder, a .safetensors/.bin/.pt/.pth file, or a Hugging Face repo id "
    "org/name[@revision]"
)
_MAPPING_HELP = "a mapping file, or a preset name (see `weightmap presets`)"


def _side_files_arg(p: argparse.ArgumentParser, *, writes: bool = True) -> None:
    carried = "carried into DST" if writes else "planned as carried into the output"
    p.add_argument(
        "--no-side-files",
        action="store_true",
        help=f"{'write' if writes else 'plan'} the weights and config.json only; by default the "
        f"folder's other files (tokenizer, generation config, README...) are {carried}",
    )


def _allow_code_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-code-files",
        action="store_true",
        help="let the mapping's files blocks add or rename into code files that loaders run "
        "(*.py, which trust_remote_code imports); refused by default. The plan lists every "
        "code file of the output",
    )


def _examples(*lines: str) -> str:
    """A command's ``--help`` epilog: its examples, one per line."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line, as every other error here is."""

    def error(self, message: str) -> NoReturn:
        # argparse prints the command's whole usage (nine lines for convert) before the
        # message; the line says where the usage is instead.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="weightmap", description="Remap tensor checkpoints between frameworks.")
    debug_help = "show the traceback of an error (or WEIGHTMAP_DEBUG=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # (The package is imported before any of its modules: its version is there to read.)
    version = getattr(sys.modules.get("weightmap"), "__version__", "unknown")
    parser.add_argument("--version", action="version", version=f"weightmap {version}")
    # --debug after the command too (`weightmap inspect X --debug`), as people type it: each
    # command takes it, and SUPPRESS leaves the top-level value alone where it is not given.
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # (RawDescription: the examples' lines stay as they are written.)
    add_parser = partial(
        sub.add_parser, parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter
    )

    p = add_parser(
        "convert",
        help="convert a checkpoint with a preset or a mapping",
        epilog=_examples(
            "weightmap convert examples/eagle3-speculators out/sglang --preset eagle3-sglang",
            "weightmap convert ./llama out/llama-bf16 --mapping cast.wm --verify",
            "weightmap convert org/name@main out/x --preset NAME --dry-run",
            "weightmap convert ./llama --inplace --mapping rename.wm",
        ),
    )
    p.add_argument("src", help=_SRC_HELP)
    p.add_argument("dst", nargs="?", help="output folder (not with --inplace)")
    _mapping_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.add_argument("--inplace", action="store_true", help="rename in place (header rewrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--verify", action="store_true", help="re-read and check the output")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="most tensor bytes in one output shard (default 5GB; the header and up to 4 KiB "
        "of alignment come on top)",
    )
    p.add_argument(
        "--workers", type=int, default=None, help="writer threads (with --ray: tasks at once)"
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="run as tasks on a Ray cluster (RAY_ADDRESS, one started on this machine with "
        "`ray start`, or a new local one); input and output on a filesystem every node "
        "mounts at the same path",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        default=None,
        help="the Ray cluster's address, host:port or ray://host:port (implies --ray)",
    )
    p.add_argument(
        "--layout",
        choices=_LAYOUTS,
        default="clone",
        help="clone (default): unchanged bytes keep their input offsets modulo 4096, so a "
        "copy-on-write filesystem can share them; reference: the bytes safetensors.save_file "
        "writes",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _loads_args(p, "--check-loads", "before writing, check that the output would load")
    _side_files_arg(p)
    _allow_code_arg(p)
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar, no summary: warnings and errors only"
    )
    p.set_defaults(func=_cmd_convert)

    p = add_parser(
        "plan",
        help="show what a conversion would do, writing nothing",
        epilog=_examples(
            "weightmap plan examples/eagle3-speculators --preset eagle3-sglang",
            "weightmap plan ./llama --mapping my.wm --json",
        ),
    )
    p.add_argument("src", help=_SRC_HELP)
    _mapping_args(p)
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument(
        "--all",
        action="store_true",
        help=f"list every output and dropped input (by default the first {_PLAN_ROWS} of each)",
    )
    _side_files_arg(p, writes=False)
    _allow_code_arg(p)
    p.set_defaults(func=_cmd_plan)

    p = add_parser(
        "inspect",
        help="list a checkpoint's tensors",
        epilog=_examples("weightmap inspect ./llama", "weightmap inspect model.safetensors --json"),
    )
    p.add_argument("checkpoint", help=_SRC_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_inspect)

    p = add_parser(
        "diff",
        help="compare two checkpoints (exit 1 if they differ)",
        epilog=_examples("weightmap diff ./llama out/llama-roundtrip"),
    )
    p.add_argument("a", help="the first checkpoint (" + _SRC_HELP + ")")
    p.add_argument("b", help="the checkpoint to compare it with")
    p.set_defaults(func=_cmd_diff)

    p = add_parser(
        "presets",
        help="list presets, or show one",
        epilog=_examples(
            "weightmap presets",
            "weightmap presets eagle3-sglang",
            "weightmap presets --for ./llama",
        ),
    )
    p.add_argument("name", nargs="?", help="a preset to show: its text, parameters and refusals")
    p.add_argument(
        "--for",
        dest="for_checkpoint",
        metavar="CHECKPOINT",
        help="say which presets apply to this checkpoint, and why the others do not",
    )
    p.set_defaults(func=_cmd_presets)

    p = add_parser(
        "check",
        help="parse a mapping, and compile it against a checkpoint; or (--loads) check that a "
        "checkpoint loads",
        epilog=_examples(
            "weightmap check my.wm",
            "weightmap check eagle3-sglang ./drafter",
            "weightmap check ./converted --loads transformers",
        ),
    )
    p.add_argument(
        "mapping",
        help=_MAPPING_HELP + "; with --loads and nothing after it, the checkpoint to check",
    )
    p.add_argument("checkpoint", nargs="?", help="compile it against this checkpoint too")
    _loads_args(p, "--loads", "check that the checkpoint (or the mapping's output) loads")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help=_SET_HELP,
    )
    _input_arg(p)
    _allow_code_arg(p)
    p.set_defaults(func=_cmd_check)

    p = add_parser(
        "invert",
        help="print the inverse of a mapping (file or preset)",
        epilog=_examples("weightmap invert my.wm", "weightmap invert eagle3-sglang ./drafter"),
    )
    p.add_argument("mapping", help=_MAPPING_HELP)
    p.add_argument(
        "checkpoint",
        nargs="?",
        help="check that the inverse gives this checkpoint's names, dtypes, shapes and config back",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help=_SET_HELP,
    )
    p.set_defaults(func=_cmd_invert)

    p = add_parser(
        "clean",
        help="remove what killed runs left in a folder",
        epilog=_examples("weightmap clean ./llama", "weightmap clean out"),
    )
    p.add_argument(
        "path", help="a checkpoint folder, or the folder an output was being written into"
    )
    p.set_defaults(func=_cmd_clean)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv``: ``sys.argv[1:]`` by default); returns the exit code."""
    return run(parse(argv))


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's arguments parsed (``argv``: ``sys.argv[1:]`` by default); exits,
    as argparse does, for ``--help`` and usage errors."""
    return _parser().parse_args(argv)


def run(args: argparse.Namespace, *, final: bool = False) -> int:
    """Run the command that ``parse`` gave; returns the exit code.

    ``final``: nothing follows the command in this process (the ``weightmap`` script), which
    then ends as the command does, with its exit code, and does not return."""
    debug = args.debug or os.environ.get("WEIGHTMAP_DEBUG", "") not in ("", "0")
    stdout = sys.stdout
    sys.stdout = cast(TextIO, _Printable(stdout))
    try:
        code = _run(args, debug, final)
    finally:
        sys.stdout = stdout
    if final or args.cancel.signal is not None:
        # The command done (or stopped by a signal, its clean-up done): the process ends
        # now, not after the half second the interpreter takes to unload torch, during
        # which a Ctrl-C would end it with a traceback from torch's teardown (a stop must
        # take well under a second). Its files are closed and synced, its output flushed.
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return code


# The signals that stop a command: Ctrl-C, and what `kill`, systemd and Kubernetes send.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _stop_on_signals(token: CancelToken, final: bool = False) -> Iterator[None]:
    """While the command runs, the first SIGINT or SIGTERM cancels ``token``, says so at once
    and raises KeyboardInterrupt in this thread; the run's loops stop at their next chunk,
    and the temporaries go as the exception unwinds. Where the run shields or polls the
    token (``CancelToken.shielded``, ``CancelToken.polled``: a stretch that must finish, or
    one that shares locks with threads of its own) it is only cancelled, and the run stops
    at its next check. Later signals only wait for that (a second exception would cut the
    clean-up short). The previous handlers come back after, unless ``final`` (the process
    ends with the command: a signal between its end and the exit is ignored).
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # (handlers can only be set in the main thread; a caller there keeps its own)
        return

    def stop(signum: int, frame: object) -> None:
        if token.cancelled:
            return
        token.cancel(signum)
        hand_off_releases()  # the output's pages are freed after the exit (fs/cancel.py)
        # Written straight to the descriptor: a signal handler may run in the middle of a
        # write to sys.stderr (the progress bar), which a second write there would refuse.
        with contextlib.suppress(OSError):
            os.write(2, b"\nweightmap: interrupting...\n")
        if not (token.shielding or token.polling):
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            # Once stopped, the command ends with the exit code of the first signal: a later
            # one (a second Ctrl-C during the clean-up) waiting to be handled must not run
            # Python's default handler then, which raises a KeyboardInterrupt nothing catches.
            signal.signal(s, signal.SIG_IGN if token.cancelled or final else handler)


def _interrupted(token: CancelToken) -> int:
    """The exit code of a stopped command: 128 + the signal, as a shell reports it."""
    return 128 + (token.signal or signal.SIGINT)


def _run(args: argparse.Namespace, debug: bool, final: bool = False) -> int:
    """The command, its known errors as a line on stderr and an exit code."""
    token = args.cancel = CancelToken()
    try:
        with _stop_on_signals(token, final):
            code: int = args.func(args)
            # Flushed here, not at exit, so that a closed pipe is caught below.
            sys.stdout.flush()
        if token.cancelled:
            # The signal came while a stretch that must finish ran (an in-place rename's
            # journal replay): it finished, and said so above.
            _err("weightmap: interrupted after the work was committed; it is complete")
            return _interrupted(token)
        return code
    except BrokenPipeError:
        # `weightmap inspect ... | head` closes the pipe early; that is not an error. Whatever
        # is still buffered has nowhere to go: point stdout at /dev/null so that the flush at
        # interpreter exit does not fail again.
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 0
    except (KeyboardInterrupt, Cancelled):
        if token.committed:  # (the output went into place before the stop was seen)
            _err("weightmap: interrupted after the work was committed; it is complete")
        else:
            _err("weightmap: interrupted; nothing was committed")
        return _interrupted(token)
    except (UsageError, MappingSyntaxError, MappingError) as exc:
        if debug:
            raise
        # Mapping errors span several lines (one per problem, with carets): keep them whole.
        _err(f"weightmap: error: {exc}")
        return 2
    except (WeightmapError, OSError) as exc:
        if debug:
            raise
        _err(f"weightmap: error: {exc}")
        return 1
    except ValueError as exc:
        # Argument values the library refuses (a size like "5XB", a negative worker count).
        if debug:
            raise
        _err(f"weightmap: error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
