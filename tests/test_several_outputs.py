"""Mappings of several outputs (``output NAME files ... count N``): Hugging Face Llama back
into Meta's model-parallel rank files, bit for bit against the slices Meta's model code holds
(tests/several.py builds them as Meta saves them), from Python, at several chunk sizes, in
memory and from the CLI; the language's `chunk ... into` and `NAME:*:` names; and every way a
family can be declared or filled wrong, each refused with its fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import weightmap
from several import VOCAB, meta_params, meta_ranks
from test_conversions import example
from test_several_inputs import _same
from weightmap import cli
from weightmap.errors import CompileError, MappingError
from weightmap.plan.plan import Plan

Tensors = dict[str, torch.Tensor]


def _hf(tmp: Path, version: str, ranks: int) -> tuple[Path, list[Tensors], dict[str, Any]]:
    """A Hugging Face folder made from Meta rank files by llama-meta-ranks-to-hf (tested
    against write_model in test_several_inputs.py), the rank files' tensors, and the params
    that give the Meta folder back."""
    folder, per = meta_ranks(tmp, version, ranks)
    params = {"version": version} | ({"vocab_size": VOCAB} if version == "2" else {})
    hf = tmp / f"hf-{version}-{ranks}"
    weightmap.remap(folder, hf, preset="llama-meta-ranks-to-hf", params=params, progress=False)
    meta = meta_params(version)
    back = {
        "ranks": ranks,
        "version": version,
        "multiple_of": meta["multiple_of"],
        "ffn_dim_multiplier": meta.get("ffn_dim_multiplier") or 0.0,
    }
    # Meta's rope.freqs (Llama 2) is a buffer the model recomputes; Hugging Face has none.
    return hf, [{k: v for k, v in sd.items() if k != "rope.freqs"} for sd in per], back


def _ranks(folder: Path, n: int) -> list[Tensors]:
    return [load_file(folder / f"consolidated.{i:02d}.safetensors") for i in range(n)]


@pytest.mark.parametrize(("version", "ranks"), [("2", 4), ("3", 2), ("3", 1)])
def test_hf_back_into_meta_ranks(tmp_path: Path, version: str, ranks: int) -> None:
    hf, per, params = _hf(tmp_path, version, ranks)
    how: dict[str, Any] = {"preset": "llama-hf-to-meta-ranks", "params": params}
    memory = {k: v.clone() for k, v in weightmap.iter_tensors(hf, **how)}
    for i, chunk in enumerate((4096, 1 << 20)):
        out = tmp_path / f"back{i}"
        result = weightmap.remap(hf, out, chunk_bytes=chunk, verify=True, progress=False, **how)
        assert result.verified
        got = _ranks(out, ranks)
        for rank in range(ranks):
            _same(got[rank], per[rank])
            prefix = f"consolidated:{rank}:"
            _same(
                got[rank], {k[len(prefix) :]: v for k, v in memory.items() if k.startswith(prefix)}
            )
        # Every tensor went into a rank: no main weights, no index; params.json beside them.
        names = sorted(p.name for p in out.iterdir())
        assert not [n for n in names if n.startswith("model")]
        assert (
            json.loads((out / "params.json").read_text())["n_heads"]
            == meta_params(version)["n_heads"]
        )
        assert sorted(result.paths) == sorted(
            [out / f"consolidated.{r:02d}.safetensors" for r in range(ranks)]
            + [out / f.name for f in result.plan.files]
        )
    # And the rank files read back to the same Hugging Face weights.
    again = tmp_path / "again"
    weightmap.remap(
        tmp_path / "back0",
        again,
        preset="llama-meta-ranks-to-hf",
        params={"version": version} | ({"vocab_size": VOCAB} if version == "2" else {}),
        progress=False,
    )
    _same(load_file(again / "model.safetensors"), load_file(hf / "model.safetensors"))


@pytest.mark.parametrize("ranks", [1, 4])
def test_hf_to_meta_ranks_worked_example(tmp_path: Path, ranks: int) -> None:
    """docs/language.md's scatter into Meta's ranks: the slices Meta's rank files hold."""
    hf, per, back = _hf(tmp_path, "3", ranks)
    params = {k: v for k, v in back.items() if k != "version"}  # (Llama 3's split: dim 0)
    out = tmp_path / "ranks"
    mapping = example("hf-to-meta-ranks")
    weightmap.remap(hf, out, mapping=mapping, params=params, progress=False, verify=True)
    for rank, got in enumerate(_ranks(out, ranks)):
        _same(got, per[rank])
    memory = dict(weightmap.iter_tensors(hf, mapping=mapping, params=params))
    for rank in range(ranks):
        for name, t in per[rank].items():
            assert torch.equal(memory[f"consolidated:{rank}:{name}"], t), name


