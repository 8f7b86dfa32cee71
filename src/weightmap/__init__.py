"""weightmap: remap tensor checkpoints between frameworks, correct to the bit.

A mapping (a small rule language, or a preset from ``mappings/``) is compiled against a
checkpoint's headers and config into an immutable plan, which a streaming executor writes
into a new safetensors checkpoint in bounded memory.
"""

from __future__ import annotations

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
