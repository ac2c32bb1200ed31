"""Twinkle on Ray: worker groups of Ray actors that form one ``torch.distributed`` group, a proxy that drives a
model in every rank from one controller, and ``twinkle train --runtime ray``.

``twinkle-core`` never imports Ray; this package imports it inside the functions that need it.
"""

from twinkle_ray.remote_model import RemoteModel
from twinkle_ray.worker_group import WorkerFailedError, WorkerGroup

__all__ = ["RemoteModel", "WorkerFailedError", "WorkerGroup"]