@pytest.mark.parametrize(("version", "ranks"), [("2", 4), ("3", 2)])
def test_meta_ranks_from_the_cli_and_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str, ranks: int
) -> None:
    hf, per, params = _hf(tmp_path, version, ranks)
    sets = [x for k, v in params.items() for x in ("--set", f"{k}={v}")]
    rc = cli.main(["plan", str(hf), "--preset", "llama-hf-to-meta-ranks", *sets])
    text = capsys.readouterr().out
    assert rc == 0
    last = f"consolidated.{ranks - 1:02d}.safetensors"
    assert "consolidated.00.safetensors" in text and last in text
    rc = cli.main(
        [
            "convert",
            str(hf),
            str(tmp_path / "cli"),
            "--preset",
            "llama-hf-to-meta-ranks",
            *sets,
            "--quiet",
            "--verify",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    for rank, got in enumerate(_ranks(tmp_path / "cli", ranks)):
        _same(got, per[rank])


def test_meta_ranks_preset_refusals(tmp_path: Path) -> None:
    hf, _, params = _hf(tmp_path, "3", 2)
    with pytest.raises(CompileError, match="say which Llama this is"):
        weightmap.compile(hf, preset="llama-hf-to-meta-ranks", params={**params, "version": ""})
    with pytest.raises(CompileError, match="do not divide over 3 ranks"):
        weightmap.compile(hf, preset="llama-hf-to-meta-ranks", params={**params, "ranks": 3})
    with pytest.raises(ValueError, match="in-place rename cannot"):
        weightmap.remap(hf, preset="llama-hf-to-meta-ranks", params=params, inplace=True)


# -- the language ----------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path: Path) -> Path:
    folder = tmp_path / "small"
    folder.mkdir()
    tensors = {
        "a.weight": torch.arange(48, dtype=torch.float32).reshape(4, 12),
        "b.weight": torch.arange(36, dtype=torch.float32).reshape(3, 12),
        "norm": torch.ones(3),
    }
    save_file(tensors, folder / "model.safetensors")
    (folder / "notes.txt").write_text("carried")
    return folder


SCATTER = """weightmap 1
param n = 2
output out files "rank{rank}.safetensors" count n
chunk "{x}.weight" dim 1 into n -> "out:{r}:{x}.weight"
rename "norm" -> "out:*:norm"
"""


def test_scatter_with_chunk_into_and_every_rank(tmp_path: Path, small: Path) -> None:
    full = load_file(small / "model.safetensors")
    for n in (1, 3):
        out = tmp_path / f"out{n}"
        weightmap.remap(small, out, mapping=SCATTER, params={"n": n}, verify=True, progress=False)
        assert sorted(p.name for p in out.iterdir()) == sorted(
            [f"rank{r:02d}.safetensors" for r in range(n)] + ["notes.txt"]
        )
        for r, got in enumerate(_ranks_named(out, n)):
            expected = {
                "a.weight": full["a.weight"].chunk(n, dim=1)[r],
                "b.weight": full["b.weight"].chunk(n, dim=1)[r],
                "norm": full["norm"],
            }
            _same(got, expected)


def _ranks_named(folder: Path, n: int) -> list[Tensors]:
    return [load_file(folder / f"rank{i:02d}.safetensors") for i in range(n)]


def test_main_checkpoint_beside_the_members(tmp_path: Path, small: Path) -> None:
    """Tensors outside the family stay in the main checkpoint, sharded with its index as
    ever; the index lists the main tensors only. The reference layout writes each member
    as safetensors' save_file does."""
    mapping = """weightmap 1
output out files "part-{i}.safetensors" count 2
chunk "a.weight" dim 0 into 2 -> "out:{r}:a.weight"
unmatched keep
"""
    out = tmp_path / "out"
    weightmap.remap(small, out, mapping=mapping, max_shard_size=100, layout="reference")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["b.weight", "norm"]
    assert index["metadata"]["total_size"] == 36 * 4 + 3 * 4
    full = load_file(small / "model.safetensors")
    for r in range(2):
        path = out / f"part-{r:02d}.safetensors"
        reference = tmp_path / f"ref{r}.safetensors"
        save_file({"a.weight": full["a.weight"].chunk(2)[r].contiguous()}, reference,
                  metadata={"format": "pt"})  # fmt: skip
        assert path.read_bytes() == reference.read_bytes()


def test_ten_ranks_or_more_keep_file_names_in_order(tmp_path: Path, small: Path) -> None:
    plan = weightmap.compile(small, mapping=SCATTER, params={"n": 12})
    assert [f for _, f in plan.members()][-2:] == ["rank10.safetensors", "rank11.safetensors"]
    again = Plan.from_json(plan.to_json())
    assert again.families == plan.families and again.members() == plan.members()


TWICE = 'output out files "x{r}.safetensors" count 2\noutput out files "y{r}.safetensors" count 2'


@pytest.mark.parametrize(
    ("decl", "message"),
    [
        ('output out files "../x{r}.safetensors" count 2', "name one .safetensors file"),
        ('output out files "sub/x{r}.safetensors" count 2', "name one .safetensors file"),
        ('output out files "x{r}.bin" count 2', "name one .safetensors file"),
        ('output out files "x{r}{s}.safetensors" count 2', "name one .safetensors file"),
        ('output out files "x*{r}.safetensors" count 2', "name one .safetensors file"),
        ('output out files "x.safetensors" count 2', "name one .safetensors file"),
        ('output n files "x{r}.safetensors" count 2', "takes a param's name"),
        (TWICE, "declared twice"),
        ('input out\noutput out files "x{r}.safetensors" count 2', "has the name of an input"),
    ],
)
def test_bad_declarations(small: Path, decl: str, message: str) -> None:
    with pytest.raises(MappingError, match=message):
        weightmap.compile(small, mapping=f"weightmap 1\nparam n = 2\n{decl}\nunmatched keep\n")


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ('rename "norm" -> "out:2:norm"', r"rank '2' is not one of family `out`'s ranks 0..1"),
        ('rename "norm" -> "out:01:norm"', r"rank '01' is not one of"),
        ('rename "norm" -> "out:norm"', r'without a rank and a tensor name: write "out:RANK:NAME"'),
        ('copy "norm" -> "out:*:norm", "out:0:norm"', "is written twice"),
        ('rename "norm" -> "out:0:norm"', r"member rank01.safetensors \(rank 1\) gets no tensor"),
        # The member's own name is its header's key: "__metadata__" would be read as metadata.
        (
            'copy "norm" -> "out:0:__metadata__", "out:1:norm"',
            r"'out:0:__metadata__': the member's tensor name is reserved by safetensors",
        ),
        ('copy "norm" -> "out:*:__metadata__"', r"the member's tensor name is reserved"),
    ],
)
def test_bad_family_names(small: Path, rules: str, message: str) -> None:
    mapping = f"""weightmap 1
output out files "rank{{r}}.safetensors" count 2
{rules}
unmatched drop
"""
    with pytest.raises(CompileError, match=message):
        weightmap.compile(small, mapping=mapping)


