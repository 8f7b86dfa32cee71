"""Generated checkpoints and mapping programs: streaming output == in-memory reference, bit for bit.

Every rule kind of the language (rename, split, chunk, merge, stack, unstack, transpose,
permute, reshape, cast) is generated over random dtypes and shapes, compiled, then executed
both by the streaming executor (tiny chunks, several threads, small shards) and by the
reference on fully loaded tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import weightmap
from strategies import rule_programs
from weightmap.compiler.inverse import invert
from weightmap.execute.kernels import tensor_bytes
from weightmap.execute.memory import execute_in_memory
from weightmap.execute.streaming import execute
from weightmap.format.layout import Layouts
from weightmap.inputs.checkpoint import Checkpoint


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=rule_programs(), chunk=st.sampled_from([3, 64, 1 << 20]), workers=st.sampled_from([1, 2])
)
def test_program_streaming_equals_reference(
    tmp_path_factory: pytest.TempPathFactory,
    layout: Layouts,
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
        execute(
            plan,
            ckpt,
            root / "out",
            chunk_bytes=chunk,
            workers=workers,
            max_shard_size="100B",
            layout=layout,
        )
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
