"""Direct Preference Optimisation (Rafailov et al. 2023) and its pairwise variants: hinge, IPO, robust DPO."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossContext, LossOutput
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE
from twinkle_rl.checks import finite_number
from twinkle_rl.losses.base import PairLogps, PreferenceLoss, pair_metrics, smoothed_sigmoid_loss

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


class DPOLoss(PreferenceLoss):
    """Pairwise preference loss against a frozen reference model.

    With ``h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))`` from per-sequence sums over the
    answer tokens (``ref`` from ``inputs["ref_logps"]`` ``[S]``, in sequence order), each pair's loss is

    * ``"sigmoid"`` (DPO): ``-(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)``, ``ls = label_smoothing``
      (conservative DPO);
    * ``"hinge"`` (SLiC / RSO): ``relu(1 - beta h)``;
    * ``"ipo"`` (Azar et al. 2023, eq. 17 with ``beta`` as ``tau``): ``(h' - 1 / (2 beta))^2`` where ``h'``
      divides every log-probability, policy and reference, by its answer's length, as the IPO paper does;
    * ``"robust"`` (Chowdhury et al. 2024), ``label_smoothing`` being the label noise rate ``eps < 0.5``:
      ``((1 - eps)(-log sigmoid(beta h)) + eps log sigmoid(-beta h)) / (1 - 2 eps)``, an unbiased loss under
      noisy preferences;

    plus ``sft_weight`` x an NLL of the chosen answers (RPO), averaged as ``sft_normalization`` says:
    ``"answer"`` (default, the RPO paper: per answer, then over pairs) or ``"batch_tokens"`` (TRL's
    ``rpo_alpha``: one token mean over the batch's chosen answer tokens); see
    :class:`~twinkle_rl.losses.base.PreferenceLoss`. ``reference_free=True`` takes the reference as uniform
    (``log ref = 0``) and ignores any ``ref_logps``.

    Metrics (means over the micro-batch's pairs), with TRL ``DPOTrainer``'s meaning where TRL has the name:
    ``rewards/chosen`` / ``rewards/rejected`` (``beta (log pi - log ref)`` of whole sequences, for every
    ``loss_type``), ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen`` / ``logps/rejected``
    (the policy's sequence sums; TRL up to 0.28 logged per-token means there for ``ipo``), and with
    ``sft_weight`` ``nll/chosen`` and ``nll/chosen_batch_tokens`` (the latter is TRL's ``nll_loss``).
    """

    name: ClassVar[str] = "dpo"

    def __init__(self, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 reference_free: bool = False, sft_weight: float = 0.0, sft_normalization: str = "answer",
                 ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(sft_weight=sft_weight, sft_normalization=sft_normalization, ignore_index=ignore_index,
                         chunk_size=chunk_size)
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        beta = finite_number("dpo loss: beta", beta, low=0.0, low_open=True)
        label_smoothing = finite_number("dpo loss: label_smoothing", label_smoothing)
        if loss_type == "sigmoid" and not 0.0 <= label_smoothing <= 0.5:
            raise ConfigError(f"label_smoothing must be in [0, 0.5] for loss_type 'sigmoid', got {label_smoothing}")
        if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
            # the robust loss divides by 1 - 2 eps: at eps = 0.5 the labels carry no information
            raise ConfigError(f"label_smoothing (the noise rate) must be in [0, 0.5) for loss_type 'robust', "
                              f"got {label_smoothing}")
        if loss_type in ("hinge", "ipo") and label_smoothing:
            raise ConfigError(f"label_smoothing is not defined for loss_type {loss_type!r}; use 'sigmoid' or 'robust'")
        self.beta = float(beta)
        self.loss_type = loss_type
        self.label_smoothing = float(label_smoothing)
        self.reference_free = reference_free

    def _reference(self, inputs: dict[str, Any], logps: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed answer log-probs of each pair's chosen and rejected sequence."""
        if self.reference_free:
            zeros = torch.zeros_like(logps.chosen)
            return zeros, zeros
        ref = inputs.get("ref_logps")
        if ref is None:
            raise ConfigError(
                f"{self.where} needs the reference model's log-probs (inputs['ref_logps']) and the batch has none: "
                f"set the preference task's task_options.reference, or train without a reference with "
                f"loss.options.reference_free: true")
        ref = torch.as_tensor(ref).detach().to(device=logps.chosen.device, dtype=logps.chosen.dtype).reshape(-1)
        if ref.numel() != 2 * len(logps):
            raise ValueError(f"{self.where}: ref_logps has {ref.numel()} values for a batch of {2 * len(logps)} "
                             f"sequences (one summed log-prob per sequence, in sequence order)")
        return ref[logps.pairs.chosen.to(ref.device)], ref[logps.pairs.rejected.to(ref.device)]

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        logps = self.pair_logps(outputs, inputs, context)
        ref_chosen, ref_rejected = self._reference(inputs, logps)
        chosen_ratio = logps.chosen - ref_chosen
        rejected_ratio = logps.rejected - ref_rejected
        h = chosen_ratio - rejected_ratio

        if self.loss_type == "sigmoid":
            losses = smoothed_sigmoid_loss(self.beta * h, self.label_smoothing)
        elif self.loss_type == "hinge":
            losses = torch.relu(1.0 - self.beta * h)
        elif self.loss_type == "ipo":
            # the answers' token counts normalise the reference too: both scored the same answer tokens
            h_per_token = chosen_ratio / logps.chosen_tokens - rejected_ratio / logps.rejected_tokens
            losses = (h_per_token - 1.0 / (2.0 * self.beta)) ** 2
        else:
            eps, z = self.label_smoothing, self.beta * h
            losses = ((1.0 - eps) * -F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)

        metrics = pair_metrics(self.beta * chosen_ratio, self.beta * rejected_ratio, logps.chosen, logps.rejected)
        losses = losses + self.sft_term(logps, metrics)
        return logps.output(losses, metrics)