def test_bad_counts_and_pieces(small: Path) -> None:
    with pytest.raises(CompileError, match="count 0: a family writes 1 to 4096 files"):
        weightmap.compile(small, mapping=SCATTER, params={"n": 0})
    with pytest.raises(CompileError, match="count must be an integer"):
        weightmap.compile(small, mapping=SCATTER.replace("count n", 'count "2"'))
    with pytest.raises(CompileError, match="does not divide into 5 equal chunks"):
        weightmap.compile(small, mapping=SCATTER, params={"n": 5})
    two = SCATTER.replace('-> "out:{r}:{x}.weight"', '-> "out:{r}:{x}.weight", "other"')
    with pytest.raises(CompileError, match="names its pieces by one template"):
        weightmap.compile(small, mapping=two)
    nameless = SCATTER.replace('"out:{r}:{x}.weight"', '"out:0:{x}.weight"')
    with pytest.raises(CompileError, match="needs exactly one new name for the index"):
        weightmap.compile(small, mapping=nameless)


def test_member_names_other_files_take(tmp_path: Path, small: Path) -> None:
    clash = SCATTER + 'files { rename "notes.txt" -> "rank01.safetensors" }\n'
    with pytest.raises(CompileError, match=r"'rank01.safetensors' .* is written by the conversion"):
        weightmap.compile(small, mapping=clash)
    twice = SCATTER.replace('rename "norm" -> "out:*:norm"', 'rename "norm" -> "other:0:norm"')
    twice += 'output other files "rank{r}.safetensors" count 1\n'
    with pytest.raises(
        CompileError, match=r"rank00.safetensors, which is member 0 of family 'out'"
    ):
        weightmap.compile(small, mapping=twice)
    main = SCATTER.replace("rank{rank}.safetensors", "model-0000{rank}-of-00002.safetensors")
    with pytest.raises(CompileError, match="which is a main shard of the output"):
        weightmap.compile(small, mapping=main)


