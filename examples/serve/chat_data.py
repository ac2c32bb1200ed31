"""The quickstart's chats as Tinker datums, and its held-out exact match through a sampling client.

Plain `tinker` SDK and `transformers` (for the tokenizer's chat template): nothing here imports Twinkle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "quickstart"


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer")


def read_chats(name: str) -> list[list[dict[str, str]]]:
    with open(QUICKSTART / name) as rows:
        return [json.loads(row)["messages"] for row in rows if row.strip()]


def template_ids(tokenizer: Any, messages: list[dict[str, str]], **options: Any) -> list[int]:
    """The chat template's token ids (recent transformers return a mapping from apply_chat_template)."""
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, **options)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[float]]:
    """The whole chat's tokens and a weight per token: 1 on every assistant reply (its end marker included),
    0 on the rest; the spans come from rendering each prefix with the template."""
    tokens = template_ids(tokenizer, messages)
    weights = [0.0] * len(tokens)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(template_ids(tokenizer, messages[:turn], add_generation_prompt=True))
        end = len(template_ids(tokenizer, messages[: turn + 1]))
        for i in range(start, end):
            weights[i] = 1.0
    return tokens, weights


def to_datum(tokens: list[int], weights: list[float]) -> Any:
    """Next-token prediction: the model reads tokens[:-1] and is scored on tokens[1:]."""
    import tinker

    return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                              loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})


def prompt_tokens(tokenizer: Any, question: str) -> list[int]:
    return template_ids(tokenizer, [{"role": "user", "content": question}], add_generation_prompt=True)


def greedy_answers(sampling_client: Any, tokenizer: Any, chats: list[list[dict[str, str]]],
                   max_tokens: int = 16) -> list[str]:
    """Greedy answers to each chat's first question."""
    import tinker

    params = tinker.types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["<|im_end|>"])
    futures = [sampling_client.sample(tinker.types.ModelInput.from_ints(prompt_tokens(tokenizer, chat[0]["content"])),
                                      num_samples=1, sampling_params=params) for chat in chats]
    return [tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True)
            .replace("<|im_end|>", "").strip() for future in futures]


def exact_match(sampling_client: Any, tokenizer: Any, chats: list[list[dict[str, str]]],
                max_tokens: int = 16) -> float:
    """The share of greedy answers to each chat's first question equal to its first answer."""
    answers = greedy_answers(sampling_client, tokenizer, chats, max_tokens)
    return sum(answer == chat[1]["content"] for answer, chat in zip(answers, chats)) / len(chats)
