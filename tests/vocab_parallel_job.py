"""Two gloo ranks: the vocabulary-parallel losses against the same losses on the whole logits.

Launched by tests/test_vocab_parallel.py (``torchrun --nproc-per-node 2``). Every rank builds the same full
logits ``[B, T, padded V]`` (padding columns set large, so a padding row that got probability would show), keeps
its slice ``start:end`` as a leaf, runs a loss with ``LossContext(vocab_shard=...)`` and back-propagates; the
reference is the unsharded loss on ``logits[..., :vocab_size]``. Losses must agree, and each rank's gradient must
be the reference gradient's columns ``start:end`` (zero on padding columns). float64 to ~1e-12, float32 within
:func:`twinkle_core.testing.tolerance.sum_tolerance`. Prints ``vocab-parallel checks passed`` at the end.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossContext
from twinkle_core.loss.cross_entropy import ChunkedCrossEntropyLoss, CrossEntropyLoss
from twinkle_core.loss.gkd import GKDLoss
from twinkle_core.loss.logprobs import tempered_token_logprobs, token_logprobs
from twinkle_core.loss.vocab_parallel import VocabShard, vocab_parallel_argmax
from twinkle_core.metrics import TokenAccuracy
from twinkle_core.testing.tolerance import sum_tolerance

B, T = 3, 9
#: (real vocabulary, padded vocabulary): 13 -> 14 leaves rank 1 one padding column, 5 -> 8 three, 3 -> 8 rank 1
#: no real token at all
VOCABS = ((13, 14), (5, 8), (3, 8))


def shard_for(vocab: int, padded: int) -> VocabShard:
    width = padded // dist.get_world_size()
    start = dist.get_rank() * width
    return VocabShard(start=start, end=start + width, vocab_size=vocab, group=None)


def batch(vocab: int, padded: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(vocab * 31 + padded)
    logits = (torch.randn(B, T, padded, generator=generator, dtype=torch.float64) * 4).to(dtype)
    logits[..., vocab:] = 60.0  # a padding row that got any probability would dominate the softmax
    labels = torch.randint(0, vocab, (B, T), generator=generator)
    labels[0, :4] = -100  # a prompt
    labels[2, -2:] = -100  # padding
    return logits, labels


def tolerance(dtype: torch.dtype, terms: int, magnitude: float) -> float:
    if dtype == torch.float64:
        return 1e-12 * max(1.0, magnitude)
    return sum_tolerance(terms, magnitude, dtype)


def close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    delta = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    if not delta <= tol:
        raise AssertionError(f"rank {dist.get_rank()} {what}: max |sharded - full| = {delta:.3g} > {tol:.3g}")


def compare(what: str, fn, vocab: int, padded: int, dtype: torch.dtype) -> None:
    """``fn(logits, labels, shard_or_None) -> tensor`` (reduced with fixed random weights before backward)."""
    logits, labels = batch(vocab, padded, dtype)
    shard = shard_for(vocab, padded)
    full = logits[..., :vocab].clone().requires_grad_(True)
    local = logits[..., shard.start : shard.end].clone().requires_grad_(True)
    want, got = fn(full, labels, None), fn(local, labels, shard)
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=want.dtype).view(want.shape)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    magnitude = float(logits[..., :vocab].abs().max()) + math.log(vocab) + 1.0
    per_token = tolerance(dtype, vocab, magnitude)
    summed = B * T if want.numel() == 1 else 1  # a loss summed over the tokens adds their errors
    close(f"{what} value", got.detach(), want.detach(), per_token * summed)
    expected = torch.zeros_like(local)
    real = shard.real_width
    expected[..., :real] = full.grad[..., shard.start : shard.start + real]
    close(f"{what} gradient", local.grad, expected, per_token)


def cross_entropy(loss):
    def fn(logits, labels, shard):
        return loss({"logits": logits}, {"labels": labels}, context=LossContext(vocab_shard=shard)).loss
    return fn


def tempered(temperature):
    def fn(logits, labels, shard):
        scored = tempered_token_logprobs(logits, labels, temperature=temperature, chunk_size=4, vocab_shard=shard)
        return torch.stack([scored.logps, scored.entropy])  # the entropy (no gradient) is compared as a value
    return fn


def plain_logprobs(logits, labels, shard):
    return token_logprobs(logits, labels, chunk_size=5, temperature=1.3, vocab_shard=shard)[0]


def check_argmax() -> None:
    shard = shard_for(10, 12)  # rank 0: 0..5, rank 1: 6..11 (10, 11 padding)
    full = torch.tensor([[1.0, 7.0, 3.0, 7.0, 0.0, 0.0, 7.0, 2.0, 0.0, 0.0, 99.0, 99.0],
                         [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0, 9.0, 0.0, 8.0, 99.0, 99.0],
                         [5.0] * 10 + [99.0, 99.0]])
    got = vocab_parallel_argmax(full[:, shard.start : shard.end], shard)
    assert got.tolist() == full[:, :10].argmax(-1).tolist() == [1, 6, 0], got.tolist()
    logits = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(4))
    sharded, whole = TokenAccuracy(), TokenAccuracy()
    sharded.reset()
    whole.reset()
    sharded.update({"labels": labels}, {"logits": logits[..., shard.start : shard.end]}, None,
                   context=LossContext(vocab_shard=shard))
    whole.update({"labels": labels}, {"logits": logits[..., :10]}, None)
    assert sharded.totals() == whole.totals(), (sharded.totals(), whole.totals())


def check_refusal() -> None:
    logits, labels = batch(13, 14, torch.float32)
    shard = shard_for(13, 14)
    local = logits[..., shard.start : shard.end]
    try:
        GKDLoss()({"logits": local}, {"labels": labels, "teacher_logits": local}, context=LossContext(vocab_shard=shard))
    except ConfigError as error:
        assert "vocab_parallel_loss" in str(error), error
    else:
        raise AssertionError("GKDLoss took a vocabulary shard")
    fused = {"hidden_states": torch.randn(B, T, 4), "lm_head_weight": torch.randn(shard.width, 4)}
    try:
        CrossEntropyLoss(lm_head="fused")(fused, {"labels": labels}, context=LossContext(vocab_shard=shard))
    except ConfigError as error:
        assert "vocab_parallel_loss" in str(error), error
    else:
        raise AssertionError("the fused LM head took a vocabulary shard")


def main() -> None:
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 2, "run with --nproc-per-node 2"
    losses = {
        "cross_entropy": cross_entropy(CrossEntropyLoss()),
        "cross_entropy (label smoothing, mean)": cross_entropy(CrossEntropyLoss(label_smoothing=0.1, reduction="mean")),
        "chunked_cross_entropy": cross_entropy(ChunkedCrossEntropyLoss(chunk_size=3, label_smoothing=0.2)),
        "tempered_token_logprobs T=0.7": tempered(0.7),
        "token_logprobs T=1.3": plain_logprobs,
    }
    for dtype in (torch.float64, torch.float32):
        for vocab, padded in VOCABS:
            for name, fn in losses.items():
                compare(f"{name} {dtype} vocab {vocab}/{padded}", fn, vocab, padded, dtype)
    check_argmax()
    check_refusal()
    dist.barrier()
    print(f"rank {dist.get_rank()}: vocab-parallel checks passed", flush=True)
    from twinkle_core.testing.torchrun import exit_job

    exit_job(0)


if __name__ == "__main__":
    sys.exit(main())
