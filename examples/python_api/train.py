"""Training from Python: the quickstart's chats, with the TwinkleModel API and the data path of `twinkle train`.

Runs as is from the repository root, nothing downloaded: the quickstart's tiny Qwen2 architecture (randomly
initialised from its config), its tokenizer and its training chats. ``OUTPUT_DIR`` and ``MAX_STEPS`` may be
set in the environment (defaults: ``outputs/python_api``, 300 optimizer steps).
"""

import os

from twinkle.data import build_loader
from twinkle.model import TransformersModel  # the spec's path; also twinkle_core.model: the installed backend

QUICKSTART = "examples/quickstart"
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/python_api")
MAX_STEPS = int(os.environ.get("MAX_STEPS", "300"))

# A pretrained model instead: TransformersModel(model_id="hf://Qwen/Qwen2.5-0.5B-Instruct", precision="bf16")
# (model.tokenizer is its own), then e.g. a LoRA adapter before set_optimizer:
#   model.add_adapter_to_model("default", {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})
model = TransformersModel(
    config={"model_type": "qwen2", "vocab_size": 262, "hidden_size": 128, "intermediate_size": 384,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "tie_word_embeddings": True,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0},
    tokenizer=f"{QUICKSTART}/tokenizer",  # a directory or hub id; model.tokenizer is the loaded tokenizer
    seed=0,
)
model.set_loss("cross_entropy")
model.set_optimizer("AdamW", lr=3e-3, weight_decay=0.01, gradient_accumulation_steps=4)
model.set_lr_scheduler("cosine", num_training_steps=MAX_STEPS, num_warmup_steps=min(30, MAX_STEPS // 10))

# a recipe's data: section as arguments: read, render with the chat template, shard per rank, collate
loader = build_loader(f"{QUICKSTART}/train.jsonl", model=model, mode="chat", max_length=128, batch_size=8, seed=0)

steps = 0
while steps < MAX_STEPS:
    for batch in loader:  # one pass is one epoch; the next pass reshuffles
        out = model.forward_backward(inputs=batch)  # forward + loss + backward
        if model.clip_grad_and_step(max_grad_norm=1.0) is None:  # steps once every 4 calls
            continue
        steps += 1
        if steps % 50 == 0 or steps == MAX_STEPS:
            print(f"step {steps}/{MAX_STEPS}: loss {float(out['loss']):.4f}", flush=True)
        if steps == MAX_STEPS:
            break
print("saved:", model.save("final", output_dir=OUTPUT_DIR))  # a plain transformers (or PEFT) directory
