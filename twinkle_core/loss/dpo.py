"""Direct Preference Optimisation and two of its pairwise variants (IPO, hinge/SLiC)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from twinkle_core.loss._common import require_whole_sequences, scalar
from twinkle_core.loss.base import Loss, LossContext, LossOutput
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


class DPOLoss(Loss):
    """Pairwise preference loss against a frozen reference model.

    Batch layout: ``2P`` sequences, the **first half are the chosen** responses and the **second half
    the rejected** responses, row ``i`` and row ``P + i`` answering the same prompt. ``labels`` mask
    the prompt (``ignore_index``) so that only response tokens count.

    The sequence log-probability is the sum of the label-token log-probabilities. Reference
    log-probabilities (computed the same way by the reference model, i.e. per-sequence sums) come as
    ``inputs["ref_logps"]`` ``[2P]`` in the same layout, or as ``inputs["ref_chosen_logps"]`` and
    ``inputs["ref_rejected_logps"]`` ``[P]`` each. With ``reference_free=True`` the reference is
    taken as uniform (all zeros).

    With ``h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))``:

    * ``"sigmoid"`` (DPO): ``-(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta * h)``
      (``ls = label_smoothing``, conservative DPO);
    * ``"hinge"`` (SLiC / RSO): ``relu(1 - beta * h)``;
    * ``"ipo"``: ``(h - 1 / (2 * beta)) ** 2`` (IPO eq. 17, ``beta`` playing ``tau``), where, as in
      the IPO paper and TRL's ``loss_type="ipo"``, the log-probabilities are **length-normalised**:
      each sequence sum (policy *and* reference) is divided by the sequence's number of label tokens.
      ``ref_logps`` are therefore still given as sums; the division uses the label count of the
      batch, which is the reference's count too since both score the same labels.

    Returns the sum over pairs with ``num_tokens`` = number of pairs. Metrics (means over the pairs
    of this micro-batch): ``rewards/chosen`` and ``rewards/rejected`` (``beta * (log pi - log ref)``),
    ``rewards/margins`` and ``rewards/accuracy`` (share of pairs with chosen reward > rejected).
    """

    name: ClassVar[str] = "dpo"

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reference_free: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if beta <= 0:
            raise ValueError(f"beta must be positive, got {beta}")
        if not 0.0 <= label_smoothing <= 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
        self.beta = beta
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.ignore_index = ignore_index
        self.reference_free = reference_free
        self.chunk_size = chunk_size

    def _reference(self, inputs: dict[str, Any], pairs: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ref = inputs.get("ref_logps")
        if ref is not None:
            ref = torch.as_tensor(ref).to(like).reshape(-1)
            if ref.numel() != 2 * pairs:
                raise ValueError(f"ref_logps has {ref.numel()} values for a batch of {2 * pairs} sequences")
            return ref[:pairs], ref[pairs:]
        chosen, rejected = inputs.get("ref_chosen_logps"), inputs.get("ref_rejected_logps")
        if chosen is not None and rejected is not None:
            chosen = torch.as_tensor(chosen).to(like).reshape(-1)
            rejected = torch.as_tensor(rejected).to(like).reshape(-1)
            if chosen.numel() != pairs or rejected.numel() != pairs:
                raise ValueError(f"ref_chosen_logps / ref_rejected_logps must have {pairs} values each")
            return chosen, rejected
        if self.reference_free:
            zeros = like.new_zeros(pairs)
            return zeros, zeros
        raise KeyError(
            "DPOLoss needs inputs['ref_logps'] ([B]) or inputs['ref_chosen_logps'] and "
            "inputs['ref_rejected_logps'] ([B/2]); or construct it with reference_free=True"
        )

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        logits = outputs["logits"]
        batch = logits.shape[0]
        if batch % 2:
            raise ValueError(f"DPOLoss needs an even batch (chosen half, then rejected half), got {batch}")
        pairs = batch // 2
        require_whole_sequences(inputs, type(self).__name__)
        logps, mask = token_logprobs(logits, inputs["labels"], self.ignore_index, self.chunk_size)
        seq_logps = logps.sum(-1)
        ref_chosen, ref_rejected = self._reference(inputs, pairs, seq_logps)
        ref_chosen, ref_rejected = ref_chosen.detach(), ref_rejected.detach()
        if self.loss_type == "ipo":
            lengths = mask.sum(-1).clamp(min=1).to(seq_logps.dtype)
            seq_logps = seq_logps / lengths
            ref_chosen, ref_rejected = ref_chosen / lengths[:pairs], ref_rejected / lengths[pairs:]
        chosen_ratio = seq_logps[:pairs] - ref_chosen
        rejected_ratio = seq_logps[pairs:] - ref_rejected
        h = chosen_ratio - rejected_ratio

        if self.loss_type == "sigmoid":
            ls = self.label_smoothing
            losses = -(1.0 - ls) * F.logsigmoid(self.beta * h) - ls * F.logsigmoid(-self.beta * h)
        elif self.loss_type == "hinge":
            losses = torch.relu(1.0 - self.beta * h)
        else:
            losses = (h - 1.0 / (2.0 * self.beta)) ** 2

        with torch.no_grad():
            chosen_rewards = self.beta * chosen_ratio
            rejected_rewards = self.beta * rejected_ratio
            metrics = {
                "rewards/chosen": scalar(chosen_rewards.mean()),
                "rewards/rejected": scalar(rejected_rewards.mean()),
                "rewards/margins": scalar((chosen_rewards - rejected_rewards).mean()),
                "rewards/accuracy": scalar((chosen_rewards > rejected_rewards).float().mean()),
            }
        return LossOutput(loss=losses.sum(), num_tokens=pairs, metrics=metrics)
