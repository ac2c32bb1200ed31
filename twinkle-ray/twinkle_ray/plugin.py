"""Registrations of the Ray runtime (entry point ``twinkle: ray``)."""

from __future__ import annotations

from twinkle_core import hookimpl
from twinkle_core.records import RewardRecord, RuntimeRecord, SamplerRecord

_PKG = "twinkle_ray"


@hookimpl
def twinkle_register_runtimes():
    yield RuntimeRecord("ray", f"{_PKG}.runtime:RayRuntime",
                        "Ray actors as ranks: one machine or a cluster (--ray-address), restarts from checkpoints")


@hookimpl
def twinkle_register_samplers():
    yield SamplerRecord("ray", f"{_PKG}.sampler:RaySampler",
                        "any push sampler (hf_generate copy_weights) in its own Ray actor, shared by all ranks")


@hookimpl
def twinkle_register_rewards():
    yield RewardRecord("ray_pool", f"{_PKG}.reward_pool:RayRewardPool",
                       "any reward scored in a pool of Ray CPU actors, with a timeout; failures score nan")
