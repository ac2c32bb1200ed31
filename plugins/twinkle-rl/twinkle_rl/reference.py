"""Reference log-probabilities: what DPO compares the policy against.

``task_options.reference`` picks the provider:

* ``adapter``: the policy is a LoRA adapter; the reference is its base model, the same network run with
  the adapters disabled (``forward_only(..., disable_adapters=True)``): no second copy in memory;
* ``model``: full fine-tuning; a frozen copy of the initial weights (``model.frozen_copy()``), built by
  ``PreferenceTask.prepare_model`` (before training and before a resumed run loads its checkpoint);
* ``precomputed``: one pass over the data before training, with the model's initial weights (its base
  under a LoRA adapter), cached under the output directory and reused on resume, after the reference has
  reproduced the cached values of a sample of pairs (:mod:`twinkle_rl.precompute`);
* ``none``: no reference (SimPO, ORPO, DPO with ``reference_free``);
* ``auto`` (default): ``adapter`` when the model has a LoRA adapter, else ``none`` when the model's loss is
  reference-free (``simpo``, ``orpo``, ``reference_free: true``), else ``model``. The trainer decides it in
  ``PreferenceTask.prepare_dataset``, once the adapter and loss are set and before a checkpoint is resumed;
  a script that never calls ``prepare_dataset`` gets it decided at the first batch, and a frozen copy made
  then holds the initial weights only when no step was taken yet (the task refuses otherwise).

Each provider returns ``ref_logps`` ``[S]``: per sequence, the summed log-probability of its answer
tokens under the reference (float32, on the CPU like the rest of a collated batch).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.loss.logprobs import token_logprobs
from twinkle_core.model.train_configs import LossSpec, TrainingSetup
from twinkle_rl.layout import sequence_sums

logger = logging.getLogger("twinkle.rl")

REFERENCES = ("auto", "adapter", "model", "precomputed", "none")
#: losses that compare the policy with no reference model (by registered name)
REFERENCE_FREE_LOSSES = frozenset({"simpo", "orpo"})


def has_adapters(model: Any) -> bool:
    return bool(TrainingSetup.of(model).adapters)


def base_logits(model: Any, batch: dict[str, Any], adapter_name: str | None = None) -> torch.Tensor:
    """The model's logits with its LoRA adapters (if any) switched off; ``adapter_name``: the tenant whose call
    it is, on a model with several adapters."""
    kw = {"adapter_name": adapter_name} if adapter_name is not None else {}
    return _logits(model.forward_only(inputs=batch, disable_adapters=has_adapters(model), **kw))


def reference_logps(logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """Per-sequence sums of the answer tokens' log-probabilities, ``[S]`` float32 on the CPU."""
    num_sequences = int(torch.as_tensor(batch["pair_index"]).numel())
    logps, mask = token_logprobs(logits, batch["labels"].to(logits.device))
    sums, _ = sequence_sums(logps, mask, batch, num_sequences)
    return sums.detach().float().cpu()


def _logits(outputs: Any) -> torch.Tensor:
    return outputs["logits"] if isinstance(outputs, dict) else outputs.logits


class ReferenceProvider(ABC):
    name: ClassVar[str] = ""

    def prepare(self, model: Any) -> None:
        """Called once before training (and before a resumed run restores its weights)."""

    @abstractmethod
    def logits(self, model: Any, batch: dict[str, Any]) -> torch.Tensor | None:
        """The reference's logits for ``batch``, or ``None`` when there is no reference."""

    def ref_logps(self, model: Any, batch: dict[str, Any]) -> torch.Tensor | None:
        with torch.no_grad():
            logits = self.logits(model, batch)
            return None if logits is None else reference_logps(logits, batch)


class AdapterReference(ReferenceProvider):
    """The base model under the LoRA adapter: the policy's own network with its adapters disabled."""

    name = "adapter"

    def __init__(self, adapter_name: str | None = None) -> None:
        #: the tenant trained, on a model with several adapters; else found at first use
        self.adapter_name = adapter_name

    def _adapter_name(self, model: Any) -> str:
        # looked up at first use, not in prepare(): the trainer adds the adapter after task.prepare_model
        if self.adapter_name is None:
            adapters = list(TrainingSetup.of(model).adapters)
            if not adapters:
                raise ConfigError("task_options.reference: adapter needs a model with a LoRA adapter (model.adapter "
                                  "in the recipe); for full fine-tuning use reference: model")
            if len(adapters) > 1:
                raise ConfigError(f"task_options.reference: adapter: the model has several adapters {adapters}; the "
                                  f"preference task trains one: name it with task_options.adapter_name")
            self.adapter_name = adapters[0]
        return self.adapter_name

    def logits(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        return _logits(model.forward_only(inputs=batch, adapter_name=self._adapter_name(model),
                                          disable_adapters=True))


class FrozenCopyReference(ReferenceProvider):
    """A frozen copy of the weights the model had when :meth:`prepare` ran."""

    name = "model"

    def __init__(self) -> None:
        self.copy: Any = None

    def prepare(self, model: Any) -> None:
        if self.copy is None:
            self.copy = model.frozen_copy()
            logger.info("preference task: the reference is a frozen copy of the initial weights")

    def logits(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        if self.copy is None:
            raise ConfigError("task_options.reference: model needs its frozen copy, made by task.prepare_model(model) "
                              "before training (twinkle train calls it; a script must too)")
        return _logits(self.copy.forward_only(inputs=batch))


class NoReference(ReferenceProvider):
    name = "none"

    def logits(self, model: Any, batch: dict[str, Any]) -> None:
        return None


_PROVIDERS: dict[str, type[ReferenceProvider]] = {
    cls.name: cls for cls in (AdapterReference, FrozenCopyReference, NoReference)}


def make_reference(name: str, *, adapter_name: str | None = None) -> ReferenceProvider:
    if name == "precomputed":
        raise ConfigError("task_options.reference: precomputed values come with the data set "
                          "(PreferenceTask.prepare_dataset computes them before training); this batch has none")
    if name not in _PROVIDERS:
        raise ConfigError(f"task_options.reference must be one of {', '.join(REFERENCES)}, got {name!r}")
    if name == "adapter":
        return AdapterReference(adapter_name)
    return _PROVIDERS[name]()


def is_reference_free(loss: LossSpec | None) -> bool:
    """Whether the configured loss (``TrainingSetup.loss``) compares against no reference."""
    if loss is None:
        return False
    return loss.name in REFERENCE_FREE_LOSSES or bool(loss.option("reference_free"))


def resolve_auto(model: Any) -> str:
    """``auto`` for this model as it is now: adapter, none (reference-free loss) or model."""
    setup = TrainingSetup.of(model)
    if setup.adapters:
        return "adapter"
    if is_reference_free(setup.loss):
        return "none"
    return "model"


__all__ = [
    "REFERENCES",
    "REFERENCE_FREE_LOSSES",
    "AdapterReference",
    "FrozenCopyReference",
    "NoReference",
    "ReferenceProvider",
    "base_logits",
    "has_adapters",
    "is_reference_free",
    "make_reference",
    "reference_logps",
    "resolve_auto",
]
