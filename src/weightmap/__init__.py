"""weightmap: remap tensor checkpoints between frameworks, correct to the bit.

A mapping (a small rule language, or a preset from ``mappings/``) is compiled against a
checkpoint's headers and config into an immutable plan, which a streaming executor writes
into a new safetensors checkpoint in bounded memory.
"""

from __future__ import annotations

import importlib

# Not typing's: the ``weightmap`` command imports this package before it can catch a Ctrl-C
# (``__main__``), so it imports only what it must. (mypy reads any TYPE_CHECKING as True.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from weightmap.api import (
        Result,
        compile,
        invert,
        iter_tensors,
        load_mapping,
        presets,
        recover,
        remap,
        verify,
    )
    from weightmap.errors import (
        Cancelled,
        CheckpointError,
        ExecutionError,
        FormatError,
        MappingError,
        MappingSyntaxError,
        OutputExistsError,
        PlanError,
        WeightmapError,
    )
    from weightmap.inputs.checkpoint import Checkpoint
    from weightmap.language.mapping import Mapping
    from weightmap.loads import LoadError, LoadReport, check_loads
    from weightmap.plan.plan import Plan

# Where each public name lives. They are imported on first use (PEP 562), not here: the
# command line imports this package first, and `weightmap --help` should not pay for the
# compiler, the executors and the parser it does not use.
_HOMES = {
    **dict.fromkeys(
        ("Result", "compile", "invert", "iter_tensors", "load_mapping", "presets", "recover",
         "remap", "verify"),
        "weightmap.api",
    ),
    **dict.fromkeys(
        ("Cancelled", "CheckpointError", "ExecutionError", "FormatError", "MappingError",
         "MappingSyntaxError", "OutputExistsError", "PlanError", "WeightmapError"),
        "weightmap.errors",
    ),
    "Checkpoint": "weightmap.inputs.checkpoint",
    "Mapping": "weightmap.language.mapping",
    **dict.fromkeys(("LoadError", "LoadReport", "check_loads"), "weightmap.loads"),
    "Plan": "weightmap.plan.plan",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'weightmap' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


__version__ = "0.1.0"

__all__ = [
    "Cancelled",
    "Checkpoint",
    "CheckpointError",
    "ExecutionError",
    "FormatError",
    "LoadError",
    "LoadReport",
    "Mapping",
    "MappingError",
    "MappingSyntaxError",
    "OutputExistsError",
    "Plan",
    "PlanError",
    "Result",
    "WeightmapError",
    "__version__",
    "check_loads",
    "compile",
    "invert",
    "iter_tensors",
    "load_mapping",
    "presets",
    "recover",
    "remap",
    "verify",
]
