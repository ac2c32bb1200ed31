"""A per-rank memory model for long-context training: why 128k tokens need ``cp=8``.

:func:`estimate_memory` adds up, in bytes per rank, what a training step of a decoder-only transformer keeps
alive at its peak, from the model's shape (:class:`ModelShape`: hidden size, layers, heads, key/value heads,
vocabulary, MLP width), the batch (rows x sequence length), the precision and the device mesh. It is an
*estimate* meant to show orders of magnitude and how they scale; allocator slack, communication buffers,
the CUDA context and temporary workspaces are not in it.

Assumptions (each term):

* **Parameters** (:meth:`ModelShape.parameter_count`): embedding ``V h``, an LM head ``V h`` unless tied, per
  layer the q/k/v/o projections (``2 h H d + 2 h Hkv d``), a gated MLP (``3 h I``: gate, up, down) and two
  norms; biases are ignored. Stored in ``param_bytes`` (4: Twinkle keeps fp32 weights and autocasts bf16/fp16
  unless the model is loaded in a 2-byte dtype), divided by ``tp * pp`` and, for a strategy that shards the model's
  state (FSDP, DeepSpeed ZeRO; an upper bound for ZeRO-1/2, which keep whole parameters), by the data-parallel ranks
  too: ``state_shards``, what :meth:`Strategy.model_state_shards <twinkle_core.strategy.Strategy.model_state_shards>`
  says (by default ``tp * pp``, or with an ``fsdp`` mesh dimension ``tp * pp * dp * fsdp``).
* **Gradients** in the parameter dtype, **optimizer states** two fp32 moments (AdamW: 8 bytes) per *trainable*
  parameter, sharded like the parameters. A LoRA adapter trains ``r (in + out)`` per adapted linear layer (the 7
  projections of every layer); the frozen base has no gradient and no optimizer state.
* **Activations** kept for backward, per token per layer, in the autocast dtype (``activation_bytes``): the two
  norms' inputs and outputs (``4 h``, replicated over ``tp``) and q, k, v, the attention output, the MLP's gate,
  up, activated gate and product (``2 h + 2 Hkv d + 4 I``, split over ``tp``). A rank holds
  ``rows * seq / (sp * cp)`` tokens: Ulysses (``sp``) and ring (``cp``) split every sequence, so this term and
  the logits fall as ``1 / (sp * cp)``. With gradient checkpointing only each layer's input (``h``) is kept,
  plus one layer's activations during its recompute.
* **Attention scores**: without ring (``cp = 1``) none with a fused kernel (``flash``: flash-attention or
  memory-efficient SDPA, which keep only a log-sum-exp per query; the recipe reader counts every implementation
  but ``eager`` as fused), else the fp32 softmax probabilities of every layer, ``rows * H/(tp sp) * seq * seq``
  (each rank holds ``H/sp`` heads of the whole sequence). The ring attention (``cp > 1``) keeps none between the
  passes, but Twinkle's (:mod:`twinkle_backend_hf.sequence_parallel.ring_attention`) recomputes each block's
  probabilities with matmuls in the backward off the CPU (its forward, and on the CPU its backward too, run
  blocks in a fused kernel), so one block's fp32 scores and probabilities, ``2 * rows * H/(tp sp) * (seq/cp)^2``,
  exist at a time; ``fused_ring=True`` models a ring whose backward runs a fused kernel too (none of it).
* **Logits** ``[tokens/rank, V]`` in fp32 (the loss upcasts them) plus their gradient of the same size (``2 * 4``
  bytes per element), divided by ``tp`` when the loss is vocabulary-parallel.

Example (Qwen2.5-7B shape, one 131072-token sequence, bf16 autocast, LoRA, gradient checkpointing, flash
attention, an 80 GB device): ``cp=1`` needs about 242 GB per rank (159 GB of it the logits), ``cp=8`` about 57 GB
with a fused ring; Twinkle's matmul ring adds a 60 GB block at ``cp=8`` (28 heads x 16384^2 x 8 bytes), which
``sp=4 x cp=8`` cuts to 15 GB. See ``tests/test_memory_model.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh

GIB = 1024 ** 3
#: bytes per element of the activations for each precision mode (autocast dtype; ``no`` is fp32)
ACTIVATION_BYTES = {"no": 4, "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
#: linear layers a LoRA adapter adapts in every decoder layer when it targets all of them
LORA_LINEARS_PER_LAYER = 7
#: fp32 bytes per trainable parameter of AdamW's two moments
ADAM_STATE_BYTES = 8
LOGITS_BYTES = 4 * 2  # fp32 logits and their gradient
RING_BLOCK_BYTES = 4 * 2  # fp32 scores and probabilities of one ring block


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that the memory model needs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    head_dim: int = 0  # 0: hidden / heads
    tied_embeddings: bool = False

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a ``transformers`` config object or its dict (``hidden_size``, ``num_hidden_layers``, ...)."""
        get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
        text = get("text_config")  # multimodal configs nest the language model's
        if text is not None and get("hidden_size") is None:
            return cls.from_config(text)
        names = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                 "vocab": "vocab_size", "intermediate": "intermediate_size"}
        missing = [key for key in names.values() if get(key) is None]
        if missing:
            raise ConfigError(f"the memory model needs {', '.join(missing)} in the model config")
        values = {field: int(get(key)) for field, key in names.items()}
        return cls(**values, kv_heads=int(get("num_key_value_heads") or values["heads"]),
                   head_dim=int(get("head_dim") or 0), tied_embeddings=bool(get("tie_word_embeddings", False)))

    def layer_linears(self) -> list[tuple[int, int]]:
        """``(in, out)`` of every linear layer of one decoder layer."""
        q, kv = self.heads * self.dim, self.kv_heads * self.dim
        h, i = self.hidden, self.intermediate
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    def parameter_count(self) -> int:
        per_layer = sum(a * b for a, b in self.layer_linears()) + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.layers * per_layer + self.hidden

    def lora_parameter_count(self, rank: int) -> int:
        return self.layers * sum(rank * (a + b) for a, b in self.layer_linears())


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of each term (see the module doc) and the tokens each rank holds."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    attention_scores: int
    logits: int
    tokens_per_rank: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "tokens_per_rank")

    def fits(self, budget_bytes: float) -> bool:
        return self.total <= budget_bytes

    def lines(self) -> list[str]:
        terms = [f"{f.name.replace('_', ' ')} {readable(getattr(self, f.name))}" for f in fields(self)
                 if f.name != "tokens_per_rank"]
        return [f"{self.tokens_per_rank} tokens per rank; per rank: " + ", ".join(terms),
                f"total {readable(self.total)} per rank (an estimate: no allocator slack, buffers or workspaces)"]


