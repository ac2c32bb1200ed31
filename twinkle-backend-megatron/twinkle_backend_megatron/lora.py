"""LoRA on megatron-core's column- and row-parallel linear layers, equivalent to PEFT's LoRA on the HF model.

Each Hugging Face projection PEFT would adapt (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj`` and the LM head ``lm_head``) gets its own ``lora_A`` / ``lora_B``,
also where Megatron fuses projections into one layer (``linear_qkv`` = q, k, v in per-query-group order;
``linear_fc1`` = gate and up). So a Megatron adapter is exactly a PEFT adapter: it exports to and imports
from PEFT's files one to one, with ``delta = (alpha / r) * B @ A`` per projection.

Tensor parallelism, consistent with the base layer's sharding:

* column-parallel layers (output split over TP): ``A`` [r, in] is replicated and ``B`` [out/tp, r]
  split by rows; the rank-r activation ``x A^T`` passes ``copy_to_tensor_model_parallel_region`` so
  that its gradient (and so ``A``'s) sums every rank's output shard;
* row-parallel layers (input split over TP): ``A`` [r, in/tp] is split by columns, the partial
  ``x_t A_t^T`` is summed over TP ranks (``reduce_from_tensor_model_parallel_region``) and ``B``
  [out, r] is replicated;
* the LM head (``output_layer``): ``A`` and ``B`` [vocab, r] are replicated; on gathered logits every rank adds
  the whole delta (zero on Megatron's padding rows of the vocabulary), on logits split over the TP ranks (the
  vocabulary-parallel loss) each rank adds its rows' share and the gradients are summed over the ranks
  (:meth:`LoraProjection.sliced_delta`).

The adapters hang under each adapted layer as ``<layer>.lora.<adapter>.<projection>.lora_A/B`` and add
their delta through a forward hook, for the adapter the model has made active only.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.lora import LoraSettings

#: HF projection names of a decoder layer's attention and of its dense MLP (MoE experts are fused parameters in HF,
#: not PEFT targets)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
#: "all-linear" in PEFT's sense: every linear but the LM head
ALL_LINEAR = ATTENTION + MLP
#: the HF name of the LM head (Megatron's ``output_layer``)
HEAD = "lm_head"
#: the PEFT LoRA options a dict adapter config may give on this backend
SUPPORTED_OPTIONS = frozenset({"r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora",
                               "init_lora_weights", "exclude_modules", "layers_to_transform", "layers_pattern"})
#: PEFT options this backend's LoRA layers do not implement (refused also when a peft.LoraConfig sets them)
_NOT_IMPLEMENTED = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "target_parameters")
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


def lora_settings(config: Any) -> LoraSettings:
    """The core's :class:`~twinkle_core.lora.LoraSettings` of a dict ``{"type": "lora", "r": 8, ...}`` or a
    ``peft.LoraConfig``, refused when it asks for what this backend's LoRA layers cannot do."""
    settings = LoraSettings.from_config(config, backend="the Megatron backend", supported=SUPPORTED_OPTIONS)
    if settings.bias != "none":
        raise ConfigError("LoRA bias training is not supported by the Megatron backend (use bias='none')")
    not_implemented = settings.options_set(_NOT_IMPLEMENTED)
    if not_implemented:
        raise ConfigError(f"LoRA option {not_implemented[0]} is not supported by the Megatron backend")
    return settings


def to_lora_config(config: Any) -> Any:
    """A ``peft.LoraConfig`` from a dict ``{"type": "lora", "r": 8, ...}`` (or a LoraConfig as is)."""
    return lora_settings(config).to_peft()


def target_modules(spec: Any) -> dict[str, list[str]]:
    """``TwinkleModel.lora_target_modules()`` of a model of ``spec`` (``convert.ModelSpec``): what this module's
    layers adapt, by kind."""
    return {"attn": list(ATTENTION), "mlp": [] if spec.num_experts else list(MLP), "unembed": [HEAD]}


def _targets(lora: Any, module_name: str) -> bool:
    import copy

    from peft.tuners.tuners_utils import check_target_module_exists

    if isinstance(lora.target_modules, str) and lora.target_modules.lower() == "all-linear":
        lora = copy.copy(lora)
        lora.target_modules = set(ALL_LINEAR)
    found = check_target_module_exists(lora, module_name)
    return bool(found) and type(found).__name__ != "_ExcludedModule"


