"""Chat with the quickstart's checkpoint using plain transformers (no Twinkle import).

    python examples/quickstart/generate.py outputs/quickstart/final "reverse: galaxy"
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "outputs/quickstart/final"
    prompts = sys.argv[2:] or ["reverse: galaxy", "upper: star", "double: moon"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=24, do_sample=False, eos_token_id=end,
                                 pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"{prompt!r} -> {answer!r}")


if __name__ == "__main__":
    main()
