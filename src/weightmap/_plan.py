"""The Plan: what the executor does, as an immutable value that never touches tensor data.

Each output tensor is a small tree of operations over input tensors (:class:`Source` leaves).
Every node records the dtype and shape of its own result, so a plan can be printed, diffed,
serialized and checked without reading a byte of the checkpoint.

Output order: outputs are sorted by the input position of their earliest source tensor, then by
name, so a plan (and a streaming write) follows the input file's order and is deterministic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from weightmap._ast import Loc
from weightmap._dtypes import DTYPES, TensorSpec

__all__ = [
    "Cast",
    "Concat",
    "Dropped",
    "Node",
    "OutputTensor",
    "Permute",
    "Plan",
    "Reshape",
    "Slice",
    "Source",
    "Stack",
]

PLAN_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class Node:
    """An operation's result: its safetensors dtype and shape."""

    dtype: str
    shape: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        """The operand nodes."""
        return ()

    def sources(self) -> tuple[Source, ...]:
        """The input tensors this node reads, left to right."""
        out: list[Source] = []
        for c in self.children():
            out.extend(c.sources())
        return tuple(out)

    def describe(self) -> str:
        """A one-line expression such as ``cast(slice(q, dim=0, 0:64))``."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class Source(Node):
    """An input tensor, read whole."""

    name: str

    def sources(self) -> tuple[Source, ...]:
        return (self,)

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True, kw_only=True)
class Slice(Node):
    """``src`` narrowed to ``start:stop`` along ``dim`` (split, chunk, unstack)."""

    src: Node
    dim: int
    start: int
    stop: int

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"slice({self.src.describe()}, dim={self.dim}, {self.start}:{self.stop})"


@dataclass(frozen=True, kw_only=True)
class Concat(Node):
    """``srcs`` joined along an existing ``dim`` (merge)."""

    srcs: tuple[Node, ...]
    dim: int

    def children(self) -> tuple[Node, ...]:
        return self.srcs

    def describe(self) -> str:
        return f"concat({', '.join(s.describe() for s in self.srcs)}, dim={self.dim})"


@dataclass(frozen=True, kw_only=True)
class Stack(Node):
    """``srcs`` (all the same shape) stacked along a new ``dim``."""

    srcs: tuple[Node, ...]
    dim: int

    def children(self) -> tuple[Node, ...]:
        return self.srcs

    def describe(self) -> str:
        if len(self.srcs) > 4:
            inner = f"{self.srcs[0].describe()}, ... {len(self.srcs)} tensors"
        else:
            inner = ", ".join(s.describe() for s in self.srcs)
        return f"stack({inner}, dim={self.dim})"


@dataclass(frozen=True, kw_only=True)
class Permute(Node):
    """Axes of ``src`` reordered: result axis i is source axis ``perm[i]`` (transpose, permute)."""

    src: Node
    perm: tuple[int, ...]

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"permute({self.src.describe()}, {list(self.perm)})"


@dataclass(frozen=True, kw_only=True)
class Reshape(Node):
    """``src`` in row-major order viewed with the node's ``shape`` (same element count)."""

    src: Node

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"reshape({self.src.describe()}, {list(self.shape)})"


@dataclass(frozen=True, kw_only=True)
class Cast(Node):
    """``src`` converted to the node's ``dtype``.

    Float to float rounds to nearest even (as torch does). An integer cast to a narrower type
    (see :attr:`narrowing`) must be range-checked by the executor: a value that does not fit
    is an error, never a wrap-around.
    """

    src: Node

    @property
    def narrowing(self) -> bool:
        """True for integer casts that may not hold every source value."""
        return not int_cast_fits(self.src.dtype, self.dtype)

    def children(self) -> tuple[Node, ...]:
        return (self.src,)

    def describe(self) -> str:
        return f"cast({self.src.describe()}, {self.dtype})"


def int_cast_fits(src: str, dst: str) -> bool:
    """True unless ``src`` -> ``dst`` is an integer cast that can lose values."""
    a, b = DTYPES[src], DTYPES[dst]
    if a.kind not in ("int", "uint") or b.kind not in ("int", "uint"):
        return True
    if a.kind == b.kind:
        return b.bits >= a.bits
    return a.kind == "uint" and b.bits > a.bits


@dataclass(frozen=True, kw_only=True)
class OutputTensor:
    """One tensor of the output checkpoint and the rule (``origin``) that produced it."""

    name: str
    node: Node
    origin: Loc

    @property
    def spec(self) -> TensorSpec:
        """The output tensor's name, dtype and shape."""
        return TensorSpec(self.name, self.node.dtype, self.node.shape)


