"""The one-pass keep/rename compile (compiler/bulk.py) gives exactly the working set's plan,
or leaves the mapping to the working set: same outputs, origins, drops and errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import weightmap
from weightmap.compiler import bulk
from weightmap.compiler import compile as compile_module
from weightmap.compiler.compile import compile_plan
from weightmap.errors import MappingError
from weightmap.execute import sources as sources_module
from weightmap.execute import streaming
from weightmap.format import header as header_module
from weightmap.format import layout as layout_module
from weightmap.format.dtypes import SpecTable, TensorSpec
from weightmap.format.writer import CheckpointWriter
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.language import ast as A
from weightmap.language.mapping import load_mapping
from weightmap.plan.parts import OutputTable

PATTERNS = [
    '"a.{i:int}.{r*}"',
    '"a.{i}.w"',
    '"b.**"',
    '"**"',
    '"*.0.w"',
    '"a.1.b"',
    '"c.{p:w,b}"',
    '"x.{i:int}.{r*}"',
    '"nothing.{r*}"',
]
# Templates over the captures every pattern above may give: some rename into names that
# exist (collisions), into names a later rule takes (a second hop), or leave them as they are.
TEMPLATES = {
    '"a.{i:int}.{r*}"': [
        '"x.{i}.{r}"',
        '"a.{i + 1}.{r}"',
        '"b.{r}"',
        '"a.{i}.{r}"',
        '"y"',
        # A literal brace; a param's hole beside captures (no capture).
        '"{{x.{i}.{r}"',
        '"{k}.{i}.{r}"',
    ],
    # (`i` is a string here: `{i + 1}` fails, for some tensors, while the rule runs.)
    '"a.{i}.w"': ['"x.{i}.w"', '"w.{i}"', '"a.{i}.w"', '"x.{i + 1}.w"'],
    '"b.**"': ['"moved"'],
    '"**"': ['"z"'],
    '"*.0.w"': ['"zero"'],
    '"a.1.b"': ['"a.1.b2"', '"a.0.w"'],
    '"c.{p:w,b}"': ['"c.{p}.x"', '"{p}"'],
    '"x.{i:int}.{r*}"': ['"x.{i}.{r}.again"'],
    '"nothing.{r*}"': ['"never.{r}"'],
}
NAMES = ["a.0.w", "a.0.b", "a.1.w", "a.1.b", "a.12.w", "b.w", "b.q.w", "c.w", "c.b", "x.3.w"]


@st.composite
def mappings(draw: st.DrawFn) -> str:
    lines = ["weightmap 1", 'param k = "K"']
    for _ in range(draw(st.integers(1, 3))):
        pattern = draw(st.sampled_from(PATTERNS))
        # Weighted towards plans the one pass takes: optional rules, a kept remainder.
        op = draw(
            st.sampled_from(
                ["rename?"] * 4 + ["rename"] * 2 + ["keep?"] * 2 + ["keep", "cast", "drop"]
            )
        )
        if op.startswith("rename"):
            lines.append(f"{op} {pattern} -> {draw(st.sampled_from(TEMPLATES[pattern]))}")
        elif op.startswith("keep"):
            # Where the working set filters (a `where`), the one pass stands aside.
            where = draw(st.sampled_from(["", "", " where dtype == f32"]))
            lines.append(f"{op} {pattern}{where}")
        elif op == "cast":
            lines.append(f"cast {pattern} to f16 where dtype == f32")
        else:
            lines.append(f"drop? {pattern}")
    policies = ["unmatched keep"] * 3 + ["unmatched drop"] * 2 + ["", "unmatched error"]
    policy = draw(st.sampled_from(policies))
    if policy:
        lines.append(policy)
    return "\n".join(lines) + "\n"


@st.composite
def inputs(draw: st.DrawFn) -> list[TensorSpec]:
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8, unique=True))
    if draw(st.integers(0, 4)) == 0 and len(names) > 1:
        names.append(names[0])  # a name twice: the compiler reports it
    dtypes = st.sampled_from(["F32", "BF16"])
    return [TensorSpec(n, draw(dtypes), (draw(st.integers(1, 3)), 2)) for n in names]


def _outcome(text: str, specs: list[TensorSpec], one_pass: bool) -> Any:
    """The plan's outputs (name, spec, node, origin) and drops, or the error's text."""
    mapping = load_mapping(text)
    patch = pytest.MonkeyPatch()
    if not one_pass:
        patch.setattr(compile_module, "bulk_renames", lambda *a, **k: None)
    try:
        plan = compile_plan(mapping, specs, None)
    except MappingError as exc:
        return ("error", str(exc))
    finally:
        patch.undo()
    outputs = [(o.name, o.spec, o.spec.nbytes, o.node, o.origin) for o in plan.outputs]
    return (outputs, plan.dropped, plan.warnings)


def _spy(
    patch: pytest.MonkeyPatch,
    owner: Any = compile_module,
    name: str = "bulk_renames",
    module: Any = bulk,
) -> list[bool]:
    """Whether each call of ``module.<name>`` (``bulk``'s, as ``owner`` calls it) through
    ``patch`` found something (True: the one pass, or the columns, took the plan) or not."""
    taken: list[bool] = []
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        taken.append(found is not None)
        return found

    patch.setattr(owner, name, spy)
    return taken


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mappings(), inputs())
def test_one_pass_is_the_working_set(text: str, specs: list[TensorSpec]) -> None:
    patch = pytest.MonkeyPatch()
    taken = _spy(patch)
    try:
        fast = _outcome(text, specs, one_pass=True)
    finally:
        patch.undo()
    event(f"one pass: {any(taken)}")
    assert fast == _outcome(text, specs, one_pass=False), text


def test_a_rename_of_every_tensor_takes_the_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commonest plans (every layer renamed, the rest kept) are made in one pass, and are
    the working set's plans; a filter, a collision or a second rename leave it to the working
    set."""
    specs = [TensorSpec(f"model.layers.{i}.w{j}", "BF16", (4, 4)) for i in range(3) for j in (0, 1)]
    specs.append(TensorSpec("lm_head.weight", "BF16", (4, 4)))
    calls = _spy(monkeypatch)
    cases = {
        'rename "model.layers.{i:int}.{r*}" -> "layers.{i}.{r}"\nunmatched keep\n': True,
        'rename "model.layers.{i:int}.{r*}" -> "layers.{i}.{r}"\nkeep "lm_head.weight"\n': True,
        # Below the renames, a keep of everything: outputs go on through it unchanged.
        'rename "model.layers.{i:int}.{r*}" -> "layers.{i}.{r}"\nkeep "**"\n': True,
        'rename "{r*}" -> "all.{r}"\nkeep "all.**"\n': True,  # the keep takes outputs alone
        'keep "**" where dtype == bf16\n': False,  # a filter
        'rename "model.layers.{i:int}.w0" -> "model.layers.{i}.w1"\nunmatched keep\n': False,
        'rename "model.layers.{i:int}.{r*}" -> "l.{i}.{r}"\nrename? "l.{r*}" -> "m.{r}"\n'
        "unmatched keep\n": False,  # a second hop
        # Onto the name of an input no rule takes, which is still there when the rule runs.
        'rename "model.layers.0.w0" -> "lm_head.weight"\nunmatched drop\n': False,
        # Names made from the match's groups: literal braces, an int, an alternative; a hole
        # that is a param, not a capture, renders through the scope.
        'rename "model.layers.{i:int}.{r:w0,w1}" -> "{{{i}}}}}.{r}"\nunmatched keep\n': True,
        'param p = "P"\nrename "model.layers.{i:int}.{r*}" -> "{p}.{i}.{r}"\nunmatched keep\n': (
            True
        ),
    }
    for body, one_pass in cases.items():
        calls.clear()
        text = "weightmap 1\n" + body
        assert _outcome(text, specs, one_pass=True) == _outcome(text, specs, one_pass=False)
        assert calls == [one_pass], body


def test_names_come_from_the_match_groups_where_every_hole_is_a_capture() -> None:
    # (The cases above give the same plans either way: this is that the quick way is taken.)
    mapping = load_mapping('weightmap 1\nrename "a.{i:int}.{r*}" -> "b{{.{r}.{i}"\n')
    (rule,) = (s for s in mapping.program.stmts if isinstance(s, A.Rule))
    template = rule.outputs[0]
    quick = bulk._positional(template, {"i": 2, "r": 3})
    assert quick is not None and quick("a.7.x", "7", "x") == "b{.x.7"
    assert bulk._positional(template, {"i": 2}) is None  # `r` is no capture here


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mappings(), inputs())
def test_columns_are_the_loop(text: str, specs: list[TensorSpec]) -> None:
    """Where one alternative takes every input, the outputs made column by column are the
    ones the loop makes input by input."""
    patch = pytest.MonkeyPatch()
    taken = _spy(patch, bulk, "_one_alternative")
    try:
        columns = _outcome(text, specs, one_pass=True)
    finally:
        patch.undo()
    event(f"columns: {any(taken)}")
    patch.setattr(bulk, "_one_alternative", lambda *args: None)
    try:
        assert columns == _outcome(text, specs, one_pass=True), text
    finally:
        patch.undo()


