"""The gradient side of :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy`.

:class:`ZeroGradients` works on one engine's ZeRO partitions: backward into them (boundary / non-boundary
micro-steps), scaling and clipping the partitioned gradients, the optimizer step on the shared engine, and
dropping gradients that will not be stepped. The strategy hands each call the engine, the wrapped module and
the optimizer's handle; the object keeps only the ZeRO stage.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from twinkle_backend_hf.strategies.deepspeed_module import DeepSpeedHandle, DeepSpeedModule
from twinkle_core import distributed
from twinkle_core.errors import ConfigError

#: tells "the optimizer had no instance-level ``step``" apart from any value it could have had
_MISSING = object()


class ZeroGradients:
    """The gradients of one ZeRO engine (``stage`` 1, 2 or 3), reached through its public per-parameter APIs."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def backward(self, engine: Any, wrapped: DeepSpeedModule, handle: DeepSpeedHandle | None, loss: torch.Tensor,
                 *, accumulating: bool) -> None:
        """Back-propagate ``loss`` into ``handle``'s partitions; ``accumulating``: a micro-step that is not the
        last before a step (a DeepSpeed non-boundary backward)."""
        if handle is None:
            raise ConfigError("strategy 'deepspeed' back-propagates into an optimizer's gradient partitions: call "
                              "set_optimizer for this adapter (or the model) before its backward")
        if any(other.gradients for other in wrapped.handles if other is not handle):
            raise ConfigError("strategy 'deepspeed' holds one set of partitioned gradients for all adapters: "
                              "finish one adapter's optimizer step (clip_grad_and_step) before back-propagating "
                              "another adapter's loss")
        reduced = handle.gradients == "reduced"
        # Once a boundary backward has reduced the gradients, any further backward before the step must
        # be a boundary too (its gradients have to reach the same partitions).
        boundary = reduced or not accumulating
        carried = None
        if reduced and self.stage < 3:
            # ZeRO-1/2 rebuild the partitioned gradients from this backward alone at a second boundary;
            # keep the first boundary's and add them back (ZeRO-3 accumulates by itself).
            carried = [(p, g.detach().clone()) for p, g in self.pieces(engine, handle.parameters, tolerant=True)]
        engine.set_gradient_accumulation_boundary(boundary)
        # scale_wrt_gas=False: the loss is a token sum; Twinkle divides by the global token count.
        engine.backward(loss, scale_wrt_gas=False)
        if carried:
            now = {id(p): g for p, g in self.pieces(engine, [p for p, _ in carried], tolerant=True)}
            for p, previous in carried:
                if id(p) in now:
                    now[id(p)].add_(previous.to(now[id(p)].device, now[id(p)].dtype))
        handle.gradients = "reduced" if boundary else "accumulating"

    def pieces(self, engine: Any, parameters: list[torch.nn.Parameter], *,
               tolerant: bool = False) -> list[tuple[Any, torch.Tensor]]:
        """This rank's share of each parameter's gradient: ``(param, tensor)``, disjoint across ranks.
        ``tolerant``: leave out parameters DeepSpeed holds no reduced gradient for."""
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_grad

            local = [(p, safe_get_local_grad(p)) for p in parameters if hasattr(p, "ds_id")]
            return [(p, grad) for p, grad in local if grad is not None]
        pieces: list[tuple[Any, torch.Tensor]] = []
        for p in parameters:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # no fragment of this parameter is owned by this rank
                continue
            try:
                grad = mapping.get_lp_grad_fragment(p._index_in_param_group)
            except ValueError:  # "Gradients are only available immediately after backward and before step"
                if tolerant:
                    continue
                raise
            address = mapping.lp_fragment_address
            if grad.numel() == p.numel() and address.numel != p.numel():
                # a full-size accumulation buffer (bf16 optimizer): this rank owns one fragment of it
                grad = grad.view(-1).narrow(0, address.start, address.numel)
            pieces.append((p, grad))
        return pieces

    def multiply(self, pieces: list[tuple[Any, torch.Tensor]], factor: float) -> None:
        if factor == 1.0:
            return
        if self.stage == 3:
            from deepspeed.utils import safe_set_local_grad

            for p, grad in pieces:
                safe_set_local_grad(p, grad * factor)
            return
        for _, grad in pieces:
            grad.mul_(factor)

    @staticmethod
    def has_reduced_gradients(handle: DeepSpeedHandle) -> bool:
        """Whether ``handle``'s optimizer has reduced gradients waiting in the partitions."""
        if handle.gradients == "accumulating":
            raise ConfigError("strategy 'deepspeed': the optimizer step came before the last micro-batch of the "
                              "gradient accumulation window (gradient_accumulation_steps), so DeepSpeed has not "
                              "reduced the gradients; step after the last micro-batch (clip_grad_and_step does)")
        return handle.gradients == "reduced"

    def scale(self, engine: Any, handle: DeepSpeedHandle, factor: float) -> None:
        if self.has_reduced_gradients(handle):
            self.multiply(self.pieces(engine, handle.parameters), factor)

    def clip(self, engine: Any, handle: DeepSpeedHandle, max_norm: float, norm_type: float, *,
             device: torch.device, group: Any) -> torch.Tensor:
        """Clip ``handle``'s partitioned gradients in place; return the global pre-clip norm (reduced over
        ``group``, the data-parallel ranks)."""
        if not self.has_reduced_gradients(handle):
            return torch.zeros((), dtype=torch.float64)  # no gradients, like torch's clip_grad_norm_
        pieces = self.pieces(engine, handle.parameters)
        norm_type = float(norm_type)
        if math.isinf(norm_type):
            local = max((float(g.detach().abs().max()) for _, g in pieces if g.numel()), default=0.0)
            total = torch.tensor(local, dtype=torch.float64, device=device)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=group)
        else:
            local = torch.zeros((), dtype=torch.float64, device=device)
            for _, g in pieces:
                local += torch.linalg.vector_norm(g.detach().to(device), norm_type, dtype=torch.float64) ** norm_type
            total = distributed.all_reduce_sum(local, group=group) ** (1.0 / norm_type)
        total = total.cpu()
        if math.isfinite(max_norm) and math.isfinite(float(total)):
            coefficient = max_norm / (float(total) + 1e-6)
            if coefficient < 1.0:
                self.multiply(pieces, coefficient)
        return total

    def step(self, engine: Any, wrapped: DeepSpeedModule, handle: DeepSpeedHandle) -> bool:
        """Step ``handle``'s optimizer on the shared engine; False when DeepSpeed skipped the step."""
        if not self.has_reduced_gradients(handle):
            return True  # this optimizer has no gradients since its last step: like torch, a no-op
        group = wrapped.optimizer_group
        if group is not None:
            group.active = handle.optimizer
        try:
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        finally:
            if group is not None:
                group.active = None
            handle.gradients = None
        return bool(engine.was_step_applied())

    def discard(self, engine: Any, wrapped: DeepSpeedModule, handle: DeepSpeedHandle) -> None:
        """Drop gradients that will not be stepped (a skipped non-finite step, ``zero_grad`` without ``step``)."""
        try:
            if handle.gradients == "reduced":
                self._release_reduced(engine, wrapped, handle)
            elif self.stage == 3:
                # Mid-accumulation: ZeRO-3's zero_grad restarts its micro-step count, so the next backward
                # overwrites the partially accumulated partitions instead of adding to them.
                engine.optimizer.zero_grad(set_to_none=True)
            else:
                self._clear_accumulation_buffers(engine.optimizer)
        finally:
            handle.gradients = None

    @staticmethod
    def _release_reduced(engine: Any, wrapped: DeepSpeedModule, handle: DeepSpeedHandle) -> None:
        """Let DeepSpeed's step bookkeeping release the reduced gradients, with the torch optimizer's update
        switched off, so no weight and no optimizer state moves."""
        target = wrapped.optimizer_group if wrapped.optimizer_group is not None else handle.optimizer
        previous = target.__dict__.get("step", _MISSING)
        target.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
        try:
            engine.set_gradient_accumulation_boundary(True)
            engine.step()
        finally:
            if previous is _MISSING:
                del target.step
            else:
                target.step = previous

    @staticmethod
    def _clear_accumulation_buffers(zero: Any) -> None:
        """Mid-accumulation: ZeRO-1/2 keep the micro-steps' gradients in their accumulation buffers; clear them
        the way DeepSpeed's own overflow handling in step() does."""
        zero.zero_grad(set_to_none=True)
        for buffers in (getattr(zero, "averaged_gradients", {}), getattr(zero, "all_grad_tensors", {})):
            for key in list(buffers):
                buffers[key] = None
        if hasattr(zero, "micro_step_id"):
            zero.micro_step_id = -1  # DeepSpeed's INITIAL_MICRO_STEP_ID: the next backward starts afresh
