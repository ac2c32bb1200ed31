"""``native_fsdp``: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) with DCP checkpoints.

Each transformer block (the classes in the model's ``_no_split_modules``, else the children of the
first ``nn.ModuleList``) becomes one FSDP unit, then the root takes the remaining weights
(embeddings, final norm, head). Parameters and gradients are ``DTensor`` shards.

Mesh: the data-parallel ranks ``dp * fsdp`` of the Twinkle mesh. One of them > 1: the parameters
are sharded over all data-parallel ranks. Both > 1: HSDP, replicated over ``dp`` groups and sharded
within each group of ``fsdp`` ranks. Without a mesh, ``fsdp`` = world size.

Options:

* ``reshard_after_forward`` (default ``True``) — ``False`` keeps the gathered weights until the
  backward (ZeRO-2 like: more memory, fewer all-gathers).
* ``mixed_precision`` — by default derived from the model's precision (:mod:`.fsdp_precision`): the weights
  are gathered as stored and the precision's autocast computes in its dtype. ``"bf16"`` / ``"fp16"`` (or a
  ``MixedPrecisionPolicy``) gathers the weights in that dtype too, with gradients reduced in fp32; it must
  match the precision (``precision="bf16"`` with ``"fp16"`` is a configuration error).
* ``full_state_dict_on_all_ranks`` (default ``True``) — ``get_state_dict`` is complete on every
  rank, gathered one tensor at a time to CPU. ``False``: complete on rank 0 only (DCP's
  ``full_state_dict + cpu_offload``), which saves host memory for big models; other ranks get ``{}``.

Checkpoints: full weights are gathered for the public ``save_pretrained`` files; the optimizer is
a sharded DCP checkpoint in ``<state dir>/optimizer_dcp/`` that each rank writes its shard into.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_hf.strategies.collectives import device_mesh, ensure_process_group, grad_norm
from twinkle_backend_hf.strategies.fsdp_precision import check_mixed_precision, mixed_precision_policy
from twinkle_backend_hf.strategies.model_parts import transformer_blocks
from twinkle_core import distributed
from twinkle_core.capabilities import check_mesh
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.strategy import OptimizerHandle, Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator
    from twinkle_core.precision import Precision

logger = logging.getLogger("twinkle.strategies")

OPTIMIZER_DIR = "optimizer_dcp"


def _is_fsdp(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


class NativeFSDPStrategy(Strategy):
    name = "native_fsdp"
    shards_state = True
    averages_gradients = True
    #: the DCP optimizer state and the full exported weights load at any number of ranks (``--resume`` at
    #: another world size, see :mod:`twinkle_core.train.resharding`)
    reshards_checkpoints = True
    mesh_dimensions: ClassVar[tuple[str, ...]] = ("dp", "fsdp")

    def __init__(self, mesh: DeviceMesh | None = None, *, precision: Precision | None = None,
                 reshard_after_forward: bool = True, mixed_precision: Any = None,
                 full_state_dict_on_all_ranks: bool = True, **options: Any) -> None:
        if options:
            raise ConfigError(f"strategy {self.name!r} got unknown option(s) {sorted(options)}; known: "
                              f"reshard_after_forward, mixed_precision, full_state_dict_on_all_ranks")
        super().__init__(mesh, precision=precision, reshard_after_forward=reshard_after_forward,
                         mixed_precision=mixed_precision, full_state_dict_on_all_ranks=full_state_dict_on_all_ranks)
        check_mixed_precision(precision, mixed_precision)  # before anything is built
        self._device_mesh: Any = None

    def bind_precision(self, precision: Precision) -> None:
        super().bind_precision(precision)
        check_mixed_precision(self.precision, self.options["mixed_precision"])

    # ------------------------------------------------------------------ process group
    def setup(self, accelerator: Accelerator) -> None:
        ensure_process_group(accelerator.dist_backend)
        if self.mesh is None:
            self.mesh = DeviceMesh(fsdp=distributed.world_size())
        super().setup(accelerator)
        check_mesh(self.name, self.mesh, self.mesh_dimensions)

    def shard_mesh(self) -> Any:
        """The torch ``DeviceMesh`` that ``fully_shard`` uses (1-D FSDP or 2-D HSDP)."""
        if self._device_mesh is None:
            device_type = self.accelerator.device_type if self.accelerator is not None else "cpu"
            dp, fsdp = self.mesh.dp, self.mesh.fsdp
            if dp > 1 and fsdp > 1:
                self._device_mesh = device_mesh(device_type, (dp, fsdp), ("dp_replicate", "dp_shard"))
            else:
                self._device_mesh = device_mesh(device_type, (dp * fsdp,), ("dp_shard",))
        return self._device_mesh

    def mixed_precision_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy``, derived from the precision (see :mod:`.fsdp_precision`)."""
        return mixed_precision_policy(self.precision, self.options["mixed_precision"])

    # ------------------------------------------------------------------ module
    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        if _is_fsdp(module):
            return module
        kwargs = {"mesh": self.shard_mesh(), "reshard_after_forward": self.options["reshard_after_forward"],
                  "mp_policy": self.mixed_precision_policy()}
        blocks = transformer_blocks(module)
        if not blocks:
            logger.warning("native_fsdp: found no transformer blocks in %s; sharding the model as one unit "
                           "(every forward gathers all weights)", type(module).__name__)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)
        return module

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # fully_shard works in place: the module is its own wrapper

    @property
    def forward_is_collective(self) -> bool:
        return True  # each sharded unit all-gathers its parameters in its forward

    @contextlib.contextmanager
    def no_sync(self, module: torch.nn.Module) -> Iterator[None]:
        """Accumulate unsharded gradients locally; the step's last backward reduce-scatters the sum."""
        if not _is_fsdp(module):
            yield
            return
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ gradients
    def scale_gradients(self, module: torch.nn.Module, handle: OptimizerHandle, factor: float) -> None:
        grads = [p.grad for p in handle.parameters if p.grad is not None]
        if grads and factor != 1.0:
            with torch.no_grad():
                for g in grads:  # DTensor.mul_ scales the local shard
                    g.mul_(factor)

    def clip_grad_norm(self, module: torch.nn.Module, handle: OptimizerHandle, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        """Clip in place; return the global pre-clip norm (reduced over every shard) as a plain tensor."""
        grads = [p.grad for p in handle.parameters if p.grad is not None]
        total = grad_norm(grads, norm_type)
        coefficient = float(max_norm) / (float(total) + 1e-6)
        if grads and coefficient < 1.0:  # False for an infinite limit and for a NaN norm (the step is skipped)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coefficient)
        return total

    # ------------------------------------------------------------------ weights
    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        if not _is_fsdp(module):
            return super().full_state_dict(module)
        if not self.options["full_state_dict_on_all_ranks"]:
            return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        sharded = get_model_state_dict(module)
        full: dict[str, torch.Tensor] = {}
        for key, value in sharded.items():  # same order on every rank: each full_tensor() is a collective
            if isinstance(value, DTensor):
                value = value.full_tensor()
            full[key] = value.detach().cpu()
        return full

    def load_state_dict(self, module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if not _is_fsdp(module):
            return super().load_state_dict(module, state_dict, strict=strict)
        own = set(module.state_dict().keys())
        unexpected = sorted(set(state_dict) - own)
        missing = sorted(own - set(state_dict))
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        state_dict = {k: v for k, v in state_dict.items() if k in own}
        set_model_state_dict(module, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))

    # ------------------------------------------------------------------ optimizer
    def save_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not _is_fsdp(module):
            return super().save_optimizer_state(directory, module, handle)
        state = {"optimizer": get_optimizer_state_dict(module, handle.optimizer)}
        dcp.save(state, checkpoint_id=os.path.join(directory, OPTIMIZER_DIR))

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        path = os.path.join(directory, OPTIMIZER_DIR)
        if not _is_fsdp(module) or not os.path.isdir(path):
            if not os.path.isdir(path) and _is_fsdp(module):
                raise FileNotFoundError(f"{directory} holds no {OPTIMIZER_DIR}/: was the checkpoint written by a "
                                        f"different strategy than {self.name!r}?")
            return super().load_optimizer_state(directory, module, handle)
        # the template: DCP loads in place into tensors of the right shapes and shardings
        state = {"optimizer": get_optimizer_state_dict(module, handle.optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(module, handle.optimizer, state["optimizer"])
