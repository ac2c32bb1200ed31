"""A ``MegatronModel``'s weights as Hugging Face tensors: this rank's Megatron shards made from HF tensors, and
the full HF state dict gathered from every TP / EP / PP rank (the names and layouts are ``convert.py``'s)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from twinkle_backend_megatron import convert

__all__ = ["ShardedWeights", "chunks_of", "gather_over_pipeline"]


def chunks_of(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model chunks a rank holds: one, or one per virtual pipeline stage (a ``ModuleList``)."""
    return list(module) if isinstance(module, torch.nn.ModuleList) else [module]


def gather_over_pipeline(tensors: dict[str, torch.Tensor], pp: int) -> dict[str, torch.Tensor]:
    """Every pipeline stage's ``tensors`` joined, on every stage, sorted by name (collective over PP)."""
    if pp > 1:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        gathered: list[Any] = [None] * pp
        dist.all_gather_object(gathered, tensors, group=ps.get_pipeline_model_parallel_group())
        tensors = {k: v for part in gathered for k, v in part.items()}
    return dict(sorted(tensors.items()))


def _sharding(param: torch.nn.Parameter) -> tuple[int | None, int, int, Any]:
    """``(partition dim or None, tp rank, tp size, group)`` of a parameter (experts: expert-TP)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "allreduce", True):
        rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
        group = ps.get_expert_tensor_parallel_group(check_initialized=False)
    else:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        group = ps.get_tensor_model_parallel_group()
    dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) and size > 1 else None
    return dim, rank, size, group


def _tensor_parallel_shards(param: torch.nn.Parameter) -> tuple[list[torch.Tensor], int | None]:
    """Every TP rank's shard of ``param`` on the CPU, and the dimension they split (collective over TP)."""
    import torch.distributed as dist

    dim, _, size, group = _sharding(param)
    tensor = param.detach().contiguous()
    if dim is None:
        return [tensor.cpu()], None
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor, group=group)
    return [s.cpu() for s in shards], dim


def _stack_experts(experts: dict[str, dict[int, torch.Tensor]], ep: int) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors of every EP rank stacked into the fused ``[experts, ...]`` tensors (collective)."""
    if experts and ep > 1:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        gathered: list[Any] = [None] * ep
        dist.all_gather_object(gathered, experts, group=ps.get_expert_model_parallel_group())
        experts = {}
        for part in gathered:
            for key, per_expert in part.items():
                experts.setdefault(key, {}).update(per_expert)
    return {key: torch.stack([per_expert[e] for e in sorted(per_expert)]) for key, per_expert in experts.items()}


class ShardedWeights:
    """The base-model parameters of a rank's chunks, converted to and from full Hugging Face tensors."""

    def __init__(self, chunks: list[torch.nn.Module], spec: convert.ModelSpec, mesh: Any) -> None:
        self.chunks, self.spec, self.mesh = chunks, spec, mesh

    def named_parameters(self) -> Iterator[tuple[str, str, torch.nn.Parameter, int, int]]:
        """``(full name in the model, name inside its chunk, parameter, layer offset, expert offset)`` of the
        base model's parameters."""
        from megatron.core import parallel_state as ps

        several = len(self.chunks) > 1
        expert_offset = 0
        if self.spec.num_experts:
            expert_offset = ps.get_expert_model_parallel_rank() * (self.spec.num_experts // self.mesh.ep)
        for index, chunk in enumerate(self.chunks):
            layers = getattr(chunk.decoder, "layers", [])
            offset = layers[0].layer_number - 1 if len(layers) else 0
            for name, param in chunk.named_parameters():
                if ".lora." in name:
                    continue  # adapter weights (see lora.py) are not part of the base model
                yield (f"{index}.{name}" if several else name), name, param, offset, expert_offset

    def local_state(self, get: Callable[[str], torch.Tensor], *, fused_experts: bool) -> dict[str, torch.Tensor]:
        """This rank's Megatron parameters made from HF tensors (``get(key)``)."""
        weights = convert.WeightMap(self.spec, fused_experts=fused_experts)
        state = {}
        for full, name, param, offset, expert_offset in self.named_parameters():
            rule = weights.rule(name, offset, expert_offset)
            dim, rank, size, _ = _sharding(param)
            try:
                tensor = weights.to_local(rule, get, tp_rank=rank, tp_size=size, partition_dim=dim)
            except KeyError as exc:
                raise KeyError(f"the Hugging Face weights lack {exc} needed for Megatron parameter {full!r}") from None
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"Megatron parameter {full!r} has shape {tuple(param.shape)} but the Hugging Face "
                                 f"weights {list(rule.hf_keys)} give {tuple(tensor.shape)}")
            state[full] = tensor.to(param.dtype)
        return state

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF tensors of the whole model, on every rank (collective over TP / EP / PP)."""
        weights = convert.WeightMap(self.spec, fused_experts=True)
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for _, name, param, offset, expert_offset in self.named_parameters():
            if name == "output_layer.weight" and self.spec.tied:
                continue  # the tied copy of the embedding (last pipeline stage)
            rule = weights.rule(name, offset, expert_offset)
            for key, value in weights.to_hf(rule, *_tensor_parallel_shards(param)).items():
                if rule.expert is not None:
                    experts.setdefault(key, {})[rule.expert] = value.clone()
                else:
                    out[key] = value.clone()
        out.update(_stack_experts(experts, self.mesh.ep))
        out = gather_over_pipeline(out, self.mesh.pp)
        if self.spec.tied and "model.embed_tokens.weight" in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
            out = dict(sorted(out.items()))
        return out
