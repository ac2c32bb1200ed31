"""``ddp``: torch ``DistributedDataParallel`` over every rank (gloo on CPU, nccl on GPU).

Every rank holds the whole model; DDP averages gradients over the ranks during backward. Options:

* ``find_unused_parameters`` (default: automatic) — DDP must be told when some registered
  parameters get no gradient in a step. That is the case as soon as the model holds several PEFT
  adapters (only the active tenant's weights are used), so "automatic" turns it on exactly then.
* ``broadcast_buffers`` (default ``True``), ``bucket_cap_mb`` — passed to DDP.
* ``local_accumulation`` (default ``True``) — see :meth:`DDPStrategy.no_sync`.

Several adapters: DDP registers the parameters that require a gradient when it is built, and PEFT
leaves only the active adapter trainable. The wrap therefore marks every adapter's weights
trainable while DDP is built, so that whichever tenant trains later is synchronised; which ones
actually train is decided per forward by PEFT's ``set_adapter``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_hf.strategies.collectives import ensure_process_group
from twinkle_backend_hf.strategies.model_parts import all_adapters_trainable, peft_adapter_names
from twinkle_core.capabilities import check_mesh
from twinkle_core.errors import ConfigError
from twinkle_core.strategy import Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator
    from twinkle_core.precision import Precision

logger = logging.getLogger("twinkle.strategies")


class DDPStrategy(Strategy):
    name = "ddp"
    averages_gradients = True
    mesh_dimensions: ClassVar[tuple[str, ...]] = ("dp",)

    def __init__(self, mesh: Any = None, *, precision: Precision | None = None,
                 find_unused_parameters: bool | None = None, broadcast_buffers: bool = True,
                 bucket_cap_mb: float | None = None, local_accumulation: bool = True, **options: Any) -> None:
        if options:
            raise ConfigError(f"strategy 'ddp' got unknown option(s) {sorted(options)}; known: "
                              f"find_unused_parameters, broadcast_buffers, bucket_cap_mb, local_accumulation")
        super().__init__(mesh, precision=precision, find_unused_parameters=find_unused_parameters,
                         broadcast_buffers=broadcast_buffers, bucket_cap_mb=bucket_cap_mb,
                         local_accumulation=local_accumulation)
        self._skip_sync = False

    def setup(self, accelerator: Accelerator) -> None:
        ensure_process_group(accelerator.dist_backend)
        super().setup(accelerator)
        check_mesh(self.name, self.mesh, self.mesh_dimensions)

    # ------------------------------------------------------------------ module
    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):
            return module
        several_adapters = len(peft_adapter_names(module)) > 1
        find_unused = self.options["find_unused_parameters"]
        if find_unused is None:
            find_unused = several_adapters
        elif not find_unused and several_adapters:
            logger.warning("ddp: find_unused_parameters=False with several PEFT adapters; the second step "
                           "that trains another adapter will fail in DDP's reducer")
        kwargs: dict[str, Any] = {"find_unused_parameters": find_unused}
        # torch >= 2.12 renamed broadcast_buffers to forward_sync_buffers
        sync_key = ("forward_sync_buffers" if "forward_sync_buffers" in
                    inspect.signature(DistributedDataParallel.__init__).parameters else "broadcast_buffers")
        kwargs[sync_key] = self.options["broadcast_buffers"]
        if self.options["bucket_cap_mb"] is not None:
            kwargs["bucket_cap_mb"] = self.options["bucket_cap_mb"]
        device = self.accelerator.device() if self.accelerator is not None else torch.device("cpu")
        if device.type != "cpu":
            kwargs["device_ids"] = [device.index]
            kwargs["output_device"] = device.index
        with all_adapters_trainable(module):
            if not any(p.requires_grad for p in module.parameters()):
                return module  # a frozen model (a reference or teacher) has no gradients to synchronise
            wrapped = DistributedDataParallel(module, **kwargs)
        if self.options["local_accumulation"]:
            wrapped.register_comm_hook(None, self._comm_hook)
        return wrapped

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        return module.module if isinstance(module, DistributedDataParallel) else module

    @contextlib.contextmanager
    def no_sync(self, module: torch.nn.Module) -> Iterator[None]:
        """Backward without gradient all-reduce (accumulation micro-steps).

        ``DDP.no_sync`` only takes effect when the *forward* ran inside it too; the model calls
        this around the backward alone. With ``local_accumulation`` the DDP comm hook therefore
        skips the all-reduce while this context is open, so accumulated gradients are reduced
        once, at the step's last micro-batch.
        """
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(module, DistributedDataParallel):
            yield
            return
        self._skip_sync = True
        try:
            with module.no_sync():
                yield
        finally:
            self._skip_sync = False

    def _comm_hook(self, state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        if self._skip_sync:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(bucket.buffer())  # keep this rank's gradients as they are
            return future
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)
