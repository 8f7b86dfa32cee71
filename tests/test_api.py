"""The public API: remap and its options, compile, iter_tensors, verify."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap
from weightmap import (
    Checkpoint,
    ExecutionError,
    MappingError,
    OutputExistsError,
    PlanError,
    WeightmapError,
)

RENAME = """weightmap 1
rename "layers.0.{rest*}" -> "midlayer.{rest}"
unmatched keep
"""


@pytest.fixture
def ckpt(example: Path, tmp_path: Path) -> Path:
    """A private copy of the example checkpoint (tests may modify it)."""
    dest = tmp_path / "in"
    shutil.copytree(example, dest)
    return dest


def test_public_names_are_sorted_and_exported() -> None:
    assert weightmap.__all__ == sorted(weightmap.__all__)
    for name in weightmap.__all__:
        assert hasattr(weightmap, name), name


def test_remap_with_mapping_text(ckpt: Path, tmp_path: Path) -> None:
    result = weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, progress=False)
    assert result.dest == tmp_path / "out"
    assert result.paths == (tmp_path / "out" / "model.safetensors",)
    assert result.bytes_written == result.bytes_copied == 198_656
    out = load_file(tmp_path / "out" / "model.safetensors")
    ref = load_file(ckpt / "model.safetensors")
    assert torch.equal(out["midlayer.mlp.up_proj.weight"], ref["layers.0.mlp.up_proj.weight"])
    assert len(out) == 16 and "16 tensors" in str(result)


def test_remap_with_mapping_file(ckpt: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.wm"
    rules.write_text(RENAME)
    weightmap.remap(ckpt, tmp_path / "out", mapping=rules, progress=False)
    assert "midlayer.norm" not in load_file(tmp_path / "out" / "model.safetensors")


def test_dry_run_writes_nothing(ckpt: Path, tmp_path: Path) -> None:
    result = weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, dry_run=True)
    assert result.dry_run and result.paths == ()
    assert not (tmp_path / "out").exists()
    assert "midlayer.self_attn.q_proj.weight" in result.plan.explain()


def test_verify_and_checksums(ckpt: Path, tmp_path: Path) -> None:
    result = weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, verify=True, progress=False)
    assert result.verified and len(result.checksums) == 16
    assert weightmap.verify(tmp_path / "out", result.plan, result.checksums) == []
    # Corrupt one byte of one tensor: verify names it.
    loc = Checkpoint.open(tmp_path / "out").location("norm.weight")
    with loc.path.open("r+b") as f:
        f.seek(loc.offset)
        byte = f.read(1)
        f.seek(loc.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = weightmap.verify(tmp_path / "out", result.plan, result.checksums)
    assert problems == ["'norm.weight' bytes differ from what was written"]


def test_progress_callback_sees_every_byte(ckpt: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    weightmap.remap(
        ckpt,
        tmp_path / "out",
        mapping=RENAME,
        workers=1,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen[-1] == (198_656, 198_656)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


@pytest.mark.parametrize(
    ("mapping", "verify", "paused"),
    [
        (RENAME, False, True),  # bytes moved, none computed: one pause over it all
        (RENAME, True, False),  # verifying reads every byte: the pause ends with the plan
        ('weightmap 1\ncast "{x*}" to F32 where dtype == "BF16"\nkeep "{x*}"\n', False, False),
    ],
)
def test_remap_pauses_the_collector_only_where_nothing_is_computed(
    ckpt: Path, tmp_path: Path, mapping: str, verify: bool, paused: bool
) -> None:
    """The collector stays paused while bytes move only where the conversion computes
    nothing (fs/gcpause.py), and is on again once remap returns, as it was before."""
    import gc

    during: list[bool] = []
    assert gc.isenabled()
    weightmap.remap(
        ckpt,
        tmp_path / "out",
        mapping=mapping,
        verify=verify,
        progress=lambda _done, _total: during.append(gc.isenabled()),
    )
    assert during and set(during) == {not paused}
    assert gc.isenabled()
    with pytest.raises(MappingError, match="matches no input"):  # fails inside the pause
        weightmap.remap(ckpt, tmp_path / "out2", mapping='weightmap 1\nkeep "none.{x}"\n')
    assert gc.isenabled()


def test_progress_bar_goes_to_stderr(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "weightmap" in captured.err


def test_overwrite_and_existing_destination(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputExistsError, match="overwrite"):
        weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, progress=False)
    weightmap.remap(ckpt, tmp_path / "out", mapping=RENAME, overwrite=True, progress=False)
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_never_overwrites_the_input(ckpt: Path) -> None:
    before = (ckpt / "model.safetensors").read_bytes()
    with pytest.raises(OutputExistsError, match="holds the input"):
        weightmap.remap(ckpt, ckpt, mapping=RENAME, overwrite=True, progress=False)
    assert (ckpt / "model.safetensors").read_bytes() == before


def test_inplace_rename(ckpt: Path) -> None:
    result = weightmap.remap(ckpt, mapping=RENAME, inplace=True)
    assert result.inplace and result.paths == (ckpt / "model.safetensors",)
    names = set(load_file(ckpt / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in names and len(names) == 16


def test_inplace_refuses_computed_outputs(ckpt: Path) -> None:
    before = (ckpt / "model.safetensors").read_bytes()
    cast = 'weightmap 1\ncast "{x*}" to f32 where dtype == bf16\nunmatched keep\n'
    with pytest.raises(PlanError, match="only renames"):
        weightmap.remap(ckpt, mapping=cast, inplace=True)
    assert (ckpt / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({}, "give exactly one of preset"),
        ({"preset": "x", "mapping": RENAME}, "give exactly one of preset"),
        ({"mapping": RENAME}, "give out="),
        ({"mapping": RENAME, "inplace": True, "out": "x"}, "do not pass out"),
    ],
)
def test_argument_errors(ckpt: Path, kwargs: dict[str, object], text: str) -> None:
    with pytest.raises(ValueError, match=text):
        weightmap.remap(ckpt, **kwargs)  # type: ignore[arg-type]


def test_unknown_preset_lists_presets(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(MappingError, match="no preset named 'nope'"):
        weightmap.remap(ckpt, tmp_path / "out", preset="nope")


def test_compile_reads_no_data_and_reports_all_problems(ckpt: Path) -> None:
    rules = 'weightmap 1\nrename "layers.0.{rest*}" -> "midlayer.{rest}"\n'
    with pytest.raises(MappingError) as info:
        weightmap.compile(ckpt, mapping=rules)
    message = str(info.value)
    for name in ("fc.weight", "lm_head.weight", "d2t", "t2d"):
        assert name in message


def test_iter_tensors_is_lazy_and_zero_copy(ckpt: Path) -> None:
    it = weightmap.iter_tensors(ckpt, mapping=RENAME)
    name, first = next(iter(it))
    second_name, second = next(iter(it))
    with Checkpoint.open(ckpt) as c:
        src = {n.replace("layers.0.", "midlayer."): n for n in c}
        assert torch.equal(first, c.view(src[name]))
        # Views of one memory map, not copies: their addresses are as far apart as their
        # bytes are in the file.
        gap = c.location(src[second_name]).offset - c.location(src[name]).offset
    assert second.data_ptr() - first.data_ptr() == gap
    rest = dict(it)
    assert len(rest) == 14


def test_iter_tensors_computes_casts(ckpt: Path) -> None:
    rules = 'weightmap 1\ncast "{x*}" to f32 where dtype == bf16\nunmatched keep\n'
    out = dict(weightmap.iter_tensors(ckpt, mapping=rules))
    ref = load_file(ckpt / "model.safetensors")
    assert out["fc.weight"].dtype == torch.float32
    assert torch.equal(out["fc.weight"], ref["fc.weight"].float())
    assert out["d2t"].dtype == torch.int64


def test_iter_tensors_reports_problems_before_yielding(ckpt: Path) -> None:
    with pytest.raises(MappingError):
        weightmap.iter_tensors(ckpt, mapping='weightmap 1\nkeep "fc.weight"\n')


def test_input_changed_after_compile_is_detected(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4)}, tmp_path / "model.safetensors")
    plan = weightmap.compile(tmp_path, mapping='weightmap 1\nkeep "a"\n')
    save_file({"a": torch.zeros(5)}, tmp_path / "model.safetensors")
    from weightmap.execute.streaming import execute

    with Checkpoint.open(tmp_path) as c, pytest.raises(ExecutionError, match="compile the plan"):
        execute(plan, c, tmp_path / "out")


def test_recomputed_checksums_read_bytes_only_for_whole_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify(source=) CRCs an input tensor taken whole (renamed, kept) from its bytes, and
    everything else (slices, a cast, a transpose) from its values, so that the writer's byte
    arithmetic for slices is checked by another route: each equals the CRC of the values, and
    the files written verify clean."""
    import weightmap.execute.verify as verify_module
    from weightmap.execute.kernels import evaluate
    from weightmap.execute.verify import crc, recomputed

    read: list[list[tuple[Path, int, int]]] = []
    real = verify_module.crc_of_ranges

    def recorded(ranges: list[tuple[Path, int, int]], fds: dict[Path, int]) -> int:
        read.append(list(ranges))
        return real(ranges, fds)

    monkeypatch.setattr(verify_module, "crc_of_ranges", recorded)

    src = tmp_path / "in"
    src.mkdir()
    save_file(
        {
            "qkv": torch.arange(24, dtype=torch.float32).reshape(6, 4),
            "b": torch.arange(5, dtype=torch.bfloat16),
            "w": torch.arange(6, dtype=torch.float16).reshape(2, 3),
            "empty": torch.zeros(0, 3),
            "x": torch.arange(7, dtype=torch.int64),
        },
        str(src / "model.safetensors"),
    )
    mapping = (
        'weightmap 1\nsplit "qkv" dim 0 sizes [2, 2, 2] -> "q", "k", "v"\n'
        'cast "b" to F32\ntranspose "w"\nrename "empty" -> "e"\nkeep "x"\n'
    )
    result = weightmap.remap(src, tmp_path / "out", mapping=mapping, verify=True, progress=False)
    with Checkpoint.open(src) as ckpt:
        by_values = {
            o.name: crc(evaluate(o.node, ckpt.view, o.name))
            for o in result.plan.outputs
            if o.spec.nbytes
        }
        read.clear()
        assert recomputed(result.plan, ckpt) == by_values
        assert read == [[(ckpt.location("x").path, ckpt.location("x").offset, 56)]]
    # (the run's own checksums list the empty output too, as 0)
    assert result.checksums == {**by_values, "e": 0}
    assert weightmap.verify(tmp_path / "out", result.plan, source=src) == []


