"""Generated programs over several inputs and outputs: the streaming executor (any chunk size,
one or two threads) writes the bytes the in-memory reference computes.

Each program reads a main checkpoint, a second one (``other``) and a family of rank files
(``ranks``), and may write a family of its own (``out``): merges over the rank along any dim,
replicas taken once (``same``), sums and products across inputs, a merged tensor cut into
the output family's members. Chunks of 3 bytes cut every piece of a join and every row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import weightmap

from valuetools import as_bytes

Tensors = dict[str, torch.Tensor]

_FLOATS = [torch.bfloat16, torch.float16, torch.float32]
_ANY = [*_FLOATS, torch.int8, torch.int32, torch.uint8]


def _tensor(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


@st.composite
def several_programs(draw: st.DrawFn) -> tuple[Tensors, Tensors, list[Tensors], str]:
    """The main input's tensors, ``other``'s, each rank's, and a program over them."""
    main: Tensors = {}
    other: Tensors = {}
    n = draw(st.integers(1, 4))
    ranks: list[Tensors] = [{} for _ in range(n)]
    rules = [
        "weightmap 1",
        "input other",
        'input ranks files "part.{rank}.safetensors"',
    ]
    family = draw(st.integers(1, 3))
    if draw(st.booleans()):
        rules.append(f'output out files "o.{{rank}}.safetensors" count {family}')
        outputs = True
    else:
        outputs = False
    for k in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["merge", "same", "add", "matmul"]))
        dtype = draw(st.sampled_from(_ANY if op in ("merge", "same") else _FLOATS))
        if op == "merge":
            rank = draw(st.integers(1, 3))
            # A first dim of 40 at times: a join along a later dim is then a piece of each rank
            # per row, more pieces than are copied as byte ranges (64), so it is computed.
            first = draw(st.sampled_from([1, 2, 5, 40]))
            shape = (first, *(draw(st.integers(1, 5)) for _ in range(rank - 1)))
            d = draw(st.integers(0, rank - 1))
            for r in range(n):
                ranks[r][f"m{k}"] = _tensor(draw, shape, dtype)
            rules.append(f'merge "ranks:{{r:int}}:m{k}" dim {d} -> "m{k}"')
            then = draw(st.sampled_from(["", "transpose", "cast"]))
            if then == "transpose" and rank == 2:  # (a joined region read column-wise)
                rules.append(f'transpose "m{k}"')
            elif then == "cast" and dtype.is_floating_point:
                rules.append(f'cast "m{k}" to f32')
            if outputs and draw(st.booleans()):
                # The joined tensor cut into the output family's members along dim e.
                joined = [s * (n if i == d else 1) for i, s in enumerate(shape)]
                if rules[-1] == f'transpose "m{k}"':
                    joined.reverse()
                e = draw(st.sampled_from([i for i, s in enumerate(joined) if s % family == 0]
                                         or [None]))  # fmt: skip
                if e is not None:
                    rules.append(f'chunk "m{k}" dim {e} into {family} -> "out:{{r}}:m{k}"')
        elif op == "same":
            shape = tuple(draw(st.integers(1, 5)) for _ in range(draw(st.integers(1, 2))))
            t = _tensor(draw, shape, dtype)
            for r in range(n):
                ranks[r][f"s{k}"] = t.clone()
            rules.append(f'merge "ranks:{{r:int}}:s{k}" same -> "s{k}"')
        elif op == "add":
            shape = tuple(draw(st.integers(1, 6)) for _ in range(draw(st.integers(1, 2))))
            main[f"a{k}"] = _tensor(draw, shape, dtype)
            other[f"a{k}"] = _tensor(draw, shape, dtype)
            rules.append(f'add "a{k}", "other:a{k}" in f32 -> "a{k}"')
        else:
            m, inner, cols = (draw(st.integers(1, 6)) for _ in range(3))
            main[f"x{k}"] = _tensor(draw, (m, inner), dtype)
            other[f"y{k}"] = _tensor(draw, (inner, cols), dtype)
            rules.append(f'matmul "x{k}", "other:y{k}" in f32 to f32 -> "p{k}"')
    if outputs:
        # Every member must get a tensor: a replicated one for all of them.
        main["everywhere"] = _tensor(draw, (3,), torch.float32)
        rules.append('rename "everywhere" -> "out:*:everywhere"')
    rules.append("unmatched keep")
    return main, other, ranks, "\n".join(rules) + "\n"


def _written(out: Path) -> Tensors:
    """Every tensor of an output folder under the names iter_tensors gives them: the main
    checkpoint's as they are, each member's behind ``out:RANK:``."""
    got: Tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        loaded = load_file(path)
        if path.name.startswith("o."):
            rank = int(path.name.split(".")[1])
            got.update({f"out:{rank}:{k}": v for k, v in loaded.items()})
        else:
            got.update(loaded)
    return got


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    case=several_programs(),
    chunk=st.sampled_from([3, 64, 1 << 20]),
    workers=st.sampled_from([1, 2]),
)
def test_several_inputs_streaming_equals_reference(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[Tensors, Tensors, list[Tensors], str],
    chunk: int,
    workers: int,
) -> None:
    main, other, ranks, program = case
    root = tmp_path_factory.mktemp("s")
    for folder, tensors in (("main", main), ("other", other)):
        (root / folder).mkdir()
        save_file(tensors, root / folder / "model.safetensors")
    (root / "ranks").mkdir()
    for r, tensors in enumerate(ranks):
        save_file(tensors, root / "ranks" / f"part.{r}.safetensors")
    inputs = {"other": root / "other", "ranks": root / "ranks"}
    expected = {
        k: v.clone()
        for k, v in weightmap.iter_tensors(root / "main", mapping=program, inputs=inputs)
    }
    weightmap.remap(
        root / "main",
        root / "out",
        mapping=program,
        inputs=inputs,
        chunk_bytes=chunk,
        workers=workers,
        max_shard_size="100B",
        progress=False,
    )
    got = _written(root / "out")
    assert sorted(got) == sorted(expected), program
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, (program, name)
        assert torch.equal(as_bytes(got[name]), as_bytes(ref)), (program, name)
