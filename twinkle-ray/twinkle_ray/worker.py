"""One rank of a worker group: a Ray actor whose process looks to Twinkle exactly like a ``torchrun`` worker.

The group sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the actor before anything imports torch's distributed package, so the strategies start their
process group from the environment as they do under torchrun. The actor then either builds a model and answers
calls on it (the Python API's :class:`~twinkle_ray.remote_model.RemoteModel`) or runs a whole ``twinkle train``
job as one rank (``--runtime ray``).
"""

from __future__ import annotations

import os
import socket
from typing import Any


class TwinkleWorker:
    """The actor class (made remote by :class:`~twinkle_ray.worker_group.WorkerGroup`)."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.model: Any = None

    # ------------------------------------------------------------------ placement and rendezvous
    def identity(self) -> dict[str, Any]:
        """Where this actor runs: its Ray node id, the node's address and the process id."""
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "pid": os.getpid(),
                "accelerator_ids": {k: list(v) for k, v in context.get_accelerator_ids().items()}}

    def free_port(self, host: str) -> int:
        """A TCP port free on this actor's node, for the group's rendezvous (rank 0 is asked)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])

    def set_environment(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def environment(self, keys: list[str]) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in keys}

    def apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in this rank's process (``fn`` is pickled by Ray: a module-level function)."""
        return to_host(fn(*args, **kwargs))

    # ------------------------------------------------------------------ a model driven call by call
    def build_model(self, model_class: Any, kwargs: dict[str, Any]) -> dict[str, int]:
        """Build the model (this starts the process group); return this rank's data-parallel coordinates."""
        if isinstance(model_class, str):
            from twinkle_core.model import get_model_class

            model_class = get_model_class(model_class)
        self.model = model_class(**kwargs)
        view = self.model.data_parallel
        return {"dp_rank": view.rank, "dp_size": view.size}

    def attach_model(self, locate: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, int]:
        """Drive a model already built in this process: ``locate(*args, **kwargs)`` (a module-level function, pickled
        by Ray) returns it, e.g. the model of a service object that ``apply`` built. Returns the model's
        data-parallel coordinates, as :meth:`build_model` does."""
        self.model = locate(*args, **kwargs)
        view = self.model.data_parallel
        return {"dp_rank": view.rank, "dp_size": view.size}

    def model_attribute(self, name: str) -> Any:
        """The value of the model's attribute ``name`` (a property such as ``network_input_keys``)."""
        if self.model is None:
            raise RuntimeError("no model built in this worker: call build_model first")
        return to_host(getattr(self.model, name))

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.model is None:
            raise RuntimeError("no model built in this worker: call build_model first")
        return to_host(getattr(self.model, method)(*args, **kwargs))

    # ------------------------------------------------------------------ a whole job
    def run_training(self, argv: list[str]) -> dict[str, Any] | None:
        """Run ``twinkle train`` as this rank; rank 0 returns the run's summary."""
        from twinkle_core.commands.train import train_this_process

        return train_this_process(argv)


def to_host(value: Any) -> Any:
    """``value`` with every tensor detached and moved to the CPU (what crosses to the controller)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value