def test_a_failed_write_leaves_no_member(tmp_path: Path, small: Path) -> None:
    """A value that does not fit stops the run: nothing of the output, members included,
    is left under the final name."""
    mapping = SCATTER.replace('rename "norm" -> "out:*:norm"', 'cast "norm" to i8 -> "out:*:norm"')
    save_file(
        {**load_file(small / "model.safetensors"), "norm": torch.full((3,), 1000.0)},
        small / "model.safetensors",
    )
    out = tmp_path / "out"
    with pytest.raises(weightmap.errors.ExecutionError):
        weightmap.remap(small, out, mapping=mapping, progress=False)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["small"]


def test_unparse_round_trip() -> None:
    from weightmap.language.parse import parse_program
    from weightmap.language.unparse import unparse

    program = parse_program(SCATTER, "t")
    assert parse_program(unparse(program), "t").stmts == program.stmts


# -- a gather's inverse is a scatter ---------------------------------------------------------------

GATHER = """weightmap 1
input ranks files "shard.{rank}.*"
merge "ranks:{r:int}:l.{n:int}.w" dim 0 -> "layers.{n}.w"
merge "ranks:{r:int}:l.{n:int}.o" dim 1 -> "layers.{n}.o"
rename "ranks:0:norm" -> "norm"
drop? "ranks:{r:int}:norm"
"""


def _sharded(folder: Path, ranks: int) -> list[Tensors]:
    """A folder of ``ranks`` rank files (PyTorch pickles, as trainers save them)."""
    gen = torch.Generator().manual_seed(ranks)
    full = {
        "l.0.w": torch.randn(8, 6, generator=gen),
        "l.1.w": torch.randn(8, 6, generator=gen),
        "l.0.o": torch.randn(6, 8, generator=gen),
    }
    norm = torch.randn(6, generator=gen)
    per = []
    for r in range(ranks):
        sd = {
            k: v.chunk(ranks, dim=1 if k.endswith(".o") else 0)[r].clone() for k, v in full.items()
        }
        per.append({**sd, "norm": norm.clone()})
    folder.mkdir()
    for r, sd in enumerate(per):
        torch.save(sd, folder / f"shard.{r}.pth")
    return per


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_a_gather_inverts_into_a_scatter(tmp_path: Path, ranks: int) -> None:
    per = _sharded(tmp_path / "src", ranks)
    mapping = weightmap.load_mapping(GATHER)
    weightmap.remap(tmp_path / "src", tmp_path / "full", mapping=mapping, progress=False)
    inverse = weightmap.invert(mapping, check=tmp_path / "src")
    assert 'output ranks files "shard.{rank}.safetensors" count ranks_count' in inverse.text
    assert 'chunk "layers.{n:int}.o" dim 1 into ranks_count -> "ranks:{r}:l.{n}.o"' in inverse.text
    assert 'rename "norm" -> "ranks:*:norm"' in inverse.text
    back = tmp_path / "back"
    weightmap.remap(tmp_path / "full", back, mapping=inverse, params={"ranks_count": ranks},
                    verify=True, progress=False)  # fmt: skip
    for r in range(ranks):
        _same(load_file(back / f"shard.{r:02d}.safetensors"), per[r])
    # The count is the caller's to give: the inverse reads no folder of ranks.
    with pytest.raises(CompileError, match=r"count 0: .* say how many \(--set ranks_count=N\)"):
        weightmap.compile(tmp_path / "full", mapping=inverse)


