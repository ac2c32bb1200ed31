"""A saved model's ``generation_config.json`` that ends answers at the chat template's end-of-turn token.

A model trained on chat data ends its turn with the template's end-of-turn token (``<|im_end|>`` in ChatML),
which is often not the tokenizer's EOS. ``generate`` stops only at ``generation_config.eos_token_id``, so a
plain ``AutoModelForCausalLM.from_pretrained(DIR).generate(...)`` (and servers that read the file, such as vLLM)
would run past the end of the answer. Every directory Twinkle writes a model to (training checkpoints and
``twinkle export``) records all stop tokens there.
"""

from __future__ import annotations

import copy
import os
from typing import Any


def write_end_of_turn_generation_config(directory: str | os.PathLike[str], model: Any, tokenizer: Any) -> None:
    """(Re)write ``directory/generation_config.json`` from ``model.generation_config`` with ``eos_token_id`` =
    the model's EOS, the tokenizer's EOS and the chat template's end-of-turn token
    (:func:`~twinkle_backend_hf.commands.checkpoint_loading.stop_token_ids`). Nothing for a model that does not
    generate or without a tokenizer. The model itself is left unchanged."""
    from twinkle_backend_hf.commands.checkpoint_loading import stop_token_ids

    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "generation_config", None)
    if tokenizer is None or config is None or not callable(can_generate) or not can_generate():
        return
    stops = stop_token_ids(tokenizer, model)
    if not stops:
        return
    updated = copy.deepcopy(config)
    updated.eos_token_id = stops[0] if len(stops) == 1 else stops
    updated.save_pretrained(str(directory))
