"""Plain float64 references shared by every loss test (the core's and the plugins'): a random batch of logits and
labels, log-softmax written out, per-token log-probabilities by explicit loops, and the accumulation rule the model
applies (micro-batch sums over the total count). Slow on purpose: each is the formula, not an implementation."""

from __future__ import annotations

from typing import Any

import torch

from twinkle_core.constants import IGNORE_INDEX

IGNORE = IGNORE_INDEX
DT = torch.float64


def log_softmax_row(z: torch.Tensor) -> torch.Tensor:
    return z - torch.log(torch.exp(z - z.max()).sum()) - z.max()


def make_batch(b: int = 3, t: int = 6, v: int = 7, seed: int = 0, ignore_prefix: bool = True,
               dtype: torch.dtype = DT) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[b, t, v]`` (requiring grad) and labels with prompts of different lengths and right padding."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=dtype).mul(2).requires_grad_(True)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[:, 0] = IGNORE  # the "prompt" start
    if ignore_prefix:
        for i in range(b):
            labels[i, : 1 + (i % 3)] = IGNORE  # prompt lengths differ per row
        labels[-1, -1] = IGNORE  # right padding on the last row
    return logits, labels


def naive_token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> dict[tuple, Any]:
    """{(b, t): log softmax(logits[b, t] / T)[labels[b, t + 1]]} over non-ignored labels."""
    out = {}
    b_, t_, _ = logits.shape
    for b in range(b_):
        for t in range(t_ - 1):
            y = int(labels[b, t + 1])
            if y != IGNORE:
                out[(b, t)] = log_softmax_row(logits[b, t] / temperature)[y]
    return out


def grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


def close(a: Any, b: Any, tol: float = 1e-10) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=DT), torch.as_tensor(b, dtype=DT), rtol=tol, atol=tol)


def accumulate(loss_fn: Any, micro_batches: list[tuple[dict, dict]]) -> torch.Tensor:
    """Sum of micro-batch losses over the total num_tokens, as the model computes it."""
    outs = [loss_fn(o, i) for o, i in micro_batches]
    return sum(o.loss for o in outs) / sum(float(o.num_tokens) for o in outs)


def whole(loss_fn: Any, outputs: dict, inputs: dict) -> torch.Tensor:
    """The loss of the whole batch at once, divided by its count."""
    out = loss_fn(outputs, inputs)
    return out.loss / float(out.num_tokens)


def rows(d: dict[str, Any], idx: Any) -> dict[str, Any]:
    return {k: v[idx] for k, v in d.items()}
