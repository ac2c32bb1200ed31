"""Twinkle's RL plugin: preference training (the ``preference`` task; ``dpo`` / ``simpo`` / ``orpo``) and online RL
(the ``grpo`` and ``ppo`` tasks, the ``hf_generate`` sampler, rewards, advantages and the policy / value losses)."""

__version__ = "0.1.0"
