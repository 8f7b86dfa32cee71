"""Where features meet: `iter_tensors` beside side files. Each case runs both ways and
compares with the conversion into a new folder."""

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
