"""A sampler in its own Ray actor, behind the core's sampler contract (``task_options.sampler.name: ray``).

::

    task_options:
      sampler: {name: ray, inner: {name: hf_generate, copy_weights: true}, num_cpus: 1}

The actor hosts any ``push`` sampler (``inner``), given the policy's Hugging Face config and tokenizer. The
weight-sync protocol of :mod:`twinkle_core.sampling` is followed across processes: after optimizer step ``k``
every trainer rank calls ``sync_weights`` (the state dict is gathered collectively), rank 0 sends the update to
the actor and waits for its acknowledgement, and a barrier keeps every rank from sampling before that; each
completion then carries ``policy_step=k``. All trainer ranks share the one actor (named per Ray job).

``placement``: ``split`` (default) starts the actor with its own ``num_cpus`` / ``num_gpus`` wherever the cluster
has room; ``colocated`` time-shares trainer rank 0's placement-group bundle and device, synchronous rollouts only
(:mod:`twinkle_ray.sampler_placement`).

``weight_transport``: ``channel`` (default) sends the update in buckets of ``bucket_mb`` over a dedicated
two-process gloo group between trainer rank 0 and the actor (:mod:`twinkle_ray.weight_channel`), outside the
trainer's own process group; ``object_store`` sends it as one Ray object.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

from twinkle_core import distributed
from twinkle_core.errors import ConfigError, TwinkleError
from twinkle_core.sampling import Completion, Sampler, SamplingParams, WeightUpdate
from twinkle_ray import sampler_placement
from twinkle_ray.rank_layout import VISIBLE_DEVICES
from twinkle_ray.weight_channel import DEFAULT_BUCKET_BYTES, TensorSlot, WeightChannel, plan_buckets

TRANSPORTS = ("channel", "object_store")


class SamplerUnavailableError(TwinkleError, RuntimeError):
    """The sampler actor died or did not answer in time."""


@dataclass
class PolicyDescription:
    """What a ``push`` sampler reads from the policy at ``bind``, without the policy's weights: its Hugging Face
    config (the ``export_config`` seam) and the remote-code switch it was built with."""

    config: Any
    trust_remote_code: bool | None = None
    device: str = "cpu"
    module: Any = None

    def export_config(self) -> Any:
        return self.config


class SamplerWorker:
    """The actor class: builds the inner sampler and answers the contract's calls."""

    def __init__(self, inner: dict[str, Any], env: dict[str, str] | None = None) -> None:
        from twinkle_core.plugins import get_plugins

        os.environ.update(env or {})  # before anything initialises an accelerator (a colocated actor's devices)
        spec = dict(inner)
        self.sampler = get_plugins().load("sampler", spec.pop("name"))(**spec)
        if self.sampler.weight_sync != "push":
            raise ConfigError(f"the ray sampler hosts a sampler that owns its weights (weight_sync 'push'); "
                              f"{type(self.sampler).__name__} with these options reads the policy in process: "
                              f"for hf_generate set copy_weights: true")

    def bind(self, policy: PolicyDescription, tokenizer: Any, adapter_name: str | None) -> None:
        self.sampler.bind(policy, tokenizer, adapter_name=adapter_name)

    def placement(self) -> dict[str, Any]:
        """Where this actor runs, as Ray reports it from inside: node, placement group, resources it holds."""
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "placement_group_id": context.get_placement_group_id(),
                "pid": os.getpid(), "resources": context.get_assigned_resources(),
                "devices": {v: os.environ[v] for v in VISIBLE_DEVICES.values() if v in os.environ}}

    def receive_weights(self, update: WeightUpdate) -> int:
        self.sampler.receive_weights(update)
        self.sampler.policy_step = update.step
        return update.step

    def open_channel(self, timeout_s: float) -> tuple[str, int]:
        """Start the receiving end of a weight channel on this actor's node; its address."""
        import ray

        from twinkle_ray.cluster import node_addresses

        host = node_addresses()[ray.get_runtime_context().get_node_id()]
        self.channel = WeightChannel.listen(host, timeout_s)
        return host, self.channel.port

    def connect_channel(self) -> bool:
        self.channel.connect()  # blocks until the trainer's end has joined
        return True

    def receive_buckets(self, step: int, adapter_name: str | None, buckets: list[list[TensorSlot]]) -> int:
        state = self.channel.receive(buckets)
        return self.receive_weights(WeightUpdate(step=step, state_dict=state, adapter_name=adapter_name))

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[list[int]],
               ) -> list[list[Completion]]:
        return self.sampler.sample(prompts, n=n, params=params, seeds=seeds)


