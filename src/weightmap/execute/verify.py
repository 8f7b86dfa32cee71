"""Checking a written output against its plan: names, dtypes, shapes, config.json, every
tensor's bytes (CRC-32 against the checksums taken while writing, or recomputed from the
input) and the side files. ``api.verify`` and ``remap(verify=True)`` both come here.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from weightmap.execute.kernels import evaluate
from weightmap.execute.sidefiles import check_side_files
from weightmap.execute.streaming import check_inputs, crc_of_ranges
from weightmap.fs.fdlimit import make_room, open_now
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.inputs.join import join
from weightmap.plan.nodes import Source
from weightmap.plan.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["check_output", "crc", "differences", "recomputed", "stored_crc"]


def check_output(
    dest: Path,
    plan: Plan,
    checksums: Mapping[str, int],
    files_root: Path | None,
    check: Callable[[], None] = lambda: None,
) -> list[str]:
    """The tensors and config of ``dest`` against the plan and checksums; its side files
    against the plan and, given ``files_root``, the input's files. ``check()`` is called
    before each tensor is read back (it raises to stop: reading back a large output takes
    seconds)."""
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(_open_written(dest, plan))
        make_room(open_now() + len(ckpt.files))  # (their maps, beside what is open)
        problems = differences(plan, ckpt, checksums, check)
    check()
    return problems + check_side_files(plan.files, dest, files_root)


@contextlib.contextmanager
def _open_written(dest: Path, plan: Plan) -> Iterator[Checkpoint]:
    """The written output as one checkpoint: its main checkpoint (none where every tensor
    went into an output family's files) and each family member's file, its tensors under the
    member's prefix, as the plan names them."""
    members = plan.members()
    if not members:
        with Checkpoint.open(dest) as ckpt:
            yield ckpt
        return
    prefixes = tuple(prefix for prefix, _ in members)
    has_main = any(not o.name.startswith(prefixes) for o in plan.outputs)
    main = Checkpoint.open(dest) if has_main else Checkpoint.empty(dest)
    parts: list[tuple[str, Checkpoint]] = []
    try:
        for prefix, filename in members:
            parts.append((prefix, Checkpoint.open(dest / filename, rank_file=True)))
        joined = join(main, parts, tuple(f.name for f in plan.families))
        with joined:
            yield joined
    finally:
        for _, part in parts:
            part.close()
        main.close()


def crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes as stored, without copying a view of the file."""
    import torch

    if t.numel() == 0:
        return 0
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def recomputed(plan: Plan, ckpt: Checkpoint) -> dict[str, int]:
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
    for out in plan.outputs:
        if not out.spec.nbytes:
            continue
        node = out.node
        if safetensors and type(node) is Source and ckpt.has_range(node.name):
            found[out.name] = stored_crc(ckpt, node.name)
        else:
            found[out.name] = crc(evaluate(node, ckpt.view, out.name))
    return found


def stored_crc(ckpt: Checkpoint, name: str) -> int:
    """CRC-32 of tensor ``name`` of ``ckpt`` as stored: its byte range read with pread (no
    torch: checking a rename's output must not cost the seconds importing torch takes), or,
    for a tensor that is no byte range of its file, its values' bytes."""
    if not ckpt.has_range(name):
        return crc(ckpt.view(name))
    loc = ckpt.location(name)
    return crc_of_ranges([(loc.path, loc.offset, loc.length)], ckpt.descriptors)


def differences(
    plan: Plan,
    ckpt: Checkpoint,
    checksums: Mapping[str, int],
    check: Callable[[], None] = lambda: None,
) -> list[str]:
    """Names, dtypes, shapes, bytes (against ``checksums``) and config of ``ckpt`` against
    the plan's outputs: one line per difference (``check()`` called before each tensor's
    bytes are read)."""
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
        check()
        if spec.nbytes and stored_crc(ckpt, name) != checksums[name]:
            problems.append(f"{name!r} bytes differ from what was written")
    if plan.config is not None and ckpt.config != plan.config:
        problems.append("config.json differs from the plan's")
    return problems