def test_columns_take_a_rename_of_every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    # (The property above holds trivially if the columns are never taken.)
    specs = [TensorSpec(f"model.layers.{i}.w{j}", "BF16", (4, 4)) for i in range(3) for j in (0, 1)]
    taken = _spy(monkeypatch, bulk, "_one_alternative")
    cases = {
        'rename "model.layers.{i:int}.{r*}" -> "layers.{i}.{r}"\n': True,
        'keep "model.layers.**"\n': True,
        # Below the rename, a keep of everything: the loop routes each output through it.
        'rename "model.layers.{i:int}.{r*}" -> "layers.{i}.{r}"\nkeep "**"\n': False,
        # Two alternatives take the inputs.
        'rename "model.layers.{i:int}.w0" -> "a.{i}"\n'
        'rename "model.layers.{i:int}.w1" -> "b.{i}"\n': False,
    }
    for body, columns in cases.items():
        taken.clear()
        text = "weightmap 1\n" + body
        outcome = _outcome(text, specs, one_pass=True)
        assert outcome == _outcome(text, specs, one_pass=False), body
        assert taken == [columns], body
    taken.clear()
    _outcome('weightmap 1\nrename "model.layers.{i:int}.{r*}" -> "l.{i}.{r}"\n', specs, True)
    assert taken == [True]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mappings(), inputs())
