"""Ulysses sequence parallelism vs. the single-process model, on a tiny Qwen2 (fp32, CPU/gloo).

Two modes, run by ``tests/test_sequence_parallel.py``:

    python sp_parity.py reference OUT_DIR                   # strategy "single", one process
    torchrun --nproc-per-node 2 ... sp_parity.py sp OUT_DIR  # SequenceParallelStrategy, mesh sp=2
    torchrun --nproc-per-node 4 ... sp_parity.py sp OUT_DIR 2  # mesh dp=2 x sp=2
    torchrun --nproc-per-node 2 ... sp_parity.py sp OUT_DIR 1 fsdp  # FSDP2 for the data dimension (default ddp)

``reference`` writes ``OUT_DIR/reference.pt`` and ``OUT_DIR/spread.json``: how far the reference's own
training results move when only its summation order changes (every batch's rows reversed: the same
sums, added in another order). Ten AdamW steps amplify float32 rounding by an amount no fixed bound
can predict (Adam divides by the gradient's own running magnitude), so the test derives the training
tolerance from that spread. ``sp`` reads the reference, runs the same cases and writes
``OUT_DIR/deltas-rank{R}.json``: the largest absolute difference of every compared quantity.

Cases (each builds fresh models with seed 0):

* ``train``: 10 AdamW steps (clip 1.0), a new batch of 4 x 16 tokens each step; losses (the
  model's loss metric), gradient norms and final weights. ``lora_train``: the same, 5 steps, training a
  LoRA adapter (its weights compared).
* ``grad_*``: one forward_backward, then the normalised gradient (``clip_grad_norm(inf)``) of every
  parameter: right-padded rows of length 15 (not a multiple of sp), packed rows (position_ids
  resets), left padding, a model with a single kv head (kv heads repeated across sp ranks),
  two accumulated micro-batches (``gradient_accumulation_steps=2``, DDP ``no_sync``), and a LoRA
  adapter with gradient checkpointing on packed rows (attention recomputed in backward).
* ``eval_*``: ``forward_only`` logits (gathered over the sp group) of the padded and packed batches.

``sp`` also resumes: 2 training steps, ``save`` (the optimizer through the data-parallel strategy: one file
under DDP, a sharded DCP checkpoint under FSDP2), a model of another seed resumed from it, 2 more steps; their
losses must equal steps 2 and 3 of the uninterrupted ``train`` run bit for bit (``_resume_loss_delta``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from twinkle_backend_hf.testing import tiny_qwen2_config

from twinkle_core.testing.conformance import LORA_CONFIG

VOCAB = 64
STEPS = 10
LORA_STEPS = 5


# ---------------------------------------------------------------------- batches
def lm_batch(seed: int, rows: int = 4, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels = ids.clone()
    prompt = torch.randint(1, length // 2, (rows,), generator=g)
    for i in range(rows):
        labels[i, : int(prompt[i])] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def right_padded_batch(seed: int, length: int = 15) -> dict[str, torch.Tensor]:
    batch = lm_batch(seed, rows=4, length=length)
    for row, real in enumerate((length, 11, 6, 13)):
        batch["attention_mask"][row, real:] = 0
        batch["labels"][row, real:] = -100
        batch["input_ids"][row, real:] = 0
    return batch


def left_padded_batch(seed: int, length: int = 16) -> dict[str, torch.Tensor]:
    batch = lm_batch(seed, rows=4, length=length)
    for row, pad in enumerate((0, 5, 9, 2)):
        batch["attention_mask"][row, :pad] = 0
        batch["labels"][row, : pad + 1] = -100  # pads, and the first real token (no real token predicts it)
        batch["input_ids"][row, :pad] = 0
    return batch


def packed_batch(seed: int, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, length), generator=g)
    lengths = [(5, 7, 4), (9, 3, 4)]  # the last piece of each row continues as right padding below
    positions = torch.zeros_like(ids)
    labels = ids.clone()
    for row, pieces in enumerate(lengths):
        start = 0
        for n in pieces:
            positions[row, start : start + n] = torch.arange(n)
            labels[row, start] = -100  # a sequence's first token is predicted by nothing in it
            start += n
    labels[1, 14:] = -100  # padding of row 1: positions continue its last sequence
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


# ---------------------------------------------------------------------- models
def make_model(strategy, options=None, seed=0, **config_overrides):
    from twinkle_backend_hf.model import TransformersModel

    return TransformersModel(config=tiny_qwen2_config(vocab_size=VOCAB, **config_overrides), seed=seed,
                             attn_implementation="sdpa", strategy=strategy, **(options or {}))


def lora_model(strategy, options=None):
    model = make_model(strategy, options)
    model.add_adapter_to_model("sft", LORA_CONFIG)
    return model


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 shard (a collective: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def grads(model) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.module.named_parameters()}
    return {names[id(p)]: whole(p.grad).detach().clone() for p in model.trainable_parameters() if p.grad is not None}


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.get_state_dict().items()}


def train_steps(model, rows, steps) -> tuple[list[float], list[float]]:
    """One AdamW step (clip 1.0) on ``lm_batch(100 + step)`` for each of ``steps``: the losses and gradient norms."""
    losses, norms = [], []
    for step in steps:
        model.forward_backward(inputs=rows(model, lm_batch(100 + step)))
        norms.append(float(model.clip_grad_and_step(max_grad_norm=1.0)))
        losses.append(model.calculate_metric()["loss"])
    return losses, norms


def run_training(model, rows, steps=STEPS, prefix="train") -> dict[str, object]:
    """``steps`` AdamW steps: the losses, gradient norms and final weights."""
    model.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01)
    losses, norms = train_steps(model, rows, range(steps))
    return {f"{prefix}_losses": torch.tensor(losses, dtype=torch.float64),
            f"{prefix}_grad_norms": torch.tensor(norms, dtype=torch.float64), f"{prefix}_weights": state(model)}


def all_training(strategy_factory, rows) -> dict[str, object]:
    """The full fine-tuning and the LoRA training runs."""
    return {**run_training(make_model(strategy_factory()), rows),
            **run_training(lora_model(strategy_factory()), rows, LORA_STEPS, "lora_train")}


def resumed_losses(strategy_factory, rows, out_dir: str) -> list[float]:
    """Steps 2 and 3 of ``run_training``, run by a model of another seed resumed from a checkpoint of steps 0-1."""
    first = make_model(strategy_factory())
    first.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01)
    train_steps(first, rows, range(2))
    path = first.save("resume", output_dir=out_dir)
    resumed = make_model(strategy_factory(), seed=7)
    resumed.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01)
    resumed.resume_from_checkpoint(path)
    return train_steps(resumed, rows, range(2, 4))[0]


def run_cases(strategy_factory, rows=lambda model, batch: batch) -> dict[str, object]:
    """``rows(model, batch)``: the rows this rank feeds (all of them, except under data parallelism)."""
    results = all_training(strategy_factory, rows)

    checkpointing = {"gradient_checkpointing": True}
    cases = {  # name: (config overrides, model options, LoRA?, micro-batches)
        "grad_right_padded": ({}, {}, False, [right_padded_batch(7)]),
        "grad_packed": ({}, {}, False, [packed_batch(8)]),
        "grad_left_padded": ({}, {}, False, [left_padded_batch(9)]),
        "grad_single_kv_head": ({"num_key_value_heads": 1}, {}, False, [lm_batch(10)]),
        "grad_accumulated": ({}, {}, False, [lm_batch(11), right_padded_batch(12)]),
        "grad_lora_checkpointing_packed": ({}, checkpointing, True, [packed_batch(13)]),
    }
    for name, (overrides, options, lora, batches) in cases.items():
        model = make_model(strategy_factory(), options, **overrides)
        if lora:
            model.add_adapter_to_model("sft", LORA_CONFIG)
        model.set_optimizer("SGD", lr=0.1, gradient_accumulation_steps=len(batches))
        for batch in batches:
            model.forward_backward(inputs=rows(model, batch))
        model.clip_grad_norm(math.inf)
        results[name] = grads(model)

    model = make_model(strategy_factory())
    for name, batch in (("eval_right_padded", right_padded_batch(7)), ("eval_packed", packed_batch(8))):
        batch = rows(model, batch)
        logits = model.forward_only(inputs=batch)["logits"].detach()
        keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        results[name] = logits * keep[..., None]  # padding positions differ by construction (garbage either way)
    return results


def sp_controls(strategy_factory, reference, rows) -> dict[str, object]:
    """Evidence that the sp path really ran, and a negative control showing the parity checks can fail."""
    from torch.distributed.tensor import DTensor
    from twinkle_backend_hf.sequence_parallel import ulysses

    strategy = strategy_factory()
    model = make_model(strategy)
    batch = rows(model, lm_batch(100))
    out = model.forward(inputs=batch)
    evidence = {
        "_attn_implementation": model.hf_model.config._attn_implementation,
        "_local_logits_shape": list(out["logits"].shape),
        "_global_logits_shape": list(batch["input_ids"].shape) + [VOCAB],
        "_gradient_average_size": strategy.gradient_average_size,
        "_gradient_scale_x_tokens": strategy.gradient_scale(100.0) * 100.0,
        "_sharded_parameters": sum(isinstance(p, DTensor) for p in model.trainable_parameters()),
        "_parameters": len(model.trainable_parameters()),
    }
    # the packed case without its block-diagonal mask must NOT match the reference
    original = ulysses.packed_mask
    ulysses.packed_mask = lambda *args, **kwargs: None
    try:
        model = make_model(strategy_factory())
        model.set_optimizer("SGD", lr=0.1)
        model.forward_backward(inputs=rows(model, packed_batch(8)))
        model.clip_grad_norm(math.inf)
        evidence["_control_packed_without_mask"] = max_delta(grads(model), reference["grad_packed"])
    finally:
        ulysses.packed_mask = original
    return evidence


def max_delta(a, b) -> float:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max(max_delta(a[k], b[k]) for k in a)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.double() - b.double()).abs().max())


def main() -> int:
    mode, out_dir = sys.argv[1], sys.argv[2]
    torch.use_deterministic_algorithms(True)
    start = time.time()
    if mode == "reference":
        results = run_cases(lambda: "single")
        torch.save(results, os.path.join(out_dir, "reference.pt"))
        reordered = all_training(lambda: "single", rows=lambda model, batch: {k: v.flip(0) for k, v in batch.items()})
        spread = {key: max_delta(reordered[key], results[key]) for key in reordered}
        with open(os.path.join(out_dir, "spread.json"), "w") as f:
            json.dump(spread, f, indent=1)
        print(f"reference done in {time.time() - start:.1f}s")
        return 0
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

    from twinkle_core.mesh import DeviceMesh
    from twinkle_core.testing.conformance import local_rows

    world = int(os.environ["WORLD_SIZE"])
    dp = int(sys.argv[3]) if len(sys.argv) > 3 else 1  # optional data-parallel size (world = dp * sp)
    data_parallel = sys.argv[4] if len(sys.argv) > 4 else "ddp"  # what synchronises the data dimension
    mesh = DeviceMesh(dp=dp, sp=world // dp)

    def strategy_factory():
        return SequenceParallelStrategy(mesh=mesh, data_parallel=data_parallel)

    results = run_cases(strategy_factory, rows=local_rows)
    reference = torch.load(os.path.join(out_dir, "reference.pt"), weights_only=False)
    dp_rank = int(os.environ["RANK"]) // mesh.sp
    for key in ("eval_right_padded", "eval_packed"):  # this rank's rows of the reference logits
        n = reference[key].shape[0] // dp
        reference[key] = reference[key][dp_rank * n : (dp_rank + 1) * n]
    deltas = {key: max_delta(results[key], reference[key]) for key in reference}
    deltas.update(sp_controls(strategy_factory, reference, local_rows))
    resumed = resumed_losses(strategy_factory, local_rows, out_dir)
    deltas["_resume_loss_delta"] = max_delta(torch.tensor(resumed, dtype=torch.float64), results["train_losses"][2:4])
    deltas["_seconds"] = time.time() - start
    deltas["_losses"] = results["train_losses"].tolist()
    deltas["_reference_losses"] = reference["train_losses"].tolist()
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"deltas-rank{rank}.json"), "w") as f:
        json.dump(deltas, f, indent=1)
    print(json.dumps({"rank": rank, **deltas}))
    return 0


if __name__ == "__main__":
    code = main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job(code or 0)
