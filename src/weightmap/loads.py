"""Will it load? A checkpoint's (or a plan's output's) tensors against the model that loads it.

The model class is the one ``config.json`` names (``architectures``, else ``model_type``
through transformers' auto classes), built on the meta device so that nothing is allocated
(a 70B Llama is built in a fraction of a second), and its parameters and persistent buffers
are compared with the tensor names, shapes and dtypes: what transformers would report as
missing, unexpected or mismatched only once it has read every weight, said here from the
headers alone. Tensor names go through transformers' own load-time renames and conversions
(``conversion_mapping.py``: the per-expert layouts it fuses at load time load), and its
``_keys_to_ignore_on_load_*`` patterns and tied weights are honoured.

Remote code (``auto_map``) is never run unless ``trust_remote_code=True``, the flag that
transformers itself requires.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightmap.compiler.unmatched import compact_names
from weightmap.errors import WeightmapError
from weightmap.format.dtypes import DTYPES, TensorSpec
from weightmap.format.text import one_line
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["LIBRARIES", "LoadError", "LoadReport", "check_loads"]

LIBRARIES = ("transformers",)
# Engines whose model classes need their own runtime (and, for most models, a GPU) to be
# built: what can be checked of them without one is said in docs/presets.md.
_ENGINES = ("sglang", "vllm")
_FLOAT_NAMES = {d.torch_name: name for name, d in DTYPES.items() if d.torch_name}


class LoadError(WeightmapError, ValueError):
    """A checkpoint would not load as its config says (``problems`` lists each problem), or
    the model it names cannot be built here (no config, unknown class, remote code)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