def test_a_table_of_inputs_is_the_specs(text: str, specs: list[TensorSpec]) -> None:
    """Compiled from a checkpoint's table of specs (columns), a plan has the outputs, drops and
    errors it has compiled from the specs themselves; where one alternative takes every input,
    its outputs are a table too."""
    table = SpecTable.of(specs)
    assert table == specs and list(table) == specs
    outcome = _outcome(text, table, one_pass=True)  # type: ignore[arg-type]
    assert outcome == _outcome(text, specs, one_pass=True), text
    with pytest.MonkeyPatch.context() as patch:  # the names matched two at a time
        patch.setattr(bulk, "_SLICE", 2)
        assert _outcome(text, table, one_pass=True) == outcome, text  # type: ignore[arg-type]
    try:
        plan = compile_plan(load_mapping(text), table, None)
    except MappingError:
        return
    event(f"outputs as a table: {isinstance(plan.outputs, OutputTable)}")
    if isinstance(plan.outputs, OutputTable):
        assert plan.is_rename_only
        assert list(plan.output_specs()) == [o.spec for o in plan.outputs]
        assert plan.output_nbytes() == sum(o.spec.nbytes for o in plan.outputs)


def _shards(folder: Path) -> None:
    """Three shards and an index, written by safetensors itself: tensors of several dtypes."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    folder.mkdir()
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for s in range(3):
        tensors = {
            f"model.layers.{s}.mlp.experts.{e}.w{j}": torch.randn((3 + e, 5 + j), generator=gen).to(
                [torch.bfloat16, torch.float32, torch.float16][(e + j) % 3]
            )
            for e in range(4)
            for j in range(3)
        }
        tensors[f"model.layers.{s}.mask"] = torch.ones(7, dtype=torch.bool)
        # Large enough for the clone layout to share blocks (so it keeps the input's order).
        tensors[f"model.layers.{s}.big"] = torch.randn((64, 64), generator=gen)
        name = f"model-{s + 1:05d}-of-00003.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("layout", ["clone", "reference"])
@pytest.mark.parametrize("max_shard_size", ["5GB", 600])
def test_a_rename_read_as_columns_writes_the_bytes_of_one_read_as_objects(
    tmp_path: Path, layout: str, max_shard_size: int | str
) -> None:
    """The headers read as columns, the plan's outputs a table, the layout from the columns:
    the very bytes of the conversion made of one object per tensor."""
    _shards(tmp_path / "in")
    mapping = 'weightmap 1\nrename "model.layers.{n}.{rest*}" -> "layers.{n}.{rest}"\n'
    options: dict[str, Any] = {"mapping": mapping, "layout": layout}
    options["max_shard_size"] = max_shard_size
    counted: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        real_length = layout_module._header_length
        patch.setattr(
            layout_module,
            "_header_length",
            lambda *args: counted.append(1) or real_length(*args),
        )
        # Every stage took its columns: the headers, the compiler and the origins.
        headers = _spy(patch, header_module, "_column_header", header_module)
        tables = _spy(patch, bulk, "_table_alternative")
        origins = _spy(patch, sources_module, "_every_input", sources_module)
        weightmap.remap(tmp_path / "in", tmp_path / "columns", **options)
    assert headers == [True] * 3 and tables == [True] and origins == [True]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(header_module, "_column_header", lambda *args: None)
        real = Checkpoint.specs
        patch.setattr(Checkpoint, "specs", lambda self: tuple(real(self)))
        taken = _spy(patch, bulk, "_table_alternative")
        weightmap.remap(tmp_path / "in", tmp_path / "objects", **options)
        assert taken == []
    if layout == "clone" and max_shard_size == "5GB":
        assert counted, "no header was laid out from the columns"
    names = sorted(p.name for p in (tmp_path / "columns").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "objects").iterdir())
    assert any(name.endswith(".safetensors") for name in names)
    for name in names:
        assert (tmp_path / "columns" / name).read_bytes() == (
            tmp_path / "objects" / name
        ).read_bytes(), name


def test_names_matched_a_slice_at_a_time_keep_to_one_alternative(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A later slice of names taken by another alternative than the first slice's: the table
    of outputs is no rename of one alternative, and the loop takes the plan."""
    specs = [TensorSpec(f"a.{i}.w", "F32", (2,)) for i in range(4)]
    specs += [TensorSpec(f"b.{i}", "F32", (2,)) for i in range(2)]
    text = 'weightmap 1\nrename? "a.{i:int}.{r*}" -> "x.{i}.{r}"\nrename? "b.{j}" -> "y.{j}"\n'
    monkeypatch.setattr(bulk, "_SLICE", 2)
    taken = _spy(monkeypatch, bulk, "_table_alternative")
    outcome = _outcome(text, SpecTable.of(specs), one_pass=True)  # type: ignore[arg-type]
    assert taken == [False]
    assert outcome == _outcome(text, specs, one_pass=False)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(st.characters(exclude_categories=["Cs"]), max_size=6),
            st.sampled_from(["F32", "BF16", "I8", "F4", "BOOL"]),
            st.lists(st.integers(0, 12), max_size=3).map(tuple),
            st.integers(0, 3000),
        ),
        max_size=12,
    ),
    st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3)),
)
@example([("a", "I8", (10,), 10)], None)  # offsets at powers of ten
@example([("a", "I8", (90,), 90), ("b", "I8", (10,), 10), ("c", "I8", (900,), 900)], None)
def test_a_header_length_counted_from_columns_is_the_text_length(
    rows: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None
) -> None:
    """The header a whole rename lays out is made only when written: its length, which places
    the data, is counted from the columns, and must be the text's to the byte."""
    names = [r[0] for r in rows]
    dtypes = [r[1] for r in rows]
    shapes = [r[2] for r in rows]
    sizes = [r[3] for r in rows]
    table = SpecTable(names, dtypes, shapes, sizes)
    text = layout_module._header_text(table, sizes, metadata)
    assert layout_module._header_length(table, sizes, metadata) == len(text)


