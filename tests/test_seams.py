"""Where features meet: in-place renames beside side files and `config from`, `iter_tensors`
beside side files, PyTorch inputs beside in-place renames. Each case runs both ways and
compares with the conversion into a new folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import weightmap
from weightmap import cli
from weightmap.errors import MappingError
from weightmap.inputs.checkpoint import Checkpoint


def _folder(root: Path) -> Path:
    root.mkdir()
    save_file({"a": torch.arange(4.0), "b": torch.ones(3)}, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "x"}))
    (root / "config.py").write_text("class Config: ...\n")
    (root / "README.md").write_text("# model\n")
    return root


# A rename-only mapping whose config depends on a side file, as the eagle3-speculators preset's
# auto_map depends on config.py.
EXISTS = """weightmap 1
rename "a" -> "c"
unmatched keep
if exists file "config.py" {
    config {
        auto_map = {"": "config.Config"}
    }
} else {
    warn "no config.py"
}
"""


def test_inplace_sees_the_side_files_a_conversion_sees(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src")
    moved = weightmap.remap(src, tmp_path / "out", mapping=EXISTS)
    assert moved.plan.warnings == ()
    result = weightmap.remap(src, mapping=EXISTS, inplace=True)
    # Nothing is carried in place: the side files stay where they are, and no "not carried"
    # warnings or side files are shown for them.
    assert result.plan.warnings == () and result.plan.files == ()
    with Checkpoint.open(src) as ckpt:
        assert ckpt.config == moved.plan.config
        assert ckpt.config is not None and ckpt.config["auto_map"] == {"": "config.Config"}
        assert sorted(ckpt.tensors) == ["b", "c"]


@pytest.mark.parametrize(
    ("block", "what"),
    [
        ('drop "README.md"', "dropped: README.md"),
        # (Not config.py: a mapping renames into a code file only when allowed.)
        ('rename "README.md" -> "docs/README.md"', "renamed: README.md -> docs/README.md"),
        ('add "NOTICE" = "converted\\n"', "added: NOTICE"),
    ],
)
def test_inplace_refuses_a_files_block_it_cannot_apply(
    tmp_path: Path, block: str, what: str
) -> None:
    src = _folder(tmp_path / "src")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    mapping = f'weightmap 1\nrename "a" -> "c"\nunmatched keep\nfiles {{\n    {block}\n}}\n'
    with pytest.raises(MappingError, match="in-place mode leaves the folder's other files") as info:
        weightmap.remap(src, mapping=mapping, inplace=True)
    assert what in str(info.value) and "convert into a new folder" in str(info.value)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    # Turned off, no block applies (as for any conversion), and the rename goes ahead.
    weightmap.remap(src, mapping=mapping, inplace=True, side_files=False)
    with Checkpoint.open(src) as ckpt:
        assert sorted(ckpt.tensors) == ["b", "c"]


def test_inplace_with_config_from_writes_config_json(tmp_path: Path) -> None:
    """The conversion writes the config it read from params.json as config.json; so must the
    in-place rename, though the config is unchanged from the file it was read from."""
    src = tmp_path / "src"
    src.mkdir()
    save_file({"a": torch.ones(2)}, src / "model.safetensors")
    (src / "params.json").write_text(json.dumps({"dim": 8}))
    mapping = 'weightmap 1\nconfig from "params.json"\nrename "a" -> "c"\n'
    weightmap.remap(src, tmp_path / "out", mapping=mapping)
    weightmap.remap(src, mapping=mapping, inplace=True)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {"dim": 8}
    assert json.loads((src / "config.json").read_text()) == written
    # An older config.json beside params.json is replaced, as in the output folder.
    (src / "config.json").write_text(json.dumps({"dim": 4}))
    back = 'weightmap 1\nconfig from "params.json"\nrename "c" -> "a"\n'
    weightmap.remap(src, mapping=back, inplace=True)
    assert json.loads((src / "config.json").read_text()) == written


def test_inplace_refuses_pytorch_before_the_plan_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    mapping = tmp_path / "m.wm"
    mapping.write_text('weightmap 1\nrename "a" -> "b"\n')
    for extra in ([], ["--dry-run"]):
        code = cli.main(["convert", str(tmp_path), "--inplace", "--mapping", str(mapping), *extra])
        out, err = capsys.readouterr()
        assert code == 1 and out == "", out
        assert "in-place renames rewrite safetensors headers" in err and "[inplace-format]" in err


@pytest.mark.parametrize(
    ("option", "flag", "message"),
    [
        ({"verify": True}, "--verify", "verify=True checks a new output"),
        ({"executor": "ray"}, "--ray", "executor='ray' runs a conversion into a new folder"),
    ],
)
def test_inplace_refuses_options_it_would_ignore(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    option: dict[str, Any],
    flag: str,
    message: str,
) -> None:
    src = _folder(tmp_path / "src")
    with pytest.raises(ValueError, match=message):
        weightmap.remap(src, mapping=EXISTS, inplace=True, **option)
    (tmp_path / "m.wm").write_text(EXISTS)
    args = ["convert", str(src), "--inplace", flag, "--mapping", str(tmp_path / "m.wm")]
    assert cli.main(args) == 2
    assert f"(no {flag})" in capsys.readouterr().err
    with Checkpoint.open(src) as ckpt:
        assert sorted(ckpt.tensors) == ["a", "b"]


def test_iter_tensors_sees_the_side_files_remap_sees(tmp_path: Path) -> None:
    src = _folder(tmp_path / "src")
    mapping = 'weightmap 1\nif exists file "config.py" {\n    rename "a" -> "c"\n}\n'
    mapping += "unmatched keep\n"
    written = weightmap.remap(src, tmp_path / "out", mapping=mapping)
    assert sorted(s.name for s in written.plan.output_specs()) == ["b", "c"]
    assert sorted(name for name, _ in weightmap.iter_tensors(src, mapping=mapping)) == ["b", "c"]
    # A files block is compiled with the rest: its problems are reported before any tensor.
    with pytest.raises(MappingError, match=r'"absent\.txt" matches no side file'):
        weightmap.iter_tensors(src, mapping=mapping + 'files {\n    drop "absent.txt"\n}\n')
