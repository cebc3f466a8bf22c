"""Make the tiny random Llama that the engine tests and the engine bench serve.

Run in the engine venv (``scripts/engine.sh``): ``python make_model.py DIR``. No hub
access: the tokenizer is a byte-level BPE trained here with ``tokenizers`` on a small
generated text, the weights are random (fixed seed, so every run makes the same model),
and the chat template is written beside them so that ``vllm serve``'s chat endpoint works.
Two layers, hidden 256, 4 attention heads and 2 key-value heads: divisible by TP=2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    words = "the a scheduler worker tensor queue engine token step batch model cache image reader writer".split()
    lines = []
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}")
    return lines


def main(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    generation = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}
    (path / "generation_config.json").write_text(json.dumps(generation))


if __name__ == "__main__":
    main(sys.argv[1])