@dataclass(frozen=True)
class LoadReport:
    """What a load check found: ``problems`` is empty when the checkpoint loads cleanly."""

    library: str
    model_class: str
    tensors: int  # tensors in the checkpoint
    expected: int  # parameters and persistent buffers of the model
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when the model would load with nothing missing, unexpected or mismatched."""
        return not self.problems

    def __str__(self) -> str:
        what = (
            f"{self.model_class} ({self.library}): {self.tensors} tensors, {self.expected} expected"
        )
        if self.ok:
            return f"loads as {what}"
        n = len(self.problems)
        lines = [f"does not load as {what} ({n} problem{'s' * (n != 1)}):"]
        return "\n".join([*lines, *(f"  {p}" for p in self.problems)])

    def raise_for_problems(self) -> None:
        """Raise :class:`LoadError` listing the problems, if there are any (for ``on_plan``)."""
        if self.problems:
            raise LoadError(f"the output {self}", self.problems)


def check_loads(
    checkpoint_or_plan: str | os.PathLike[str] | Checkpoint | Plan,
    library: str = "transformers",
    *,
    trust_remote_code: bool = False,
) -> LoadReport:
    """Check that a checkpoint, or a plan's output, loads into the model its config.json names.

    Reads headers and config.json only (for a :class:`Plan`: its output specs and config, so
    a conversion can be checked before a byte is written). Returns a :class:`LoadReport`;
    raises :class:`LoadError` when no model can be built (no config.json, a class transformers
    does not have, remote code without ``trust_remote_code``). Needs transformers and torch.

    >>> weightmap.check_loads("out/llama").ok                     # doctest: +SKIP
    True
    """
    if library in _ENGINES:
        raise ValueError(
            f"{library} builds its models in its own runtime, which is not checked here: check "
            "with transformers (the names and shapes of the Hugging Face layout), and see "
            "docs/presets.md for what can be checked of sglang and vllm without a GPU"
        )
    if library not in LIBRARIES:
        raise ValueError(f"unknown library {library!r}: use one of {', '.join(LIBRARIES)}")
    root: Path | None = None
    if isinstance(checkpoint_or_plan, Plan):
        specs, config = checkpoint_or_plan.output_specs(), checkpoint_or_plan.config
    elif isinstance(checkpoint_or_plan, Checkpoint):
        root = checkpoint_or_plan.root
        specs, config = checkpoint_or_plan.specs(), checkpoint_or_plan.config
    else:
        with Checkpoint.open(checkpoint_or_plan) as ckpt:
            root = ckpt.root
            specs, config = ckpt.specs(), ckpt.config
    if config is None:
        raise LoadError(
            "no config.json: transformers cannot tell which model to build; convert with a "
            "mapping that writes one"
        )
    with _quiet_transformers():
        folder = root if root is not None and root.is_dir() else None
        try:
            model = _build(config, folder, trust_remote_code)
        except LoadError:
            raise
        except Exception as exc:  # transformers' own, on a config it cannot build a model of
            raise LoadError(
                f"transformers cannot build the model config.json describes: "
                f"{type(exc).__name__}: {one_line(str(exc))[:300]}; fix config.json"
            ) from exc
        problems = _compare(model, specs, config)
    return LoadReport(
        library, type(model).__name__, len(specs), len(model.state_dict()), tuple(problems)
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own warnings (a config field it does not know, ...) silenced while the
    model is built: the report says what matters."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity(40)  # logging.ERROR
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _build(config: dict[str, Any], root: Path | None, trust_remote_code: bool) -> Any:
    """The model config.json names, on the meta device."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if "auto_map" in config and trust_remote_code:
        return _build_remote(config, root)
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        remote = " (config.json's auto_map names remote code: pass trust_remote_code)"
        raise LoadError(
            f"config.json's model_type {model_type!r} is not one transformers "
            f"{transformers.__version__} knows"
            + (remote if "auto_map" in config else ": upgrade transformers, or fix model_type")
        )
    cls = getattr(transformers, arch, None) if arch is not None else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        cls = None  # not a model class of transformers (a name of something else in it)
        if arch is not None and "auto_map" not in config:
            # Another library's class (a serving engine's: SGLang's LlamaForCausalLMEagle3):
            # checked as the model_type's class instead, every difference between the two
            # would be reported as a problem of the checkpoint.
            raise LoadError(
                f"config.json's architectures names {arch!r}, which is no model class of "
                f"transformers {transformers.__version__} (another library's own?): "
                "transformers cannot check it; check it with the library it is for, or fix "
                "architectures"
            )
    if cls is None:
        for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES"):
            name = getattr(modeling_auto, table).get(model_type)
            if isinstance(name, str):
                cls = getattr(transformers, name, None)
                break
    if cls is None:
        named = f"architectures {archs}" if arch is not None else f"model_type {model_type!r}"
        hint = (
            " (its auto_map names remote code: pass trust_remote_code)"
            if "auto_map" in config
            else ""
        )
        raise LoadError(
            f"config.json's {named} names no model class of transformers "
            f"{transformers.__version__}{hint}"
        )
    cfg_fields = {k: v for k, v in config.items() if k != "auto_map"}
    cfg = CONFIG_MAPPING[model_type].from_dict(cfg_fields)
    with torch.device("meta"):
        return cls(cfg)


def _build_remote(config: dict[str, Any], root: Path | None) -> Any:
    """The model of ``auto_map``, its code run as transformers runs it (trusted by the caller)."""
    import torch
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    if root is None:
        raise LoadError(
            "config.json's auto_map names remote code, which is run from the checkpoint's "
            "folder: check the written folder (weightmap check OUT --loads transformers "
            "--trust-remote-code)"
        )
    auto_map = config["auto_map"]
    ref = next((auto_map[k] for k in ("AutoModelForCausalLM", "AutoModel") if k in auto_map), None)
    if not isinstance(ref, str):
        raise LoadError("config.json's auto_map names no AutoModelForCausalLM or AutoModel class")
    cfg = AutoConfig.from_pretrained(str(root), trust_remote_code=True)
    cls = get_class_from_dynamic_module(ref, str(root))
    with torch.device("meta"):
        return cls(cfg)


