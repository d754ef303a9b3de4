"""Writes a small Llama checkpoint with a chat tokenizer, as a Hugging Face model directory
(save_pretrained): the starting point of the fine-tuning example. Nothing is downloaded: the
tokenizer is the BPE that ships in the package with two ChatML special tokens and a ChatML chat
template; the weights are random (a stand-in for a published checkpoint you would point
model.pretrained at).

    .venv/bin/python examples/finetune_chat/make_checkpoint.py [OUT_DIR]   # default runs/tiny-chat-llama
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    assets = Path(importlib.util.find_spec("raytrain_hybrid").submodule_search_locations[0]) / "assets"
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(assets / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4104,  # the BPE's 4,096 tokens, the 2 added ones, rounded up to a multiple of 8 (TP)
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    print(f"wrote {out} (config.json, model.safetensors, tokenizer files with a chat template)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-chat-llama"))
