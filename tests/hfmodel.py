"""A tiny Hugging Face model folder, built offline: a Llama, its tokenizer, its generation
config and a README, with the weights as safetensors, one ``pytorch_model.bin`` or sharded
``.bin`` files with their index."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "model", "folder", "is", "served"]


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def build(folder: Path, weights: str, *, tied: bool = True) -> torch.nn.Module:
    """Write the folder; ``weights`` is ``safetensors``, ``bin`` or ``bin-sharded``. Returns the
    model, for reference outputs."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    if weights == "safetensors":
        model.save_pretrained(folder)
    else:
        config.save_pretrained(folder)
        state = model.state_dict()
        if weights == "bin":
            torch.save(state, folder / "pytorch_model.bin")
        else:
            names = sorted(state)
            halves = [names[: len(names) // 2], names[len(names) // 2 :]]
            weight_map = {}
            for i, part in enumerate(halves, 1):
                shard = f"pytorch_model-{i:05d}-of-00002.bin"
                torch.save({n: state[n] for n in part}, folder / shard)
                weight_map.update(dict.fromkeys(part, shard))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=4).save_pretrained(folder)
    _tokenizer(folder)
    (folder / "README.md").write_text("# tiny llama\n")
    return model
