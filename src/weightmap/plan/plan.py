"""The Plan: what the executor does, as an immutable value that never touches tensor data.

Each output tensor is a tree of operations over input tensors (``nodes.py``). Output order:
outputs are sorted by the input position of their earliest source tensor, then by name, so a
plan (and a streaming write) follows the input file's order and is deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weightmap.format.dtypes import SpecTable, TensorSpec
from weightmap.format.text import same_json
from weightmap.fs.gcpause import gc_paused
from weightmap.plan.explain import explain
from weightmap.plan.nodes import Source, node_from_dict, node_to_dict
from weightmap.plan.parts import (
    Dropped,
    OutputFamily,
    OutputTable,
    OutputTensor,
    SideFile,
    loc_dict,
    loc_from_dict,
)

__all__ = ["PLAN_FORMAT", "Dropped", "OutputFamily", "OutputTensor", "Plan", "SideFile"]

PLAN_FORMAT = 1


def _json_or_none(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=False)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """An immutable, serializable description of one conversion.

    ``config`` is the whole output config.json (a fresh dict on every access) whenever the input
    had one, edited or not; it is None only when the input had no config. ``config_changed``
    tells whether the mapping edited it.
    """

    mapping_name: str
    # A tuple, or (a checkpoint's inputs, the outputs of a rename of all of them) a table of
    # columns read as one: see SpecTable and OutputTable.
    inputs: Sequence[TensorSpec]
    outputs: Sequence[OutputTensor]
    dropped: tuple[Dropped, ...] = ()
    warnings: tuple[str, ...] = ()
    params_json: str = "{}"
    config_json: str | None = None
    input_config_json: str | None = None
    files: tuple[SideFile, ...] = ()
    # The families of files written beside the main checkpoint (``output NAME ...``).
    families: tuple[OutputFamily, ...] = ()
    # Caches filled on first use; not init fields, so dataclasses.replace never carries one
    # over to a plan with other outputs.
    _by_name: dict[str, OutputTensor] = field(
        default_factory=dict, init=False, compare=False, repr=False, hash=False
    )
    _specs: list[Sequence[TensorSpec]] = field(
        default_factory=list, init=False, compare=False, repr=False, hash=False
    )

    @classmethod
    def build(
        cls,
        *,
        mapping_name: str,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[OutputTensor],
        dropped: tuple[Dropped, ...] = (),
        warnings: tuple[str, ...] = (),
        params: dict[str, Any] | None = None,
        config: Any = None,
        input_config: Any = None,
        files: tuple[SideFile, ...] = (),
        families: tuple[OutputFamily, ...] = (),
    ) -> Plan:
        """Make a plan from Python values (JSON-serializable config and params)."""
        return cls(
            mapping_name=mapping_name,
            inputs=inputs,
            outputs=outputs,
            dropped=dropped,
            warnings=warnings,
            params_json=json.dumps(params or {}),
            config_json=_json_or_none(config),
            input_config_json=_json_or_none(input_config),
            files=files,
            families=families,
        )

    @property
    def params(self) -> dict[str, Any]:
        """The resolved parameter values (defaults plus overrides)."""
        result: dict[str, Any] = json.loads(self.params_json)
        return result

    @property
    def config(self) -> dict[str, Any] | None:
        """The output config.json as a fresh dict, or None if the input had none."""
        if self.config_json is None:
            return None
        result: dict[str, Any] = json.loads(self.config_json)
        return result

    @property
    def input_config(self) -> dict[str, Any] | None:
        """The input config.json as a fresh dict, or None."""
        if self.input_config_json is None:
            return None
        return json.loads(self.input_config_json)  # type: ignore[no-any-return]

    @property
    def config_changed(self) -> bool:
        """True when the mapping edited the config (JSON equality: ``true`` to ``1`` is an
        edit)."""
        return not same_json(self.config, self.input_config)

    @property
    def is_rename_only(self) -> bool:
        """True when every output is an input read whole (renames, keeps, drops only)."""
        if isinstance(self.outputs, OutputTable):
            return True  # (every one of a table's outputs is an input read whole)
        return all(isinstance(o.node, Source) for o in self.outputs)

    def output_specs(self) -> Sequence[TensorSpec]:
        """The output tensors' names, dtypes and shapes, in plan order."""
        if isinstance(self.outputs, OutputTable):
            return self.outputs.specs  # (the table's own columns)
        # Asked for by the writer, the executor and the progress bar alike: made once, as a
        # checkpoint of 100,000 tensors takes a tenth of a second to list.
        if not self._specs:
            with gc_paused():
                self._specs.append(tuple(o.spec for o in self.outputs))
        return self._specs[0]

    def output_nbytes(self) -> int:
        """The bytes of every output tensor, together (a table's by its column of sizes)."""
        specs = self.output_specs()
        if isinstance(specs, SpecTable):
            return sum(specs.sizes)
        return sum(s.nbytes for s in specs)

    def members(self) -> list[tuple[str, str]]:
        """``(name prefix, file name)`` of every file the output families write, the
        tensors named with the prefix going into that file without it."""
        return [m for family in self.families for m in family.members()]

    def output(self, name: str) -> OutputTensor:
        """The output tensor called ``name`` (KeyError if none)."""
        if not self._by_name:
            self._by_name.update((o.name, o) for o in self.outputs)
        return self._by_name[name]

    # ------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_dict`); ``files`` only when there are some."""
        d: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "mapping": self.mapping_name,
            "params": self.params,
            "inputs": [_spec_dict(s) for s in self.inputs],
            "outputs": [
                {"name": o.name, "origin": loc_dict(o.origin), "node": node_to_dict(o.node)}
                for o in self.outputs
            ],
            "dropped": [{"name": d.name, "origin": loc_dict(d.origin)} for d in self.dropped],
            "warnings": list(self.warnings),
            "config": self.config,
            "input_config": self.input_config,
        }
        if self.files:
            d["files"] = [f.to_dict() for f in self.files]
        if self.families:
            d["output_families"] = [f.to_dict() for f in self.families]
        return d

    def to_json(self, indent: int | None = 1) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Rebuild a plan written by :meth:`to_dict`."""
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"unknown plan format {d.get('format')!r}")
        return cls.build(
            mapping_name=d["mapping"],
            inputs=tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in d["inputs"]),
            outputs=tuple(
                OutputTensor(
                    name=o["name"],
                    node=node_from_dict(o["node"]),
                    origin=loc_from_dict(o["origin"]),
                )
                for o in d["outputs"]
            ),
            dropped=tuple(
                Dropped(name=x["name"], origin=loc_from_dict(x["origin"])) for x in d["dropped"]
            ),
            warnings=tuple(d["warnings"]),
            params=d["params"],
            config=d["config"],
            input_config=d["input_config"],
            files=tuple(SideFile.from_dict(f) for f in d.get("files", ())),
            families=tuple(OutputFamily.from_dict(f) for f in d.get("output_families", ())),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan from :meth:`to_json` text."""
        return cls.from_dict(json.loads(text))

    def explain(self, limit: int | None = None) -> str:
        """A readable table: input -> operation -> output, with dtypes and shapes, then config;
        at most ``limit`` outputs and dropped inputs listed (None: all of them)."""
        return explain(self, limit)


def _spec_dict(s: TensorSpec) -> dict[str, Any]:
    return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}
