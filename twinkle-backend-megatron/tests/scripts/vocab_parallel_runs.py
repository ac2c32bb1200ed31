"""TP=2 with the vocabulary-parallel loss on and off: the same tiny Qwen2, the same steps; rank 0 writes JSON.

    torchrun --nproc-per-node 2 vocab_parallel_runs.py --out results.json

Per setting: two SFT steps (cross entropy, token accuracy), then one GRPO step (a log-prob loss, temperature 0.7,
with a KL term to a reference); each step's loss, token accuracy and pre-clip gradient norm, the width of the
logits ``forward_backward`` hands the losses (and returns) and of those ``forward`` / ``forward_only`` return. The vocabulary (61, padded to 62 over
two ranks) leaves the second rank a padding row.
"""

import argparse
import json
import sys
import warnings

VOCAB = 61


def one_run(vocab_parallel: bool) -> dict:
    import torch
    from twinkle_backend_megatron.model import MegatronModel
    from twinkle_backend_megatron.testing import tiny_qwen2_config

    from twinkle_core.testing.conformance import local_rows, make_batch

    model = MegatronModel(config=tiny_qwen2_config(vocab_size=VOCAB), mesh={"tp": 2}, seed=0,
                          strategy_options={"vocab_parallel_loss": vocab_parallel})
    model.add_metric("accuracy")
    model.set_optimizer("AdamW", lr=1e-2)
    losses, norms, accuracy = [], [], []
    for step in range(2):
        model.forward_backward(inputs=local_rows(model, make_batch(100 + step, vocab=VOCAB)))
        norms.append(float(model.clip_grad_and_step(max_grad_norm=1.0)))
        metrics = model.calculate_metric()
        losses.append(metrics["loss"])
        accuracy.append(metrics["accuracy"])
    batch = make_batch(200, vocab=VOCAB)
    widths = {"forward_backward": model.forward_backward(inputs=batch)["logits"].shape[-1],
              "forward": model.forward(inputs=batch)["logits"].shape[-1],
              "forward_only": model.forward_only(inputs=batch)["logits"].shape[-1]}
    model.zero_grad()
    rows, length = batch["input_ids"].shape
    generator = torch.Generator().manual_seed(5)
    batch["advantages"] = torch.randn(rows, generator=generator)
    batch["old_logps"] = torch.full((rows, length - 1), -4.0)
    batch["ref_logps"] = torch.full((rows, length - 1), -4.2)
    model.set_loss("grpo", beta=0.1, temperature=0.7)
    out = model.forward_backward(inputs=batch)
    norms.append(float(model.clip_grad_and_step(max_grad_norm=1.0)))
    losses.append(float(out["loss"]))
    return {"losses": losses, "norms": norms, "accuracy": accuracy, "widths": widths,
            "shard": None if model.vocab_shard is None else [model.vocab_shard.start, model.vocab_shard.end]}


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from twinkle_core import distributed

    results = {"on": one_run(True), "off": one_run(False)}
    if distributed.is_main_process():
        with open(args.out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    sys.exit(main())
