"""Torch norms that megatron-core's local layers can use under sequence parallelism (TP-SP) on any device.

megatron-core's local layer spec builds its norms with ``WrappedTorchNorm``, which asserts
``not config.sequence_parallel`` (``megatron/core/transformer/torch_norm.py``) although nothing in a
``torch.nn.RMSNorm`` / ``LayerNorm`` depends on the layout: under TP-SP each tensor-parallel rank normalises its own
slice of the sequence, and the norm's weight (replicated over the TP ranks) gets a gradient from that slice alone.
What Apex's and Transformer Engine's norms add is the tag ``weight.sequence_parallel = True``, by which the
gradient reduction sums those partial gradients over the TP group (megatron-core's ``finalize_model_grads``, and
:meth:`~twinkle_backend_megatron.strategy.MegatronStrategy.scale_gradients` here). :class:`SequenceParallelNorm`
builds the same torch norm and adds that tag, and :func:`with_sequence_parallel_norms` puts it into a layer spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["SequenceParallelNorm", "with_sequence_parallel_norms"]

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelNorm:
    """Builds a torch norm when megatron-core's specs call it (``build_module(spec, config=, hidden_size=, eps=)``;
    a class, because ``build_module`` returns a plain function uncalled); its parameters are tagged
    ``sequence_parallel`` when the config is."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> torch.nn.Module:
        # persist_layer_norm / zero_centered_gamma / normalization: the config's fields decide, as in WrappedTorchNorm
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise NotImplementedError("zero-centred-gamma and memory-efficient norms need Apex or Transformer Engine")
        norm_class = _NORMS.get(config.normalization)
        if norm_class is None:
            raise NotImplementedError(f"normalization {config.normalization!r}: only {sorted(_NORMS)} are built here")
        norm = norm_class(hidden_size, eps=eps)
        for parameter in norm.parameters():
            parameter.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _replace_norms(submodules: Any, norm: Any) -> Any:
    """A copy of a spec's submodules dataclass with every ``*layernorm`` field that builds a norm replaced."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    changes = {}
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        if isinstance(value, ModuleSpec) and dataclasses.is_dataclass(value.submodules):
            changes[field.name] = dataclasses.replace(value, submodules=_replace_norms(value.submodules, norm))
        elif field.name.endswith("layernorm") and value is not None and value is not IdentityOp:
            changes[field.name] = norm
    return dataclasses.replace(submodules, **changes)


def with_sequence_parallel_norms(layer_spec: Any, num_layers: int) -> Any:
    """A ``TransformerBlockSubmodules`` of ``num_layers`` copies of ``layer_spec`` whose norms, and the block's final
    norm, are :class:`SequenceParallelNorm` (what megatron-core builds from a layer spec, with that norm)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = dataclasses.replace(layer_spec, submodules=_replace_norms(layer_spec.submodules, SequenceParallelNorm))
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelNorm)
