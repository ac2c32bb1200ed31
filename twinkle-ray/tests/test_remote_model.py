"""The Python API through a worker group: the README's loop with a RemoteModel of 2 DDP ranks gives one
process's losses and gradient norms (the whole batch in one process) within float32 rounding."""

from __future__ import annotations

import pytest
import torch
from twinkle_ray.remote_model import RemoteModel, merge_outputs, split_batch
from twinkle_ray.worker_group import WorkerGroup

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.testing.tolerance import assert_within_spread, sum_tolerance

STEPS, ROWS, WIDTH, VOCAB = 8, 8, 24, 128


def batches(reverse_rows: bool = False) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):  # two batches, seen in turn: the model memorises them, so the losses fall
        ids = torch.randint(0, VOCAB, (ROWS, WIDTH), generator=generator)
        lengths = torch.randint(WIDTH // 2, WIDTH + 1, (ROWS,), generator=generator)
        mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE_INDEX))
        labels[:, :4] = IGNORE_INDEX  # a prompt
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        out.append({k: v.flip(0) for k, v in batch.items()} if reverse_rows else batch)
    return [out[step % 2] for step in range(STEPS)]


def train(model, data) -> tuple[list[float], list[float]]:
    model.set_loss("cross_entropy")
    model.set_optimizer("AdamW", lr=1e-2)
    losses, norms = [], []
    for batch in data:
        out = model.forward_backward(inputs=batch)
        norms.append(float(model.clip_grad_and_step(max_grad_norm=1.0)))
        losses.append(float(out["loss"]))
    return losses, norms


def model_options() -> dict:
    from twinkle_backend_hf.testing import tiny_qwen2_config

    return {"config": tiny_qwen2_config(vocab_size=VOCAB), "seed": 0}


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_readme_loop_through_two_ddp_ranks_equals_one_process(ray_cluster, worker_env):
    pytest.importorskip("twinkle_backend_hf")
    from twinkle_backend_hf.model import TransformersModel

    reference = train(TransformersModel(**model_options()), batches())
    reordered = train(TransformersModel(**model_options()), batches(reverse_rows=True))
    with WorkerGroup(2, env=worker_env) as group:
        remote = RemoteModel(group, "TransformersModel", strategy="ddp", **model_options())
        assert remote.dp_ranks == [0, 1] and remote.dp_size == 2
        got = train(remote, batches())
        configs = remote.get_train_configs()
    assert reference[0][-1] < reference[0][0] - 0.3, f"the model did not learn: {reference[0]}"
    tokens = int(sum((b["labels"] != IGNORE_INDEX).sum() for b in batches()) / STEPS)
    numel = sum(p.numel() for p in TransformersModel(**model_options()).trainable_parameters())
    delta = assert_within_spread("losses", got[0], reference[0], reordered[0],
                                 floor=sum_tolerance(tokens, max(reference[0])))
    assert_within_spread("pre-clip grad norms", got[1], reference[1], reordered[1],
                         floor=sum_tolerance(numel, max(reference[1])))
    assert configs["strategy"] == "ddp" or "ddp" in str(configs), configs
    print(f"max |loss - one process| = {delta:.3g} over {STEPS} steps")


def test_split_batch_gives_each_rank_a_contiguous_slice():
    batch = {"input_ids": torch.arange(12).reshape(6, 2), "labels": list(range(6)), "flag": "x"}
    first, second = split_batch(batch, 2)
    assert first["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5]] and second["labels"] == [3, 4, 5]
    assert first["flag"] == second["flag"] == "x"
    with pytest.raises(ConfigError, match="6 rows does not split evenly over 4"):
        split_batch(batch, 4)


def test_merged_outputs_are_what_one_process_returns_for_the_whole_batch():
    """Per-rank means over their own tokens become the mean over all tokens; counts add; rows concatenate."""
    a = {"loss": torch.tensor(1.0), "num_tokens": 3, "logps": torch.zeros(2, 4), "accuracy": 0.5}
    b = {"loss": torch.tensor(3.0), "num_tokens": 1, "logps": torch.ones(1, 4), "accuracy": 1.0}
    merged = merge_outputs([a, b])
    assert merged["num_tokens"] == 4
    assert merged["loss"].item() == pytest.approx((1.0 * 3 + 3.0 * 1) / 4)
    assert merged["accuracy"] == pytest.approx((0.5 * 3 + 1.0) / 4)
    assert merged["logps"].shape == (3, 4)
