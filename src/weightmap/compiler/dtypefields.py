"""A warning when casts leave config.json's dtype field saying what the weights no longer are.

transformers loads weights in the dtype ``torch_dtype`` (transformers 4) or ``dtype``
(transformers 5) names, so a conversion that casts every floating-point weight to bfloat16
and leaves ``"torch_dtype": "float32"`` makes loaders upcast what was just made smaller. The
compiler cannot know what the user wants, so it warns, with the one-line fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightmap.plan.nodes import Cast, Node, Source, only_sources
from weightmap.plan.parts import OutputTable
from weightmap.plan.plan import OutputTensor

__all__ = ["stale_dtype_fields"]

# The floating-point dtypes config.json names, by their safetensors names.
_CONFIG_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _casts(node: Node) -> bool:
    if type(node) is Source:  # most outputs of most plans: no children to look through
        return False
    if isinstance(node, Cast) and node.src.dtype != node.dtype:
        return True
    children = node.children()
    # A stack of inputs (every expert of a layer) casts nothing: seen without a call per child.
    return not only_sources(children) and any(_casts(c) for c in children)


def stale_dtype_fields(
    outputs: Sequence[OutputTensor], before: dict[str, Any] | None, after: dict[str, Any] | None
) -> list[str]:
    """Warnings (at the first cast) for ``torch_dtype``/``dtype`` fields a cast made stale and
    the mapping kept.

    Only when a rule cast some tensor and every floating-point output now has one dtype; a
    field the mapping set itself is the mapping's decision.
    """
    # (A renamed or kept input, most outputs of most plans, is no cast: seen without a call;
    # a table's outputs are all such inputs.)
    if isinstance(outputs, OutputTable):
        return []
    cast = next((o for o in outputs if type(o.node) is not Source and _casts(o.node)), None)
    if after is None or cast is None:
        return []
    floats = {o.node.dtype for o in outputs if o.node.dtype in _CONFIG_NAMES}
    if len(floats) != 1:
        return []
    new = _CONFIG_NAMES[floats.pop()]
    out = []
    for field in ("torch_dtype", "dtype"):
        old = after.get(field)
        kept = before is not None and before.get(field) == old
        if isinstance(old, str) and old in _CONFIG_NAMES.values() and old != new and kept:
            out.append(
                f'{cast.origin}: config.json says {field} = "{old}" but the floating-point '
                f"weights are now {new}; to say so, add to the mapping: "
                f'config {{ if config.{field} == "{old}" {{ {field} = "{new}" }} }} (written so, '
                "`weightmap invert` can undo it)"
            )
    return out
