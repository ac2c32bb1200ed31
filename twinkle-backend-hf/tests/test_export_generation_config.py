"""Saved models stop at the chat template's end of turn: ``twinkle export`` and training checkpoints write a
generation_config.json whose ``eos_token_id`` includes ``<|im_end|>``, so a plain ``generate`` ends the answer."""

from __future__ import annotations

import json

import pytest
from ok_model import TOKENIZER, build_ok_model, token_id

from twinkle_core.cli import main

pytest.importorskip("twinkle_backend_hf")


def _answer_ids(directory, tokenizer) -> list[int]:
    """The tokens plain transformers generates (greedy, the directory's generation_config) after a chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return out[0, prompt["input_ids"].shape[1]:].tolist()


def test_exported_model_generates_until_the_end_of_turn(tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    o, k, x = (token_id(tokenizer, t) for t in ("o", "k", "x"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    source = build_ok_model(tmp_path / "ok")
    # the source's generation_config stops only at <|endoftext|>: generate runs past the end of the turn
    assert _answer_ids(source, tokenizer) == [o, k, end] + [x] * 5

    assert main(["export", str(source), "-o", str(tmp_path / "export")]) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [0, end]
    assert _answer_ids(tmp_path / "export", tokenizer) == [o, k, end]


def test_training_checkpoint_records_the_end_of_turn(tmp_path):
    from transformers import AutoTokenizer
    from twinkle_backend_hf.testing import make_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = make_tiny_model(seed=0, tokenizer=tokenizer)
    path = model.save("ckpt", output_dir=str(tmp_path), save_optimizer=False)
    saved = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in saved["eos_token_id"], saved
    assert path == str(tmp_path / "ckpt")