def test_digits_are_counted_at_every_power_of_ten() -> None:
    values = [0, 1, 9, 10, 11, 99, 100, 101, 999, 1000, 10**12, 10**19, 2**64 - 1]
    for end in range(len(values) + 1):
        assert layout_module._digits(values[:end]) == sum(len(str(v)) for v in values[:end])


def test_headers_left_for_the_copies_are_written_by_the_commit_if_not_before(
    tmp_path: Path,
) -> None:
    """A rename's headers are made and written as the copies run (with the index); where that
    did not happen (the step stopped short), the commit writes them: the same bytes."""
    _shards(tmp_path / "in")
    mapping = 'weightmap 1\nrename "model.layers.{n}.{rest*}" -> "layers.{n}.{rest}"\n'
    weightmap.remap(tmp_path / "in", tmp_path / "during", mapping=mapping)
    with pytest.MonkeyPatch.context() as patch:
        deferred: list[int] = []
        real_open = CheckpointWriter.open

        def opened(self: CheckpointWriter) -> None:
            real_open(self)
            deferred.append(len(self._pending))

        patch.setattr(CheckpointWriter, "open", opened)
        patch.setattr(streaming, "_meanwhile_writes", lambda writer, check: None)
        weightmap.remap(tmp_path / "in", tmp_path / "commit", mapping=mapping)
    assert deferred == [3]  # (every shard's header was left for later)
    for path in sorted((tmp_path / "during").iterdir()):
        assert path.read_bytes() == (tmp_path / "commit" / path.name).read_bytes(), path.name
