"""``megatron``: Megatron-core model parallelism (TP / PP / VPP / EP / CP) plus data parallelism.

The Twinkle mesh maps onto ``megatron.core.parallel_state``: ``tp`` tensor, ``pp`` pipeline, ``vpp``
virtual pipeline stages per rank, ``cp`` context, ``ep`` expert parallel (carved out of the
data-parallel ranks) and ``dp`` = world / (tp * pp * cp). ``fsdp`` and Ulysses ``sp`` do not exist in
Megatron (use ``distributed_optimizer=True`` to shard optimizer state, ``sequence_parallel=True`` for
Megatron's TP sequence parallelism).

Gradients: every rank keeps its shard's gradients in ``param.grad``. Once per optimizer step (when
the model normalises gradients) they are summed over the data-parallel group (expert weights over
the expert-data-parallel group), the tied embedding of the first and last pipeline stages over the
embedding group, and then scaled to ``d(sum loss) / global tokens``. The norm in
:meth:`MegatronStrategy.clip_grad_norm` is the norm of the full (unsharded) gradient: TP-sharded
weights are counted once per shard, TP-replicated ones (norms) and the tied output copy once.

Options:

* ``num_microbatches`` (default: the pipeline size) — how many pipeline micro-batches one
  ``forward_backward`` batch is split into when ``pp > 1``.
* ``batch_p2p_comm`` (default: ``True`` except with virtual pipelining on gloo, where megatron-core's
  batched isend/irecv gives wrong results) — passed to the pipeline schedules.
* ``sequence_parallel`` (needs ``tp > 1``) — Megatron sequence parallelism inside TP regions (on CPU too, with
  ``pp > 1`` as well; lengths are padded to a multiple of ``tp``, see :mod:`.sequence_padding`).
* ``distributed_optimizer`` (default ``False``) — Megatron's ``DistributedOptimizer``: the model chunks
  are wrapped in megatron-core's ``DistributedDataParallel`` (contiguous gradient buffers,
  reduce-scatter over the data-parallel ranks) and the optimizer state and fp32 main weights are
  sharded over them (ZeRO-1). Adam / AdamW only (megatron-core's restriction), full fine-tuning only;
  clipping and the norm use megatron-core's sharded implementation and agree with the default path.
* ``vocab_parallel_loss`` (default ``True``; only matters with ``tp > 1``) — the LM head keeps its logits split
  over the TP ranks and the losses get this rank's vocabulary slice (``LossContext.vocab_shard``, see
  :mod:`twinkle_core.loss.vocab_parallel`): no rank holds ``[tokens, vocab]``. ``False`` gathers the full logits
  first (what a loss that needs whole distributions, e.g. ``gkd``, or LoRA on the LM head requires).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_megatron import sequence_padding
from twinkle_backend_megatron.weights import chunks_of
from twinkle_core import distributed
from twinkle_core.capabilities import check_mesh
from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.strategy import OptimizerHandle, Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator
    from twinkle_core.precision import Precision

_KNOWN_OPTIONS = ("num_microbatches", "batch_p2p_comm", "sequence_parallel", "distributed_optimizer",
                  "vocab_parallel_loss")

#: mesh dimensions Megatron has no counterpart for, and what to use instead (the core's capability check
#: shows these in place of its generic refusal)
_FOREIGN_DIMENSIONS = {
    "fsdp": ("strategy 'megatron' has no fsdp dimension (mesh.fsdp={size}); use mesh.dp for data parallelism "
             "(distributed_optimizer=True shards the optimizer state over it)"),
    "sp": ("strategy 'megatron' has no Ulysses sequence parallelism (mesh.sp={size}); use mesh.cp (context "
           "parallel) or sequence_parallel=True with mesh.tp > 1"),
}


@dataclass(eq=False)
class MegatronHandle(OptimizerHandle):
    """An optimizer as the ``megatron`` strategy drives it.

    ``sharded`` is megatron-core's ``DistributedOptimizer`` around ``optimizer`` (``None`` without
    ``distributed_optimizer``); ``grads_ready`` says whether its main gradients were already copied from
    the gradient buffers in this window (``prepare_grads`` must run exactly once per step).
    """

    sharded: Any = None
    grads_ready: bool = False

    def prepared(self) -> Any:
        """The distributed optimizer, with this window's main gradients copied from the buffers."""
        if not self.grads_ready:
            self.sharded.prepare_grads()
            self.grads_ready = True
        return self.sharded


