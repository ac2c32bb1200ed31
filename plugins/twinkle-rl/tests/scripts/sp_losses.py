"""Per-sequence losses under sequence parallelism vs. whole sequences (gloo, CPU).

    python sp_losses.py reference OUT_DIR            # one process: the model cases with strategy "single"
    torchrun --nproc-per-node 2 sp_losses.py sp OUT_DIR

``sp`` writes ``OUT_DIR/rank{R}.json`` with two parts:

* ``losses``: every preference and policy loss on float64 logits, each rank holding its slice of every row (the
  HF backend's own :func:`~twinkle_backend_hf.sequence_parallel.batch_sharding.shard_batch`, ``contiguous`` as Ulysses
  splits and ``zigzag`` as ring attention does) with ``LossContext(sp_group=world, sp_size=2)``, normalised as the
  model does (summed ranks' losses over the summed ``num_tokens``). Per loss and layout: the loss and the gradient
  of the logits (gathered back) against the whole-row loss computed on one rank, the largest magnitudes, and
  ``num_tokens`` summed over the ranks against the whole batch's.
* ``model``: one ``forward_backward`` of a tiny Qwen2 (fp32) under strategy ``ulysses`` (mesh ``sp=2``, and
  ``cp_impl: ring``) per loss: the model's loss metric and the normalised gradients (``clip_grad_norm(inf)``)
  against the ``reference`` run.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

VOCAB = 64
DT = torch.float64
#: loss name: options; the model cases use MODEL_LOSSES of them
LOSSES = {
    "dpo": {"beta": 0.5}, "dpo_ipo_sft": {"name": "dpo", "beta": 0.5, "loss_type": "ipo", "sft_weight": 0.3,
                                          "sft_normalization": "batch_tokens"},
    "simpo": {}, "orpo": {}, "grpo": {"beta": 0.05}, "gspo": {"epsilon_low": 0.1, "epsilon_high": 0.1, "beta": 0.05},
    "dr_grpo": {"max_completion_length": 20, "beta": 0.05}, "dapo": {"beta": 0.05}, "ppo": {},
}
MODEL_LOSSES = ("dpo", "grpo", "gspo", "dr_grpo")
PREFERENCE = ("dpo", "dpo_ipo_sft", "simpo", "orpo")


def make_loss(key: str):
    from twinkle_core.plugins import get_plugins

    options = dict(LOSSES[key])
    return get_plugins().load("loss", options.pop("name", key))(**options)


def batch(key: str, rows: int = 4, length: int = 15, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows with prompts of different lengths and right padding (``length`` is not a multiple of 2 or 4, so the
    strategy pads); the preference layout (2 pairs, reference log-probs) or the policy inputs per token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    for row, (prompt, real) in enumerate(((3, length), (5, 12), (2, 9), (6, 14))):
        labels[row, :prompt] = -100
        labels[row, real:] = -100
        mask[row, real:] = 0
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if key in PREFERENCE:
        out.update(pair_index=torch.arange(rows) // 2, is_chosen=torch.arange(rows) % 2 == 0,
                   ref_logps=torch.randn(rows, generator=g) * 3 - 40)
    else:
        out["advantages"] = (torch.randn(rows, length, generator=g) if key == "ppo"
                             else torch.randn(rows, generator=g))
        out["old_logps"] = -torch.rand(rows, length, generator=g) * 0.2 - 4.0  # aligned with labels
        out["ref_logps"] = -torch.rand(rows, length, generator=g) * 0.2 - 4.0
    return out


# ---------------------------------------------------------------------- the losses alone
def sliced_loss(key: str, layout: str, group_size: int, rank: int) -> dict[str, float]:
    """The loss on this rank's slices against the whole-row loss; gradients of the float64 logits."""
    from twinkle_backend_hf.sequence_parallel.batch_sharding import shard_batch

    from twinkle_core.loss.base import LossContext

    whole = {k: v.to(DT) if v.is_floating_point() else v for k, v in batch(key).items()}
    logits = torch.randn(4, 15, VOCAB, generator=torch.Generator().manual_seed(1), dtype=DT).mul(2)
    loss = make_loss(key)
    leaf = logits.clone().requires_grad_(True)
    expected = loss({"logits": leaf}, whole)
    (expected_grad,) = torch.autograd.grad(expected.loss / float(expected.num_tokens), leaf)
    # the token index rides along as input_ids (+1: the alignment padding is pad_token_id 0), to cut the logits
    indexed = {**whole, "input_ids": torch.arange(1, 16).expand(4, -1)}
    local, _ = shard_batch(indexed, group_size, rank, layout=layout)
    index = local.pop("input_ids") - 1
    leaf = logits.clone().requires_grad_(True)
    padded = torch.cat([leaf, leaf.new_zeros(4, 1, VOCAB)], dim=1)  # index -1 (padding) reads the zero column
    local_logits = padded[torch.arange(4)[:, None], index]
    group = torch.distributed.group.WORLD
    out = loss({"logits": local_logits}, local, context=LossContext(sp_group=group, sp_size=group_size))
    tokens = torch.tensor(float(out.num_tokens), dtype=DT)
    torch.distributed.all_reduce(tokens)
    total = out.loss.detach().clone()
    torch.distributed.all_reduce(total)
    (got_grad,) = torch.autograd.grad(out.loss / tokens, leaf)
    got_grad = got_grad.contiguous()  # autograd may hand back a strided view, which gloo would not reduce in place
    torch.distributed.all_reduce(got_grad)  # every rank's slice of the gradient (the others' are zero)
    return {"loss": float(total / tokens), "reference_loss": float(expected.loss.detach() / float(expected.num_tokens)),
            "num_tokens": float(tokens), "reference_num_tokens": float(expected.num_tokens),
            "grad_delta": float((got_grad - expected_grad).abs().max()),
            "grad_magnitude": float(expected_grad.abs().max())}