def readable(size: float) -> str:
    """``size`` bytes in GiB, or MiB below one GiB (a tiny model's terms would all read 0.00 GiB)."""
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2 ** 20:.2f} MiB"


def estimate_memory(shape: ModelShape, *, rows: int, seq_len: int, mesh: DeviceMesh | None = None,
                    precision: str = "bf16", state_shards: int | None = None, lora_rank: int | None = None,
                    gradient_checkpointing: bool = False, flash: bool = True, fused_ring: bool = False,
                    vocab_parallel_loss: bool = False, param_bytes: int = 4) -> MemoryEstimate:
    """Per-rank bytes of a training step on ``rows`` sequences of ``seq_len`` tokens per rank group (module doc).

    ``lora_rank``: a LoRA adapter of that rank on every linear layer (``None``: full fine-tuning). ``state_shards``:
    over how many ranks each parameter's state is split (the strategy's ``model_state_shards``; default: that of a
    strategy that shards nothing itself)."""
    mesh = mesh or DeviceMesh()
    if precision not in ACTIVATION_BYTES:
        raise ConfigError(f"unknown precision {precision!r} for the memory model; one of {', '.join(ACTIVATION_BYTES)}")
    split = mesh.sp * mesh.cp
    tokens = rows * math.ceil(seq_len / split)
    if state_shards is None:  # a strategy that shards nothing itself (sharding only through an fsdp mesh dimension)
        from twinkle_core.strategy import Strategy

        state_shards = Strategy.model_state_shards({}, mesh)
    shards = state_shards
    total_params = shape.parameter_count()
    trainable = total_params if lora_rank is None else shape.lora_parameter_count(lora_rank)
    act = ACTIVATION_BYTES[precision]
    h, tp = shape.hidden, mesh.tp
    per_token_layer = 4 * h + (2 * h + 2 * shape.kv_heads * shape.dim + 4 * shape.intermediate) / tp
    if gradient_checkpointing:
        activations = tokens * act * (shape.layers * h + per_token_layer)
    else:
        activations = tokens * act * shape.layers * per_token_layer
    scores = 0
    heads = shape.heads / (tp * mesh.sp)
    if mesh.cp > 1 and not fused_ring:
        scores = rows * heads * (seq_len / mesh.cp) ** 2 * RING_BLOCK_BYTES  # transient: one block at a time
    elif mesh.cp == 1 and not flash:
        scores = rows * heads * seq_len * seq_len * 4 * shape.layers
    logits = tokens * shape.vocab * LOGITS_BYTES / (tp if vocab_parallel_loss else 1)
    return MemoryEstimate(parameters=total_params * param_bytes // shards,
                          gradients=trainable * param_bytes // shards,
                          optimizer_states=trainable * ADAM_STATE_BYTES // shards,
                          activations=int(activations), attention_scores=int(scores), logits=int(logits),
                          tokens_per_rank=tokens)


