"""Samplers of online RL (``twinkle_core.sampling.Sampler``): ``hf_generate`` decodes in this process."""

from __future__ import annotations

from twinkle_rl.samplers.hf_generate import HFGenerateSampler

__all__ = ["HFGenerateSampler"]