_NO_TORCH = """
import sys, weightmap
result = weightmap.remap({src!r}, {out!r}, mapping={mapping!r}, verify=True, progress=False)
assert result.verified and result.checksums
if {whole!r}:  # (against the source, a part of a tensor is recomputed from its values)
    assert weightmap.verify({out!r}, result.plan, source={src!r}) == []
assert weightmap.verify({out!r}, result.plan, result.checksums) == []
print("torch" in sys.modules)
"""


# Byte moves only: a split along dim 0 and a join of its parts are ranges of the input.
_SPLIT_JOIN = """weightmap 1
split "embed_tokens.weight" dim 0 sizes [128, 384] -> "a", "b"
merge "a", "b" dim 0 -> "embed_tokens.weight"
split "lm_head.weight" dim 0 sizes [64, 64] -> "lm_head.0", "lm_head.1"
unmatched keep
"""


@pytest.mark.parametrize("mapping", [RENAME, _SPLIT_JOIN], ids=["rename", "split-join"])
def test_moving_bytes_never_imports_torch(ckpt: Path, tmp_path: Path, mapping: str) -> None:
    """A rename or a split moves bytes, and its output is checked by reading bytes:
    importing torch would cost such a run seconds where the run takes a fraction of one."""
    import subprocess
    import sys

    from conftest import REPO

    whole = mapping == RENAME
    code = _NO_TORCH.format(src=str(ckpt), out=str(tmp_path / "out"), mapping=mapping, whole=whole)
    env = {
        **__import__("os").environ,
        "PYTHONPATH": str(REPO / "src"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # (its parsed program: not the user's)
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


_NO_WRITER = """
import sys, weightmap
weightmap.remap({src!r}, mapping={mapping!r}, dry_run=True, progress=False)
weightmap.remap({src!r}, mapping={mapping!r}, inplace=True, progress=False)
heavy = ("weightmap.execute.streaming", "weightmap.format.writer", "weightmap.format.layout")
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_inplace_and_dry_runs_import_no_writer(ckpt: Path, tmp_path: Path) -> None:
    """An in-place rename (timed in milliseconds at the command line) and a dry run without a
    destination write no new folder: the executor, the writer and the layout planner are not
    imported."""
    import subprocess
    import sys

    from conftest import REPO

    code = _NO_WRITER.format(src=str(ckpt), mapping=RENAME)
    env = {
        **__import__("os").environ,
        "PYTHONPATH": str(REPO / "src"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert "midlayer.self_attn.q_proj.weight" in load_file(ckpt / "model.safetensors")


def test_load_mapping_takes_a_preset_name() -> None:
    # As the CLI's --mapping and `invert` do (no program is one line without its version).
    preset = weightmap.load_mapping("eagle3-sglang")
    assert preset.name == "eagle3-sglang"
    assert preset.text == (Path(__file__).parents[1] / "mappings" / "eagle3-sglang.wm").read_text()
    assert weightmap.load_mapping("fp8-quant", name="q").name == "q"
    with pytest.raises(weightmap.MappingError, match="half an fp8 step"):
        weightmap.invert(weightmap.load_mapping("fp8-quant"))  # as `weightmap invert fp8-quant`
    with pytest.raises(weightmap.MappingSyntaxError):
        weightmap.load_mapping("no-such-preset")


KEEP = "weightmap 1\nunmatched keep\n"


@pytest.mark.parametrize("params", [[1], "p=1", 3])
def test_params_that_are_no_mapping_are_a_mapping_error(
    ckpt: Path, tmp_path: Path, params: object
) -> None:
    for call in (
        lambda: weightmap.compile(ckpt, mapping=KEEP, params=params),  # type: ignore[arg-type]
        lambda: weightmap.remap(ckpt, tmp_path / "o", mapping=KEEP, params=params),  # type: ignore[arg-type]
        lambda: list(weightmap.iter_tensors(ckpt, mapping=KEEP, params=params)),  # type: ignore[arg-type]
    ):
        with pytest.raises(MappingError, match="params must be a dict of name to value"):
            call()
    assert not (tmp_path / "o").exists()


def test_iter_tensors_yields_independent_tensors_where_outputs_share_an_input(
    tmp_path: Path,
) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(
        {"embed": torch.arange(12.0).reshape(4, 3), "qkv": torch.ones(6, 2)},
        tmp_path / "model.safetensors",
    )
    mapping = (
        'weightmap 1\ncopy "embed" -> "lm_head"\n'
        'split "qkv" dim 0 sizes [2, 2, 2] -> "q", "k", "v"\nunmatched keep\n'
    )
    d = dict(weightmap.iter_tensors(tmp_path, mapping=mapping))
    assert d["embed"].data_ptr() != d["lm_head"].data_ptr()
    d["embed"].mul_(2)  # (views are copy-on-write: the file stays as it is)
    assert torch.equal(d["lm_head"], torch.arange(12.0).reshape(4, 3))
    # The parts of a split are disjoint: they stay views of the file, not copies.
    assert d["k"].data_ptr() - d["q"].data_ptr() == d["q"].numel() * 4


@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"max_shard_size": "abc"}, ValueError, "cannot parse size 'abc'"),
        ({"max_shard_size": "9" * 400 + "GB"}, ValueError, "larger than any file can be"),
        ({"workers": 0}, ValueError, "workers must be at least 1"),
        ({"layout": "tight"}, ValueError, "unknown layout 'tight'"),
    ],
)
def test_a_dry_run_refuses_what_the_real_run_refuses(
    ckpt: Path, tmp_path: Path, options: dict[str, object], error: type, text: str
) -> None:
    for dry_run in (True, False):
        with pytest.raises(error, match=text):
            weightmap.remap(ckpt, tmp_path / "o", mapping=KEEP, dry_run=dry_run, **options)  # type: ignore[arg-type]
    assert not (tmp_path / "o").exists()


def test_a_dry_run_into_an_existing_folder_needs_overwrite(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        weightmap.remap(ckpt, tmp_path / "o", mapping=KEEP, dry_run=True)
    assert weightmap.remap(ckpt, tmp_path / "o", mapping=KEEP, dry_run=True, overwrite=True).dry_run


def test_an_inplace_dry_run_refuses_what_the_rewrite_refuses(ckpt: Path) -> None:
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    drop = 'weightmap 1\ndrop "d2t"\nunmatched keep\n'
    for dry_run in (True, False):
        with pytest.raises(WeightmapError, match="in-place mode cannot drop tensors"):
            weightmap.remap(ckpt, mapping=drop, inplace=True, dry_run=dry_run)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before


@pytest.mark.parametrize(
    "options",
    [{"max_shard_size": "10KB"}, {"layout": "reference"}, {"overwrite": True}, {"workers": 3}],
)
def test_inplace_refuses_options_it_would_ignore(ckpt: Path, options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="would do nothing: leave it out"):
        weightmap.remap(ckpt, mapping=KEEP, inplace=True, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", ["5GB", "5gb", 5_000_000_000])
def test_inplace_takes_the_default_shard_size_however_written(ckpt: Path, size: object) -> None:
    assert weightmap.remap(ckpt, mapping=KEEP, inplace=True, max_shard_size=size).inplace  # type: ignore[arg-type]


@pytest.mark.parametrize("what", ["file", "holds the input"])
def test_a_dry_run_makes_the_writers_destination_checks(
    ckpt: Path, tmp_path: Path, what: str
) -> None:
    dest = tmp_path / "o"
    if what == "file":
        dest.write_text("x")
    else:
        dest = ckpt.parent  # the folder that holds the input
    for dry_run in (True, False):
        with pytest.raises(OutputExistsError):
            weightmap.remap(ckpt, dest, mapping=KEEP, dry_run=dry_run, overwrite=True)


def test_a_config_edit_that_only_changes_a_json_type_is_an_edit(tmp_path: Path) -> None:
    # Python's == says true == 1 and 10000 == 10000.0: an in-place rename left such edits
    # out of config.json, the plan did not call the config edited, and diff saw no change.
    import json

    from weightmap.inputs.checkpoint import Checkpoint
    from weightmap.inputs.diff import diff_checkpoints

    src = tmp_path / "c"
    src.mkdir()
    save_file({"a": torch.ones(2)}, str(src / "model.safetensors"))
    config = {"tie_word_embeddings": True, "rope_theta": 10000}
    (src / "config.json").write_text(json.dumps(config))
    shutil.copytree(src, tmp_path / "before")
    mapping = weightmap.load_mapping(
        'weightmap 1\nrename "a" -> "b"\nconfig { tie_word_embeddings = 1  rope_theta = 10000.0 }\n'
    )
    assert weightmap.compile(src, mapping=mapping).config_changed
    weightmap.remap(src, inplace=True, mapping=mapping, progress=False)
    edited = json.loads((src / "config.json").read_text())
    assert [type(v) for v in edited.values()] == [int, float]
    with Checkpoint.open(tmp_path / "before") as a, Checkpoint.open(src) as b:
        assert diff_checkpoints(a, b).config == [
            "~ rope_theta: 10000 -> 10000.0",
            "~ tie_word_embeddings: true -> 1",
        ]


_CAST_PART = """weightmap 1
cast "w" to i8 -> "w8"
{between}split "{split}" dim {dim} sizes [2, 2] -> "kept", "dropped"
drop "{drop}"
"""


@pytest.mark.parametrize("drop", ["dropped", "kept"])
@pytest.mark.parametrize("how", ["rows", "columns", "transposed"])
def test_a_narrowing_cast_checks_the_values_an_output_holds(
    tmp_path: Path, drop: str, how: str
) -> None:
    """remap, iter_tensors and verify agree: a part no output keeps may hold values the cast
    cannot, and stops nothing; a part an output keeps stops all three. Split along the dim
    the executor computes in chunks or across it, or after a transpose."""
    w = torch.tensor([[1, -2, 300, 400], [3, 4, 500, 600], [5, 6, 700, 800], [7, 8, 900, 999]])
    if how == "rows":
        w = w.t().contiguous()
    save_file({"w": w}, tmp_path / "model.safetensors")
    between = 'transpose "w8" -> "t"\n' if how == "transposed" else ""
    mapping = _CAST_PART.format(
        between=between,
        split="t" if how == "transposed" else "w8",
        dim=1 if how == "columns" else 0,
        drop=drop,
    )
    if drop == "kept":
        with pytest.raises(weightmap.ExecutionError, match=r"\[300, 999\] do not fit in I8"):
            weightmap.remap(tmp_path, tmp_path / "out", mapping=mapping, progress=False)
        with pytest.raises(weightmap.ExecutionError, match=r"\[300, 999\] do not fit in I8"):
            dict(weightmap.iter_tensors(tmp_path, mapping=mapping))
        assert not (tmp_path / "out").exists()
        return
    result = weightmap.remap(tmp_path, tmp_path / "out", mapping=mapping, progress=False)
    expected = torch.tensor([[1, 3, 5, 7], [-2, 4, 6, 8]], dtype=torch.int8)
    if how == "columns":
        expected = expected.t()
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["kept"], expected)
    assert torch.equal(dict(weightmap.iter_tensors(tmp_path, mapping=mapping))["kept"], expected)
    assert weightmap.verify(tmp_path / "out", result.plan, source=tmp_path) == []