def _conversions(model: Any) -> tuple[list[Any], list[Any], Any]:
    """transformers' load-time renames and converters for ``model``, and its key renamer;
    none with a transformers that has no conversion mapping (4.x)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # transformers 4: names are loaded as they are
        return [], [], None
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters, rename_source_key


def _config_dtype(config: dict[str, Any]) -> str | None:
    """The safetensors name of the dtype config.json says the weights are in."""
    value = config.get("dtype", config.get("torch_dtype"))
    if isinstance(value, str):
        return _FLOAT_NAMES.get(value.removeprefix("torch."))
    return None


def _shape(spec: TensorSpec | tuple[str, tuple[int, ...]]) -> str:
    dtype, shape = (spec.dtype, spec.shape) if isinstance(spec, TensorSpec) else spec
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _ignored_by_every_model(model: Any) -> list[re.Pattern[str]]:
    """The unexpected names transformers drops for every model, beside each model's own
    patterns (``PreTrainedModel._adjust_missing_and_unexpected_keys``): older checkpoints'
    per-layer ``rotary_emb.inv_freq`` where the model has such a buffer, and ``position_ids``
    where it has one (no longer saved)."""
    buffers = [name for name, _ in model.named_buffers()]
    patterns = []
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.append(re.compile(r"rotary_emb\.inv_freq"))
    if any(name.endswith("position_ids") for name in buffers):
        patterns.append(re.compile(r"(^|\.)position_ids$"))
    return patterns


def _compare(model: Any, specs: Sequence[TensorSpec], config: dict[str, Any]) -> list[str]:
    """Each problem of loading ``specs`` into ``model``, grouped: one line per kind and detail."""
    expected: dict[str, torch.Tensor] = model.state_dict()
    want = {
        name: (_FLOAT_NAMES.get(str(t.dtype).removeprefix("torch."), str(t.dtype)), tuple(t.shape))
        for name, t in expected.items()
    }
    renamings, converters, rename = _conversions(model)
    prefix = getattr(model, "base_model_prefix", None)
    ignore_missing = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    ]
    ignore_unexpected = [
        re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    ] + _ignored_by_every_model(model)
    tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    keep_f32 = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    )
    float_dtype = _config_dtype(config)
    said = config.get("dtype", config.get("torch_dtype"))

    found: dict[tuple[str, str], list[str]] = {}  # (kind, detail with "{}" for the name)

    def report(kind: str, name: str, detail: str = "") -> None:
        found.setdefault((kind, detail), []).append(name)

    loaded: set[str] = set()
    for spec in specs:
        name = spec.name
        target, converted = name, None
        if rename is not None:
            target, converted = rename(name, renamings, converters, prefix, expected)
            if target not in expected and name in expected:
                target, converted = rename(name, [], [], prefix, expected)
        if target not in want:
            if not any(p.search(name) for p in ignore_unexpected):
                report("unexpected", name, ": the model has no such parameter or buffer")
            continue
        loaded.add(target)
        if converted is not None:
            continue  # fused by transformers' conversion at load: its shape is the result's
        dtype, shape = want[target]
        if spec.shape != shape:
            turned = len(shape) == 2 and spec.shape == shape[::-1]
            report(
                "shape",
                name,
                f" is {_shape(spec)}, the model has [{', '.join(map(str, shape))}]"
                + (" (the transposed shape)" if turned else "")
                + (f" (loaded as {target})" if target != name else ""),
            )
        elif DTYPES.get(spec.dtype) is not None and DTYPES[spec.dtype].kind == "float":
            kept = any(m in target.split(".") or m in target for m in keep_f32)
            if (
                float_dtype is not None
                and spec.dtype != float_dtype
                and not (kept and spec.dtype == "F32")
            ):
                report(
                    "dtype",
                    name,
                    f" is {spec.dtype} but config.json says {said}: transformers would cast it "
                    "on load; cast it, or make the config say its dtype",
                )
        elif spec.dtype != dtype:
            report("dtype", name, f" is {spec.dtype}, the model's buffer is {dtype}")
    for name in want:
        if name in loaded or any(p.search(name) for p in ignore_missing):
            continue
        source = tied.get(name)
        if source is not None and source in loaded:
            continue  # tied: transformers points it at its source
        dtype, shape = want[name]
        if float_dtype is not None and dtype in DTYPES and DTYPES[dtype].kind == "float":
            dtype = float_dtype  # the meta model is float32; it would load in the config's dtype
        report("missing", name, f": the model has {_shape((dtype, shape))}")
    lines = []
    order = ("missing", "unexpected", "shape", "dtype")
    for (kind, detail), names in sorted(found.items(), key=lambda kv: order.index(kv[0][0])):
        for line in compact_names(names):
            group, _, count = line.partition("  (")
            lines.append(f"{kind}: {group}{detail}" + (f" ({count}" if count else ""))
    return lines