def _ensure_process_group(backend: str) -> None:
    """Join the torchrun job, or start a one-rank group: megatron-core always needs one."""
    import torch.distributed as dist

    if distributed.init_process_group(backend):
        return
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


class MegatronStrategy(Strategy):
    name = "megatron"
    #: dist_checkpointing reshards base-model weights and optimizer to another TP / PP / DP layout (LoRA and
    #: distributed-optimizer states refuse another layout in load_optimizer_state)
    reshards_checkpoints = True
    averages_gradients = False  # gradients are summed over data-parallel ranks, then divided by global tokens
    mesh_dimensions: ClassVar[tuple[str, ...]] = ("dp", "tp", "pp", "vpp", "cp", "ep")
    supported_models: ClassVar[tuple[str, ...] | None] = ("MegatronModel",)
    dimension_notes: ClassVar[dict[str, str]] = _FOREIGN_DIMENSIONS
    #: ``sequence_parallel=True`` (the spec's flag, not a size) is this strategy's own option: sequence
    #: parallelism inside tensor-parallel regions
    spec_options: ClassVar[frozenset[str]] = frozenset({"sequence_parallel"})

    @classmethod
    def splits_vocabulary(cls, options: dict[str, Any]) -> bool:
        return bool(options.get("vocab_parallel_loss", True))

    def __init__(self, mesh: DeviceMesh | None = None, *, precision: Precision | None = None,
                 num_microbatches: int | None = None, batch_p2p_comm: bool | None = None,
                 sequence_parallel: bool = False, distributed_optimizer: bool = False,
                 vocab_parallel_loss: bool = True, **options: Any) -> None:
        if options:
            raise ConfigError(f"strategy 'megatron' got unknown option(s) {sorted(options)}; known: "
                              f"{', '.join(_KNOWN_OPTIONS)}")
        if num_microbatches is not None and num_microbatches < 1:
            raise ConfigError("strategy 'megatron': num_microbatches must be >= 1")
        if mesh is not None:
            check_mesh(self.name, mesh, self.mesh_dimensions, self.dimension_notes)
        super().__init__(mesh, precision=precision, num_microbatches=num_microbatches, batch_p2p_comm=batch_p2p_comm,
                         sequence_parallel=sequence_parallel, distributed_optimizer=distributed_optimizer,
                         vocab_parallel_loss=bool(vocab_parallel_loss))
        self.cpu_layer = False

    # ------------------------------------------------------------------ process groups
    def setup(self, accelerator: Accelerator) -> None:
        from twinkle_backend_megatron import ascend, compat

        ascend.prepare_megatron(accelerator)  # on npu MindSpeed must patch megatron-core before its first import
        self.accelerator = accelerator
        if accelerator.device_type == "cpu":
            self.cpu_layer = compat.apply()
        _ensure_process_group(accelerator.dist_backend)
        accelerator.set_device()
        world = distributed.world_size()
        if self.mesh is None:
            self.mesh = DeviceMesh.infer(world)
        mesh = self.mesh
        on_cpu = accelerator.device_type == "cpu"
        if on_cpu and mesh.cp > 1:
            raise UnsupportedHardwareError(
                "context parallelism (mesh.cp > 1) on the Megatron backend needs Transformer Engine attention on "
                "GPUs: megatron-core's local attention (DotProductAttention in "
                "megatron/core/transformer/dot_product_attention.py) asserts context_parallel_size == 1, and only "
                "TEDotProductAttention splits the sequence. On CPU use the HF backend's ring attention (strategy "
                "'ulysses' with cp_impl: ring), or sequence_parallel=true with mesh.tp > 1 here")
        if self.options["sequence_parallel"]:
            if mesh.tp == 1:
                raise ConfigError("sequence_parallel=True needs tensor parallelism (mesh.tp > 1)")
        mesh.validate(world)
        if self.options["batch_p2p_comm"] is None:
            # gloo + interleaved schedule + batched isend/irecv silently corrupts activations
            self.options["batch_p2p_comm"] = not (mesh.vpp > 1 and accelerator.dist_backend == "gloo")
        self._initialize_parallel_state()

    def _initialize_parallel_state(self) -> None:
        from megatron.core import parallel_state as ps

        mesh = self.mesh
        layout = (mesh.tp, mesh.pp, mesh.vpp if mesh.vpp > 1 else None, mesh.cp, mesh.ep)
        if ps.model_parallel_is_initialized():
            current = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                       ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                       ps.get_expert_model_parallel_world_size())
            if current == layout:
                return
            ps.destroy_model_parallel()  # a new layout in the same process (tests build several)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=mesh.tp, pipeline_model_parallel_size=mesh.pp,
            virtual_pipeline_model_parallel_size=layout[2], context_parallel_size=mesh.cp,
            expert_model_parallel_size=mesh.ep, create_gloo_process_groups=False)

    @property
    def dp_size(self) -> int:
        return self.mesh.dp if self.mesh else 1

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def dp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        # with one data-parallel rank (pure TP / PP) the sum is the value: no hand-off to the collective's thread
        return value if self.dp_size == 1 else super().global_sum(value)

    def vocab_shard(self, vocab_size: int, padded_vocab_size: int) -> Any:
        """This rank's :class:`~twinkle_core.loss.vocab_parallel.VocabShard` of a ``padded_vocab_size`` LM head,
        or ``None`` when the losses get the whole (gathered) logits: ``mesh.tp == 1`` or the option
        ``vocab_parallel_loss=False``. With a shard the head keeps its output split over the TP ranks
        (``parallel_output=True``) and the losses take the softmax across them, so no rank holds
        ``[tokens, vocab]``."""
        if self.mesh is None or self.mesh.tp == 1 or not self.options["vocab_parallel_loss"]:
            return None
        from megatron.core import parallel_state as ps

        from twinkle_core.loss.vocab_parallel import VocabShard

        width = padded_vocab_size // self.mesh.tp
        start = ps.get_tensor_model_parallel_rank() * width
        return VocabShard(start=start, end=start + width, vocab_size=vocab_size,
                          group=ps.get_tensor_model_parallel_group())

    @property
    def num_microbatches(self) -> int:
        return self.options["num_microbatches"] or self.mesh.pp

    @property
    def sequence_multiple(self) -> int:
        """What every sequence length must divide by: ``tp`` under sequence parallelism (the sequence is split
        over the TP ranks), else 1."""
        return self.mesh.tp if self.options["sequence_parallel"] else 1

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Sequences right-padded to :attr:`sequence_multiple` (:mod:`.sequence_padding`; nothing real changes)."""
        return sequence_padding.pad_sequences(inputs, self.sequence_multiple)[0]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "cpu_compat_layer": self.cpu_layer}

    # ------------------------------------------------------------------ distributed optimizer
    @property
    def distributed_optimizer(self) -> bool:
        return bool(self.options["distributed_optimizer"])

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed_optimizer:
            return module
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        if isinstance(module, DistributedDataParallel) or (
                isinstance(module, torch.nn.ModuleList) and isinstance(module[0], DistributedDataParallel)):
            return module
        if not any(p.requires_grad for p in module.parameters()):
            return module  # a frozen model (a reference or teacher) has no gradients to reduce or optimizer to shard
        chunks = chunks_of(module)
        if any(".lora." in name for name, _ in module.named_parameters()):
            raise ConfigError("distributed_optimizer=True supports full fine-tuning only; LoRA adapters keep "
                              "their (small) optimizer state per rank, leave distributed_optimizer off")
        config = chunks[0].config
        if self.mesh.ep > 1:
            raise ConfigError("distributed_optimizer=True with expert parallelism (mesh.ep > 1) is not supported yet")
        if self.mesh.pp > 1 and chunks[0].share_embeddings_and_output_weights:
            raise ConfigError("distributed_optimizer=True with pipeline parallelism and tied embeddings is not "
                              "supported yet")
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                                   overlap_param_gather=False, grad_reduce_in_fp32=True)
        wrapped = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
        return wrapped[0] if len(wrapped) == 1 else torch.nn.ModuleList(wrapped)

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from megatron.core.distributed import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):
            return module.module
        if isinstance(module, torch.nn.ModuleList) and len(module) and isinstance(module[0], DistributedDataParallel):
            return torch.nn.ModuleList([m.module for m in module])
        return module

    def prepare_optimizer(self, module: torch.nn.Module, optimizer: Any, *, parameters: list[torch.nn.Parameter],
                          gradient_accumulation_steps: int = 1) -> tuple[torch.nn.Module, MegatronHandle]:
        """With ``distributed_optimizer``: shard ``optimizer`` (its class and hyper-parameters) with megatron-core.

        The handle's optimizer stays the inner torch optimizer, whose parameter groups then hold this rank's
        fp32 main-weight shards: schedulers and ``param_groups[0]["lr"]`` work on it as on any optimizer.
        """
        handle = MegatronHandle(optimizer, list(parameters), gradient_accumulation_steps)
        if self.distributed_optimizer:
            handle.sharded = self._shard_optimizer(module, optimizer)
        return module, handle

    def _shard_optimizer(self, module: torch.nn.Module, optimizer: Any) -> Any:
        """megatron-core's ``DistributedOptimizer`` around ``optimizer`` (ZeRO-1 over the data-parallel ranks)."""
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ConfigError(f"distributed_optimizer=True shards Adam / AdamW only (megatron-core), got "
                              f"{type(optimizer).__name__}; use set_optimizer('AdamW', ...) or turn it off")
        group = optimizer.param_groups[0]
        config = OptimizerConfig(optimizer="adam", lr=group["lr"], weight_decay=group.get("weight_decay", 0.0),
                                 adam_beta1=group["betas"][0], adam_beta2=group["betas"][1], adam_eps=group["eps"],
                                 clip_grad=0.0, use_distributed_optimizer=True, params_dtype=torch.float32)
        chunks = chunks_of(module)
        buffers = {i: list(chunk.buffers) + list(chunk.expert_parallel_buffers) for i, chunk in enumerate(chunks)}
        return DistributedOptimizer(
            optimizer, config, None, None, model_chunks=chunks, per_model_buffers=buffers,
            data_parallel_group=ps.get_data_parallel_group(with_context_parallel=True),
            data_parallel_group_gloo=None, data_parallel_group_idx=0, distributed_optimizer_instance_id=0)

    # ------------------------------------------------------------------ gradients
    def scale_gradients(self, module: torch.nn.Module, handle: MegatronHandle, factor: float) -> None:
        if handle.sharded is not None:
            for chunk in chunks_of(module):
                chunk.finish_grad_sync()  # reduce-scatter (summed: calculate_per_token_loss) into the buffers
                chunk.scale_gradients(factor)
            return
        self._sum_replicated_gradients(handle.parameters)
        _scale_grads(handle.parameters, factor)

    def _sum_replicated_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum each gradient over the ranks holding a copy of its weight (data, expert-data, SP, tied embedding)."""
        from megatron.core import parallel_state as ps

        if self.dp_size > 1:
            dense = [p for p in parameters if getattr(p, "allreduce", True)]
            experts = [p for p in parameters if not getattr(p, "allreduce", True)]
            _all_reduce_grads(dense, self.dp_group)
            if experts and ps.get_expert_data_parallel_world_size() > 1:
                _all_reduce_grads(experts, ps.get_expert_data_parallel_group())
        if self.options["sequence_parallel"]:
            # norms inside sequence-parallel regions see only this rank's tokens
            _all_reduce_grads([p for p in parameters if getattr(p, "sequence_parallel", False)],
                              ps.get_tensor_model_parallel_group())
        if self.mesh.pp > 1:
            shared = [p for p in parameters if getattr(p, "shared_embedding", False)]
            if ps.is_rank_in_embedding_group(ignore_virtual=True):
                _all_reduce_grads(shared, ps.get_embedding_group())

    def clip_grad_norm(self, module: torch.nn.Module, handle: MegatronHandle, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        if handle.sharded is not None:
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

            sharded = handle.prepared()
            norm = get_grad_norm_fp32(sharded.get_main_grads_for_grad_norm(), norm_type=norm_type,
                                      grad_stats_parallel_group=sharded.get_grad_stats_parallel_group())
            if math.isfinite(max_norm) and math.isfinite(norm):
                clip_grad_by_total_norm_fp32(sharded.get_parameters(), max_norm, norm)
            return torch.tensor(float(norm))
        parameters = handle.parameters
        norm = self.grad_norm(parameters, norm_type)
        if math.isfinite(max_norm) and math.isfinite(float(norm)):
            coefficient = max_norm / (float(norm) + 1e-6)
            if coefficient < 1.0:
                _scale_grads(parameters, coefficient)
        return norm

    def grad_norm(self, parameters: list[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """Norm of the full model's gradient (every shard of every rank counted once)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        norm_type = float(norm_type)
        device = self.accelerator.device() if self.accelerator is not None else torch.device("cpu")
        parts = {True: torch.zeros((), dtype=torch.float64, device=device),
                 False: torch.zeros((), dtype=torch.float64, device=device)}
        grads: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for p in parameters:
            if p.grad is None or getattr(p, "shared", False):  # the tied output copy is counted on stage 0
                continue
            if not param_is_not_tensor_parallel_duplicate(p):
                continue
            grads[not getattr(p, "allreduce", True)].append(p.grad.detach())
        for expert, local in grads.items():
            if not local:
                continue
            # one multi-tensor kernel per group, accumulating in float64 without a float64 copy of every gradient
            norms = torch.stack(torch._foreach_norm(local, norm_type, dtype=torch.float64))
            parts[expert] = norms.max() if norm_type == math.inf else norms.pow(norm_type).sum()
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(parts[False], op=op, group=ps.get_model_parallel_group())
        if any(not getattr(p, "allreduce", True) for p in parameters):
            dist.all_reduce(parts[True], op=op, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        if norm_type == math.inf:
            return torch.maximum(parts[False], parts[True]).float()
        return (parts[False] + parts[True]).pow(1.0 / norm_type).float()

    def optimizer_step(self, module: torch.nn.Module, handle: MegatronHandle) -> bool:
        if handle.sharded is None:
            return super().optimizer_step(module, handle)
        success = handle.prepared().step_with_ready_grads()  # steps this rank's shard, then all-gathers the weights
        handle.grads_ready = False
        return bool(success)

    def zero_grad(self, module: torch.nn.Module, handle: MegatronHandle) -> None:
        if handle.sharded is None:
            return super().zero_grad(module, handle)
        for chunk in chunks_of(module):
            chunk.zero_grad_buffer()
        handle.sharded.zero_grad()
        handle.grads_ready = False

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> None:
        missing, unexpected = self.unwrap_module(module).load_state_dict(state_dict, strict=False)
        # Megatron layers' ``_extra_state`` (FP8 metadata) and LoRA weights are not part of a base checkpoint
        missing = [k for k in missing if not k.endswith("_extra_state") and ".lora." not in k]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def _layout(self) -> dict[str, int]:
        return {**self.mesh.to_dict(), "world_size": distributed.world_size()}

    def _base_model_optimizer(self, module: torch.nn.Module, handle: MegatronHandle) -> bool:
        """Whether the optimizer trains base-model weights only (they carry megatron-core's sharding metadata)."""
        base = {id(p) for name, p in self.unwrap_module(module).named_parameters() if ".lora." not in name}
        # the optimizer's own groups, not handle.parameters: an optimizer instance may hold other weights
        return all(id(p) in base for group in handle.optimizer.param_groups for p in group["params"])

    def save_optimizer_state(self, directory: str, module: torch.nn.Module, handle: MegatronHandle) -> None:
        """Base-model optimizers go through ``dist_checkpointing`` (resumable at another TP / PP / VPP / DP layout,
        see :mod:`twinkle_backend_megatron.checkpointing`); adapters' optimizers and the distributed optimizer
        write one file per rank (resumable at the same layout)."""
        from twinkle_backend_megatron import checkpointing

        if handle.sharded is None and self._base_model_optimizer(module, handle):
            checkpointing.save_optimizer(directory, self.unwrap_module(module), handle.optimizer)
        else:
            torch.save({"layout": self._layout(), "state": handle.optimizer.state_dict()},
                       os.path.join(directory, f"optimizer-rank{distributed.rank():05d}.pt"))

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, handle: MegatronHandle) -> None:
        from twinkle_backend_megatron import checkpointing

        if os.path.isdir(os.path.join(directory, checkpointing.DIST_DIR)):
            if handle.sharded is not None:
                raise ConfigError(f"{directory} holds a regular optimizer's state (dist_checkpointing) but this run "
                                  f"uses distributed_optimizer=True; resume with distributed_optimizer off")
            checkpointing.load_optimizer(directory, self.unwrap_module(module), handle.optimizer)
            return
        path = os.path.join(directory, f"optimizer-rank{distributed.rank():05d}.pt")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was written with a different number of ranks")
        from twinkle_core.checkpoint import load_state_file

        saved = load_state_file(path)
        if saved["layout"] != self._layout():
            raise ConfigError(f"the optimizer state in {directory} was saved with the parallel layout "
                              f"{saved['layout']}, but this job runs {self._layout()}; LoRA adapters and the distributed "
                              f"optimizer resume with the same mesh (full fine-tuning checkpoints without "
                              f"distributed_optimizer reshard)")
        handle.optimizer.load_state_dict(saved["state"])


def _scale_grads(parameters: list[torch.nn.Parameter], factor: float) -> None:
    """Multiply every gradient by ``factor`` (one multi-tensor kernel instead of one op per parameter)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def _all_reduce_grads(parameters: list[torch.nn.Parameter], group: Any) -> None:
    """Sum the gradients of ``parameters`` over ``group`` in one flat buffer (missing ones count as zero)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not parameters:
        return
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
