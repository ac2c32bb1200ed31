r"""Tinker's built-in loss functions (``forward_backward(data, loss_fn=..., loss_fn_config=...)``), computed as
Tinker documents them.

Notation: for every position ``t`` of a datum, ``lp_t`` is ``target_logprobs`` (the learner's
:math:`\log p_\theta(x_t)`, computed here, with gradient), ``q_t`` is ``loss_fn_inputs["logprobs"]`` (the sampler's
:math:`\log q(x_t)`, recorded at sampling time), ``A_t`` is ``loss_fn_inputs["advantages"]``, ``w_t`` is
``loss_fn_inputs["weights"]`` and :math:`r_t = \exp(lp_t - q_t)` is the importance ratio. Every loss is a **sum** over
tokens (and over the datums of a request) — never a mean; aggregation choices are the client's, through advantages
or weights. ``clip(x, lo, hi)`` is ``torch.clamp``: the thresholds bound the *ratio* itself (PPO's default 0.8/1.2 is
:math:`1 \mp \epsilon` with :math:`\epsilon = 0.2`). ``sg`` is stop-gradient (``.detach()``).

``cross_entropy`` (inputs ``target_tokens``, ``weights``; no config):
    :math:`L = -\sum_t w_t \, lp_t`.
``importance_sampling`` (inputs ``target_tokens``, ``logprobs``, ``advantages``; no config):
    :math:`L = -\sum_t r_t A_t`.
``ppo`` (same inputs; config ``clip_low_threshold`` = 0.8, ``clip_high_threshold`` = 1.2):
    :math:`L = -\sum_t \min(r_t A_t,\ \mathrm{clip}(r_t, lo, hi) A_t)`.
``cispo`` (same inputs; config ``clip_low_threshold`` = 0.0, ``clip_high_threshold`` = 4.0):
    :math:`L = -\sum_t \mathrm{sg}[\mathrm{clip}(r_t, lo, hi)] \, lp_t \, A_t`.
``dro`` (same inputs; config ``beta`` = 0.05):
    :math:`L = -\sum_t \left(lp_t A_t - \tfrac12 \beta (lp_t - q_t)^2\right)`.
``gspo`` — GSPO-token (inputs also ``sequence_ratio_mask``; config ``clip_low_threshold`` and
``clip_high_threshold``, both REQUIRED here because Tinker's defaults for gspo are not published):
    with :math:`M` the positions whose ``sequence_ratio_mask`` is non-zero,
    :math:`s = \exp(\frac{1}{|M|}\sum_{t \in M} (\mathrm{sg}[lp_t] - q_t))` and
    :math:`s_t = \exp(\log s + lp_t - \mathrm{sg}[lp_t])` (the value of ``s``, the gradient of the token's own
    log-probability), :math:`L = -\sum_t \min(s_t A_t,\ \mathrm{clip}(s_t, lo, hi) A_t)` over all positions.

Sources (formulas, input and output names, the ``loss:sum`` metric):

- https://tinker-docs.thinkingmachines.ai/tinker/losses/ and its pages ``/tinker/losses/ppo``, ``/cispo``, ``/dro``,
  ``/gspo/``, ``/stable-reinforce/``; the same text for cross_entropy / importance_sampling / ppo / cispo / dro is in
  github.com/thinking-machines-lab/tinker-cookbook ``docs/losses.mdx`` (commit a2b1b820).
- Defaults: PPO's 0.8 / 1.2 — the ppo page ("fixed to 0.2") and tinker-cookbook ``tutorials/202_loss_functions.py``;
  CISPO's one-sided 0.0 / 4.0 — same tutorial, tinker-cookbook commit acf3e5a9 ("CISPO now defaults to a one-sided
  clip (clip_low=0, clip_high=4) on the backend ... PPO's default stays 0.8/1.2"); DRO's ``beta`` = 0.05 —
  tinker-cookbook ``tinker_cookbook/recipes/loss_fn_comparison/README.md`` (commit 3db93cab, configuration table).
- ``loss:sum`` is the metric the docs list for every loss and that the SDK reads
  (``tinker/lib/public_interfaces/training_client.py`` pops ``metrics["loss:sum"]``; every metric name must be
  ``name:reduction`` for ``chunked_fwdbwd_helpers._metrics_reduction`` to combine chunks).
- Per-token outputs: the docs list ``logprobs`` (the target log-probabilities); ``elementwise_loss`` (the per-token
  summand of ``loss:sum``, the docs' ``elementwise_loss`` variable) is what public client code reads from Tinker's
  ``cross_entropy`` outputs, and is returned here for every loss.

Left out: ``stable_reinforce`` — its objective uses stability information Tinker records server-side at sampling
time (``record_stability_info=True``, per-position ``sequence_id`` provenance) and the formula is not published.
``custom`` — a loss uploaded to the server (``create_custom_loss``) is not supported: a custom loss runs on the
client (``forward_backward_custom``, which the SDK sends as ``cross_entropy`` with the loss's gradient as weights).

Padding: positions where ``mask`` is False contribute exactly 0 to the loss and get exactly 0 gradient, whatever
values (even NaN) the padded inputs hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle_server.errors import BadRequest

__all__ = ["SUPPORTED", "LossResult", "TinkerLoss", "UnsupportedLoss", "tinker_loss"]

_CLIP_LOW = "clip_low_threshold"
_CLIP_HIGH = "clip_high_threshold"
_BETA = "beta"
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")


class UnsupportedLoss(BadRequest):
    """A loss function this server does not compute: unknown, unpublished, or ``custom``."""


@dataclass
class LossResult:
    loss: torch.Tensor  # scalar: the documented SUM, what is back-propagated
    per_token: dict[str, torch.Tensor]  # [B, T], detached; 0 on padding
    metrics: dict[str, float]


@dataclass(frozen=True)
class _Spec:
    required_inputs: tuple[str, ...]
    # config key -> default; None: the key must be given (no published default)
    config: dict[str, float | None]
    compute: Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, float]], torch.Tensor]
    no_default_reason: str = ""


# ---- the documented per-token terms (inputs already zeroed on padding; the caller masks the result) ----------------


def _cross_entropy(lp: torch.Tensor, x: dict[str, torch.Tensor], mask: torch.Tensor, c: dict[str, float]):
    return -(lp * x["weights"])


def _importance_sampling(lp, x, mask, c):
    ratio = torch.exp(lp - x["logprobs"])
    return -(ratio * x["advantages"])


def _ppo(lp, x, mask, c):
    ratio = torch.exp(lp - x["logprobs"])
    clipped = torch.clamp(ratio, c[_CLIP_LOW], c[_CLIP_HIGH])
    adv = x["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


def _cispo(lp, x, mask, c):
    ratio = torch.exp(lp - x["logprobs"])
    clipped = torch.clamp(ratio, c[_CLIP_LOW], c[_CLIP_HIGH]).detach()
    return -(clipped * lp * x["advantages"])


def _dro(lp, x, mask, c):
    quadratic = (lp - x["logprobs"]) ** 2
    return -(lp * x["advantages"] - 0.5 * c[_BETA] * quadratic)


def _gspo(lp, x, mask, c):
    in_ratio = (x["sequence_ratio_mask"] != 0) & mask
    count = in_ratio.sum(dim=1)
    empty = (count == 0) & mask.any(dim=1)
    if bool(empty.any()):
        rows = [int(i) for i in torch.nonzero(empty).flatten()]
        raise BadRequest(
            f"gspo: sequence_ratio_mask marks no position of datum(s) {rows}; the sequence ratio is the mean "
            "log-ratio over the marked positions, so mark at least one (typically the sampled tokens) per datum"
        )
    log_ratio_terms = torch.where(in_ratio, lp.detach() - x["logprobs"], torch.zeros_like(lp))
    log_ratio = log_ratio_terms.sum(dim=1) / count.clamp(min=1).to(lp.dtype)
    ratio = torch.exp(log_ratio.unsqueeze(1) + lp - lp.detach())
    clipped = torch.clamp(ratio, c[_CLIP_LOW], c[_CLIP_HIGH])
    adv = x["advantages"]
    return -torch.minimum(ratio * adv, clipped * adv)


_SPECS: dict[str, _Spec] = {
    "cross_entropy": _Spec(("target_tokens", "weights"), {}, _cross_entropy),
    "importance_sampling": _Spec(_RL_INPUTS, {}, _importance_sampling),
    "ppo": _Spec(_RL_INPUTS, {_CLIP_LOW: 0.8, _CLIP_HIGH: 1.2}, _ppo),
    "cispo": _Spec(_RL_INPUTS, {_CLIP_LOW: 0.0, _CLIP_HIGH: 4.0}, _cispo),
    "dro": _Spec(_RL_INPUTS, {_BETA: 0.05}, _dro),
    "gspo": _Spec(
        (*_RL_INPUTS, "sequence_ratio_mask"),
        {_CLIP_LOW: None, _CLIP_HIGH: None},
        _gspo,
        no_default_reason="Tinker does not publish gspo's default clip thresholds",
    ),
}

SUPPORTED: tuple[str, ...] = tuple(_SPECS)

_NO_PUBLIC_DEFINITION = {
    "stable_reinforce": "its objective uses stability information Tinker records server-side at sampling time "
    "(record_stability_info, sequence_id provenance) and is not published",
}


def _supported_list() -> str:
    return ", ".join(SUPPORTED)


def _resolve_name(loss_fn: Any) -> _Spec:
    if not isinstance(loss_fn, str):
        raise UnsupportedLoss(f"loss_fn must be a string naming a loss; supported: {_supported_list()}")
    if loss_fn == "custom":
        raise UnsupportedLoss(
            "loss_fn 'custom' (a loss uploaded to the server) is not supported here: run it on the client with "
            f"forward_backward_custom, which needs no upload; built-in losses: {_supported_list()}"
        )
    if loss_fn in _NO_PUBLIC_DEFINITION:
        raise UnsupportedLoss(
            f"loss_fn {loss_fn!r} has no public definition ({_NO_PUBLIC_DEFINITION[loss_fn]}); "
            f"supported: {_supported_list()}"
        )
    spec = _SPECS.get(loss_fn)
    if spec is None:
        raise UnsupportedLoss(f"unknown loss_fn {loss_fn!r}; supported: {_supported_list()}")
    return spec


def _number(loss_fn: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{loss_fn}: loss_fn_config[{key!r}] must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise BadRequest(f"{loss_fn}: loss_fn_config[{key!r}] must be finite, got {value!r}")
    return value


def _resolve_config(loss_fn: str, spec: _Spec, config: Mapping[str, Any] | None) -> dict[str, float]:
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise BadRequest(f"{loss_fn}: loss_fn_config must be a mapping of key to number")
    known = sorted(spec.config)
    unknown = sorted(str(k) for k in config if k not in spec.config)
    if unknown:
        accepted = ", ".join(known) if known else "none (omit loss_fn_config)"
        raise BadRequest(
            f"{loss_fn}: unknown loss_fn_config key(s) {', '.join(unknown)}; accepted keys: {accepted}"
        )
    resolved: dict[str, float] = {}
    for key, default in spec.config.items():
        if key in config:
            resolved[key] = _number(loss_fn, key, config[key])
        elif default is None:
            missing = [k for k, d in spec.config.items() if d is None and k not in config]
            raise BadRequest(
                f"{loss_fn}: loss_fn_config must give {', '.join(missing)} ({spec.no_default_reason}), e.g. "
                f"loss_fn_config={{{', '.join(repr(k) + ': ...' for k in missing)}}}"
            )
        else:
            resolved[key] = float(default)
    if _CLIP_LOW in resolved:
        lo, hi = resolved[_CLIP_LOW], resolved[_CLIP_HIGH]
        if lo < 0:
            raise BadRequest(f"{loss_fn}: {_CLIP_LOW} must be >= 0 (it bounds the probability ratio), got {lo}")
        if hi < lo:
            raise BadRequest(f"{loss_fn}: {_CLIP_HIGH} ({hi}) must be >= {_CLIP_LOW} ({lo})")
    if _BETA in resolved and resolved[_BETA] < 0:
        raise BadRequest(f"{loss_fn}: {_BETA} must be >= 0, got {resolved[_BETA]}")
    return resolved


@dataclass
class TinkerLoss:
    """One built-in loss with its validated configuration. Call it on a padded batch."""

    name: str
    config: dict[str, float]
    required_inputs: tuple[str, ...]
    _spec: _Spec = field(repr=False)

    def check_inputs(self, names: Iterable[str]) -> None:
        """Refuse a datum whose loss_fn_inputs lack a required key or carry one this loss does not read (a
        silently ignored ``weights`` or ``mask`` would train on positions the client meant to exclude)."""
        names = set(names)
        missing = [k for k in self.required_inputs if k not in names]
        if missing:
            raise BadRequest(
                f"{self.name}: loss_fn_inputs lack {', '.join(missing)}; {self.name} needs "
                f"{', '.join(self.required_inputs)}"
            )
        extra = sorted(names - set(self.required_inputs))
        if extra:
            raise BadRequest(
                f"{self.name}: loss_fn_inputs {', '.join(extra)} are not read by {self.name}; send exactly "
                f"{', '.join(self.required_inputs)}"
            )

    def __call__(
        self, target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor
    ) -> LossResult:
        self.check_inputs(inputs)
        shape = tuple(target_logprobs.shape)
        if target_logprobs.dim() != 2 or tuple(mask.shape) != shape:
            raise ValueError(f"target_logprobs {shape} and mask {tuple(mask.shape)} must both be [B, T]")
        mask = mask.to(device=target_logprobs.device, dtype=torch.bool)
        zero = torch.zeros((), dtype=target_logprobs.dtype, device=target_logprobs.device)
        values: dict[str, torch.Tensor] = {}
        for key in self.required_inputs:
            value = inputs[key]
            if tuple(value.shape) != shape:
                raise BadRequest(
                    f"{self.name}: loss_fn_inputs[{key!r}] has shape {list(value.shape[1:])} per datum; this "
                    "server takes exactly one value per model_input position"
                )
            if key == "target_tokens":
                continue  # consumed where target_logprobs were gathered
            value = value.to(device=target_logprobs.device, dtype=target_logprobs.dtype)
            bad = mask & ~torch.isfinite(value)
            if bool(bad.any()):
                datum, pos = (int(i) for i in torch.nonzero(bad)[0])
                raise BadRequest(
                    f"{self.name}: loss_fn_inputs[{key!r}] of datum {datum} is not finite at position {pos}"
                )
            values[key] = torch.where(mask, value, zero)
        # Zeroing the padded log-probs first (not only the result) keeps their gradient exactly 0 even where a
        # padded term would be inf or NaN.
        lp = torch.where(mask, target_logprobs, zero)
        per_token = torch.where(mask, self._spec.compute(lp, values, mask, self.config), zero)
        loss = per_token.sum()
        return LossResult(
            loss=loss,
            per_token={"logprobs": lp.detach(), "elementwise_loss": per_token.detach()},
            metrics={"loss:sum": float(loss.detach())},
        )


def tinker_loss(loss_fn: str, config: Mapping[str, float | str] | None) -> TinkerLoss:
    """The built-in loss ``loss_fn`` configured by ``config`` (Tinker's ``loss_fn_config``); UnsupportedLoss for a
    name this server does not compute, BadRequest for an unknown key or a bad value."""
    spec = _resolve_name(loss_fn)
    resolved = _resolve_config(loss_fn, spec, config)
    return TinkerLoss(name=loss_fn, config=resolved, required_inputs=spec.required_inputs, _spec=spec)
