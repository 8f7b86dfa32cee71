"""The in-memory executor: a plan applied to tensors one output at a time, no file written.

The reference the streaming executor is tested against, and what ``iter_tensors`` runs over
memory-mapped views (where a view stays a view and nothing is copied).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from weightmap.execute.chunks import tree_nodes
from weightmap.execute.kernels import evaluate
from weightmap.format.checkpoint import Checkpoint, check_torch_shape
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


def iter_outputs(plan: Plan, ckpt: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each output of ``plan`` computed over ``ckpt``'s views; closes ``ckpt`` at the end."""
    try:
        for out in plan.outputs:
            t = evaluate(out.node, ckpt.view, out.name)
            yield out.name, t if t.is_contiguous() else t.contiguous()
    finally:
        ckpt.close()