# ---------------------------------------------------------------------- the model
def model_step(strategy, key: str) -> tuple[float, dict[str, torch.Tensor]]:
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config

    model = TransformersModel(config=tiny_qwen2_config(vocab_size=VOCAB), seed=0, attn_implementation="sdpa",
                              strategy=strategy)
    options = dict(LOSSES[key])
    model.set_loss(options.pop("name", key), **options)
    model.set_optimizer("SGD", lr=0.1)
    model.forward_backward(inputs=batch(key))
    model.clip_grad_norm(math.inf)
    names = {id(p): n for n, p in model.module.named_parameters()}
    grads = {names[id(p)]: p.grad.detach().clone() for p in model.trainable_parameters() if p.grad is not None}
    return model.calculate_metric()["loss"], grads


def max_delta(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main(mode: str, out_dir: str) -> None:
    torch.use_deterministic_algorithms(True)
    if mode == "reference":
        torch.save({key: model_step("single", key) for key in MODEL_LOSSES}, os.path.join(out_dir, "reference.pt"))
        return
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

    from twinkle_core.mesh import DeviceMesh
    from twinkle_core.testing.torchrun import exit_job

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    results: dict[str, object] = {"losses": {f"{key}/{layout}": sliced_loss(key, layout, world, rank)
                                             for key in LOSSES for layout in ("contiguous", "zigzag")}}
    saved = torch.load(os.path.join(out_dir, "reference.pt"), weights_only=False)
    model: dict[str, object] = {}
    for cp_impl in ("ulysses", "ring"):
        for key in MODEL_LOSSES:
            ref_loss, ref_grads = saved[key]
            loss, grads = model_step(SequenceParallelStrategy(mesh=DeviceMesh(sp=world), cp_impl=cp_impl), key)
            model[f"{key}/{cp_impl}"] = {
                "loss": loss, "reference_loss": ref_loss, "grad_delta": max_delta(grads, ref_grads),
                "grad_magnitude": max(float(g.abs().max()) for g in ref_grads.values())}
    results["model"] = model
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    exit_job(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
