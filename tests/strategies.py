"""Every hypothesis strategy of the test suite, in one module.

Sections, in order:

- language programs: source texts generated from the grammar, with the headers and config
  they compile against (``test_language_props``);
- tensors and plan nodes for the executor (``test_execute``);
- safetensors headers, index and config files, and mutated mapping programs, for fuzzing
  (``test_fuzz`` and ``fuzz/fuzz_parsers.py``);
- mapping programs with the checkpoints they consume, for the property tests
  (``test_programs``);
- writer checkpoints (``test_writer``).

Oracles and helpers that check results stay in their test files; data a strategy and a test
both need (the fuzzing corpus, the valid index, ...) lives here and the tests import it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark
from lark import Lark

from weightmap.format.dtypes import DTYPES, U64_MAX, TensorSpec, numel
from weightmap.format.header import MAX_HEADER_SIZE
from weightmap.format.layout import CONFIG_NAME
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.language.resources import read_text
from weightmap.plan.nodes import (
    Arith,
    Binary,
    Cast,
    Clamp,
    Concat,
    Gather,
    Lookup,
    Matmul,
    Node,
    Pack,
    Permute,
    Quantize,
    Reduce,
    Reshape,
    Round,
    Slice,
    Source,
    Stack,
    Unpack,
    int_cast_fits,
)

# ---- language programs ---------------------------------------------------------------------------
# Source texts drawn from the grammar itself, and the headers and config they compile against.

# Terminals whose regexes would otherwise produce mostly noise: realistic words instead, so
# that generated programs reach the compiler, not only the parser.
NAMES: st.SearchStrategy[str] = st.sampled_from([
    "i", "n", "e", "x", "layout", "dtype", "shape", "name", "f32", "bf16",
    "len", "has", "min", "int", "round", "ceil", "ceildiv", "abs", "hidden_size", "a", "b",
])  # fmt: skip
STRINGS: st.SearchStrategy[str] = st.sampled_from([
    '"a.weight"', '"b.weight"', '"layers.{n:int}.{rest*}"', '"layers.{n}.w"', '"{x}.weight"',
    '"out.{x}"', '"out.{n - 1}.{rest}"', '"*"', '"**"', '"l.{i}.{gate,up}"', '"e.{e:int}"',
    '"msg {config.hidden_size}"', '"a.{x"', '"{x:a,b}"', '"x"', '""',
])  # fmt: skip


def grammar_programs() -> st.SearchStrategy[str]:
    """Source texts generated from grammars/weightmap.lark (most parse, some do not)."""
    grammar = Lark(read_text("grammars", "weightmap.lark"), parser="lalr", start="start")
    return from_lark(
        grammar,
        start="start",
        explicit={
            "NAME": NAMES,
            "STRING": STRINGS,
            "INT": st.sampled_from(["0", "1", "2", "3"]),
            "FLOAT": st.just("1.5"),
            "WS": st.just(" "),
            "COMMENT": st.just("# c\n"),
        },
    )


HEADERS: tuple[TensorSpec, ...] = (
    TensorSpec("a.weight", "F32", (4, 4)),
    TensorSpec("b.weight", "BF16", (4, 2)),
    TensorSpec("layers.0.w", "F32", (2, 3)),
    TensorSpec("layers.1.w", "F32", (2, 3)),
    TensorSpec("l.0.gate", "F16", (2, 2)),
    TensorSpec("l.0.up", "F16", (2, 2)),
    TensorSpec("e.0", "I64", (3,)),
    TensorSpec("e.1", "I64", (3,)),
)
CONFIG: dict[str, Any] = {"hidden_size": 4, "a": [1, 2], "b": {"c": None}}


# ---- tensors and plan nodes for the executor -----------------------------------------------------
# Random tensors of every dtype, chains of plan nodes over them, whole (inputs, outputs) cases.

FLOATS: list[str] = ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"]
INTS: list[str] = ["I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"]
DTYPE_CHOICES: list[str] = [*FLOATS, *INTS, "BOOL"]
# What stops a run whose narrowing cast meets a value it cannot hold (execute/kernels.py).
UNFIT = r"do not fit in|cannot be cast from|is not a whole number"


def src(name: str, t: torch.Tensor) -> Source:
    """A plan source node for tensor ``t`` under ``name`` (also used by the tests)."""
    code = next(k for k, d in DTYPES.items() if d.torch_name and d.torch() == t.dtype)
    return Source(name=name, dtype=code, shape=tuple(t.shape))


@st.composite
def tensors(draw: st.DrawFn, name: str) -> torch.Tensor:
    """A tensor of any dtype (BOOL included), rank 0 to 3, possibly empty, random bytes."""
    code = draw(st.sampled_from(DTYPE_CHOICES))
    dims = st.integers(1, 5) | st.just(0)
    shape = tuple(draw(st.lists(dims, min_size=0, max_size=3)))
    n = numel(shape) * DTYPES[code].itemsize
    if n == 0:
        return torch.zeros(shape, dtype=DTYPES[code].torch())
    raw = bytearray(draw(st.binary(min_size=n, max_size=n)))
    t = torch.frombuffer(raw, dtype=torch.uint8)
    if code == "BOOL":
        t = t % 2
    return t.view(DTYPES[code].torch()).reshape(shape).clone()


def _factorizations(n: int) -> list[tuple[int, ...]]:
    """Shapes of ``n`` elements with one to three dims: a reshape to 3 dims under a permute
    is what a rotary permute chain does, and needs the executor's multi-range reshape path."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    out: list[tuple[int, ...]] = [(n,)]
    out += [(d, n // d) for d in divisors]
    out += [(a, b, n // (a * b)) for a in divisors for b in divisors if (n // a) % b == 0]
    return out


@st.composite
def nodes(draw: st.DrawFn, base: Node, depth: int = 3) -> Node:
    """Up to ``depth`` slice/concat/stack/permute/reshape/cast nodes stacked on ``base``."""
    node = base
    for _ in range(draw(st.integers(0, depth))):
        op = draw(
            st.sampled_from(
                [
                    "slice",
                    "concat",
                    "stack",
                    "permute",
                    "reshape",
                    "cast",
                    "arith",
                    "quantize",
                    "unpack",
                    "pack",
                    "gather",
                    "lookup",
                    "matmul",
                    "round",
                    "reduce",
                ]
            )
        )
        rank = len(node.shape)
        floating = node.dtype in FLOATS
        if op == "slice" and rank and all(node.shape):
            dim = draw(st.integers(0, rank - 1))
            size = node.shape[dim]
            start = draw(st.integers(0, size - 1))
            stop = draw(st.integers(start + 1, size))
            shape = list(node.shape)
            shape[dim] = stop - start
            node = Slice(
                src=node, dim=dim, start=start, stop=stop, dtype=node.dtype, shape=tuple(shape)
            )
        elif op == "concat" and rank:
            dim = draw(st.integers(0, rank - 1))
            k = draw(st.integers(1, 3))
            shape = list(node.shape)
            shape[dim] *= k
            node = Concat(srcs=(node,) * k, dim=dim, dtype=node.dtype, shape=tuple(shape))
        elif op == "stack" and rank < 4:
            dim = draw(st.integers(0, rank))
            k = draw(st.integers(1, 3))
            shape = list(node.shape)
            shape.insert(dim, k)
            node = Stack(srcs=(node,) * k, dim=dim, dtype=node.dtype, shape=tuple(shape))
        elif op == "permute" and rank:
            perm = tuple(draw(st.permutations(range(rank))))
            node = Permute(
                src=node, perm=perm, dtype=node.dtype, shape=tuple(node.shape[p] for p in perm)
            )
        elif op == "reshape":
            n = numel(node.shape)
            shape = (0,) if n == 0 else draw(st.sampled_from(_factorizations(n)))
            node = Reshape(src=node, dtype=node.dtype, shape=shape)
        elif op == "cast":
            kind = DTYPES[node.dtype].kind
            if kind == "float":
                target = draw(st.sampled_from(FLOATS))
            elif kind in ("int", "uint"):
                # Widening only here: a narrowing cast comes last in a chain (_narrowing).
                wider = [
                    d
                    for d in INTS
                    if DTYPES[d].kind == kind and DTYPES[d].bits >= DTYPES[node.dtype].bits
                ]
                # Every integer fits F32 and F64 (rounding aside); bytes fit F16.
                floats = ["F64", "F32"] + (["F16"] if DTYPES[node.dtype].bits == 8 else [])
                target = draw(st.sampled_from([*wider, *floats]))
            else:
                target = draw(st.sampled_from(["U8", "F32"]))
            node = Cast(src=node, dtype=target, shape=node.shape)
        elif op == "arith" and floating:
            node = _arith(draw, node)
        elif op in ("unpack", "pack", "gather", "lookup", "matmul", "round", "reduce"):
            node = _quant_node(draw, op, node)
        elif op == "quantize" and floating and rank >= 2 and all(node.shape):
            block = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
            fp8 = draw(st.sampled_from(["F8_E4M3", "F8_E5M2"]))
            if draw(st.booleans()):
                node = Quantize(src=node, block=block, part="values", fp8=fp8, dtype=fp8,
                                shape=node.shape)  # fmt: skip
            else:
                grid = (*node.shape[:-2], -(-node.shape[-2] // block[0]),
                        -(-node.shape[-1] // block[1]))  # fmt: skip
                node = Quantize(src=node, block=block, part="scales", fp8=fp8, dtype="F32",
                                shape=grid)  # fmt: skip
    if draw(st.integers(0, 3)) == 0:
        node = _narrowing(draw, node)
    return node


# A fixed input of the generated cases: bytes whose bits, unpacked one by one, are the 0/1
# indexes of gathers and the codes of lookups (always in range).
CODES = Source(name="codes", dtype="U8", shape=(3,))


def _codes(bits: int) -> Unpack:
    per = 8 // bits
    return Unpack(src=CODES, dim=0, bits=bits, order=tuple(range(per)), dtype="U8",
                  shape=(3 * per,))  # fmt: skip


def _quant_node(draw: st.DrawFn, op: str, node: Node) -> Node:
    """The quantized formats' primitives, where the node's dtype and shape allow them."""
    rank, info = len(node.shape), DTYPES[node.dtype]
    if op == "unpack" and rank and info.kind in ("int", "uint"):
        bits = draw(st.sampled_from([b for b in (1, 2, 4, 8, 16) if b < info.bits]))
        per = info.bits // bits
        dim = draw(st.integers(0, rank - 1))
        order = tuple(draw(st.permutations(range(per))))
        shape = (*node.shape[:dim], node.shape[dim] * per, *node.shape[dim + 1 :])
        return Unpack(src=node, dim=dim, bits=bits, order=order,
                      dtype="U8" if bits <= 8 else "U16", shape=shape)  # fmt: skip
    if op == "pack" and rank and node.dtype in ("U8", "U16"):
        bits = 8 if node.dtype == "U8" else 16  # every code of the dtype fits
        words = [w for w in INTS if DTYPES[w].bits > bits]
        word = draw(st.sampled_from(words))
        per = DTYPES[word].bits // bits
        dims = [d for d in range(rank) if node.shape[d] % per == 0]
        if dims:
            dim = draw(st.sampled_from(dims))
            order = tuple(draw(st.permutations(range(per))))
            shape = (*node.shape[:dim], node.shape[dim] // per, *node.shape[dim + 1 :])
            return Pack(src=node, dim=dim, bits=bits, order=order, dtype=word, shape=shape)
    if op == "gather" and rank:
        dims = [d for d in range(rank) if node.shape[d] >= 2]
        if dims:
            dim = draw(st.sampled_from(dims))
            index = _codes(1)
            shape = (*node.shape[:dim], index.shape[0], *node.shape[dim + 1 :])
            return Gather(src=node, index=index, dim=dim, dtype=node.dtype, shape=shape)
    if op == "lookup" and info.kind != "bool":
        bits = draw(st.sampled_from([1, 2]))
        if numel(node.shape) >= 1 << bits:
            table = Reshape(src=node, dtype=node.dtype, shape=(numel(node.shape),))
            codes = _codes(bits)
            return Lookup(codes=codes, table=table, dtype=node.dtype, shape=codes.shape)
    if op == "round" and node.dtype in FLOATS:
        mode = draw(st.sampled_from(["round", "floor", "ceil", "clamp"]))
        if mode == "clamp":
            return Clamp(src=node, low=-1.5, high=draw(st.sampled_from([0, 2.25, 1e6])),
                         dtype=node.dtype, shape=node.shape)  # fmt: skip
        return Round(src=node, mode=mode, dtype=node.dtype, shape=node.shape)
    if op == "reduce" and rank and (node.dtype in FLOATS or node.dtype in INTS[:7]):
        reduction = draw(st.sampled_from(["amax", "amin", "sum"]))
        dim = draw(st.integers(0, rank - 1))
        extent = node.shape[dim]
        if reduction == "sum" and node.dtype not in FLOATS:
            return node
        groups = [g for g in range(1, extent + 1) if extent % g == 0]
        group = draw(st.sampled_from([0, *groups])) if groups else 0
        if not group and not extent and reduction != "sum":
            return node
        size = [extent // group] if group else []
        shape = (*node.shape[:dim], *size, *node.shape[dim + 1 :])
        out = draw(st.sampled_from(FLOATS)) if reduction == "sum" else node.dtype
        compute = draw(st.sampled_from(["F32", "F64"]))
        return Reduce(src=node, op=reduction, dim=dim, group=group, compute=compute,
                      dtype=out, shape=shape)  # fmt: skip
    if op == "matmul" and rank == 2 and node.dtype in FLOATS:
        b = Permute(src=node, perm=(1, 0), dtype=node.dtype, shape=node.shape[::-1])
        compute = draw(st.sampled_from(["F32", "F64"]))
        out = draw(st.sampled_from(FLOATS))
        return Matmul(a=node, b=b, compute=compute, dtype=out,
                      shape=(node.shape[0], node.shape[0]))  # fmt: skip
    return node


def _narrowing(draw: st.DrawFn, node: Node) -> Node:
    """A cast that may not hold every value: a float to an integer (rounded and clamped first,
    or not), an integer to a narrower one or to a float of smaller range, maybe permuted, and
    maybe a slice of it along any dim (a split whose other part is dropped: the values checked
    are the part kept's). Drawn last in a chain, where the values an output holds are the
    cast's."""
    if node.dtype in FLOATS:
        if draw(st.booleans()):  # whole numbers in range, mostly (NaN stays NaN)
            mode = draw(st.sampled_from(["round", "floor", "ceil"]))
            node = Round(src=node, mode=mode, dtype=node.dtype, shape=node.shape)
            node = Clamp(src=node, low=-100, high=100, dtype=node.dtype, shape=node.shape)
        targets = INTS
    elif node.dtype in INTS:
        targets = [d for d in [*INTS, *FLOATS] if not int_cast_fits(node.dtype, d)]
    else:
        targets = []
    if not targets:
        return node
    node = Cast(src=node, dtype=draw(st.sampled_from(targets)), shape=node.shape)
    if len(node.shape) > 1 and draw(st.booleans()):  # transposed, say, before it is split
        perm = tuple(draw(st.permutations(range(len(node.shape)))))
        shape = tuple(node.shape[p] for p in perm)
        node = Permute(src=node, perm=perm, dtype=node.dtype, shape=shape)
    dims = [d for d, n in enumerate(node.shape) if n > 1]
    if dims and draw(st.booleans()):  # a part of it only (a split whose other part is dropped)
        dim = draw(st.sampled_from(dims))
        start = draw(st.integers(0, node.shape[dim] - 1))
        stop = draw(st.integers(start + 1, node.shape[dim]))
        shape = (*node.shape[:dim], stop - start, *node.shape[dim + 1 :])
        node = Slice(src=node, dim=dim, start=start, stop=stop, dtype=node.dtype, shape=shape)
    return node


def _arith(draw: st.DrawFn, node: Node) -> Node:
    """Constant or elementwise (the node with itself) arithmetic, in a drawn compute dtype."""
    op = draw(st.sampled_from(["add", "mul"]))
    compute = draw(st.sampled_from(["F32", "F64", "BF16", "F16"]))
    out = draw(st.sampled_from(FLOATS))
    if draw(st.booleans()):
        value = draw(st.sampled_from([1, -1, 0.5, 3.25, 1e-3]))
        return Arith(src=node, op=op, value=value, compute=compute, dtype=out, shape=node.shape)
    return Binary(a=node, b=node, op=op, block=(), compute=compute, dtype=out, shape=node.shape)


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, Node]]:
    """Input tensors ``in{i}`` and output nodes ``out.{j}`` computed from them."""
    inputs = {f"in{i}": draw(tensors(f"in{i}")) for i in range(draw(st.integers(1, 3)))}
    inputs[CODES.name] = torch.tensor(draw(st.lists(st.integers(0, 255), min_size=3, max_size=3)),
                                      dtype=torch.uint8)  # fmt: skip
    outputs: dict[str, Node] = {}
    for j in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(sorted(inputs)))
        outputs[f"out.{j}"] = draw(nodes(src(name, inputs[name])))
    return inputs, outputs


# ---- safetensors headers, index and config files, for fuzzing ------------------------------------
# Valid documents damaged structurally and byte-wise, hostile values, random JSON and bytes.

REPO = Path(__file__).resolve().parent.parent
VALID_DIR = REPO / "tests" / "data" / "lang" / "valid"
PRESET = REPO / "mappings" / "eagle3-sglang.wm"
EXAMPLE = REPO / "examples" / "eagle3-speculators"

# The shards of the sharded checkpoint whose index gets fuzzed, and its valid index.
SHARDS: dict[str, dict[str, tuple[str, list[int]]]] = {
    "model-00001-of-00002.safetensors": {"a.weight": ("F32", [2, 3]), "a.bias": ("F16", [3])},
    "model-00002-of-00002.safetensors": {"b.weight": ("BF16", [4]), "b.scale": ("I64", [])},
}
VALID_INDEX: dict[str, Any] = {
    "metadata": {"total_size": 40},
    "weight_map": {name: shard for shard, ts in SHARDS.items() for name in ts},
}


def json_values(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    """Arbitrary JSON values, with the numbers parsers trip on."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from([0, -1, 2**63, 2**64, 2**64 - 1, -(2**63), 10**30, 10**400]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
        ),
        max_leaves=max_leaves,
    )


class Nested:
    """A placeholder for ``depth`` nested lists, spliced in as text (json.dumps would recurse)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def dumps_loose(value: Any) -> bytes:
    """JSON text as a hostile writer might produce it (NaN, Infinity, ints beyond 64 bits)."""
    nests: list[Nested] = []

    def placeholder(obj: object) -> str:
        if isinstance(obj, Nested):
            nests.append(obj)
            return f"@@NEST{len(nests) - 1}@@"
        raise TypeError(obj)

    try:
        text = json.dumps(value, allow_nan=True, default=placeholder)
    except ValueError:  # an int past the str-conversion limit
        return b"1" * 5000
    for i, nest in enumerate(nests):
        text = text.replace(f'"@@NEST{i}@@"', "[" * nest.depth + "0" + "]" * nest.depth)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """Flip, insert, delete, duplicate or truncate bytes of ``data``, a few times."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "dup", "truncate", "replace"]))
        at = draw(st.integers(0, len(out)))
        if op == "flip" and out:
            i = min(at, len(out) - 1)
            out[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            out[at:at] = draw(
                st.one_of(
                    st.binary(min_size=1, max_size=8),
                    st.sampled_from(
                        [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"[", b"{", b'"', b"\\"]
                    ),
                )
            )
        elif op == "delete":
            del out[at : at + draw(st.integers(1, 8))]
        elif op == "dup":
            out[at:at] = out[at : at + draw(st.integers(1, 32))]
        elif op == "truncate":
            del out[at:]
        elif op == "replace" and out:
            i = min(at, len(out) - 1)
            out[i] = draw(st.integers(0, 255))
    return bytes(out)


@st.composite
def header_entries(draw: st.DrawFn) -> dict[str, Any]:
    """A valid header as a dict (tensors back to back, optional metadata)."""
    names = draw(st.lists(st.text(min_size=1, max_size=12), max_size=5, unique=True))
    header: dict[str, Any] = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)
        )
    offset = 0
    for name in names:
        if name == "__metadata__":
            continue
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        bits = math.prod(shape) * DTYPES[dtype].bits
        if bits % 8:
            shape = [*shape, 2] if DTYPES[dtype].bits == 4 else [*shape, 4]
            bits = math.prod(shape) * DTYPES[dtype].bits
        size = bits // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header


HOSTILE_NUMBERS: list[Any] = [
    -1,
    -(2**63),
    2**63,
    2**64,
    2**64 - 1,
    2**70,
    10**30,
    1.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    True,
    False,
    None,
    "1",
    [],
    {},
    [1, 2, 3],
]


def _walk_numbers(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk_numbers(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk_numbers(v, (*path, i))
    else:
        yield path


def _set(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _set(value[head], rest, new)}
    copy = list(value)
    copy[head] = _set(value[head], rest, new)
    return copy


@st.composite
def mutated_json(draw: st.DrawFn, doc: Any) -> bytes:
    """``doc`` with structural damage, serialised (sometimes with duplicate keys or nesting)."""
    for _ in range(draw(st.integers(0, 3))):
        paths = list(_walk_numbers(doc))
        op = draw(st.sampled_from(["value", "nest", "drop", "extra", "metadata"]))
        if op == "value" and paths:
            path = draw(st.sampled_from(paths))
            new = draw(st.one_of(st.sampled_from(HOSTILE_NUMBERS), json_values(5)))
            doc = _set(doc, path, new)
        elif op == "nest" and paths:
            path = draw(st.sampled_from(paths))
            depth = draw(st.sampled_from([2, 8, 9, 50, 600, 1100, 3000]))
            doc = _set(doc, path, Nested(depth))
        elif op == "drop" and isinstance(doc, dict) and doc:
            key = draw(st.sampled_from(sorted(doc, key=str)))
            doc = {k: v for k, v in doc.items() if k != key}
        elif op == "extra" and isinstance(doc, dict):
            doc = {**doc, draw(st.text(max_size=8)): draw(json_values(5))}
        elif op == "metadata" and isinstance(doc, dict):
            doc = {**doc, "__metadata__": draw(json_values(5))}
    raw = dumps_loose(doc)
    if draw(st.booleans()) and raw.startswith(b"{") and len(raw) > 2:
        # Duplicate the first member: a duplicate key, or a plain copy of the document.
        body = raw[1:-1]
        first = body.split(b', "', 1)[0]
        raw = b"{" + first + b", " + body + b"}"
    if draw(st.booleans()):
        raw = draw(byte_mutations(raw))
    return raw


@st.composite
def header_files(draw: st.DrawFn) -> bytes:
    """Whole files: a (possibly damaged) valid header, a (possibly lying) prefix, data."""
    header = draw(header_entries())
    raw = draw(mutated_json(header))
    if draw(st.booleans()):
        raw += b" " * draw(st.integers(0, 16))
    ends = [
        e["data_offsets"][1]
        for k, e in header.items()
        if k != "__metadata__" and isinstance(e, dict)
    ]
    data_len = max(ends, default=0) + draw(st.sampled_from([0, 0, 0, -1, 1, 8]))
    size = len(raw) + draw(
        st.sampled_from([0, 0, 0, 1, -1, 8, -8, MAX_HEADER_SIZE + 1, U64_MAX, 2**63])
    )
    prefix = struct.pack("<Q", size % 2**64)
    return prefix + raw + bytes(max(0, data_len))


HOSTILE_SHARD_NAMES: list[Any] = [
    "../x",
    "../model-00001-of-00002.safetensors",
    "/etc/passwd",
    "/tmp",
    "a\x00b",
    "",
    ".",
    "..",
    "sub",
    "sub/model-00001-of-00002.safetensors",
    "model-00001-of-00002.safetensors/",
    "..\\x",
    "C:\\x",
    "~",
    "escape.safetensors",
    "x" * 255,
    "x" * 256,
    "x" * 5000,
    "\ud800.safetensors",
    "é.safetensors",
    0,
    1.5,
    None,
    True,
    [],
    ["model-00001-of-00002.safetensors"],
    {"a": 1},
]


@st.composite
def index_docs(draw: st.DrawFn) -> bytes:
    """Index files: the valid one damaged, hostile shard names, random JSON or bytes."""
    kind = draw(st.sampled_from(["shards", "shards", "mutate", "json", "bytes"]))
    if kind == "json":
        return dumps_loose(draw(json_values()))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "mutate":
        return draw(mutated_json(VALID_INDEX))
    shard_names = st.one_of(
        st.sampled_from(sorted(SHARDS)), st.sampled_from(HOSTILE_SHARD_NAMES), st.text(max_size=20)
    )
    tensor_names = st.one_of(st.sampled_from(list(VALID_INDEX["weight_map"])), st.text(max_size=10))
    weight_map = draw(st.dictionaries(tensor_names, shard_names, max_size=6))
    doc: dict[str, Any] = {"weight_map": weight_map}
    if draw(st.booleans()):
        doc["metadata"] = draw(json_values(5))
    return dumps_loose(doc)


@st.composite
def config_docs(draw: st.DrawFn) -> bytes:
    """config.json files: random JSON, damaged real configs, deep nesting, bytes."""
    kind = draw(st.sampled_from(["json", "mutate", "deep", "bytes", "text"]))
    if kind == "json":
        value = draw(json_values(30))
        if draw(st.booleans()):
            value = {"hidden_size": value, "layers": value, "a": 1, "text_config": value}
        return dumps_loose(value)
    if kind == "mutate":
        base = json.loads((EXAMPLE / CONFIG_NAME).read_text())
        return draw(mutated_json(base))
    if kind == "deep":
        depth = draw(st.sampled_from([50, 100, 400, 600, 900, 990, 1100, 5000]))
        opener, closer = draw(st.sampled_from([(b'{"a":', b"}"), (b"[", b"]")]))
        return opener * depth + b"1" + closer * depth
    if kind == "text":
        return draw(
            st.sampled_from(
                [b"NaN", b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e999}', b'{"a": "\\ud800"}']
            )
        )
    return draw(st.binary(max_size=200))


# ---- mapping programs, for fuzzing ---------------------------------------------------------------
# The valid corpus (tests/data/lang/valid and the eagle3 preset), mutated; arbitrary params.


def _program_cases() -> list[tuple[str, list[TensorSpec], dict[str, Any] | None]]:
    cases = []
    for wm in sorted(VALID_DIR.glob("*.wm")):
        doc = json.loads(wm.with_suffix(".in.json").read_text())
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in doc["tensors"]]
        # Inline includes: mutated text is loaded from a string, relative to no folder.
        text = re.sub(
            r'^include "([^"]+)"$',
            lambda m: (VALID_DIR / m.group(1)).read_text().split("\n", 1)[1],
            wm.read_text(),
            flags=re.MULTILINE,
        )
        cases.append((text, specs, doc.get("config")))
    example = Checkpoint.open(EXAMPLE)
    cases.append((PRESET.read_text(), list(example.specs()), example.config))
    return cases


PROGRAMS: list[tuple[str, list[TensorSpec], dict[str, Any] | None]] = _program_cases()
_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|\s+|#[^\n]*|.')
VOCAB: list[str] = sorted(
    {t for text, _, _ in PROGRAMS for t in _TOKEN.findall(text) if not t.isspace()}
    | {
        "99999999999999999999999",
        "9" * 5000,
        "1e999",
        "-1",
        "0",
        "[0] * 1000000000000",
        '"{x:int}"',
        '"{a,b}"',
        '"**"',
        '"{"',
        '"}"',
        '"\\u0000"',
        '"\\ud800"',
        '"a\\x"',
        '"../x"',
        '"/abs"',
        '"__metadata__"',
        "config",
        "exists",
        "[",
        "]",
        "{",
        "}",
        "(",
        ")",
        "?",
        "->",
        "\x00",
        "é",
        "\ud800",
    }
)


@st.composite
def mutated_programs(draw: st.DrawFn) -> tuple[str, list[TensorSpec], dict[str, Any] | None]:
    """A valid program with tokens or characters deleted, inserted, duplicated or replaced."""
    text, specs, config = draw(st.sampled_from(PROGRAMS))
    tokens = _TOKEN.findall(text)
    for _ in range(draw(st.integers(1, 5))):
        op = draw(st.sampled_from(["del", "dup", "insert", "replace", "swap", "char", "number"]))
        i = draw(st.integers(0, max(0, len(tokens) - 1)))
        if op == "del" and tokens:
            del tokens[i]
        elif op == "dup" and tokens:
            tokens[i:i] = tokens[i : i + draw(st.integers(1, 6))]
        elif op == "insert":
            tokens.insert(i, " " + draw(st.sampled_from(VOCAB)) + " ")
        elif op == "replace" and tokens:
            tokens[i] = draw(st.sampled_from(VOCAB))
        elif op == "swap" and len(tokens) > 1:
            j = draw(st.integers(0, len(tokens) - 1))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        elif op == "char" and tokens:
            tok = tokens[i]
            at = draw(st.integers(0, len(tok)))
            tokens[i] = tok[:at] + draw(st.characters(codec=None)) + tok[at + 1 :]
        elif op == "number":
            numbers = [k for k, t in enumerate(tokens) if t[:1].isdigit()]
            if numbers:
                k = draw(st.sampled_from(numbers))
                tokens[k] = draw(
                    st.sampled_from(["0", "-1", "1.5", "99999999999999999999", "1e308", "65536"])
                )
    return "".join(tokens), specs, config


def params_values() -> st.SearchStrategy[Any]:
    """Values a caller might pass as params, JSON or not."""
    return st.one_of(
        json_values(10),
        st.sampled_from(
            [
                object(),
                {1, 2},
                b"bytes",
                (1, 2),
                1j,
                2**15000,
                -(2**257),
                float("nan"),
                "\x00",
                "\ud800",
            ]
        ),
        st.lists(st.sampled_from([object(), b"x", (1,)]), max_size=2),
    )


@st.composite
def params_cases(draw: st.DrawFn) -> tuple[str, list[TensorSpec], dict[str, Any] | None, Any]:
    """A valid program (or one with params declared) and an arbitrary params dict."""
    text, specs, config = draw(st.sampled_from(PROGRAMS))
    declared = draw(st.sampled_from(["null", "1", '"x"', "1.5", "[1]", '{"a": 1}', "true"]))
    text = text.replace("weightmap 1\n", f"weightmap 1\nparam fuzz_p = {declared}\n", 1)
    text += '\nrename? "never.{fuzz_x}" -> "{fuzz_p}.{fuzz_x}"\nwarn if fuzz_p == 1 "p {fuzz_p}"\n'
    keys = st.one_of(st.sampled_from(["fuzz_p", "layout", "prefix"]), st.text(max_size=5))
    params = draw(st.one_of(st.none(), st.dictionaries(keys, params_values(), max_size=3)))
    return text, specs, config, params


# ---- journals, include trees and --set values, for fuzzing ---------------------------------------
# What `weightmap clean` replays (a journal found in a downloaded folder), mappings whose
# includes fan out, and the text of `--set KEY=VALUE`.


def header_json(tensors: dict[str, tuple[str, list[int]]]) -> bytes:
    """The header JSON of a file of these tensors back to back, padded to a multiple of 8."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * DTYPES[dtype].bits // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return raw + b" " * (-len(raw) % 8)


RENAMES = {
    "upper": str.upper,
    "title": str.title,
    "swap": lambda n: {"a": "b", "b": "a"}.get(n[0], n[0]) + n[1:],
}


def valid_journal(style: str = "upper") -> dict[str, Any]:
    """The journal of renaming SHARDS' tensors by ``style`` (a key of RENAMES), as weightmap
    writes it: same-length names, so each new header fits the old one's bytes exactly."""
    import base64

    rename = RENAMES[style]
    files = {
        shard: base64.b64encode(header_json({rename(n): spec for n, spec in ts.items()})).decode()
        for shard, ts in SHARDS.items()
    }
    weight_map = {rename(n): shard for shard, ts in SHARDS.items() for n in ts}
    index = json.dumps({**VALID_INDEX, "weight_map": weight_map}, indent=2, sort_keys=True)
    return {"files": files, "index": index + "\n", "config": '{"renamed": true}\n'}


JOURNAL_NAMES: list[Any] = [
    *HOSTILE_SHARD_NAMES,
    "config.json",
    "model.safetensors.index.json",
    ".weightmap-inplace-journal.json",
    "/tmp/victim.safetensors",
    "../victim.safetensors",
]


@st.composite
def journal_docs(draw: st.DrawFn) -> bytes:
    """Journals: weightmap's own, damaged; hostile shard names and headers; random JSON, bytes."""
    import base64

    kind = draw(st.sampled_from(["valid", "mutate", "mutate", "names", "fields", "json", "bytes"]))
    if kind == "json":
        return dumps_loose(draw(json_values()))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    doc = valid_journal(draw(st.sampled_from(sorted(RENAMES))))
    if kind == "mutate":
        return draw(mutated_json(doc))
    if kind == "names":
        headers = st.one_of(
            st.sampled_from(list(doc["files"].values())),
            st.binary(max_size=80).map(lambda b: base64.b64encode(b).decode()),
            st.text(max_size=20),
        )
        keys = [n for n in JOURNAL_NAMES if isinstance(n, str)]  # JSON keys are strings
        names = st.one_of(st.sampled_from(keys), st.sampled_from(sorted(SHARDS)))
        doc["files"] = draw(st.dictionaries(names, headers, min_size=1, max_size=4))
    else:
        field = draw(st.sampled_from(["files", "index", "config"]))
        doc[field] = draw(
            st.one_of(
                json_values(8),
                st.sampled_from(['{"weight_map": {}}', "[]", "NaN", '{"a": 1}', "{", ""]),
            )
        )
    return dumps_loose(doc)


@st.composite
def include_trees(draw: st.DrawFn) -> dict[str, str]:
    """Mapping files (``f0.wm`` is the main one) that include each other: fan-out, cycles,
    presets, missing and special files."""
    n = draw(st.integers(1, 8))
    files = {}
    for i in range(n):
        lines = ["weightmap 1"]
        for _ in range(draw(st.integers(0, 5))):
            kind = draw(st.sampled_from(["include", "include", "include", "rule", "param", "junk"]))
            if kind == "include":
                target = draw(
                    st.one_of(
                        st.integers(0, n).map(lambda j: f"f{j}.wm"),
                        st.sampled_from(["eagle3-sglang", "/dev/zero", "../f0.wm", "sub/", ""]),
                    )
                )
                lines += [f'include "{target}"'] * draw(st.integers(1, 3))
            elif kind == "rule":
                lines.append(draw(st.sampled_from(['keep? "**"', 'drop? "a.*"', "unmatched keep"])))
            elif kind == "param":
                lines.append(f"param p{i} = [0] * {draw(st.sampled_from([1, 1000, 10**6]))}")
            else:
                lines.append(draw(st.text(max_size=20)))
        files[f"f{i}.wm"] = "\n".join(lines) + "\n"
    return files


def set_values() -> st.SearchStrategy[str]:
    """The VALUE of `--set KEY=VALUE`: JSON (loose), deep brackets, non-finite numbers, text."""
    return st.one_of(
        st.text(max_size=30),
        json_values(10).map(lambda v: dumps_loose(v).decode("utf-8", "surrogatepass")),
        st.integers(1, 6000).map(lambda d: "[" * d + "]" * d),
        st.integers(1, 6000).map(lambda d: '{"a":' * d + "1" + "}" * d),
        st.sampled_from(
            ["NaN", "-NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "[1, NaN]",
             '{"a": Infinity}', "9" * 5000, "0.1e99999", '"\\ud800"', "[[[[", "]]]]"]
        ),
    )  # fmt: skip


# ---- mapping programs for the property tests -----------------------------------------------------
# One rule of every kind over a random tensor block: streaming vs. in-memory reference.

FLOAT_ALIASES: dict[str, str] = {
    "F64": "f64",
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    "F8_E4M3": "fp8_e4m3",
    "F8_E5M2": "fp8_e5m2",
}
DTYPES_DRAWN: list[str] = [*FLOAT_ALIASES, "I8", "I16", "I32", "I64", "U8", "BOOL"]


@st.composite
def tensor(draw: st.DrawFn, shape: tuple[int, ...], code: str) -> torch.Tensor:
    """A tensor of the given ``shape`` and dtype ``code``, random bytes."""
    n = numel(shape) * DTYPES[code].itemsize
    if n == 0:
        return torch.zeros(shape, dtype=DTYPES[code].torch())
    raw = torch.frombuffer(bytearray(draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
    if code == "BOOL":
        raw = raw % 2
    return raw.view(DTYPES[code].torch()).reshape(shape).clone()


program_shapes: st.SearchStrategy[tuple[int, ...]] = st.lists(
    st.integers(1, 4), min_size=1, max_size=3
).map(tuple)


def _parts(draw: st.DrawFn, total: int) -> list[int]:
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=3))) if total > 1 else []
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


@st.composite
def block(draw: st.DrawFn, j: int) -> tuple[dict[str, torch.Tensor], str]:
    """Input tensors named b{j}.* and one rule that consumes them all."""
    code = draw(st.sampled_from(DTYPES_DRAWN))
    shape = draw(program_shapes)
    p = f"b{j}"
    op = draw(
        st.sampled_from(
            [
                "rename",
                "add",
                "dequant",
                "quantize",
                "split",
                "chunk",
                "chunk_into",
                "same",
                "merge",
                "stack",
                "unstack",
                "transpose",
                "permute",
                "reshape",
                "cast",
                "narrow",
                "packed",
            ]
        )
    )
    d = draw(st.integers(0, len(shape) - 1))
    if op == "packed":
        return _packed_block(draw, p, shape)
    if op == "rename":
        t = draw(tensor(shape, code))
        return {
            f"{p}.layers.0.w": t
        }, f'rename "{p}.layers.{{n:int}}.{{r*}}" -> "{p}.mid.{{n}}.{{r}}"'
    if op in ("add", "dequant", "quantize"):
        return _value_block(draw, p, shape, code)
    if op == "split":
        sizes = _parts(draw, shape[d])
        outs = ", ".join(f'"{p}.part{i}"' for i in range(len(sizes)))
        return (
            {f"{p}.fused": draw(tensor(shape, code))},
            f'split "{p}.fused" dim {d} sizes {sizes} -> {outs}',
        )
    if op == "chunk":
        k = draw(st.sampled_from([k for k in (1, 2, 3, 4) if shape[d] % k == 0]))
        outs = ", ".join(f'"{p}.c{i}"' for i in range(k))
        return {f"{p}.fused": draw(tensor(shape, code))}, f'chunk "{p}.fused" dim {d} -> {outs}'
    if op == "chunk_into":  # pieces named by their index, as a scatter into ranks names them
        k = draw(st.sampled_from([k for k in (1, 2, 3, 4) if shape[d] % k == 0]))
        return (
            {f"{p}.fused": draw(tensor(shape, code))},
            f'chunk "{p}.fused" dim {d} into {k} -> "{p}.r{{i}}"',
        )
    if op == "same":  # one tensor every member holds (a norm on every tensor-parallel rank)
        t = draw(tensor(shape, code))
        k = draw(st.integers(1, 3))
        inputs = {f"{p}.r.{i}.w": t.clone() for i in range(k)}
        return inputs, f'merge "{p}.r.{{i:int}}.w" same -> "{p}.w"'
    if op == "merge":
        widths = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(2, 3)))]
        inputs = {}
        for i, w in enumerate(widths):
            s = list(shape)
            s[d] = w
            inputs[f"{p}.in{i}"] = draw(tensor(tuple(s), code))
        names = ", ".join(f'"{n}"' for n in inputs)
        return inputs, f'merge {names} dim {d} -> "{p}.merged"'
    if op == "stack":
        k = draw(st.integers(1, 3))
        sd = draw(st.integers(0, len(shape)))
        inputs = {f"{p}.e.{i}.w": draw(tensor(shape, code)) for i in range(k)}
        return inputs, f'stack "{p}.e.{{i:int}}.w" over i dim {sd} -> "{p}.stacked"'
    if op == "unstack":
        return (
            {f"{p}.experts": draw(tensor(shape, code))},
            f'unstack "{p}.experts" dim {d} -> "{p}.e.{{k}}.w"',
        )
    if op == "transpose":
        s2 = shape[:2] if len(shape) >= 2 else (shape[0], 2)
        return {f"{p}.m": draw(tensor(s2, code))}, f'transpose "{p}.m" -> "{p}.mT"'
    if op == "permute":
        perm = list(draw(st.permutations(range(len(shape)))))
        return {f"{p}.x": draw(tensor(shape, code))}, f'permute "{p}.x" dims {perm} -> "{p}.y"'
    if op == "reshape":
        n = numel(shape)
        new = draw(st.sampled_from([[a, n // a] for a in range(1, n + 1) if n % a == 0] + [[n]]))
        return {f"{p}.x": draw(tensor(shape, code))}, f'reshape "{p}.x" to {new} -> "{p}.y"'
    if op == "narrow" and code != "BOOL":
        # A narrowing cast (a float to an integer, an integer to a narrower one) of values that
        # fit, whole numbers in [0, 100] as stored in the input's dtype: the compiler marks it,
        # every executor checks the values and writes them. (Values that do not fit: the
        # generated plan nodes of `cases`.)
        count = numel(shape)
        values = draw(st.lists(st.integers(0, 100), min_size=count, max_size=count))
        x = torch.tensor(values, dtype=torch.int64).reshape(shape).to(DTYPES[code].torch())
        narrower = [d for d in ("I8", "U8", "I16", "I32") if not int_cast_fits(code, d)]
        if narrower:
            target = draw(st.sampled_from(narrower)).lower()
            return {f"{p}.x": x}, f'cast "{p}.x" to {target} -> "{p}.y"'
    # cast: between floats, or integers to a wider type
    if code in FLOAT_ALIASES:
        target = FLOAT_ALIASES[draw(st.sampled_from(sorted(FLOAT_ALIASES)))]
    elif code == "BOOL":
        code, target = "U8", "i16"
    else:
        target = "i64"
    return {f"{p}.x": draw(tensor(shape, code))}, f'cast "{p}.x" to {target} -> "{p}.y"'


def _packed_block(
    draw: st.DrawFn, p: str, shape: tuple[int, ...]
) -> tuple[dict[str, torch.Tensor], str]:
    """The quantized formats' rules, chained as a dequantization chains them: codes unpacked
    from int32 words (in a drawn order, along a drawn dim, and packed back), cast to float,
    minus a gathered zero point, a table lookup, a matrix product."""
    d = draw(st.integers(0, len(shape) - 1))
    bits = draw(st.sampled_from([1, 2, 4, 8, 16]))
    per = 32 // bits
    order = list(draw(st.permutations(range(per))))
    words = draw(tensor(shape, "I32"))
    unpacked = (*shape[:d], shape[d] * per, *shape[d + 1 :])
    kind = draw(st.sampled_from(["pack", "gather", "lookup", "matmul", "reduce"]))
    inputs = {f"{p}.qweight": words}
    rules = [f'unpack "{p}.qweight" dim {d} bits {bits} order {order} -> "{p}.codes"']
    if kind == "pack":
        rules.append(f'pack "{p}.codes" dim {d} bits {bits} order {order} to i32 -> "{p}.back"')
        return inputs, "\n".join(rules)
    rules.append(f'cast "{p}.codes" to f32')
    if kind == "reduce":  # a group's scale as quantizers find it, then codes rounded into range
        groups = [g for g in range(1, unpacked[d] + 1) if unpacked[d] % g == 0]
        group = draw(st.sampled_from(groups))
        reduction = draw(st.sampled_from(["amax", "amin", "sum"]))
        rules.append(f'copy "{p}.codes" -> "{p}.c2"')
        rules.append(f'{reduction} "{p}.c2" dim {d} group {group} -> "{p}.stat"')
        rules.append(f'mul "{p}.codes" 0.37')
        rules.append(f'{draw(st.sampled_from(["round", "floor", "ceil"]))} "{p}.codes"')
        rules.append(f'clamp "{p}.codes" [-8, 7]')
        return inputs, "\n".join(rules)
    if kind == "gather":
        rows = unpacked[d]
        zeros = draw(tensor((*unpacked[:d], 3, *unpacked[d + 1 :]), "F32"))
        index = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=rows, max_size=rows)))
        inputs.update({f"{p}.zeros": zeros, f"{p}.g_idx": index})
        rules.append(f'gather "{p}.zeros", "{p}.g_idx" dim {d} -> "{p}.zg"')
        rules.append(f'sub "{p}.codes", "{p}.zg" -> "{p}.dq"')
    elif kind == "lookup":  # the codes as they are (U8 or U16): one table entry per code
        rules.pop()
        inputs[f"{p}.table"] = draw(tensor((1 << bits,), "BF16"))
        rules.append(f'lookup "{p}.codes", "{p}.table" -> "{p}.values"')
    else:
        flat = numel(unpacked)
        rules.append(f'reshape "{p}.codes" to [{flat // unpacked[-1]}, {unpacked[-1]}]')
        inputs[f"{p}.b"] = draw(tensor((unpacked[-1], draw(st.integers(1, 3))), "F16"))
        compute = draw(st.sampled_from(["", " in f64"]))
        rules.append(f'matmul "{p}.codes", "{p}.b"{compute} to bf16 -> "{p}.product"')
    return inputs, "\n".join(rules)


def _chain(draw: st.DrawFn, p: str) -> list[str]:
    """Up to three rules over whatever a block left under prefix ``p``: later rules read the
    outputs of earlier ones (composition), and ``copy`` fans a tensor out. Each step works
    whatever the shapes and dtypes (guarded by ``where``, optional where it may take nothing)."""
    rules = []
    for step in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["rename", "copy", "flatten", "transpose", "cast"]))
        q = f"{p}{kind[0]}{step}"
        if kind == "rename":
            rules.append(f'rename "{p}.{{x*}}" -> "{q}.{{x}}"')
            p = q
        elif kind == "copy":
            # The copies go under a new prefix; the originals go on under the old one.
            rules.append(f'copy "{p}.{{x*}}" -> "{q}.{{x}}"')
        elif kind == "flatten":
            rules.append(f'reshape "{p}.**" to [-1]')
        elif kind == "transpose":
            rules.append(f'transpose? "{p}.**" dims [0, -1] where len(shape) >= 2')
        else:
            target = draw(st.sampled_from(["f32", "bf16", "f16", "f64"]))
            rules.append(f'cast? "{p}.**" to {target} where dtype in [f16, bf16, f32, f64]')
    return rules


def _value_block(
    draw: st.DrawFn, p: str, shape: tuple[int, ...], code: str
) -> tuple[dict[str, torch.Tensor], str]:
    """add/mul by a constant, a block-scaled product (dequantization), or a quantization."""
    fcode = code if code in FLOAT_ALIASES else "BF16"
    x = draw(tensor(shape, fcode))
    kind = draw(st.sampled_from(["const", "dequant", "quantize"]))
    if kind == "const":
        op = draw(st.sampled_from(["add", "mul"]))
        compute = draw(st.sampled_from(["", " in bf16", " in f64"]))
        return {f"{p}.x": x}, f'{op} "{p}.x" 0.75{compute} -> "{p}.y"'
    if len(shape) < 2:
        shape = (*shape, 3)
        x = draw(tensor(shape, fcode))
    block = [draw(st.integers(1, 4)), draw(st.integers(1, 4))]
    if kind == "quantize":
        return (
            {f"{p}.l.weight": x},
            f'quantize "{p}.{{x*}}.weight" to fp8_e4m3 block {block} '
            f'-> "{p}.{{x}}.q", "{p}.{{x}}.q_scale_inv"',
        )
    grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    scale = draw(tensor(grid, "F32"))
    return (
        {f"{p}.l.weight": x, f"{p}.l.weight_scale_inv": scale},
        f'mul "{p}.{{x*}}.weight", "{p}.{{x*}}.weight_scale_inv" block {block} to bf16 '
        f'-> "{p}.{{x}}.dq"',
    )


@st.composite
def rule_programs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], str]:
    """A checkpoint's tensors and a program of one to three rule blocks over them, each block
    followed by a chain of rules over its outputs."""
    tensors: dict[str, torch.Tensor] = {}
    rules = ["weightmap 1"]
    for j in range(draw(st.integers(1, 3))):
        inputs, rule = draw(block(j))
        tensors.update(inputs)
        rules.append(rule)
        rules += _chain(draw, f"b{j}")
    return tensors, "\n".join(rules) + "\n"


# ---- writer checkpoints --------------------------------------------------------------------------
# Whole checkpoints (any names, every torch dtype, empty tensors) for the writer.

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: d.torch() for name, d in DTYPES.items() if d.torch_name and name != "F4"
}
writer_names: st.SearchStrategy[str] = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda s: s != "__metadata__")
writer_shapes: st.SearchStrategy[tuple[int, ...]] = st.lists(
    st.integers(0, 4), min_size=0, max_size=3
).map(tuple)


@st.composite
def checkpoints(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Up to six tensors with arbitrary names, any torch dtype, shapes up to rank 3."""
    keys = draw(st.lists(writer_names, min_size=0, max_size=6, unique=True))
    out = {}
    for k in keys:
        code = draw(st.sampled_from(sorted(TORCH_DTYPES)))
        shape = draw(writer_shapes)
        n = 1
        for d in shape:
            n *= d
        raw = draw(
            st.binary(min_size=n * DTYPES[code].itemsize, max_size=n * DTYPES[code].itemsize)
        )
        out[k] = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            .view(TORCH_DTYPES[code])
            .reshape(shape)
            if n
            else torch.zeros(shape, dtype=TORCH_DTYPES[code])
        )
    return out
