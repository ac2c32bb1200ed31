"""A small, lossless, Qwen-style (ChatML) tokenizer built entirely in code, for tests.

Nothing is downloaded: a byte-level BPE is trained in memory on a few sentences with the
``tokenizers`` library and wrapped in a ``transformers.PreTrainedTokenizerFast``. Byte-level BPE
starts from all 256 byte symbols, so *any* text (digits, ASCII words, punctuation, whitespace,
non-ASCII) round-trips exactly through ``encode`` / ``decode``.

Special tokens (ids 0, 1, 2 in this order):

* ``<|endoftext|>`` -- eos and pad token
* ``<|im_start|>`` / ``<|im_end|>`` -- ChatML turn delimiters (``<|im_end|>`` ends every turn)

Usage::

    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    tok.save_pretrained(tmp_path)            # AutoTokenizer.from_pretrained(tmp_path) reloads it
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

#: The ChatML template (Qwen style, without an implicit default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DEFAULT_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "What is 2 + 2? The answer is 4. What is 12 * 3? It is 36.",
    "user assistant system tool: call the function with arguments (a, b) and return the result.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024 3.14 -7 1e-4",
    "Punctuation: ! \" # $ % & ' ( ) * + , - . / : ; < = > ? @ [ \\ ] ^ _ ` { | } ~",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Translate to French: good morning -> bonjour; thank you -> merci.",
    "def add(a, b):\n    return a + b\n",
    "Yes. No. Maybe. Sure! Okay, let me think step by step.",
)


def build_tiny_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 512, *,
                         model_max_length: int = 2048) -> Any:
    """Train a byte-level BPE on ``texts`` (a built-in corpus by default) and return a
    ``PreTrainedTokenizerFast`` with a ChatML ``chat_template``.

    ``vocab_size`` is an upper bound: the 3 special tokens and the 256 byte symbols always exist,
    merges fill the rest as far as the corpus allows. Building takes a few milliseconds.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes)")
    corpus = list(texts) if texts is not None else list(_DEFAULT_CORPUS)

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="right",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


__all__ = ["CHATML_TEMPLATE", "EOS_TOKEN", "IM_END", "IM_START", "build_tiny_tokenizer"]
