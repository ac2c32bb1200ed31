"""A ``MegatronModel``'s weights as Hugging Face tensors: this rank's Megatron shards made from HF tensors, and
the full HF state dict gathered from every TP / EP / PP rank (the names and layouts are ``convert.py``'s)."""

from __future__ import annotations

from typing import Any

import torch

from twinkle_backend_megatron import convert
from twinkle_core.model.torch_model import FULL_MODEL


class MegatronWeightsMixin:
    """Conversion between a ``MegatronModel``'s sharded parameters and full Hugging Face tensors."""

    def _weight_map(self, fused_experts: bool = True) -> convert.WeightMap:
        return convert.WeightMap(self.spec, fused_experts=fused_experts)

    def _named_chunk_parameters(self) -> Any:
        """``(full name in self.module, name inside its chunk, parameter, layer offset, expert offset)`` of the
        base model's parameters."""
        from megatron.core import parallel_state as ps

        several = isinstance(self.module, torch.nn.ModuleList)
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

    @staticmethod
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

    def _local_state(self, get: Any, *, fused_experts: bool) -> dict[str, torch.Tensor]:
        """This rank's Megatron parameters made from HF tensors (``get(key)``)."""
        weights = self._weight_map(fused_experts)
        state = {}
        for full, name, param, offset, expert_offset in self._named_chunk_parameters():
            rule = weights.rule(name, offset, expert_offset)
            dim, rank, size, _ = self._sharding(param)
            try:
                tensor = weights.to_local(rule, get, tp_rank=rank, tp_size=size, partition_dim=dim)
            except KeyError as exc:
                raise KeyError(f"the Hugging Face weights lack {exc} needed for Megatron parameter {full!r}") from None
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"Megatron parameter {full!r} has shape {tuple(param.shape)} but the Hugging Face "
                                 f"weights {list(rule.hf_keys)} give {tuple(tensor.shape)}")
            state[full] = tensor.to(param.dtype)
        return state

    def _hf_state_dict(self, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Full HF tensors of the whole model, on every rank (collective over TP / EP / PP)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        weights = self._weight_map(fused_experts=True)
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for full, name, param, offset, expert_offset in self._named_chunk_parameters():
            if wanted is not None and full not in wanted:
                continue
            if name == "output_layer.weight" and self.spec.tied:
                continue  # the tied copy of the embedding (last pipeline stage)
            rule = weights.rule(name, offset, expert_offset)
            dim, _, size, group = self._sharding(param)
            tensor = param.detach().contiguous()
            if dim is not None:
                shards = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(shards, tensor, group=group)
            else:
                shards = [tensor]
            for key, value in weights.to_hf(rule, [s.cpu() for s in shards], dim).items():
                if rule.expert is not None:
                    experts.setdefault(key, {})[rule.expert] = value.clone()
                else:
                    out[key] = value.clone()
        if experts and self.mesh.ep > 1:
            gathered: list[Any] = [None] * self.mesh.ep
            dist.all_gather_object(gathered, experts, group=ps.get_expert_model_parallel_group())
            experts = {}
            for part in gathered:
                for key, per_expert in part.items():
                    experts.setdefault(key, {}).update(per_expert)
        for key, per_expert in experts.items():
            out[key] = torch.stack([per_expert[e] for e in sorted(per_expert)])
        if self.pp_size > 1:
            gathered = [None] * self.pp_size
            dist.all_gather_object(gathered, out, group=ps.get_pipeline_model_parallel_group())
            out = {k: v for part in gathered for k, v in part.items()}
        if self.spec.tied and "model.embed_tokens.weight" in out and wanted is None:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return dict(sorted(out.items()))

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        name = self._resolve_name(adapter_name)
        if name == FULL_MODEL:
            return self._hf_state_dict()
        return self._adapter_state_dict(name)

    def local_weights(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # get_state_dict() is full Hugging Face tensors; the strategy loads this rank's Megatron shards
        return self._local_state(state_dict.__getitem__, fused_experts=True)