@dataclass(frozen=True, kw_only=True)
class Dropped:
    """An input deliberately left out, and the rule (or ``unmatched drop``) that dropped it."""

    name: str
    origin: Loc


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
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[OutputTensor, ...]
    dropped: tuple[Dropped, ...] = ()
    warnings: tuple[str, ...] = ()
    params_json: str = "{}"
    config_json: str | None = None
    input_config_json: str | None = None
    _by_name: dict[str, OutputTensor] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )

    @classmethod
    def build(
        cls,
        *,
        mapping_name: str,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[OutputTensor, ...],
        dropped: tuple[Dropped, ...] = (),
        warnings: tuple[str, ...] = (),
        params: dict[str, Any] | None = None,
        config: Any = None,
        input_config: Any = None,
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
        """True when the mapping edited the config."""
        return self.config != self.input_config

    @property
    def is_rename_only(self) -> bool:
        """True when every output is an input read whole (renames, keeps, drops only)."""
        return all(isinstance(o.node, Source) for o in self.outputs)

    def output_specs(self) -> tuple[TensorSpec, ...]:
        """The output tensors' names, dtypes and shapes, in plan order."""
        return tuple(o.spec for o in self.outputs)

    def output(self, name: str) -> OutputTensor:
        """The output tensor called ``name`` (KeyError if none)."""
        if not self._by_name:
            self._by_name.update((o.name, o) for o in self.outputs)
        return self._by_name[name]

    # ------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_dict`)."""
        return {
            "format": PLAN_FORMAT,
            "mapping": self.mapping_name,
            "params": self.params,
            "inputs": [_spec_dict(s) for s in self.inputs],
            "outputs": [
                {"name": o.name, "origin": _loc_dict(o.origin), "node": node_to_dict(o.node)}
                for o in self.outputs
            ],
            "dropped": [{"name": d.name, "origin": _loc_dict(d.origin)} for d in self.dropped],
            "warnings": list(self.warnings),
            "config": self.config,
            "input_config": self.input_config,
        }

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
                    name=o["name"], node=node_from_dict(o["node"]), origin=_loc(o["origin"])
                )
                for o in d["outputs"]
            ),
            dropped=tuple(Dropped(name=x["name"], origin=_loc(x["origin"])) for x in d["dropped"]),
            warnings=tuple(d["warnings"]),
            params=d["params"],
            config=d["config"],
            input_config=d["input_config"],
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Rebuild a plan from :meth:`to_json` text."""
        return cls.from_dict(json.loads(text))

    def explain(self) -> str:
        """A readable table: input -> operation -> output, with dtypes and shapes, then config."""
        from weightmap._explain import explain

        return explain(self)


def _spec_dict(s: TensorSpec) -> dict[str, Any]:
    return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}


def _loc_dict(loc: Loc) -> dict[str, Any]:
    return {"file": loc.file, "line": loc.line, "col": loc.col}


def _loc(d: dict[str, Any]) -> Loc:
    return Loc(d["file"], d["line"], d["col"])


def node_to_dict(n: Node) -> dict[str, Any]:
    """One node (and its operands) as a JSON-ready dict keyed by ``op``."""
    d: dict[str, Any] = {"op": type(n).__name__.lower(), "dtype": n.dtype, "shape": list(n.shape)}
    if isinstance(n, Source):
        d["name"] = n.name
    elif isinstance(n, Slice):
        d.update(src=node_to_dict(n.src), dim=n.dim, start=n.start, stop=n.stop)
    elif isinstance(n, (Concat, Stack)):
        d.update(srcs=[node_to_dict(s) for s in n.srcs], dim=n.dim)
    elif isinstance(n, Permute):
        d.update(src=node_to_dict(n.src), perm=list(n.perm))
    elif isinstance(n, (Reshape, Cast)):
        d["src"] = node_to_dict(n.src)
    return d


def node_from_dict(d: dict[str, Any]) -> Node:
    """Inverse of :func:`node_to_dict`."""
    op, dt, shape = d["op"], d["dtype"], tuple(d["shape"])
    if op == "source":
        return Source(dtype=dt, shape=shape, name=d["name"])
    if op == "slice":
        src = node_from_dict(d["src"])
        return Slice(dtype=dt, shape=shape, src=src, dim=d["dim"], start=d["start"], stop=d["stop"])
    if op in ("concat", "stack"):
        srcs = tuple(node_from_dict(s) for s in d["srcs"])
        kind = Concat if op == "concat" else Stack
        return kind(dtype=dt, shape=shape, srcs=srcs, dim=d["dim"])
    if op == "permute":
        return Permute(dtype=dt, shape=shape, src=node_from_dict(d["src"]), perm=tuple(d["perm"]))
    if op == "reshape":
        return Reshape(dtype=dt, shape=shape, src=node_from_dict(d["src"]))
    if op == "cast":
        return Cast(dtype=dt, shape=shape, src=node_from_dict(d["src"]))
    raise ValueError(f"unknown plan node {op!r}")
