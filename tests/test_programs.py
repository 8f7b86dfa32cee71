"""Generated checkpoints and mapping programs: streaming output == in-memory reference, bit for bit.

Every rule kind of the language (rename, split, chunk, merge, stack, unstack, transpose,
permute, reshape, cast) is generated over random dtypes and shapes, compiled, then executed
both by the streaming executor (tiny chunks, several threads, small shards) and by the
reference on fully loaded tensors.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import weightmap
from weightmap.compiler.inverse import invert
from weightmap.execute.kernels import tensor_bytes
from weightmap.execute.memory import execute_in_memory
from weightmap.execute.streaming import execute
from weightmap.format.checkpoint import Checkpoint
from weightmap.format.dtypes import DTYPES, numel

FLOAT_ALIASES = {
    "F64": "f64",
    "F32": "f32",
    "F16": "f16",
    "BF16": "bf16",
    "F8_E4M3": "fp8_e4m3",
    "F8_E5M2": "fp8_e5m2",
}
DTYPES_DRAWN = [*FLOAT_ALIASES, "I8", "I16", "I32", "I64", "U8", "BOOL"]


@st.composite
def tensor(draw: st.DrawFn, shape: tuple[int, ...], code: str) -> torch.Tensor:
    n = numel(shape) * DTYPES[code].itemsize
    if n == 0:
        return torch.zeros(shape, dtype=DTYPES[code].torch())
    raw = torch.frombuffer(bytearray(draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
    if code == "BOOL":
        raw = raw % 2
    return raw.view(DTYPES[code].torch()).reshape(shape).clone()


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


def _parts(draw: st.DrawFn, total: int) -> list[int]:
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=3))) if total > 1 else []
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


@st.composite
def block(draw: st.DrawFn, j: int) -> tuple[dict[str, torch.Tensor], str]:
    """Input tensors named b{j}.* and one rule that consumes them all."""
    code = draw(st.sampled_from(DTYPES_DRAWN))
    shape = draw(shapes)
    p = f"b{j}"
    op = draw(
        st.sampled_from(
            [
                "rename",
                "split",
                "chunk",
                "merge",
                "stack",
                "unstack",
                "transpose",
                "permute",
                "reshape",
                "cast",
            ]
        )
    )
    d = draw(st.integers(0, len(shape) - 1))
    if op == "rename":
        t = draw(tensor(shape, code))
        return {
            f"{p}.layers.0.w": t
        }, f'rename "{p}.layers.{{n:int}}.{{r*}}" -> "{p}.mid.{{n}}.{{r}}"'
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
    # cast: between floats, or integers to a wider type
    if code in FLOAT_ALIASES:
        target = FLOAT_ALIASES[draw(st.sampled_from(sorted(FLOAT_ALIASES)))]
    elif code == "BOOL":
        code, target = "U8", "i16"
    else:
        target = "i64"
    return {f"{p}.x": draw(tensor(shape, code))}, f'cast "{p}.x" to {target} -> "{p}.y"'


@st.composite
def programs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], str]:
    tensors: dict[str, torch.Tensor] = {}
    rules = ["weightmap 1"]
    for j in range(draw(st.integers(1, 3))):
        inputs, rule = draw(block(j))
        tensors.update(inputs)
        rules.append(rule)
    return tensors, "\n".join(rules) + "\n"


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=programs(), chunk=st.sampled_from([3, 64, 1 << 20]), workers=st.sampled_from([1, 2]))
def test_program_streaming_equals_reference(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[dict[str, torch.Tensor], str],
    chunk: int,
    workers: int,
) -> None:
    tensors, program = case
    root = tmp_path_factory.mktemp("p")
    save_file(tensors, root / "model.safetensors")
    plan = weightmap.compile(root, mapping=program)
    expected = dict(execute_in_memory(plan, load_file(root / "model.safetensors")))
    with Checkpoint.open(root) as ckpt:
        execute(plan, ckpt, root / "out", chunk_bytes=chunk, workers=workers, max_shard_size="100B")
    with Checkpoint.open(root / "out") as out:
        assert sorted(out) == sorted(expected), program
        for name, ref in expected.items():
            loc = out.location(name)
            with loc.path.open("rb") as f:
                f.seek(loc.offset)
                assert f.read(loc.length) == tensor_bytes(ref), (program, name)


def test_example_preset_free_roundtrip(example: Path, tmp_path: Path) -> None:
    """A mapping and its inverse give back the original bytes."""
    rules = weightmap.load_mapping(
        'weightmap 1\nrename "layers.0.{rest*}" -> "midlayer.{rest}"\nunmatched keep\n'
    )
    weightmap.remap(example, tmp_path / "a", mapping=rules, progress=False)
    back = invert(rules)
    weightmap.remap(tmp_path / "a", tmp_path / "b", mapping=back, progress=False)
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (
        example / "model.safetensors"
    ).read_bytes()