# ====================================================================== from a recipe (``twinkle train --dry-run``)
def recipe_model_config(recipe: Any) -> Mapping[str, Any] | None:
    """The model's config as a dict, read cheaply: the recipe's ``model.config``, else ``config.json`` of a local
    ``model.model_id`` directory (no weights, no ``transformers``); ``None`` for a hub id or a directory without it."""
    import json
    import os

    if recipe.model.config:
        return recipe.model.config
    model_dir = recipe.model.model_id
    path = os.path.join(model_dir, "config.json") if model_dir else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def recipe_estimate_lines(recipe: Any, strategy: Any, world_size: int | None) -> list[str]:
    """What ``twinkle train --dry-run`` prints: the per-rank estimate for the recipe's model, batch and mesh, or
    the one thing it needs that the recipe does not say. ``strategy``: the recipe's strategy class, which says over
    how many ranks it splits the model's state (:meth:`~twinkle_core.strategy.Strategy.model_state_shards`) and
    whether the loss sees vocabulary shards (:meth:`~twinkle_core.strategy.Strategy.splits_vocabulary`)."""
    config = recipe_model_config(recipe)
    if config is None:
        return ["memory model: needs the model's config (model.config, or a local model_id directory)"]
    if not recipe.data.max_length:
        return ["memory model: set data.max_length (the sequence length it estimates for)"]
    sizes = dict(recipe.mesh or {})
    mesh = DeviceMesh.for_job(sizes, world_size) if world_size else DeviceMesh(**sizes)
    adapter = recipe.model.adapter or {}
    attention = recipe.model.attn_implementation or "sdpa"
    try:
        estimate = estimate_memory(
            ModelShape.from_config(config), rows=recipe.data.batch_size, seq_len=recipe.data.max_length, mesh=mesh,
            precision=recipe.precision,
            state_shards=strategy.model_state_shards(dict(recipe.strategy.options), mesh),
            lora_rank=int(adapter.get("r", 8)) if adapter else None,
            gradient_checkpointing=recipe.model.gradient_checkpointing, flash=attention != "eager",
            vocab_parallel_loss=strategy.splits_vocabulary(dict(recipe.strategy.options)))
    except ConfigError as exc:  # a model the estimate does not describe must not fail a valid recipe's dry run
        return [f"memory model: not available for this model ({exc})"]
    shown = " x ".join(f"{dim}={size}" for dim, size in mesh.to_dict().items() if size > 1) or "one rank"
    return [f"memory model ({shown}; {recipe.data.batch_size} x {recipe.data.max_length} tokens per step and "
            f"data-parallel rank): " + estimate.lines()[0], estimate.lines()[1]]
