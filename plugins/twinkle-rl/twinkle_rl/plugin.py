"""Registrations of the preference-training plugin (entry point ``twinkle: rl``)."""

from __future__ import annotations

from twinkle_core import hookimpl
from twinkle_core.records import LossRecord, TaskRecord

_PKG = "twinkle_rl"


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("preference", f"{_PKG}.task:PreferenceTask",
                     "answer pairs (chosen / rejected) through the chat template; reference log-probs from the "
                     "base model (LoRA), a frozen copy, or a precomputed cache")


@hookimpl
def twinkle_register_losses():
    yield LossRecord("dpo", f"{_PKG}.losses:DPOLoss", "DPO: sigmoid / hinge / ipo / robust, label smoothing, SFT term")
    yield LossRecord("simpo", f"{_PKG}.losses:SimPOLoss", "SimPO: length-normalised, reference-free, margin gamma")
    yield LossRecord("orpo", f"{_PKG}.losses:ORPOLoss", "ORPO: SFT plus an odds-ratio term, reference-free")