class RaySampler(Sampler):
    name = "ray"
    weight_sync = "push"

    def __init__(self, *, inner: dict[str, Any] | None = None, placement: str = "split", num_cpus: float | None = None,
                 num_gpus: float | None = None, timeout_s: float = 600.0, weight_transport: str = "channel",
                 bucket_mb: float = DEFAULT_BUCKET_BYTES / (1 << 20), **options: Any) -> None:
        if options:
            raise ConfigError(f"unknown ray sampler option(s) {sorted(options)}; known: inner, placement, num_cpus, "
                              f"num_gpus, timeout_s, weight_transport, bucket_mb")
        sampler_placement.check_placement(placement, num_cpus, num_gpus)
        if weight_transport not in TRANSPORTS:
            raise ConfigError(f"the ray sampler's weight_transport must be one of {', '.join(TRANSPORTS)}, got "
                              f"{weight_transport!r}")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0 and bucket_mb < float("inf")):
            raise ConfigError(f"the ray sampler's bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
        inner = dict(inner or {"name": "hf_generate", "copy_weights": True})
        if not isinstance(inner.get("name"), str):
            raise ConfigError("the ray sampler's option inner must name a sampler, e.g. {name: hf_generate, "
                              "copy_weights: true}")
        super().__init__(inner=inner, placement=placement, num_cpus=num_cpus, num_gpus=num_gpus, timeout_s=timeout_s,
                         weight_transport=weight_transport, bucket_mb=bucket_mb)
        self.inner, self.placement, self.timeout_s = inner, placement, float(timeout_s)
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.transport, self.bucket_bytes = weight_transport, max(int(bucket_mb * (1 << 20)), 1)
        self.actor: Any = None
        self.channel: WeightChannel | None = None

    def overlap_refusal(self) -> str | None:
        if self.placement == "colocated":
            return sampler_placement.COLOCATED_OVERLAP
        return super().overlap_refusal()

    def bind(self, model: Any, tokenizer: Any, *, adapter_name: str | None = None) -> None:
        super().bind(model, tokenizer, adapter_name=adapter_name)
        from twinkle_ray.cluster import ray_module

        ray = ray_module()
        if not ray.is_initialized():
            raise ConfigError("the ray sampler runs in a Ray actor: train with `twinkle train --runtime ray`, or "
                              "call ray.init() before training")
        # one actor for the whole job: rank 0 names it, every rank looks it up
        name = distributed.broadcast_object(f"twinkle-sampler-{uuid.uuid4().hex[:12]}")
        if distributed.rank() == 0:
            where = (sampler_placement.colocated(distributed.rank()) if self.placement == "colocated"
                     else sampler_placement.split(self.num_cpus, self.num_gpus))
            worker = ray.remote(SamplerWorker).options(name=name, max_restarts=0, **where.options)
            self.actor = worker.remote(self.inner, where.env)
            policy = PolicyDescription(config=model.export_config(),
                                       trust_remote_code=getattr(model, "trust_remote_code", None), device=where.device)
            self._get(self.actor.bind.remote(policy, tokenizer, adapter_name), "bind")
            if where.bundle is not None:  # where Ray says the actor runs, asked from inside it
                sampler_placement.check_colocated(self._get(self.actor.placement.remote(), "placement"), where.bundle)
            if self.transport == "channel":
                self._open_channel()
        distributed.barrier()
        if self.actor is None:
            self.actor = ray.get_actor(name)

    def _open_channel(self) -> None:
        host, port = self._get(self.actor.open_channel.remote(self.timeout_s), "open_channel")
        joined = self.actor.connect_channel.remote()
        self.channel = WeightChannel(host, port, WeightChannel.SENDER, self.timeout_s)
        self.channel.connect()
        self._get(joined, "connect_channel")

    def sync_weights(self, model: Any, *, step: int) -> None:
        state = model.get_state_dict(adapter_name=self.adapter_name)  # a collective: every rank gathers
        if distributed.rank() == 0:
            if self.channel is not None:
                buckets = plan_buckets(state, self.bucket_bytes)
                received = self.actor.receive_buckets.remote(step, self.adapter_name, buckets)
                try:
                    self.channel.send(state, buckets)
                except RuntimeError as exc:  # gloo: the receiving end is gone (connection closed by peer)
                    raise SamplerUnavailableError(f"sampler actor ({self.inner['name']}) died during receive_weights: "
                                                  f"the weight channel broke ({str(exc).strip().splitlines()[0]})"
                                                  ) from None
            else:
                update = WeightUpdate(step=step, state_dict=state, adapter_name=self.adapter_name)
                received = self.actor.receive_weights.remote(update)
            acknowledged = self._get(received, "receive_weights")
            if acknowledged != step:
                raise SamplerUnavailableError(f"the sampler actor acknowledged step {acknowledged}, not {step}")
        distributed.barrier()  # no rank samples before the actor holds step k's weights
        self.policy_step = step

    def sample(self, prompts: list[list[int]], *, n: int, params: SamplingParams,
               seeds: list[list[int]]) -> list[list[Completion]]:
        completions = self._get(self.actor.sample.remote(prompts, n, params, seeds), "sample")
        if self.placement == "colocated":
            distributed.barrier()  # the bundle is shared: no rank trains while the actor generates for another
        return completions

    def _get(self, future: Any, call: str) -> Any:
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        from twinkle_ray.cluster import ray_module

        try:
            return ray_module().get(future, timeout=self.timeout_s)
        except GetTimeoutError:
            raise SamplerUnavailableError(f"sampler actor ({self.inner['name']}): {call} gave no answer within "
                                          f"{self.timeout_s:.0f} s (raise task_options.sampler.timeout_s)") from None
        except RayActorError as exc:
            raise SamplerUnavailableError(f"sampler actor ({self.inner['name']}) died during {call}: "
                                          f"{type(exc).__name__}") from None
        except RayTaskError as exc:
            if isinstance(exc.cause, TwinkleError):
                raise exc.cause from None
            raise SamplerUnavailableError(f"sampler actor ({self.inner['name']}) failed in {call}: "
                                          f"{str(exc).strip().splitlines()[-1]}") from None

    def close(self) -> None:
        if self.actor is not None and distributed.rank() == 0:
            from twinkle_ray.cluster import ray_module

            ray_module().kill(self.actor, no_restart=True)
        self.actor = None
        self.channel = None
