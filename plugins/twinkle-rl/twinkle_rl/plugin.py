"""Registrations of the RL plugin (entry point ``twinkle: rl``): preference training (DPO family) and online
RL (GRPO family, PPO) with its sampler and rewards."""

from __future__ import annotations

from twinkle_core import hookimpl
from twinkle_core.records import EnvironmentRecord, LossRecord, RewardRecord, SamplerRecord, TaskRecord

_PKG = "twinkle_rl"


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("preference", f"{_PKG}.task:PreferenceTask",
                     "answer pairs (chosen / rejected) through the chat template; reference log-probs from the "
                     "base model (LoRA), a frozen copy, or a precomputed cache")
    yield TaskRecord("grpo", f"{_PKG}.online_task:OnlineRLTask",
                     "online RL: sample groups of completions, score them with rewards, group-relative "
                     "advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++), clipped policy loss")
    yield TaskRecord("ppo", f"{_PKG}.ppo_task:PPOTask",
                     "online RL with a learned critic (a value head on a sibling model) and GAE advantages")
    yield TaskRecord("reward_model", f"{_PKG}.reward_model_task:RewardModelTask",
                     "a Bradley-Terry reward model (one score per sequence) trained on answer pairs")
    yield TaskRecord("gkd", f"{_PKG}.distill_task:GKDTask",
                     "on-policy distillation (GKD): student / teacher / data completions, the teacher's logits")


@hookimpl
def twinkle_register_losses():
    yield LossRecord("dpo", f"{_PKG}.losses:DPOLoss", "DPO: sigmoid / hinge / ipo / robust, label smoothing, SFT term")
    yield LossRecord("simpo", f"{_PKG}.losses:SimPOLoss", "SimPO: length-normalised, reference-free, margin gamma")
    yield LossRecord("orpo", f"{_PKG}.losses:ORPOLoss", "ORPO: SFT plus an odds-ratio term, reference-free")
    yield LossRecord("grpo", f"{_PKG}.losses.policy:GRPOLoss", "GRPO: clipped ratio, per-sequence token mean")
    yield LossRecord("dapo", f"{_PKG}.losses.policy:DAPOLoss", "DAPO: decoupled clip 0.2 / 0.28, token-level aggregation")
    yield LossRecord("dr_grpo", f"{_PKG}.losses.policy:DrGRPOLoss", "Dr. GRPO: token sum over a constant length")
    yield LossRecord("gspo", f"{_PKG}.losses.policy:GSPOLoss", "GSPO: sequence-level length-normalised ratio")
    yield LossRecord("ppo", f"{_PKG}.losses.policy:PPOLoss", "PPO clipped policy loss on per-token (GAE) advantages")
    yield LossRecord("ppo_value", f"{_PKG}.losses.value:PPOValueLoss", "PPO clipped value loss for a per-token critic")
    yield LossRecord("bradley_terry", f"{_PKG}.losses.bradley_terry:BradleyTerryLoss",
                     "reward model: -log sigmoid(r_chosen - r_rejected - margin), optional reward centring")


@hookimpl
def twinkle_register_samplers():
    yield SamplerRecord("hf_generate", f"{_PKG}.samplers.hf_generate:HFGenerateSampler",
                        "batched KV-cache decoding on the policy's own weights (or a pushed copy); any device")


@hookimpl
def twinkle_register_rewards():
    yield RewardRecord("exact_match", f"{_PKG}.rewards:ExactMatch",
                       "1.0 when the completion equals a reference row field (whitespace/case-normalised)")
    yield RewardRecord("regex", f"{_PKG}.rewards:RegexReward",
                       "format reward: 1.0 when a pattern matches (search or fullmatch, DOTALL)")
    yield RewardRecord("numeric_answer", f"{_PKG}.rewards:NumericAnswer",
                       "1.0 when the last \\boxed{} / last number equals the reference number (GSM8K '####' ok)")
    yield RewardRecord("reward_model", f"{_PKG}.model_reward:RewardModelScore",
                       "the score of a trained reward model (task: reward_model, or any one-label sequence classifier)")
    yield RewardRecord("length_penalty", f"{_PKG}.rewards:LengthPenalty",
                       "0 within max_length, linearly negative beyond (characters, or tokens from completion_lengths)")


@hookimpl
def twinkle_register_environments():
    yield EnvironmentRecord("calculator", f"{_PKG}.calculator_env:CalculatorEnvironment",
                            "agent tool 'calculator' (+ - * / and parentheses); reward 1.0 for a final answer equal "
                            "to the row's answer")