def test_what_a_gather_loses_is_said(tmp_path: Path) -> None:
    _sharded(tmp_path / "src", 2)
    lossy = weightmap.load_mapping(GATHER.replace('rename "ranks:0:norm" -> "norm"\n', ""))
    with pytest.raises(MappingError, match="ranks:0:norm: not given back"):
        weightmap.invert(lossy, check=tmp_path / "src")
    stacked = (
        'weightmap 1\ninput ranks files "s.{r}.pth"\nstack "ranks:{r:int}:{x}" over r -> "{x}"'
    )
    with pytest.raises(MappingError, match="only a merge over the rank capture"):
        weightmap.invert(stacked)
    sized = GATHER.replace('dim 0 -> "layers.{n}.w"', 'dim 0 sizes [4, 4] -> "layers.{n}.w"')
    with pytest.raises(MappingError, match="cannot invert this merge"):
        weightmap.invert(sized)
    one = 'weightmap 1\ninput ranks files "s.{r}.pth"\ndrop "ranks:0:x"\nunmatched keep'
    with pytest.raises(MappingError, match="dropped tensors of one rank"):
        weightmap.invert(one)


def test_a_checked_replica_inverts_into_every_rank(tmp_path: Path) -> None:
    per = _sharded(tmp_path / "src", 2)
    checked = GATHER.replace(
        'rename "ranks:0:norm" -> "norm"\ndrop? "ranks:{r:int}:norm"\n',
        'merge "ranks:{r:int}:norm" same -> "norm"\n',
    )
    assert "same" in checked
    mapping = weightmap.load_mapping(checked)
    weightmap.remap(tmp_path / "src", tmp_path / "full", mapping=mapping, progress=False)
    inverse = weightmap.invert(mapping, check=tmp_path / "src")
    assert 'rename "norm" -> "ranks:*:norm"' in inverse.text
    back = tmp_path / "back"
    weightmap.remap(tmp_path / "full", back, mapping=inverse, params={"ranks_count": 2})
    for r in range(2):
        _same(load_file(back / f"shard.{r:02d}.safetensors"), per[r])


def test_merge_same_is_checked_at_compile_time(small: Path) -> None:
    mapping = 'weightmap 1\nmerge "{x:a,b}.weight" same -> "w"\nunmatched keep\n'
    with pytest.raises(CompileError, match=r"members of `merge \.\.\. same` differ in shape"):
        weightmap.compile(small, mapping=mapping)
    plain = 'weightmap 1\nmerge "{p:a,b}.weight" same -> "w"\nunmatched keep\n'
    with pytest.raises(MappingError, match="inverts over a family's ranks only"):
        weightmap.invert(plain)


def test_a_plan_read_back_keeps_members_in_the_folder(small: Path) -> None:
    """A plan is JSON that may come from elsewhere: a family naming a file outside the
    output folder is refused as it is read, before any writer sees it."""
    d = weightmap.compile(small, mapping=SCATTER).to_dict()
    d["output_families"][0]["before"] = "../../escape"
    with pytest.raises(ValueError, match=r"\.safetensors files of the output folder"):
        Plan.from_dict(d)
