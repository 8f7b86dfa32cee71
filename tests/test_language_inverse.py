"""Inversion: compiling the inverse on a plan's outputs gives back the original tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightmap
from weightmap.compiler.compile import compile_plan
from weightmap.compiler.inverse import invert, round_trip_problems
from weightmap.errors import MappingError
from weightmap.format.dtypes import TensorSpec as T
from weightmap.language.mapping import load_mapping

HEADERS = [
    T("layers.0.a.weight", "BF16", (4, 4)),
    T("layers.1.a.weight", "BF16", (4, 4)),
    T("layers.2.a.weight", "BF16", (4, 4)),
    T("fc.weight", "BF16", (4, 12)),
    T("qkv.0", "F32", (16, 4)),
    T("mlp.0.gate", "F32", (8, 4)),
    T("mlp.0.up", "F32", (8, 4)),
    T("e.0.0.w", "F32", (2, 3)),
    T("e.0.1.w", "F32", (2, 3)),
    T("u", "F32", (3, 5)),
    T("t", "F32", (3, 5)),
    T("c.x", "BF16", (3,)),
    T("i.x", "I32", (3,)),
    T("r", "F32", (2, 3, 4)),
    T("p", "F32", (2, 3, 4)),
    T("pair", "F16", (4, 6)),
]

FORWARD = """weightmap 1
rename "layers.0.{rest*}" -> "midlayer.{rest}"
rename "layers.{n:int}.{rest*}" -> "additional_layers.{n - 1}.{rest}" where n >= 1
keep "fc.weight"
split "qkv.{i}" dim 0 sizes [config.h * 2, config.h, config.h] -> "q.{i}", "k.{i}", "v.{i}"
merge "mlp.{i}.{gate,up}" dim 0 sizes [8, 8] -> "mlp.{i}.gate_up"
stack "e.{i}.{e:int}.w" over e -> "e.{i}.w"
unstack "u" dim 0 -> "u.{k}"
transpose "t" -> "t.T"
cast "c.*" from bf16 to f32
cast "i.*" from i32 to i64
reshape "r" from [2, 3, 4] to [6, 4]
permute "p" dims [2, 0, 1]
chunk "pair" dim 1 -> "pair.a", "pair.b"
config { move a -> b }
"""


def _key(specs: object) -> list[tuple[str, str, tuple[int, ...]]]:
    return sorted((s.name, s.dtype, s.shape) for s in specs)  # type: ignore[attr-defined]


def test_round_trip_reproduces_names_shapes_dtypes_and_config() -> None:
    forward = load_mapping(FORWARD, name="fwd.wm")
    plan = compile_plan(forward, HEADERS, {"h": 4, "a": 1})
    inverse = invert(forward)
    back = compile_plan(inverse, plan.output_specs(), plan.config)
    assert _key(back.output_specs()) == _key(HEADERS)
    assert back.config == {"h": 4, "a": 1}


def test_inverse_text_is_a_valid_program() -> None:
    inverse = invert(load_mapping(FORWARD))
    again = load_mapping(inverse.text)
    assert again.program.stmts == inverse.program.stmts
    assert 'rename "additional_layers.{n:int}.{rest*}" -> "layers.{n + 1}.{rest}"' in inverse.text
    assert "where n + 1 >= 1" in inverse.text


def test_double_inverse_of_lossless_mapping() -> None:
    text = 'weightmap 1\nrename "a.{x}" -> "b.{x}"\ntranspose "t" -> "u"\n'
    m = load_mapping(text)
    assert invert(invert(m)).program.stmts == m.program.stmts


@pytest.mark.parametrize(
    ("rule", "reason"),
    [
        ('drop "a"', "dropped tensors cannot be brought back"),
        ('cast "a" to bf16', "cast needs `from <dtype>`"),
        ('cast "a" from f32 to bf16', "loses precision"),
        ('cast "a" from f16 to bf16', "loses precision"),
        ('rename "*.w" -> "x"', "unnamed glob"),
        ('rename "a.{x}.{y}" -> "b.{x}"', "drops {y}"),
        ('merge "m.{gate,up}" dim 0 -> "m"', "needs `sizes"),
        ('reshape "r" to [2, -1]', "needs `from"),
        ('rename "a" -> "b" where dtype == f32', "reads the tensor's dtype"),
        ("unmatched drop", "loses tensors"),
        ("config { x = 1 }", "other than `move`"),
    ],
)
def test_refusals_name_the_reason(rule: str, reason: str) -> None:
    m = load_mapping(f"weightmap 1\n{rule}\n", name="r.wm")
    with pytest.raises(MappingError, match=r"r\.wm:2:1: cannot invert") as info:
        invert(m)
    assert reason in str(info.value)


def test_unstack_without_index_name_is_refused_not_crashed() -> None:
    # Found by the grammar-generated property test.
    with pytest.raises(MappingError, match="exactly one index name"):
        invert(load_mapping('weightmap 1\nunstack "a.weight" -> "a.weight"\n'))


@pytest.mark.parametrize(
    "text",
    [
        'rename "tok.{f}" -> "{f}"\nunmatched keep\n',
        'rename "tok.{f}" -> "{f}"\nkeep "b"\n',
        'if true {\n  rename "tok.{f}" -> "{f}"\n}\nunmatched keep\n',
        'unmatched keep\nfiles {\n  rename "tokenizer/{f}" -> "{f}"\n}\n',
    ],
)
def test_an_output_of_holes_alone_beside_other_outputs_is_refused(text: str) -> None:
    # Read back, "{f}" would take every other output too: `b` would come back as `tok.b`.
    with pytest.raises(MappingError, match="is all holes"):
        invert(load_mapping(f"weightmap 1\n{text}", name="r.wm"))


def test_an_output_of_holes_alone_inverts_where_it_is_the_only_rule() -> None:
    forward = load_mapping('weightmap 1\nrename "model.{rest*}" -> "{rest}"\n', name="f.wm")
    inputs = [T("model.a.w", "F32", (2,)), T("model.b", "F32", (3,))]
    plan = compile_plan(forward, inputs, None)
    back = compile_plan(invert(forward), plan.output_specs(), plan.config)
    assert _key(back.output_specs()) == _key(inputs)


@pytest.mark.parametrize(
    "text",
    [
        # A rule without outputs keeps its names: nothing to read back with a pattern.
        'cast "{x*}" from bf16 to f32\nrename "a.{y}" -> "b.{y}"\n',
        # Only one branch runs: the other branch's rule puts nothing beside this one.
        'param layout = "a"\nif layout == "a" {\n  rename "a.{x}" -> "{x}"\n} else {\n'
        '  rename "b.{x}" -> "{x}"\n}\n',
    ],
)
def test_holes_alone_are_refused_only_beside_other_outputs(text: str) -> None:
    invert(load_mapping(f"weightmap 1\n{text}", name="r.wm"))


def test_a_copy_whose_output_is_holes_alone_is_refused() -> None:
    # The copy's source reaches the output beside the copies: `drop "{f*}"` dropped them all.
    with pytest.raises(MappingError, match="is all holes"):
        invert(load_mapping('weightmap 1\ncopy "a.{f*}" -> "{f}"\n', name="c.wm"))


@pytest.mark.parametrize(
    ("text", "difference"),
    [
        # Tensors that were f32 before match the inverse cast too, and come back bf16.
        ('cast "**" from bf16 to f32\nunmatched keep\n', "norm: F32[4] comes back as BF16[4]"),
        # Two captures joined by a separator that also occurs inside a capture.
        (
            'rename "layers.{n}.{m}.weight" -> "blk_{n}_{m}.weight"\nunmatched keep\n',
            "layers.0.q_proj.weight: not given back",
        ),
        # The parent object the move made stays behind.
        ("unmatched keep\nconfig { move a -> n.b }\n", "config.json + n: {}"),
    ],
)
def test_checking_an_inverse_against_a_checkpoint_names_what_does_not_come_back(
    tmp_path: Path, text: str, difference: str
) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    tensors = {
        "norm": torch.ones(4),
        "w": torch.ones(4, dtype=torch.bfloat16),
        "layers.0.q_proj.weight": torch.ones(2),
    }
    save_file(tensors, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"a": 1, "c": 2}))
    forward = load_mapping(f"weightmap 1\n{text}", name="f.wm")
    invert(forward)  # the mapping alone inverts
    with pytest.raises(MappingError, match="does not give back this checkpoint") as info:
        weightmap.invert(forward, check=ckpt)
    assert difference in [line.strip() for line in str(info.value).splitlines()]


def test_checking_an_inverse_that_gives_everything_back() -> None:
    forward = load_mapping(FORWARD, name="fwd.wm")
    plan = compile_plan(forward, HEADERS, {"h": 4, "a": 1})
    assert round_trip_problems(plan, invert(forward)) == []
    assert weightmap.invert(forward, check=plan).text == invert(forward).text


@pytest.mark.parametrize(
    ("text", "inputs"),
    [
        # The inverse of a stack or merge dropped its where, and took the groups it had left
        # alone: l.b.w was unstacked into l.b.e.0..1, x.b.qk split.
        (
            'stack "l.{g}.e.{i:int}" over i -> "l.{g}.w" where g == "a"\nunmatched keep\n',
            [T("l.a.e.0", "F32", (2,)), T("l.a.e.1", "F32", (2,)), T("l.b.w", "F32", (2, 2))],
        ),
        (
            'merge "x.{g}.{p:q,k}" dim 0 sizes [2, 2] -> "x.{g}.qk" where g == "a"\n'
            "unmatched keep\n",
            [T("x.a.q", "F32", (2,)), T("x.a.k", "F32", (2,)), T("x.b.qk", "F32", (4,))],
        ),
        # A copy's where read the capture unshifted: b.2 (from a.1) survived the round trip.
        (
            'copy "a.{n:int}" -> "b.{n + 1}" where n < 2\nunmatched keep\n',
            [T("a.0", "F32", (2,)), T("a.1", "F32", (2,)), T("a.2", "F32", (2,))],
        ),
    ],
)
def test_a_where_on_a_group_or_copy_is_carried_to_the_inverse(text: str, inputs: list[T]) -> None:
    forward = load_mapping(f"weightmap 1\n{text}", name="w.wm")
    plan = compile_plan(forward, inputs, None)
    assert round_trip_problems(plan, invert(forward)) == []


def test_a_where_on_a_member_capture_is_refused() -> None:
    text = 'stack "l.{g}.e.{i:int}" over i -> "l.{g}.w" where i < 3\nunmatched keep\n'
    with pytest.raises(MappingError, match="reads a member's capture"):
        invert(load_mapping(f"weightmap 1\n{text}", name="w.wm"))


@pytest.mark.parametrize("dims", ["3", '"ab"', "[-1, 0, 1]", "[0, 0]"])
def test_permute_dims_that_are_no_permutation_are_refused_not_crashed(dims: str) -> None:
    # dims 3 raised a raw TypeError; [-1, 0, 1] "2 is not in list".
    with pytest.raises(MappingError, match=r"must list 0\.\.n-1 once each"):
        invert(load_mapping(f'weightmap 1\npermute "x" dims {dims}\n', name="p.wm"))


def test_invert_takes_rule_text_as_every_entry_point_does() -> None:
    text = weightmap.invert('weightmap 1\nrename "a.{x}" -> "b.{x}"\n').text
    assert text.strip().splitlines()[-1] == 'rename "b.{x}" -> "a.{x}"'
    with pytest.raises(MappingError, match="cannot invert this config block"):
        weightmap.invert('weightmap 1\nconfig { x = 1 }\nkeep "x"\n')


def test_a_config_value_swap_inverts_and_other_sets_are_refused() -> None:
    """``if config.f == OLD { f = NEW }`` (what the stale-dtype warning advises) says what the
    field held, so its inverse swaps back; a plain set, an ``else``, or a value computed from
    the config does not, and is refused naming why."""
    swap = 'config { if config.quant.dtype == "bfloat16" { quant.dtype = "float32" } }'
    back = invert(load_mapping(f"weightmap 1\n{swap}\nunmatched keep\n"))
    assert 'if config.quant.dtype == "float32"' in back.text
    assert 'quant.dtype = "bfloat16"' in back.text
    before = {"quant": {"dtype": "bfloat16"}, "other": 1}
    forward = compile_plan(load_mapping(f"weightmap 1\n{swap}\nunmatched keep\n"), [], before)
    assert forward.config == {"quant": {"dtype": "float32"}, "other": 1}
    assert compile_plan(back, [], forward.config).config == before
    for edit in (
        'dtype = "float32"',
        'if config.dtype == "bfloat16" { dtype = "float32" } else { dtype = "f" }',
        'if config.dtype == "bfloat16" { dtype = config.other }',
        'if config.dtype == "bfloat16" { other = "float32" }',
    ):
        with pytest.raises(MappingError, match="cannot know what a field held before"):
            invert(load_mapping(f"weightmap 1\nconfig {{ {edit} }}\nunmatched keep\n"))
