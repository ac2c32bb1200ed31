"""A model in every rank of a worker group, driven from the controller as if it were one model in-process.

::

    group = WorkerGroup(2)
    model = RemoteModel(group, "TransformersModel", model_id="hf://Qwen/Qwen2.5-0.5B", strategy="ddp")
    model.set_loss("cross_entropy")
    model.set_optimizer("AdamW", lr=1e-4)
    for batch in loader:                             # global batches: each is split over the data-parallel ranks
        out = model.forward_backward(inputs=batch)   # out["loss"]: the token-weighted mean over the whole batch
        model.clip_grad_and_step(max_grad_norm=1.0)
    model.save("final", output_dir="outputs")

A proxy can also drive models that something else already built in the ranks (a service that keeps more state
beside its model): ``RemoteModel.attach(group, locate)``, where ``locate()`` runs in each rank and returns that
rank's model. A subclass may route the calls itself by overriding :meth:`RemoteModel.call_ranks`.

Dispatch: a call with ``inputs=`` sends each data-parallel rank its contiguous slice of the batch along the first
dimension (ranks that share a data-parallel rank, e.g. tensor-parallel peers, get the same slice); every other
call goes to every rank unchanged (they are collective: all ranks must make them). Results: rank 0's, except for
``forward_backward`` / ``forward_only`` whose outputs are merged as one process would return them for the whole
batch (see :func:`merge_outputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_ray.worker_group import WorkerGroup

#: calls whose ``inputs`` are split over the data-parallel ranks and whose outputs are merged
BATCHED = ("forward_backward", "forward_only", "forward")
#: the public model API the proxy forwards (every rank makes the call; rank 0's answer is returned)
BROADCAST = ("calculate_loss", "backward", "clip_grad_norm", "step", "zero_grad", "lr_step", "clip_grad_and_step",
             "set_loss", "set_optimizer", "set_lr_scheduler", "add_adapter_to_model", "save", "load",
             "resume_from_checkpoint", "get_state_dict", "add_metric", "calculate_metric", "get_train_configs",
             "export_config")
#: attributes of the model the proxy reads (rank 0's value)
ATTRIBUTES = ("network_input_keys",)


class RemoteModel:
    """The proxy. ``model``: a model class or its registered name (``"TransformersModel"``); ``kwargs`` are its
    constructor's, identical on every rank."""

    def __init__(self, group: WorkerGroup, model: Any, **kwargs: Any) -> None:
        self._connect(group, group.run("build_model", model, kwargs))

    @classmethod
    def attach(cls, group: WorkerGroup, locate: Any, *args: Any, **kwargs: Any) -> RemoteModel:
        """A proxy for models already built in the ranks: ``locate(*args, **kwargs)`` runs in each rank (a
        module-level function, pickled by Ray) and returns that rank's model."""
        proxy = cls.__new__(cls)
        proxy._connect(group, group.run("attach_model", locate, args, kwargs))
        return proxy

    def _connect(self, group: WorkerGroup, coordinates: list[dict[str, int]]) -> None:
        self.group = group
        self.dp_ranks = [c["dp_rank"] for c in coordinates]
        self.dp_size = coordinates[0]["dp_size"]

    def call_ranks(self, calls: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Run ``calls[r]`` (method, args, kwargs) on rank ``r``'s model; the results in rank order. Every call of
        the proxy reaches the ranks through here."""
        return self.group.run_each("call", list(calls))

    def __getattr__(self, name: str) -> Any:
        if name in BATCHED:
            return lambda **kwargs: self._batched(name, kwargs)
        if name in BROADCAST:
            return lambda *args, **kwargs: self.call_ranks([(name, args, kwargs)] * self.group.num_workers)[0]
        if name in ATTRIBUTES:
            return self.group.wait([self.group.actors[0].model_attribute.remote(name)])[0]
        raise AttributeError(f"{type(self).__name__} forwards the public model API "
                             f"({', '.join(BATCHED + BROADCAST + ATTRIBUTES)}); {name!r} is not part of it")

    def _batched(self, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        inputs = kwargs.pop("inputs", None)
        if inputs is None:
            raise ConfigError(f"{method} needs inputs=: a batch dict of tensors")
        shards = split_batch(inputs, self.dp_size)
        results = self.call_ranks([(method, (), {**kwargs, "inputs": shards[r]}) for r in self.dp_ranks])
        first_of_each = [results[self.dp_ranks.index(r)] for r in range(self.dp_size)]
        return merge_outputs(first_of_each)


def split_batch(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """``parts`` contiguous slices of ``batch`` along the first dimension (tensors and lists; other values are
    given to every slice). The batch size must be divisible by ``parts``: uneven slices would weigh ranks
    differently from one process seeing the whole batch."""
    sizes = {len(v) for v in batch.values() if hasattr(v, "__len__") and not isinstance(v, (str, bytes, dict))}
    if len(sizes) != 1:
        raise ConfigError(f"cannot split the batch over {parts} data-parallel ranks: its fields have first "
                          f"dimensions {sorted(sizes) or 'none'}; give tensors or lists of one batch size")
    size = sizes.pop()
    if size % parts:
        raise ConfigError(f"a batch of {size} rows does not split evenly over {parts} data-parallel ranks; "
                          f"use a batch size divisible by {parts}")
    step = size // parts
    return [{k: (v[r * step:(r + 1) * step] if _sliceable(v) else v) for k, v in batch.items()}
            for r in range(parts)]


def _sliceable(value: Any) -> bool:
    return hasattr(value, "__len__") and not isinstance(value, (str, bytes, dict))


def merge_outputs(outputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One output dict for the whole batch from each data-parallel rank's (in rank order).

    ``num_tokens`` is summed; ``loss`` and every other scalar is the ``num_tokens``-weighted mean (a per-rank
    mean over its tokens becomes the mean over all tokens, what one process computes); tensors with a batch
    dimension are concatenated in rank order; anything else is rank 0's.
    """
    import torch

    if len(outputs) == 1:
        return dict(outputs[0])
    weights = [float(o.get("num_tokens", 1)) for o in outputs]
    total = sum(weights) or 1.0
    merged: dict[str, Any] = {}
    for key, first in outputs[0].items():
        values = [o.get(key) for o in outputs]
        if key == "num_tokens":
            merged[key] = type(first)(sum(values)) if not isinstance(first, torch.Tensor) else torch.stack(
                list(values)).sum()
        elif _is_scalar(first):
            mean = sum(float(v) * w for v, w in zip(values, weights)) / total
            merged[key] = torch.tensor(mean, dtype=first.dtype) if isinstance(first, torch.Tensor) else mean
        elif isinstance(first, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in values):
            merged[key] = torch.cat(values, dim=0)
        else:
            merged[key] = first
    return merged


def _is_scalar(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, (int, float)) and not isinstance(value, bool)