@dataclass(frozen=True)
class Projection:
    """One HF projection inside a Megatron layer: name, full sizes and where its output rows sit."""

    hf_name: str  # model.layers.3.self_attn.q_proj
    in_features: int
    out_features: int

    @property
    def short_name(self) -> str:
        """``q_proj``, ``lm_head``: the projection's key inside its layer's adapter entry."""
        return self.hf_name.rsplit(".", 1)[-1]


class LoraProjection(torch.nn.Module):
    """``lora_A`` / ``lora_B`` of one HF projection, holding this TP rank's shard."""

    def __init__(self, projection: Projection, *, r: int, alpha: float, dropout: float, rslora: bool,
                 parallel: str, tp_rank: int, tp_size: int, seed: int, init: Any) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.projection, self.parallel, self.r = projection, parallel, r
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.scaling = alpha / math.sqrt(r) if rslora else alpha / r
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        a = torch.empty(r, projection.in_features)
        b = torch.zeros(projection.out_features, r)
        if init is False:  # PEFT's init_lora_weights=False: both random (tests)
            generator = torch.Generator().manual_seed(seed)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            torch.nn.init.kaiming_uniform_(b, a=math.sqrt(5), generator=generator)
        elif init in (True, None, "default"):
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
        else:
            raise ConfigError(f"init_lora_weights={init!r} is not supported by the Megatron backend")
        a, b = self.shard_a(a), self.shard_b(b)
        self.lora_A = torch.nn.Parameter(a.contiguous())
        self.lora_B = torch.nn.Parameter(b.contiguous())
        # row-parallel layers split A's input columns, column-parallel ones B's output rows; "replicated": neither
        set_tensor_model_parallel_attributes(self.lora_A, parallel == "row" and tp_size > 1, 1, 1)
        set_tensor_model_parallel_attributes(self.lora_B, parallel == "column" and tp_size > 1, 0, 1)

    def shard_a(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp_size, 1)[self.tp_rank] if self.parallel == "row" else full

    def shard_b(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp_size, 0)[self.tp_rank] if self.parallel == "column" else full

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        h = torch.nn.functional.linear(self.dropout(x), self.lora_A.to(x.dtype))
        if self.tp_size > 1 and self.parallel == "column":
            h = copy_to_tensor_model_parallel_region(h)
        elif self.tp_size > 1 and self.parallel == "row":
            h = reduce_from_tensor_model_parallel_region(h)
        return torch.nn.functional.linear(h, self.lora_B.to(x.dtype)) * self.scaling

    def sliced_delta(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The LM head's delta on this TP rank's ``width`` rows of the padded vocabulary only (the logits stay split
        over the ranks under the vocabulary-parallel loss), zero on padding rows; the whole ``[tokens, vocab]``
        delta never exists.

        ``A`` and ``B`` are replicated, but each rank's slice gives them only its share of the gradient: the
        identity-forward, all-reduce-backward ``copy_to_tensor_model_parallel_region`` on ``A x`` and on ``B`` sums
        those shares, so every rank gets the gradients of the whole delta (and ``x`` that of ``A x``)."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        start = self.tp_rank * width
        h = copy_to_tensor_model_parallel_region(
            torch.nn.functional.linear(self.dropout(x), self.lora_A.to(x.dtype)))
        rows = copy_to_tensor_model_parallel_region(self.lora_B)[start : start + width]
        delta = torch.nn.functional.linear(h, rows.to(x.dtype)) * self.scaling
        return torch.nn.functional.pad(delta, (0, width - delta.shape[-1]))


class ActiveAdapter:
    """Which adapter the layers' hooks apply (``None``: the base model)."""

    def __init__(self) -> None:
        self.name: str | None = None


def _combine(kind: str, deltas: list[torch.Tensor], groups: int, width: int) -> torch.Tensor:
    """Put the per-projection deltas where the fused Megatron layer's output (``width`` wide) has them."""
    if kind == "qkv":
        q, k, v = deltas
        lead = q.shape[:-1]
        parts = [q.reshape(*lead, groups, -1), k.reshape(*lead, groups, -1), v.reshape(*lead, groups, -1)]
        return torch.cat(parts, -1).reshape(*lead, -1)
    if kind == "gated":
        return torch.cat(deltas, -1)
    if kind == "head":  # the gathered logits of Megatron's padded vocabulary: its padding rows get no delta
        pad = width - deltas[0].shape[-1]
        if pad < 0:
            raise ConfigError(f"LoRA on the LM head got a {deltas[0].shape[-1]}-row delta for {width} logits")
        return torch.nn.functional.pad(deltas[0], (0, pad))
    return deltas[0]


class LayerAdapters:
    """The adapters of one Megatron linear layer and the hook that applies the active one."""

    def __init__(self, layer: torch.nn.Module, kind: str, parallel: str, projections: list[Projection],
                 groups_local: int, tp_size: int, active: ActiveAdapter) -> None:
        self.kind, self.parallel, self.projections = kind, parallel, projections
        self.groups_local, self.tp_size, self.active = groups_local, tp_size, active
        if not hasattr(layer, "lora"):
            layer.add_module("lora", torch.nn.ModuleDict())
        self.layer = layer
        self.handle = layer.register_forward_hook(self._hook, with_kwargs=True)

    def _deltas(self, entry: Any, x: torch.Tensor, out_width: int) -> list[torch.Tensor | None]:
        """Each projection's delta (``None`` where the adapter leaves it out); on the head's logits split over the
        TP ranks (``out_width`` below the vocabulary), only this rank's rows."""
        sliced = self.kind == "head" and out_width < self.projections[0].out_features
        return [None if p.short_name not in entry else
                entry[p.short_name].sliced_delta(x, out_width) if sliced else entry[p.short_name].delta(x)
                for p in self.projections]

    def _hook(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        name = self.active.name
        if name is None or name not in module.lora:
            return output
        entry = module.lora[name]
        x = args[0] if args else kwargs["input_"]
        deltas = self._deltas(entry, x, (output[0] if isinstance(output, tuple) else output).shape[-1])
        if all(d is None for d in deltas):
            return output
        out, bias = output if isinstance(output, tuple) else (output, None)
        if any(d is None for d in deltas):  # only some of a fused layer's projections are adapted
            sizes = [p.out_features // (self.tp_size if self.parallel == "column" else 1) for p in self.projections]
            deltas = [d if d is not None else out.new_zeros((*out.shape[:-1], size)) for d, size in zip(deltas, sizes)]
        out = out + _combine(self.kind, deltas, self.groups_local, out.shape[-1])
        return (out, bias) if isinstance(output, tuple) else out


class MegatronLora:
    """All LoRA adapters of one MegatronModel: adding, activating, naming, PEFT import / export."""

    def __init__(self, chunks: list[torch.nn.Module], spec: Any, seed: int) -> None:
        from megatron.core import parallel_state as ps

        self.spec, self.seed = spec, seed
        self.active = ActiveAdapter()
        self.configs: dict[str, Any] = {}
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.layers: list[LayerAdapters] = []
        self._full_prefix: dict[int, str] = {}
        several = len(chunks) > 1
        for index, chunk in enumerate(chunks):
            for name, module in chunk.named_modules():
                self._full_prefix[id(module)] = f"{index}.{name}" if several else name
            for layer in getattr(chunk.decoder, "layers", []):
                self._register_layer(layer)
            head = getattr(chunk, "output_layer", None) if getattr(chunk, "post_process", False) else None
            if head is not None:  # the last pipeline stage's LM head
                self.layers.append(LayerAdapters(head, "head", "replicated", [
                    Projection(HEAD, spec.hidden_size, spec.vocab_size)], 1, self.tp_size, self.active))

    def _register_layer(self, layer: torch.nn.Module) -> None:
        spec = self.spec
        g = layer.layer_number - 1
        prefix = f"model.layers.{g}."
        d, heads, groups = spec.head_dim, spec.num_heads, spec.num_query_groups
        hidden = spec.hidden_size
        groups_local = groups // self.tp_size
        attention = layer.self_attention
        self.layers.append(LayerAdapters(attention.linear_qkv, "qkv", "column", [
            Projection(prefix + "self_attn.q_proj", hidden, heads * d),
            Projection(prefix + "self_attn.k_proj", hidden, groups * d),
            Projection(prefix + "self_attn.v_proj", hidden, groups * d)], groups_local, self.tp_size, self.active))
        self.layers.append(LayerAdapters(attention.linear_proj, "plain", "row", [
            Projection(prefix + "self_attn.o_proj", heads * d, hidden)], groups_local, self.tp_size, self.active))
        mlp = layer.mlp
        if hasattr(mlp, "linear_fc1"):  # dense MLP (MoE experts are fused parameters in HF, not PEFT targets)
            ffn = spec.ffn_hidden_size
            self.layers.append(LayerAdapters(mlp.linear_fc1, "gated", "column", [
                Projection(prefix + "mlp.gate_proj", hidden, ffn), Projection(prefix + "mlp.up_proj", hidden, ffn)],
                groups_local, self.tp_size, self.active))
            self.layers.append(LayerAdapters(mlp.linear_fc2, "plain", "row", [
                Projection(prefix + "mlp.down_proj", ffn, hidden)], groups_local, self.tp_size, self.active))

    def _model_projections(self) -> list[str]:
        """The HF names of every adaptable projection of the whole model (a pipeline stage holds some of them)."""
        kinds = target_modules(self.spec)
        return [f"model.layers.{g}.{block}.{p}" for g in range(self.spec.num_layers)
                for block, names in (("self_attn", kinds["attn"]), ("mlp", kinds["mlp"])) for p in names] + [HEAD]

    # ------------------------------------------------------------------ lifecycle
    def add(self, adapter_name: str, config: Any) -> Any:
        if not _NAME.match(adapter_name):
            raise ConfigError(f"adapter name {adapter_name!r} must be letters, digits, '_' or '-'")
        settings = lora_settings(config)
        lora = settings.to_peft()
        matched = 0
        for layer in self.layers:
            entry = torch.nn.ModuleDict()
            for projection in layer.projections:
                if not _targets(lora, projection.hf_name):
                    continue
                digest = hashlib.sha256(f"{self.seed}/{adapter_name}/{projection.hf_name}".encode()).digest()
                entry[projection.short_name] = LoraProjection(
                    projection, r=settings.r, alpha=settings.alpha, dropout=settings.dropout,
                    rslora=settings.use_rslora, parallel=layer.parallel, tp_rank=self.tp_rank,
                    tp_size=self.tp_size, seed=int.from_bytes(digest[:8], "little") % (2**63),
                    init=settings.init_lora_weights)
                matched += 1
            if len(entry):
                layer.layer.lora[adapter_name] = entry
        if not matched and not any(_targets(lora, name) for name in self._model_projections()):
            raise ConfigError(f"LoRA target_modules={lora.target_modules!r} match no layer of this model; the "
                              f"adaptable projections are {', '.join((*ALL_LINEAR, HEAD))}")
        self.configs[adapter_name] = lora
        return lora

    def remove(self, adapter_name: str) -> None:
        for layer in self.layers:
            if adapter_name in layer.layer.lora:
                del layer.layer.lora[adapter_name]
        self.configs.pop(adapter_name, None)
        if self.active.name == adapter_name:
            self.active.name = None

    def _entries(self, adapter_name: str) -> Any:
        """``(module-path prefix, LoraProjection)`` of every adapted projection."""
        for layer in self.layers:
            if adapter_name in layer.layer.lora:
                base = self._full_prefix[id(layer.layer)]
                for short, module in layer.layer.lora[adapter_name].items():
                    yield f"{base}.lora.{adapter_name}.{short}", module

    def parameter_names(self, adapter_name: str) -> list[str]:
        names = []
        for path, _ in self._entries(adapter_name):
            names += [f"{path}.lora_A", f"{path}.lora_B"]
        return names

    # ------------------------------------------------------------------ PEFT naming
    @staticmethod
    def peft_key(hf_name: str, which: str, adapter_name: str) -> str:
        """The key ``TransformersModel.get_state_dict(adapter_name=...)`` uses for this weight."""
        return f"base_model.model.{hf_name}.{which}.{adapter_name}.weight"

    def full_state_dict(self, adapter_name: str) -> dict[str, torch.Tensor]:
        """Full (TP-gathered) PEFT-named weights of this rank's layers (collective over TP)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        out = {}
        for _, module in self._entries(adapter_name):
            for which, param, dim in (("lora_A", module.lora_A, 1), ("lora_B", module.lora_B, 0)):
                tensor = param.detach().contiguous()
                if getattr(param, "tensor_model_parallel", False):
                    shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                    dist.all_gather(shards, tensor, group=ps.get_tensor_model_parallel_group())
                    tensor = torch.cat(shards, dim)
                out[self.peft_key(module.projection.hf_name, which, adapter_name)] = tensor.cpu().clone()
        return out

    def local_state(self, adapter_name: str, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shards (keyed like the model's parameters) from full PEFT-named weights."""
        state = {}
        for path, module in self._entries(adapter_name):
            for which, shard in (("lora_A", module.shard_a), ("lora_B", module.shard_b)):
                key = self.peft_key(module.projection.hf_name, which, adapter_name)
                if key not in full:
                    raise KeyError(f"the adapter weights lack {key}; was it saved from a different LoRA config?")
                state[f"{path}.{which}"] = shard(full[key]).contiguous()
        return state


def file_key(peft_key: str, adapter_name: str) -> str:
    """``...q_proj.lora_A.tenant.weight`` -> ``...q_proj.lora_A.weight`` (PEFT's on-disk naming)."""
    return peft_key.replace(f".{adapter_name}.", ".", 1)
