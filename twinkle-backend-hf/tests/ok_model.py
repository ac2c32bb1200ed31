"""A hand-built tiny model whose answers are known, for the tests of serving and exporting.

A one-layer Qwen2 (the quickstart's ChatML tokenizer) whose attention and MLP add nothing, so the next token depends
on the last one only (an embedding per token, read by an untied ``lm_head``): after a newline (the end of the chat
template's generation prompt) it says ``o``, then ``k``, then the end-of-turn token ``<|im_end|>``; after any other
token it says ``x``. Its generation_config.json names only ``<|endoftext|>`` as EOS, so a plain ``generate`` runs
past ``<|im_end|>``. The margin (logit 40 against 0) makes sampling at temperature 1 pick the same tokens
(the others share e**-40 of the mass). A LoRA adapter on ``lm_head`` turns the first ``o`` into ``k``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "quickstart" / "tokenizer"
HIDDEN = 64
LOGIT = 40.0 / HIDDEN ** 0.5  # the final RMSNorm scales a one-hot hidden state to sqrt(HIDDEN): logits of 40


def token_id(tokenizer, text: str) -> int:
    (token,) = tokenizer(text, add_special_tokens=False)["input_ids"]
    return token


def build_ok_model(directory: Path) -> Path:
    """The model described in the module docstring, saved with the quickstart's ChatML tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    newline, o, k, x = (token_id(tokenizer, t) for t in ("\n", "o", "k", "x"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # attention and MLP add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.zeros_like(model.model.embed_tokens.weight)
        embed[:, 0] = 1.0  # every other token: direction 0
        head = torch.zeros_like(model.lm_head.weight)
        head[x, 0] = LOGIT  # ... is followed by "x"
        for direction, (token, follower) in enumerate(((newline, o), (o, k), (k, end)), start=1):
            embed[token] = 0.0
            embed[token, direction] = 1.0
            head[follower, direction] = LOGIT
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_k_adapter(base: Path, directory: Path) -> Path:
    """A LoRA adapter on ``lm_head`` (recording ``base``): after the newline it says ``k`` instead of ``o``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=["lm_head"]))
    layer = model.base_model.model.lm_head
    with torch.no_grad():
        layer.lora_A["default"].weight.zero_()
        layer.lora_A["default"].weight[0, 1] = 1.0  # reads the newline's direction
        layer.lora_B["default"].weight.zero_()
        layer.lora_B["default"].weight[token_id(tokenizer, "o"), 0] = -2 * LOGIT
        layer.lora_B["default"].weight[token_id(tokenizer, "k"), 0] = 2 * LOGIT
    model.save_pretrained(directory, save_embedding_layers=False)  # only the LoRA weights, not lm_head's
    return directory
