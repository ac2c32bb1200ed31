"""``grad_allreduce``: data parallelism without a wrapper, for models whose trainable parameters change while the
process runs (many tenants' LoRA adapters on one base: :class:`~twinkle_backend_hf.multi_lora.MultiLoraTransformersModel`).

Every rank holds the whole model. Backward stays local: each rank accumulates the gradients of its own slice of the
batch over the whole accumulation window. Once per optimizer step, when the model normalises the window's gradients
(:meth:`scale_gradients`, before they are measured, clipped or applied), the gradients of the stepping optimizer's
parameters are summed over the ranks (one all-reduce of one flat buffer per dtype), so every rank steps on the
gradient of the *global* batch. Nothing captures the parameter set: an adapter added or removed between steps needs
no re-wrapping, and only the stepping adapter's gradients cross the network.

Gradients are summed, not averaged (``averages_gradients = False``): the core's normalisation then divides by the
global token count, or by nothing for a loss that reports ``num_tokens=0`` (sum semantics).

Rules for callers (all ranks run the same calls in the same order, as under torchrun):

* every rank calls ``set_optimizer`` together: it broadcasts the optimizer's parameters from rank 0, so each rank
  starts every adapter from rank 0's weights (DDP's constructor does the same for the whole model);
* every rank takes part in each ``forward_backward`` of a window (the core's window bookkeeping sums token counts
  over the ranks) and in each step;
* a forward without backward (``forward_only``, generation) communicates nothing and may run on one rank alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_hf.strategies.collectives import ensure_process_group
from twinkle_core.capabilities import check_mesh
from twinkle_core.errors import ConfigError
from twinkle_core.strategy import OptimizerHandle, Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator


class GradAllReduceStrategy(Strategy):
    name = "grad_allreduce"
    averages_gradients = False
    mesh_dimensions: ClassVar[tuple[str, ...]] = ("dp",)

    def __init__(self, mesh: Any = None, *, precision: Any = None, **options: Any) -> None:
        if options:
            raise ConfigError(f"strategy 'grad_allreduce' takes no options, got {sorted(options)}")
        super().__init__(mesh, precision=precision)

    def setup(self, accelerator: Accelerator) -> None:
        ensure_process_group(accelerator.dist_backend)
        super().setup(accelerator)
        check_mesh(self.name, self.mesh, self.mesh_dimensions)

    def prepare_optimizer(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                          parameters: list[torch.nn.Parameter],
                          gradient_accumulation_steps: int = 1) -> tuple[torch.nn.Module, OptimizerHandle]:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            with torch.no_grad():
                for values in _flat_by_dtype([p.data for p in parameters]):
                    dist.broadcast(values.flat, src=0, group=self.dp_group)
                    values.scatter()
        return super().prepare_optimizer(module, optimizer, parameters=parameters,
                                         gradient_accumulation_steps=gradient_accumulation_steps)

    def scale_gradients(self, module: torch.nn.Module, handle: OptimizerHandle, factor: float) -> None:
        """Sum the window's gradients over the ranks, then multiply them by ``factor`` (once per step)."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            params = handle.parameters
            if not params:
                return super().scale_gradients(module, handle, factor)
            # a parameter without a gradient on one rank but with one on another takes part as zeros; one that no
            # rank has a gradient for stays without (the optimizer then skips it, as in one process)
            present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
            dist.all_reduce(present, group=self.dp_group)
            used = [p for p, n in zip(params, present.tolist()) if n > 0]
            for p in used:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            with torch.no_grad():
                for values in _flat_by_dtype([p.grad for p in used]):
                    dist.all_reduce(values.flat, group=self.dp_group)
                    values.scatter()
        super().scale_gradients(module, handle, factor)


class _Flat:
    """Tensors of one dtype and device packed into one buffer, and unpacked into them again."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.flat = torch.cat([t.reshape(-1) for t in tensors])

    def scatter(self) -> None:
        offset = 0
        for t in self.tensors:
            t.copy_(self.flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _flat_by_dtype(tensors: list[torch.Tensor]) -> list[_Flat]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return [_Flat(group) for group in groups.values()]
