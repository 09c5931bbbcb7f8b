"""Random-weight checkpoints saved by ``transformers`` into a folder, for benchmarks and
tests that need a real Hugging Face checkpoint on disk and cannot download one: Llamas
of a given size with a word-level tokenizer, and LLaVAs (a CLIP tower, the projector, a
Llama) with their processor and a chat template that renders images as ``<image>``.
Loaded with ``loadgen.scripts.load_script`` (``benchmarks/`` is a folder of scripts)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def save_llama_100m(folder: Path) -> Any:
    """~100M parameters: 12 layers, hidden 768, GQA 12/4 heads, vocab 32000, tied embeddings."""
    return save_random_llama(folder, 32000, 768, 2048, 12, 12, 4)


def save_random_llama(
    folder: Path,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
) -> Any:
    """A random-weight Llama (tied embeddings) and a word-level tokenizer, saved by
    ``transformers``; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(str(folder))
    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(cfg.vocab_size - 3))]
    word_tokenizer(words, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        str(folder)
    )
    return model


def word_tokenizer(words: list[str], **special_tokens: Any) -> Any:
    """A Hugging Face fast tokenizer that splits on whitespace and maps ``words[i]`` to
    id ``i`` (anything else to ``words[0]``); ``special_tokens`` as the tokenizer takes
    them (``bos_token=...``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


# Word-level chat template that renders image parts as ``<image>`` (the gateway's
# ``chat_messages(keep_images=True)`` shape).
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
    "{% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}</s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def save_random_llava(
    folder: Path,
    text_config: Any,
    vision: dict[str, int],
    words: list[str],
    shortest_edge: int,
    seed: int = 0,
    init: Callable[[Any, int], None] | None = None,
    feature_layer: int | list[int] = -2,
    strategy: str = "default",
) -> tuple[Any, Any]:
    """A random-weight ``LlavaForConditionalGeneration`` (a CLIP tower of ``vision``'s
    sizes, ``CLIPVisionConfig``'s keywords; the projector; the language model of
    ``text_config``; image features from ``feature_layer`` by ``strategy``, as
    ``LlavaConfig`` takes them) with its processor (PIL
    CLIP image processor: the shortest edge resized to ``shortest_edge``, the centre
    ``image_size`` square cropped) and a word tokenizer of ``words`` whose last word is
    ``<image>``, the placeholder; saved by ``transformers`` into ``folder``. ``init``
    re-initialises the model's weights (``init(model, seed)``) before it is saved.
    Returns the in-memory model and processor."""
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if words[-1] != "<image>" or text_config.vocab_size != len(words):
        raise ValueError("words must be the whole vocabulary, <image> last")
    config = LlavaConfig(
        text_config=text_config,
        vision_config=CLIPVisionConfig(**vision),
        image_token_id=len(words) - 1,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    if init is not None:
        init(model, seed)
    model = model.float().eval()
    model.save_pretrained(str(folder))
    tokenizer = word_tokenizer(
        words,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    side = vision["image_size"]
    images = CLIPImageProcessorPil(
        size={"shortest_edge": shortest_edge}, crop_size={"height": side, "width": side}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=vision["patch_size"],
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model, processor
