"""Make the tiny random models that the engine tests and the engine bench serve.

Run in the engine venv (``scripts/engine.sh``): ``python make_model.py DIR`` makes the
Llama, ``python make_model.py --llava DIR`` a tiny Llava (the same Llama behind a CLIP
vision tower: images 32x32 in patches of 8, so 16 image tokens an image). No hub
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


#: The Llava's chat template: an image part of a message becomes ``<image>``.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<image>{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer(extra_specials: tuple[str, ...] = ()):
    """The byte-level BPE trained here (vocab 1024), with ``extra_specials`` added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", *extra_specials]
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def llama_config(fast, hidden: int = 256, layers: int = 2, positions: int = 1024, heads: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="bfloat16",
    )


def llava(out: str, real_width: int = 0) -> None:
    """A tiny Llava: CLIP vision tower (image 32, patch 8, 2 layers, hidden 64), a
    projector, the Llama above (hidden 128); ``<image>`` and ``<pad>`` added to the
    tokenizer; ``CLIPImageProcessor`` (32x32) in a ``LlavaProcessor``.

    ``real_width`` (the engine bench's ``--llava-real DIR WIDTH``): items of real size
    with as little compute as that allows: the processor keeps 336x336 (pixel values
    3x336x336 float32, 1.3 MiB), patches of 14 (576 image tokens), one layer of vision
    tower (hidden 64), and the projector emits ``real_width``-wide embeddings (2048:
    576 x 2048 bf16 = 2.3 MiB an image; 4096: 4.5 MiB, LLaVA-1.5-7B's) into one layer
    of language model that wide, with heads of 512 at most (vLLM's CPU attention has no
    kernel for 1024: 4 heads at 2048, 8 at 4096)."""
    side, patch = (336, 14) if real_width else (32, 8)
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    fast = tokenizer(("<image>", "<pad>"))
    fast.pad_token = "<pad>"
    fast.chat_template = LLAVA_CHAT_TEMPLATE
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        do_center_crop=True,
        do_convert_rgb=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=fast,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token="<image>",
    )
    processor.save_pretrained(path)
    fast.save_pretrained(path)

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        image_size=side,
        patch_size=patch,
        num_hidden_layers=1 if real_width else 2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        projection_dim=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=llama_config(fast, hidden=128)
        if not real_width
        else llama_config(fast, hidden=real_width, layers=1, positions=4096, heads=max(4, real_width // 512)),
        image_token_index=fast.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    # transformers 5 saves the CLIP tower's weights as `...vision_tower.<x>`; vLLM 0.32's
    # loader wants `...vision_tower.vision_model.<x>`.
    for shard in path.glob("*.safetensors"):
        tensors = load_file(shard)
        renamed = {}
        for key, value in tensors.items():
            head, sep, tail = key.partition("vision_tower.")
            if sep and not tail.startswith("vision_model."):
                key = f"{head}vision_tower.vision_model.{tail}"
            renamed[key] = value
        save_file(renamed, shard, metadata={"format": "pt"})
    generation = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}
    (path / "generation_config.json").write_text(json.dumps(generation))


def main(out: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    fast = tokenizer()
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(0)
    config = llama_config(fast)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    generation = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}
    (path / "generation_config.json").write_text(json.dumps(generation))


if __name__ == "__main__":
    if sys.argv[1] == "--llava":
        llava(sys.argv[2])
    elif sys.argv[1] == "--llava-real":
        llava(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1])
