"""A converted Hugging Face model folder is one a user can serve as it is: the model's own class
and AutoTokenizer load it from the output folder alone, for safetensors and PyTorch inputs."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import weightmap

from hfmodel import CHAT_TEMPLATE, build

transformers = pytest.importorskip("transformers")

MAPPING = "weightmap 1\nunmatched keep\n"


@pytest.mark.parametrize("weights", ["safetensors", "bin", "bin-sharded"])
def test_converted_folder_loads_with_transformers(
    tmp_path: Path, weights: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = tmp_path / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(src, weights)
    result = weightmap.remap(src, tmp_path / "out", mapping=MAPPING, verify=True, progress=False)
    assert {f.name for f in result.plan.files} >= {
        "README.md",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    if weights != "safetensors":
        assert result.bytes_computed == 0  # byte ranges of the zip, moved by the kernel
    shutil.rmtree(src)  # the output folder alone

    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
        tok = transformers.AutoTokenizer.from_pretrained(out)
        generation = transformers.GenerationConfig.from_pretrained(out)
    ids = tok("hello world the model", return_tensors="pt").input_ids
    assert ids.tolist() == [[3, 4, 5, 6]]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "</s>"
    assert generation.max_new_tokens == 4
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text == "<s>hello</s>"
