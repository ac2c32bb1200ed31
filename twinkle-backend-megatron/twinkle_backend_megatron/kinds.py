"""What differs between the networks a ``MegatronModel`` builds, by the task's ``model_kind``.

Every kind's language model is megatron-core's ``GPTModel`` (``build.py``); a kind says which Hugging Face config
it is built from, what sits around it (nothing for ``causal_lm``; the Hugging Face vision tower for
``image_text_to_text``, :mod:`.vision`), how its weights map to Hugging Face names and how a batch runs through
it. ``build.py`` (which holds the kinds by name, ``NETWORKS``) and ``model.py`` ask the kind instead of branching
on it.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_backend_megatron import convert
from twinkle_backend_megatron.forward import call_chunk
from twinkle_backend_megatron.pipeline import split_rows
from twinkle_backend_megatron.weights import ShardedWeights, chunks_of


class TextNetwork:
    """``causal_lm``: the ``GPTModel`` chunks alone, with Hugging Face's causal-LM names."""

    name = "causal_lm"

    def language_config(self, hf_config: Any) -> Any:
        """The config the ``GPTModel`` is built from."""
        return hf_config

    def spec(self, hf_config: Any, tp_size: int) -> convert.ModelSpec:
        return convert.model_spec(hf_config, tp_size)

    def init_state(self, hf_config: Any, trust_remote_code: bool) -> dict[str, torch.Tensor]:
        """The Hugging Face model's random init (the weights a ``TransformersModel`` with the same seed has)."""
        import transformers

        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                           trust_remote_code=trust_remote_code)
        return {k: v.detach() for k, v in hf.state_dict().items()}

    def rotary(self, language_config: Any) -> dict[str, Any]:
        """``GPTModel`` / ``TransformerConfig`` arguments of the position embedding."""
        return {"position_embedding_type": "rope"}

    def check_layout(self, mesh: Any, options: Any) -> None:
        """Refuse what this kind cannot run (every layout ``build.check_layout`` allows works here)."""

    def assemble(self, language: torch.nn.Module, hf_config: Any) -> torch.nn.Module:
        """The network around the ``GPTModel`` chunk(s)."""
        return language

    def language(self, network: torch.nn.Module) -> torch.nn.Module:
        """The ``GPTModel`` chunk(s) inside ``network`` (as :meth:`assemble` made it)."""
        return network

    def weights(self, network: torch.nn.Module, spec: convert.ModelSpec, mesh: Any) -> Any:
        """The Megatron <-> Hugging Face weights of ``network`` (``local_state`` / ``hf_state_dict``)."""
        return ShardedWeights(chunks_of(network), spec, mesh)

    def run(self, module: torch.nn.Module, inputs: dict[str, Any], unwrap: Any) -> torch.Tensor:
        """The logits of ``module`` (as the strategy wraps it) on Twinkle's inputs."""
        return call_chunk(module, inputs, unwrap)

    def stage_runner(self, network: torch.nn.Module) -> Any:
        """``run(chunk, micro_batch, unwrap) -> output`` for the pipeline schedule's stages (``pipeline.py``)."""
        return call_chunk

    def splitter(self, network: torch.nn.Module) -> Any:
        """``split(batch, micro) -> micro-batches`` for the pipeline schedule."""
        return split_rows

    def check_adapter(self) -> None:
        """Refuse adapters this kind cannot place (every kind of LoRA ``adapters.py`` places works here)."""

    def auto_class(self) -> str:
        """The ``transformers`` auto class that loads the exported checkpoint."""
        return "AutoModelForCausalLM"

    def file_key(self, key: str) -> str:
        """The name a Hugging Face tensor of ``hf_state_dict`` has in checkpoint files."""
        return key


__all__ = ["TextNetwork"]
