"""Focused checks of the language: semantics the golden files do not pin down one by one."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightmap.compiler.compile import compile_plan
from weightmap.errors import MappingError, MappingSyntaxError
from weightmap.format.dtypes import TensorSpec as T
from weightmap.language import mapping as _mapping
from weightmap.language import resources
from weightmap.language.mapping import load_mapping, load_preset, preset_names
from weightmap.plan.nodes import Cast, Source
from weightmap.plan.plan import Plan

W = [T("a.weight", "F32", (4, 4)), T("b.weight", "F32", (4, 2))]


def compile_text(text: str, inputs: list[T] = W, config: object = None, **params: object) -> Plan:
    return compile_plan(
        load_mapping("weightmap 1\n" + text, name="t.wm"), inputs, config, params=params
    )  # type: ignore[arg-type]


def test_first_matching_rule_wins_and_where_falls_through() -> None:
    plan = compile_text(
        'rename? "a.{x}" -> "first.{x}" where false\nrename "{y}.{x}" -> "second.{y}"\n'
    )
    assert [o.name for o in plan.outputs] == ["second.a", "second.b"]
    assert plan.is_rename_only


def test_optional_rule_may_match_nothing() -> None:
    plan = compile_text('keep? "missing"\nkeep "**"\n')
    assert len(plan.outputs) == 2


def test_params_override_and_type_check() -> None:
    text = 'param p = "x"\nrename "a.weight" -> "{p}.a"\nkeep "b.weight"\n'
    assert compile_text(text, p="y").outputs[0].name == "y.a"
    with pytest.raises(MappingError, match="param 'p' takes a string like its default \"x\""):
        compile_text(text, p=3)
    # In JSON's words: "got None" said nothing to whoever typed --set p=null.
    with pytest.raises(MappingError, match=r"got null \(with --set the value is read"):
        compile_text(text, p=None)
    counted = 'param n = 3\nrename "a.weight" -> "{n}.a"\nkeep "b.weight"\n'
    with pytest.raises(MappingError, match="param 'n' takes an int like its default 3"):
        compile_text(counted, n="x")


def test_a_refused_param_is_not_checked_again_through_its_default() -> None:
    """A require that reads the param would be evaluated with the default in its place: an
    error about a value the caller never gave (`multiple_of=256`, where they set "abc")."""
    text = (
        "param m = 256\n"
        'require config.size % m == 0 else "size {config.size} is not a multiple of {m}"\n'
        'require config.size > 0 else "size {config.size} is not positive"\n'
        'keep "**"\n'
    )
    with pytest.raises(MappingError) as caught:
        compile_text(text, config={"size": -96}, m="abc")
    problems = [p.message for p in caught.value.problems]  # type: ignore[attr-defined]
    assert len(problems) == 2
    assert problems[0].startswith("param 'm' takes an int like its default 256")
    assert problems[1] == "requirement failed: size -96 is not positive"  # (reads no m)


def test_param_conditional_blocks() -> None:
    text = (
        "param fuse = false\n"
        'if fuse { merge "{x}.weight", "b.weight" dim 1 -> "ab" } else { keep "**" }\n'
    )
    assert len(compile_text(text).outputs) == 2


def test_cast_same_dtype_is_a_no_op_and_aliases_work() -> None:
    plan = compile_text('cast "a.weight" to float32\ncast "b.weight" to bf16\n')
    assert isinstance(plan.output("a.weight").node, Source)
    node = plan.output("b.weight").node
    assert isinstance(node, Cast) and node.dtype == "BF16"
    assert not plan.is_rename_only


def test_narrowing_int_cast_is_marked_for_the_executor() -> None:
    plan = compile_text('cast "i" to i32\n', [T("i", "I64", (2,))])
    node = plan.output("i").node
    assert isinstance(node, Cast) and node.narrowing


def test_strict_expressions() -> None:
    with pytest.raises(MappingError, match="not true or false"):
        compile_text('require config.n else "x"\nkeep "**"\n', config={"n": 1})
    with pytest.raises(MappingError, match="cannot compare"):
        compile_text('require config.n < "a" else "x"\nkeep "**"\n', config={"n": 1})
    plan = compile_text('require 1 != true else "x"\nkeep "**"\n', config={})
    assert plan.outputs


def test_plus_joins_objects_the_right_ones_keys_winning() -> None:
    text = (
        "param scaled = false\n"
        'config { p = {"a": 1, "b": 2} + ({"b": 3, "c": 4} if scaled else {}) }\n'
        'keep "**"\n'
    )
    assert compile_text(text, config={}).config == {"p": {"a": 1, "b": 2}}
    assert compile_text(text, config={}, scaled=True).config == {"p": {"a": 1, "b": 3, "c": 4}}
    with pytest.raises(MappingError, match=r"cannot apply \+ to"):
        compile_text('config { p = {"a": 1} + [1] }\nkeep "**"\n', config={})


def test_a_failed_rule_is_the_one_error_not_each_rule_after_it() -> None:
    """What a failed rule did not make, the rules after it find missing: each of those said
    "matches no input tensor" or "group ... is incomplete" for the one cause."""
    text = (
        'rename "b.weight" -> "a.s"\n'
        'reshape "a.weight" to [3, 5] -> "a.r"\n'  # 16 elements: fails
        'transpose "{x}.r" -> "{x}.t"\n'
        'merge "{x}.t", "{x}.s" dim 0 -> "{x}.ts"\n'
        'keep "{x}.ts"\n'
    )
    with pytest.raises(MappingError) as caught:
        compile_text(text)
    problems = [p.message for p in caught.value.problems]  # type: ignore[attr-defined]
    assert problems == ["cannot reshape `a.weight` [4, 4] (16 elements) to [3, 5]"]
    # Requires: one that fails, and one that cannot be evaluated for the same cause.
    checks = (
        'require has(config.q) else "no q"\n'
        'require config.q.bits == 4 else "not 4 bits"\n'
        'keep "**"\n'
    )
    with pytest.raises(MappingError) as caught:
        compile_text(checks, config={})
    problems = [p.message for p in caught.value.problems]  # type: ignore[attr-defined]
    assert problems == ["requirement failed: no q"]


def test_a_group_that_failed_is_not_missing_again_but_other_groups_are() -> None:
    """Group i=1 fails at the first merge; the second merge goes through for i=0 and says
    nothing of i=1 (its member is missing for the cause already said), but still says that
    group i=2 lacks its own member, a cause of its own."""
    inputs = [T(f"l.{i}.{p}", "F32", (4, 4)) for i in range(3) for p in ("q", "k", "v")]
    inputs = [t for t in inputs if t.name not in ("l.1.k", "l.2.v")]
    inputs += [T("l.1.k", "F32", (2, 4))]
    text = (
        'merge "l.{i}.q", "l.{i}.k" dim 1 -> "l.{i}.qk"\n'
        'transpose "l.{i}.qk" -> "l.{i}.t"\n'
        'merge "l.{i}.t", "l.{i}.v" dim 0 -> "l.{i}.out"\n'
    )
    with pytest.raises(MappingError) as caught:
        compile_text(text, inputs)
    problems = [p.message for p in caught.value.problems]  # type: ignore[attr-defined]
    assert len(problems) == 2, problems
    assert problems[0].startswith('group i="1": ')
    assert problems[1] == 'group i="2" is incomplete: missing `l.{i}.v` (pattern 2)'


def test_warnings_go_to_the_plan_not_to_python() -> None:
    plan = compile_text(
        'warn if exists "a.*" "found {len(config.xs)} xs"\nkeep "**"\n', config={"xs": [1]}
    )
    assert plan.warnings == ("t.wm:2:1: found 1 xs",)


def test_json_round_trip_and_explain() -> None:
    plan = compile_text(
        'transpose "a.weight"\ncast "b.weight" to f16 -> "b.half"\nconfig { x = 1 }\n', config={}
    )
    assert Plan.from_json(plan.to_json()) == plan
    text = plan.explain()
    assert "a.weight F32[4, 4]" in text and "permute [1, 0]" in text
    assert "cast F32->F16" in text and "+ x = 1" in text
    assert plan.config == {"x": 1} and plan.input_config == {}
    c = plan.config
    assert c is not None
    c["y"] = 2
    assert plan.config == {"x": 1}  # a fresh dict each time


def test_errors_are_collected_with_locations() -> None:
    with pytest.raises(MappingError) as info:
        compile_text('keep "nope"\nsplit "a.weight" dim 0 sizes [1] -> "x"\nkeep "b.weight"\n')
    problems = info.value.problems  # type: ignore[attr-defined]
    assert [str(p.loc) for p in problems] == ["t.wm:2:6", "t.wm:3:1"]


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "weightmap",
        "weightmap 1 rename",
        'weightmap 1\nkeep "a" ->',
        "weightmap 1\n\x00",
        "weightmap 1 }",
    ],
)
def test_syntax_errors_never_leak_lark_exceptions(junk: str) -> None:
    with pytest.raises(MappingSyntaxError):
        load_mapping(junk)


def test_include_and_cycle(tmp_path: Path) -> None:
    (tmp_path / "base.wm").write_text('weightmap 1\nparam p = 1\nkeep "**"\n')
    (tmp_path / "top.wm").write_text('weightmap 1\ninclude "base.wm"\n')
    m = load_mapping(tmp_path / "top.wm")
    assert m.param_defaults == {"p": 1}
    assert len(compile_plan(m, W).outputs) == 2
    (tmp_path / "loop.wm").write_text('weightmap 1\ninclude "loop.wm"\n')
    with pytest.raises(MappingError, match="include cycle"):
        load_mapping(tmp_path / "loop.wm")


def test_presets_from_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tiny.wm").write_text('weightmap 1\nkeep "**"\n')
    monkeypatch.setattr(_mapping, "data_dir", lambda folder: tmp_path)
    monkeypatch.setattr(resources, "data_dir", lambda folder: tmp_path)  # (preset_names')
    assert preset_names() == ["tiny"]
    assert load_preset("tiny").name == "tiny"
    with pytest.raises(MappingError, match="no preset named 'nope'"):
        load_preset("nope")
    with pytest.raises(MappingError, match="bad preset name"):
        load_preset("../x")


def test_output_names_from_captures_cannot_escape_validation() -> None:
    with pytest.raises(MappingError, match="is empty"):
        compile_text('rename "{x}.weight" -> "{x}" where x == "zz"\nrename "{x}.weight" -> ""\n')


def test_rename_names_from_captures_params_and_braces() -> None:
    # The rename loop renders "every hole a bare name" templates straight from the captures;
    # a hole that is no capture (a param) goes through the scope, and a capture of the same
    # name as a param wins, as everywhere else.
    inputs = [T("l.3.w", "F32", (2,)), T("l.10.b", "F32", (2,))]
    text = 'param p = "P"\nparam i = 99\nrename "l.{i:int}.{x}" -> "{{{p}}}.{i}.{x}"\n'
    plan = compile_text(text, inputs)
    assert [o.name for o in plan.outputs] == ["{P}.3.w", "{P}.10.b"]
    plan = compile_text(text, inputs, p="Q")
    assert [o.name for o in plan.outputs] == ["{Q}.3.w", "{Q}.10.b"]
    # An expression hole takes the general path and renders the same way.
    plan = compile_text('rename "l.{i:int}.{x}" -> "{i + 1}.{x}"\n', inputs)
    assert [o.name for o in plan.outputs] == ["4.w", "11.b"]
    assert all(
        o.node == Source(dtype="F32", shape=(2,), name=n.name)
        for o, n in zip(plan.outputs, inputs, strict=True)
    )


@pytest.mark.parametrize(
    ("pattern", "template", "expected"),
    [
        ('"l.3.w"', '"x"', "x"),
        ('"l.{i:int}.w"', '"{i}"', "3"),
        ('"l.{i:int}.{x}"', '"{x}.{i}"', "w.3"),
        ('"{a}.{i:int}.{x}"', '"{x}.{i}.{a}"', "w.3.l"),
        ('"{a}.{i:int}.{x}"', '"{i * 2}"', "6"),
    ],
)
def test_captures_of_every_count_reach_the_name(pattern: str, template: str, expected: str) -> None:
    # Routing reads none, one and two captures without a loop and more with one: each way
    # gives the same names and types ({i:int} is an int: `i * 2` is 6).
    plan = compile_text(f"rename {pattern} -> {template}\n", [T("l.3.w", "F32", (2,))])
    assert [o.name for o in plan.outputs] == [expected]


@pytest.mark.parametrize(
    "bad", ["", "__metadata__", "a\nb", "a\x7f", "x" * 1025, "a\ud800", "é\x01", "\x00"]
)
@pytest.mark.parametrize("company", [[], ["ok"], ["ok.é"], ["a"] * 50])
def test_every_unwritable_output_name_is_reported_in_any_company(
    bad: str, company: list[str]
) -> None:
    """check_names looks at all the names at once first (ASCII or not): a bad name among good
    ones is still found and named, and names that are good pass."""
    from weightmap.compiler.names import check_names
    from weightmap.language.ast import Loc
    from weightmap.plan.plan import OutputTensor

    def outputs(names: list[str]) -> list[OutputTensor]:
        return [OutputTensor.of(T(n, "F32", (1,)), Source.of(n, "F32", (1,)), Loc("m", 1, 1))
                for n in names]  # fmt: skip

    said: list[str] = []
    check_names(outputs([*company, bad]), lambda _loc, message: said.append(message))
    assert len(said) == 1 and repr(bad[:80]) in said[0]
    check_names(outputs([*company, "é.ü", "a b", "x" * 1024]), lambda *_: said.append("!"))
    assert len(said) == 1


@pytest.mark.parametrize(
    "names",
    [
        ["a." + "1" * 5000],  # int() refuses a string of over 4300 digits
        ["a.\u00b2", "a.3"],  # "²" is a digit to str.isdigit(), not to int()
        ["a." + "7" * 1025, "a.08"],
    ],
)
def test_odd_digit_names_are_reported_not_crashed_on(names: list[str]) -> None:
    """Input names are the checkpoint's: an all-digit segment no integer capture takes (too
    long, not ASCII, not canonical) is an unmatched name like any other, listed as text."""
    specs = [T(n, "F32", (1,)) for n in names]
    kept = load_mapping('weightmap 1\nkeep? "a.{n:int}"\nunmatched keep\n')
    if all(len(n) <= 1024 for n in names):
        with pytest.raises(MappingError, match="match no rule"):
            compile_plan(load_mapping('weightmap 1\nkeep "a.{n:int}"\n'), specs)
        assert [o.name for o in compile_plan(kept, specs).outputs] == names
    else:  # (no pattern is matched against a name no output may have)
        with pytest.raises(MappingError, match=r"input tensor name\(s\) longer than 1,024"):
            compile_plan(kept, specs)


def test_an_integer_capture_takes_up_to_1024_digits() -> None:
    # (A name of 1,024 digits: the longest input name a pattern is matched against.)
    m = load_mapping('weightmap 1\nrename "{n:int}" -> "{n}"\n')
    assert compile_plan(m, [T("9" * 1024, "F32", (1,))]).outputs[0].name == "9" * 1024


@pytest.mark.parametrize("op", ["add", "mul"])
def test_several_tensors_added_or_multiplied_need_an_output_name(op: str) -> None:
    with pytest.raises(MappingSyntaxError) as info:
        load_mapping(f'weightmap 1\n{op} "a.weight", "b.weight"\n', name="t.wm")
    assert f"`{op}` of 2 tensors needs an output name" in str(info.value)
    assert f'{op} "a.weight", "b.weight" -> "name"' in str(info.value)


def test_incomplete_groups_are_said_once_with_their_keys() -> None:
    inputs = [T(f"l.{i}.q", "F32", (2,)) for i in range(3)] + [T("l.0.k", "F32", (2,))]
    with pytest.raises(MappingError) as info:
        compile_text('merge "l.{i}.q", "l.{i}.k" dim 0 -> "l.{i}.qk"\n', inputs)
    assert 'group i={"1","2"} is incomplete: missing `l.{i}.k` (pattern 2) (2 groups)' in str(
        info.value
    )


@pytest.mark.parametrize("sizes", ["[0, 4]", "[-1, 5]"])
def test_split_sizes_must_be_positive(sizes: str) -> None:
    with pytest.raises(MappingError) as info:
        compile_text(f'split "a.weight" dim 0 sizes {sizes} -> "x", "y"\nkeep "b.weight"\n')
    assert f"split sizes {sizes} must all be positive" in str(info.value)
    assert "do not add up" not in str(info.value)


def test_several_patterns_output_must_use_every_capture_even_with_one_group() -> None:
    inputs = [T("l.0.q", "F32", (2,)), T("l.0.k", "F32", (2,))]
    with pytest.raises(MappingError) as info:
        compile_text('merge "l.{i}.q", "l.{i}.k" dim 0 -> "qk"\n', inputs)
    assert "the output leaves out {i}: with several patterns every capture" in str(info.value)
    plan = compile_text('merge "l.{i}.q", "l.{i}.k" dim 0 -> "l.{i}.qk"\n', inputs)
    assert [o.name for o in plan.outputs] == ["l.0.qk"]


@pytest.mark.parametrize(
    ("char", "hint"),
    [
        ("\u00a0", "U+00A0 (no-break space) looks like a space"),
        ("\u200b", "U+200B (zero width space)"),
        ("\x00", "U+0000 (a control character)"),
        ("\u2028", "retype it as a line break"),
    ],
)
def test_invisible_characters_are_named_in_the_hint(char: str, hint: str) -> None:
    # The line shown looks right: the hint is all that tells what is wrong with it.
    with pytest.raises(MappingSyntaxError) as info:
        load_mapping(f'weightmap 1\nkeep{char} "a.weight"\n', name="t.wm")
    assert hint in str(info.value) and "did you mean" not in str(info.value)


def test_a_byte_order_mark_before_the_version_line_is_read_past(tmp_path: Path) -> None:
    # Some editors start every UTF-8 file they save with one.
    path = tmp_path / "bom.wm"
    path.write_bytes(b'\xef\xbb\xbfweightmap 1\nkeep "**"\n')
    (tmp_path / "outer.wm").write_bytes(b'\xef\xbb\xbfweightmap 1\ninclude "bom.wm"\n')
    for name in ("bom.wm", "outer.wm"):
        plan = compile_plan(load_mapping(str(tmp_path / name)), W, None)
        assert [o.name for o in plan.outputs] == ["a.weight", "b.weight"]


def test_a_capture_named_like_a_param_counts_as_used_in_a_merge_output() -> None:
    inputs = [T("l.0.q", "F32", (2,)), T("l.0.k", "F32", (2,))]
    plan = compile_text('param i = 7\nmerge "l.{i}.q", "l.{i}.k" dim 0 -> "l.{i}.qk"\n', inputs)
    assert [o.name for o in plan.outputs] == ["l.0.qk"]


def test_moving_a_field_into_itself_is_refused_not_lost() -> None:
    # `move a -> a.b` popped `a` off the config into its own child: the field vanished.
    for dst in ("a.b", "a.b.c"):
        with pytest.raises(MappingError, match=rf"cannot move `a` into itself \(`{dst}`\)"):
            compile_text(f'keep "**"\nconfig {{ move a -> {dst} }}\n', config={"a": {"x": 1}})
    plan = compile_text('keep "**"\nconfig { move a -> b.a }\n', config={"a": {"x": 1}})
    assert plan.config == {"b": {"a": {"x": 1}}}


def test_copying_the_config_into_itself_counts_against_the_work_limit() -> None:
    # Each `xN = config` doubled the config without a charge: 35 lines, 2**35 values.
    lines = " ".join(f"x{i} = config" for i in range(35))
    with pytest.raises(MappingError, match="expression builds more than 1,000,000 values"):
        compile_text(f'keep "**"\nconfig {{ {lines} }}\n', config={"a": [0] * 10})
    plan = compile_text('keep "**"\nconfig { b = config }\n', config={"a": [1, 2]})
    assert plan.config == {"a": [1, 2], "b": {"a": [1, 2]}}


def test_a_config_path_deeper_than_any_config_is_refused_cleanly() -> None:
    deep = ".".join(["a"] * 5000)
    with pytest.raises(MappingError, match="5000 fields deep; at most 64"):
        compile_text(f'keep "**"\nconfig {{ {deep} = 1 }}\n', config={})
    with pytest.raises(MappingError, match=r"config\.json nests deeper than 64 levels"):
        compile_text('keep "**"\nconfig { ' + ".".join(["a"] * 60) + " = [[[[[[1]]]]]] }\n",
                     config={})  # fmt: skip


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"r": None}, False),
        ({"r": 3}, False),
        ({"r": "text"}, False),
        ({"r": [1, 2]}, False),
        ({}, False),
        ({"r": {"theta": None}}, True),
        ({"r": {"theta": 5}}, True),
    ],
)
def test_has_is_false_under_a_field_that_is_no_object(config: object, expected: bool) -> None:
    plan = compile_text('keep "**"\nconfig { found = has(config.r.theta) }\n', config=config)
    assert plan.config is not None and plan.config["found"] is expected


def test_has_of_list_items_and_reading_under_null_still_fails() -> None:
    plan = compile_text(
        'keep "**"\nconfig { in = has(config.xs[1]) out = has(config.xs[2]) }\n',
        config={"xs": [1, 2]},
    )
    assert plan.config is not None and (plan.config["in"], plan.config["out"]) == (True, False)
    with pytest.raises(MappingError, match=r"cannot index null with \"theta\""):
        compile_text('keep "**"\nconfig { t = config.r.theta }\n', config={"r": None})
    with pytest.raises(MappingError, match="object keys are strings"):
        compile_text('keep "**"\nconfig { t = has(config.r[0]) }\n', config={"r": {}})


def test_lift_compares_fields_as_json_values() -> None:
    # Python's `1 == True` let a lifted true replace a 1 silently.
    with pytest.raises(MappingError, match="its fields f differ"):
        compile_text('keep "**"\nconfig { lift t }\n', config={"f": 1, "t": {"f": True}})
    plan = compile_text('keep "**"\nconfig { lift t }\n', config={"f": 1, "t": {"f": 1.0}})
    assert plan.config == {"f": 1.0}


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ('mul "a.weight" 1e39', r"1e\+39, does not fit the compute dtype F32 .*`in f64`"),
        ('add "a.weight" 70000 in f16', "70000, does not fit the compute dtype F16"),
        ('add "a.weight" 100000000000000000000 in f64', "past the 64-bit integers"),
        ('mul "a.weight" -1e39 in bf16', "does not fit the compute dtype BF16"),
    ],
)
def test_a_constant_that_does_not_fit_the_compute_dtype_is_refused(rule: str, message: str) -> None:
    # In f32 a 1e39 is infinite: every output value became inf (or NaN for 0), silently; an int
    # past 64 bits stopped torch midway, after other tensors were written.
    with pytest.raises(MappingError, match=message):
        compile_text(rule + '\nkeep "**"\n')


def test_constants_at_the_compute_dtypes_limits_are_accepted() -> None:
    for rule in ('mul "a.weight" 1e39 in f64', 'add "a.weight" 65504 in f16',
                 'mul "a.weight" 3.4e38', 'add "a.weight" 9223372036854775807 in f64'):  # fmt: skip
        assert compile_text(rule + '\nkeep "**"\n').outputs


@pytest.mark.parametrize(
    ("rule", "names", "message"),
    [
        (
            'merge "m.{i}.{gate,up}_proj.*" dim 0 -> "m.{i}.gate_up_proj.weight"',
            [f"m.0.{p}_proj.{k}" for p in ("gate", "up") for k in ("bias", "weight")],
            "member gate is matched by 2 tensors (`m.0.gate_proj.bias`, `m.0.gate_proj.weight`)",
        ),
        ('stack "e.{e:int}.**" -> "w"', ["e.0.a", "e.0.b", "e.1.a", "e.1.b"], "member e=0 is"),
        ('merge "a.{i}.q", "a.{i}.*" dim 0 -> "a.{i}.m"', ["a.0.q", "a.0.k", "a.0.z"], "pattern 2"),
    ],
)
def test_two_tensors_in_one_member_of_a_group_are_refused(
    rule: str, names: list[str], message: str
) -> None:
    # The last of them took the place and the other was dropped: the biases of a fused
    # gate_up vanished without a word.
    with pytest.raises(MappingError, match="each member must be one tensor") as info:
        compile_text(rule + "\n", [T(n, "F32", (2,)) for n in names])
    assert message in str(info.value)


def test_a_gap_in_an_int_group_is_counted_not_listed() -> None:
    # e.0 beside e.99999999999999999999 overflowed range(); e.10000000 built a 100 MB message.
    inputs = [T(n, "F32", (2,)) for n in ("e.0", "e.99999999999999999999")]
    with pytest.raises(MappingError, match=r"missing e=1\.\.99999999999999999998 \(99,999"):
        compile_text('stack "e.{e:int}" -> "w"\n', inputs)
    inputs = [T(f"e.{i}", "F32", (2,)) for i in (0, 2, 3, 7, 9)]
    with pytest.raises(MappingError, match=r"missing e=1, e=4\.\.6, e=8 \(5 in all\)"):
        compile_text('stack "e.{e:int}" -> "w"\n', inputs)


def test_listings_take_any_name() -> None:
    # A segment that is literally `#` (the listing's own marker for numbers) and a capture
    # holding ", " (how group keys were split) crashed the problem listings.
    names = [T("a.#.b", "F32", (2,)), T("a.1.b", "F32", (2,))]
    with pytest.raises(MappingError, match=r"a\.#\.b"):
        compile_text('keep? "zz"\n', names)
    with pytest.raises(MappingError, match="unknown name `q`"):
        compile_text('rename "{x}.{y}.{z}" -> "{q}"\n', names)
    odd = [T(n, "F32", (2,)) for n in ("a, b.q", "c, d.q", "e.k")]
    with pytest.raises(MappingError, match="is incomplete"):
        compile_text('merge "{x*}.q", "{x*}.k" dim 0 -> "{x}.m"\n', odd)


def test_a_float_literal_too_large_for_a_float_is_a_syntax_error() -> None:
    # 1e999 became inf: no JSON value, and written back by invert as `inf.0`.
    with pytest.raises(MappingSyntaxError, match="number 1e999 is too large for a float"):
        load_mapping('weightmap 1\nparam p = 1e999\nkeep "x"\n', name="t.wm")


def test_reserved_capture_names_and_c1_controls_in_output_names_are_refused() -> None:
    # {_alt0} clashed with the compiler's name for an unnamed alternative: a raw re.error.
    with pytest.raises(MappingSyntaxError, match="capture name _alt0 is reserved"):
        load_mapping('weightmap 1\nrename "{_alt0}.{a,b}" -> "{_alt0}"\n', name="t.wm")
    # U+0085 (NEL) and the other C1 controls were let through into output names.
    with pytest.raises(MappingError, match="contains control characters"):
        compile_text('rename "{x*}" -> "a\u0085{x}"\n')


def test_a_capture_named_like_a_param_is_the_capture_in_a_stack_output() -> None:
    inputs = [T("x.0.w", "F32", (2,)), T("x.1.w", "F32", (2,))]
    with pytest.raises(MappingError, match="cannot tell the members apart"):
        compile_text('param e = 0\nstack "x.{e:int}.w" -> "out.{e}"\n', inputs)
    plan = compile_text('param e = 0\nstack "x.{e:int}.w" -> "out"\n', inputs)
    assert [o.name for o in plan.outputs] == ["out"]
