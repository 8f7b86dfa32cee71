"""Where features meet: in-place renames beside `config from`, `iter_tensors` beside side
files. Each case runs both ways and compares with the conversion into a new folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightmap
from weightmap.errors import MappingError


def _folder(root: Path) -> Path:
    root.mkdir()
    save_file({"a": torch.arange(4.0), "b": torch.ones(3)}, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "x"}))
    (root / "config.py").write_text("class Config: ...\n")
    (root / "README.md").write_text("# model\n")
    return root


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
