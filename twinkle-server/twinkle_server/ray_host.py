"""``RayModelHost``: a base model whose model lives in the ranks of a Ray worker group, behind the service's one
front process (the registry, the scheduler and tenancy stay in the front; ``ray:`` in the base model's config).

What runs where:

* every rank (a :class:`twinkle_ray.WorkerGroup` actor) builds an ordinary :class:`~twinkle_server.host.ModelHost`
  (:mod:`twinkle_server.ray_rank`) whose ``MultiLoraTransformersModel`` runs the ``grad_allreduce`` strategy: each
  rank accumulates the gradients of its own datums, and every optimizer step sums them over the ranks, so the step
  is taken on the gradient of the whole request's summed Tinker loss, as in one process;
* Tinker ``forward_backward`` / ``forward``: the datums are split contiguously over the data-parallel ranks (sizes
  differ by at most one; a rank without a datum joins with a backward that adds exactly zero); the per-datum
  outputs come back in order and the metrics are merged by their reduction (``loss:sum`` is summed);
* adapters, ``optim_step``, checkpoints (written by rank 0, every rank taking part): on every rank;
* sampling and ``compute_logprobs``: on rank 0 alone (generation communicates nothing under ``grad_allreduce``),
  which also holds the sampler adapters;
* the native API: :attr:`RayModelHost.model` is a :class:`twinkle_ray.RemoteModel` attached to the ranks' models
  (batches split evenly over the ranks, outputs merged as one process would return them).

A refused request is refused by every rank before any rank touches the model; a rank that fails otherwise stops the
group, and the base model answers 503 until the server restarts. ``state_dir`` must be the same directory on every
node (a shared filesystem): ranks write checkpoints there and the front serves them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twinkle_ray.remote_model import RemoteModel
from twinkle_ray.worker_group import WorkerFailedError, WorkerGroup

from twinkle_core.errors import ConfigError
from twinkle_server import ray_cluster, ray_rank
from twinkle_server.errors import BadRequest, Unavailable
from twinkle_server.host import AdamStep, Datum, ForwardResult

__all__ = ["HostModelProxy", "RankCalls", "RayModelHost", "contiguous_shares", "local_cpus", "merge_metrics"]

#: the strategy the ranks' models run unless the base model's ``model`` section names one
RANK_STRATEGY = "grad_allreduce"
#: the model classes a worker group hosts (what tests/test_ray_host.py runs)
TESTED_CLASSES = ("TransformersModel", "MultiLoraTransformersModel")


class RankCalls:
    """Calls of :mod:`twinkle_server.ray_rank` functions on a group's ranks, with their refusals raised here."""

    def __init__(self, group: WorkerGroup, name: str) -> None:
        self.group, self.name = group, name
        self.failure: str | None = None

    def every(self, fn: Any, *args: Any) -> list[Any]:
        return self.each(fn, [args] * self.group.num_workers)

    def each(self, fn: Any, per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``fn(*per_rank[r])`` on rank ``r``; the results in rank order."""
        self._check()
        try:
            results = self.group.run_each("apply", [(fn, *args) for args in per_rank])
        except WorkerFailedError as exc:
            self.failure = str(exc)
            raise
        return self._unwrap(results)

    def first(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on rank 0 alone."""
        self._check()
        try:
            result = self.group.wait([self.group.actors[0].apply.remote(fn, *args)])[0]
        except WorkerFailedError as exc:
            self.failure = str(exc)
            raise
        return self._unwrap([result])[0]

    def _check(self) -> None:
        if self.failure is not None or not self.group.actors:
            raise Unavailable(f"base model {self.name} is unavailable: its worker group stopped "
                              f"({self.failure or 'shut down'}); restart the server")

    def _unwrap(self, results: list[Any]) -> list[Any]:
        refused = [r for r in results if isinstance(r, ray_rank.Refused)]
        if not refused:
            return results
        if len(refused) == len(results):
            raise refused[0].error
        # some ranks refused and others went on: their states differ, and the next collective would hang
        self.failure = (f"ranks {[i for i, r in enumerate(results) if isinstance(r, ray_rank.Refused)]} refused a "
                        f"call the others ran ({refused[0].error!r})")
        self.group.shutdown()
        raise Unavailable(f"base model {self.name}: {self.failure}; the worker group was stopped, restart the server")


class HostModelProxy(RemoteModel):
    """:attr:`RayModelHost.model`: the public model API of the ranks' models (``twinkle_ray.RemoteModel``'s
    dispatch), each call's refusals raised in the front without stopping the group."""

    calls: RankCalls
    network_input_keys: tuple[str, ...]

    @classmethod
    def connect(cls, calls: RankCalls) -> HostModelProxy:
        proxy = cls.attach(calls.group, ray_rank.model)
        proxy.calls = calls
        # the handler checks each native batch against it: read from rank 0 once (fixed once the model is built),
        # so that a check never queues behind a call running on the ranks
        proxy.network_input_keys = tuple(proxy.network_input_keys)
        return proxy

    def call_ranks(self, calls: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        return self.calls.each(ray_rank.call_model, list(calls))


class RayModelHost:
    """A :class:`~twinkle_server.host.ModelHost`'s interface, served by the ranks of a worker group of
    ``ray.workers`` actors. :meth:`close` stops the group (the app does on shutdown)."""

    def __init__(self, name: str, model: dict, *, ray: Any, state_dir: Path, max_lora_rank: int = 64,
                 max_adapters: int | None = None, max_loaded_samplers: int = 8,
                 local_cpus: int | None = None) -> None:
        if model.get("class_name", "TransformersModel") not in TESTED_CLASSES:
            raise ConfigError(f"base model {name}: ray hosts {' / '.join(TESTED_CLASSES)} bases only, not "
                              f"{model['class_name']!r}; remove ray to host it in the server's process")
        self.name, self.state_dir, self.max_lora_rank = name, Path(state_dir), max_lora_rank
        self.max_adapters, self.max_loaded_samplers = max_adapters, max(1, max_loaded_samplers)
        self.group: WorkerGroup | None = None
        self._release = ray_cluster.lease(ray.address, local_cpus=local_cpus)
        try:
            self.group = WorkerGroup(ray.workers, role=f"base model {name}", cpus_per_worker=ray.cpus_per_worker,
                                     gpus_per_worker=ray.gpus_per_worker, placement=ray.placement)
            section = {"strategy": RANK_STRATEGY, **dict(model)}
            options = {"max_lora_rank": max_lora_rank, "max_adapters": max_adapters,
                       "max_loaded_samplers": self.max_loaded_samplers}
            infos = self.group.run("apply", ray_rank.start, name, section, str(self.state_dir), options)
            self.calls = RankCalls(self.group, name)
            self.model = HostModelProxy.connect(self.calls)
        except BaseException:
            self.close()
            raise
        first = infos[0]
        self.vocab_size: int = first["vocab_size"]
        self.max_positions: int | None = first["max_positions"]
        self.eos_ids: set[int] = set(first["eos_ids"])
        self.tokenizer = first["tokenizer"]
        self.dp_size: int = first["dp_size"]
        #: each data-parallel rank's first rank (the one whose results count; its peers hold the same data)
        self._dp_first = [next(r for r, i in enumerate(infos) if i["dp_rank"] == d) for d in range(self.dp_size)]
        self._dp_rank = [i["dp_rank"] for i in infos]

    def close(self) -> None:
        """Stop the worker group (its actors and placement group) and let go of the Ray connection (idempotent)."""
        group, self.group = self.group, None
        try:
            if group is not None:
                group.shutdown()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()

    def _every(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.calls.every(ray_rank.call_host, method, args, kwargs)[0]

    def _first(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.calls.first(ray_rank.call_host, method, args, kwargs)

    # ------------------------------------------------------------------ adapters
    def create_adapter(self, adapter_id: str, *, rank: int, seed: int | None = None, train_mlp: bool = True,
                       train_attn: bool = True, train_unembed: bool = True) -> None:
        # without a seed each rank draws its own weights; set_optimizer then gives every rank rank 0's
        self._every("create_adapter", adapter_id, rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn,
                    train_unembed=train_unembed)

    def remove_adapter(self, adapter_id: str) -> None:
        self._every("remove_adapter", adapter_id)

    def add_lora_adapter(self, adapter_id: str, config: dict[str, Any], *, seed: int) -> None:
        self._every("add_lora_adapter", adapter_id, config, seed=seed)

    def remove_lora_adapter(self, adapter_id: str) -> None:
        self._every("remove_lora_adapter", adapter_id)

    def adapter_ids(self) -> list[str]:
        return self._first("adapter_ids")

    def adapter_settings(self, adapter_id: str) -> dict[str, Any]:
        return self._first("adapter_settings", adapter_id)

    def model_adapter_name(self, adapter_id: str) -> str:
        """The adapter's name inside rank 0's model."""
        return self._first("model_adapter_name", adapter_id)

    # ------------------------------------------------------------------ training
    def forward_backward(self, adapter_id: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None,
                         *, backward: bool = True) -> ForwardResult:
        from twinkle_ray.cluster import ray_module

        data = list(data)
        if not data:
            raise BadRequest("no data: send at least one datum")
        shares = contiguous_shares(len(data), self.dp_size)
        stored = ray_module().put(data)  # sent once; every rank reads the whole request to check it
        results = self.calls.each(ray_rank.forward_backward, [
            (stored, shares[d], adapter_id, loss_fn, loss_fn_config, backward) for d in self._dp_rank])
        parts = [results[r] for r in self._dp_first if results[r] is not None]
        return ForwardResult(per_datum=[row for part in parts for row in part.per_datum],
                             metrics=merge_metrics([p.metrics for p in parts], [len(p.per_datum) for p in parts]))

    def optim_step(self, adapter_id: str, params: AdamStep) -> dict[str, float]:
        return self._every("optim_step", adapter_id, params)

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, adapter_id: str, directory: Path, *, optimizer: bool = True) -> None:
        self._every("save_state", adapter_id, Path(directory), optimizer=optimizer)

    def state_info(self, directory: Path) -> dict[str, Any]:
        return self._first("state_info", Path(directory))

    def load_state(self, adapter_id: str, directory: Path, *, optimizer: bool = True) -> None:
        self._every("load_state", adapter_id, Path(directory), optimizer=optimizer)

    def export_adapter(self, adapter_id: str, directory: Path) -> None:
        self._every("export_adapter", adapter_id, Path(directory))

    # ------------------------------------------------------------------ sampling (rank 0)
    def load_sampler(self, sampler_id: str, directory: Path | None) -> None:
        self._first("load_sampler", sampler_id, directory)

    def unload_sampler(self, sampler_id: str) -> None:
        self._first("unload_sampler", sampler_id)

    def sample(self, sampler_id: str | None, prompt: list[int], num_samples: int, params: Any) -> list[Any]:
        return self._first("sample", sampler_id, prompt, num_samples, params)

    def compute_logprobs(self, sampler_id: str | None, tokens: list[int]) -> list[float | None]:
        return self._first("compute_logprobs", sampler_id, tokens)

    def native_sample(self, adapter_name: str, prompts: list[list[int]], n: int, params: Any,
                      seeds: list[list[int]]) -> list[list[dict[str, Any]]]:
        return self._first("native_sample", adapter_name, prompts, n, params, seeds)


def contiguous_shares(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges over ``count`` items, sizes differing by at most one (the
    first ones larger); a part may be empty when ``count < parts``."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


def merge_metrics(metrics: Sequence[dict[str, float]], datums: Sequence[int]) -> dict[str, float]:
    """One request's metrics from its parts' (Tinker's ``name:reduction`` names): ``sum`` adds, ``min`` / ``max``
    take the extreme, ``mean`` weighs each part by its number of datums (as the Tinker SDK merges chunks)."""
    if not metrics:
        return {}
    merged: dict[str, float] = {}
    for key in metrics[0]:
        values = [float(m[key]) for m in metrics]
        reduction = key.rsplit(":", 1)[-1]
        if reduction == "sum":
            merged[key] = math.fsum(values)
        elif reduction == "min":
            merged[key] = min(values)
        elif reduction == "max":
            merged[key] = max(values)
        elif reduction == "mean":
            merged[key] = math.fsum(v * n for v, n in zip(values, datums)) / max(1, sum(datums))
        else:
            raise RuntimeError(f"metric {key!r}: no rule merges its reduction {reduction!r} over data-parallel ranks "
                               f"(known: sum, min, max, mean)")
    return merged


def local_cpus(base_models: Sequence[Any]) -> int:
    """CPUs of a local cluster started for these base models: the machine's, or what their groups reserve if that is
    more (Ray's CPUs are scheduling tokens, as torchrun's processes would also share the cores)."""
    needed = sum(math.ceil(m.ray.workers * m.ray.cpus_per_worker) for m in base_models if m.ray is not None)
    return max(os.cpu_count() or 1, needed)
