"""The in-memory executor: a plan applied to tensors one output at a time, no file written.

The reference the streaming executor is tested against, and what ``iter_tensors`` runs over
memory-mapped views (where a view stays a view and nothing is copied).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from weightmap.execute.chunks import tree_nodes
from weightmap.execute.kernels import evaluate
from weightmap.fs.cancel import CancelToken
from weightmap.inputs.checkpoint import Checkpoint, check_torch_shape
from weightmap.plan.nodes import Source
from weightmap.plan.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["check_torch_shapes", "execute_in_memory", "iter_outputs"]


def execute_in_memory(
    plan: Plan, tensors: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Apply a plan to fully loaded tensors, yielding ``(output name, tensor)`` in plan order."""
    for out in plan.outputs:
        yield out.name, evaluate(out.node, tensors.__getitem__, out.name)


def check_torch_shapes(plan: Plan) -> None:
    """Refuse, before any tensor is made, a plan with a shape torch cannot hold."""
    for out in plan.outputs:
        for node in tree_nodes(out.node):
            where = node.name if isinstance(node, Source) else out.name
            check_torch_shape(where, node.shape)


def iter_outputs(
    plan: Plan, ckpt: Checkpoint, cancel: CancelToken | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each output of ``plan`` computed over ``ckpt``'s views; closes ``ckpt`` at the end
    (``cancel``: checked before each output; once cancelled, ``Cancelled`` is raised there).

    Outputs are independent tensors, as ``remap`` writes them: one that would share memory
    with an output yielded before (a ``copy`` of a tensor that also goes on as it is: both
    views of the same bytes) is yielded as a copy, or writing into one would change the other.
    Disjoint views of one input (the parts of a split) stay views. Inputs that a PyTorch
    checkpoint stores tied (one storage, two names) are not told apart: they come out tied, as
    ``torch.load`` gives them.
    """
    shared = _shared_sources(plan)
    spans: dict[str, list[tuple[int, int]]] = {}  # shared source -> memory yielded from it
    try:
        for out in plan.outputs:
            if cancel is not None:
                cancel.check("reading the tensors")
            t = evaluate(out.node, ckpt.view, out.name)
            if not t.is_contiguous():
                t = t.contiguous()
            names = [s.name for s in out.node.sources() if s.name in shared] if shared else []
            if names and t.numel():
                start = t.data_ptr()
                end = start + t.numel() * t.element_size()
                if any(a < end and start < b for n in names for a, b in spans.get(n, ())):
                    t = t.clone()
                else:
                    for n in names:
                        spans.setdefault(n, []).append((start, end))
            yield out.name, t
    finally:
        ckpt.close()


def _shared_sources(plan: Plan) -> set[str]:
    """The inputs that more than one output reads (only their outputs can share memory)."""
    counts = Counter(s.name for out in plan.outputs for s in set(out.node.sources()))
    return {name for name, n in counts.items() if n > 1}
