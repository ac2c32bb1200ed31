"""``hf_generate``: batched KV-cache decoding with any Hugging Face-style causal LM, in this process.

Two ways to the weights (option ``copy_weights``):

* ``false`` (``weight_sync: in_process``): decode with the policy itself, lent by
  ``TwinkleModel.generation_module(adapter_name=...)``; LoRA adapters are applied as in training. Under a
  strategy whose forwards are collectives (FSDP2, ZeRO-3) every rank runs the same number of forwards.
* ``true`` (``weight_sync: push``): decode with an own Hugging Face copy, built from the policy's config
  (or the ``config`` option) and loaded by every :meth:`receive_weights`. Needed for models that cannot lend
  their network (Megatron's). Full-model weights only: a LoRA policy is refused.

Prompts are left-padded into batches of at most ``batch_size`` sequences (default: all); ``position_ids``
follow the attention mask, so padding does not change a completion. A prompt's
:class:`~twinkle_core.prompt_inputs.PromptInputs` (a vision-language prompt's pictures, per-token values and 3-D
positions) go into the prefill (:func:`~twinkle_core.prompt_inputs.batch_prompt_inputs`); decoding continues each
row's positions from the largest of its prompt, as the training rows do. Each completion draws its noise from a
generator seeded with its own seed (:mod:`twinkle_rl.samplers.processing`): the same seed gives the same
completion alone, in any batch and on any number of ranks (up to float rounding of the logits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_core.prompt_inputs import PromptInputs, batch_prompt_inputs, next_positions
from twinkle_core.sampling import (
    Completion,
    GenerationModule,
    Sampler,
    SamplingParams,
    WeightUpdate,
    forward_keywords,
)
from twinkle_core.sources import resolve
from twinkle_rl.samplers.processing import choose_tokens, process_logits


@dataclass
class _Row:
    """One completion being decoded: prompt ``prompt_index``, sample ``sample_index``."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    seed: int
    inputs: PromptInputs | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def _auto_class(config: Any) -> Any:
    """The transformers class that builds the sampler's copy: a vision-language config (Qwen2.5-VL ...) is no
    causal LM's, it builds with ``AutoModelForImageTextToText``; custom code says which class in its ``auto_map``."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map or type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM
    if "AutoModelForImageTextToText" in auto_map or type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM  # its error names the config transformers cannot build


class HFGenerateSampler(Sampler):
    """Samples with ``module(input_ids, attention_mask, position_ids, past_key_values, use_cache=True)``.

    Options: ``copy_weights`` (see the module docstring), ``batch_size`` (sequences per decoding batch,
    default all), ``config`` (the Hugging Face config of the copy, a ``PretrainedConfig`` or a dict with
    ``model_type``, when the policy does not expose one).
    """

    name = "hf_generate"
    takes_prompt_inputs = True

    def __init__(self, *, copy_weights: bool = False, batch_size: int | None = None, config: Any = None,
                 **options: Any) -> None:
        if options:
            raise ConfigError(f"unknown hf_generate option(s) {sorted(options)}; known: batch_size, config, "
                              f"copy_weights")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"hf_generate batch_size must be a positive integer or null, got {batch_size!r}")
        # an instance attribute: the base class validates whichever weight_sync the instance reports
        self.weight_sync = "push" if copy_weights else "in_process"
        super().__init__(copy_weights=copy_weights, batch_size=batch_size, config=config)
        self.batch_size = batch_size
        self.copy_config = config
        self.copy: torch.nn.Module | None = None

    # ------------------------------------------------------------------ weights
    def bind(self, model: Any, tokenizer: Any, *, adapter_name: str | None = None) -> None:
        super().bind(model, tokenizer, adapter_name=adapter_name)
        if self.weight_sync == "push":
            network = getattr(model, "module", None)
            if adapter_name is not None or hasattr(network, "peft_config"):
                raise ConfigError("hf_generate with copy_weights: true loads full-model weights only; for a LoRA "
                                  "policy use copy_weights: false (the adapter is applied in process)")
            self.copy_config = self._hf_config(model)

    def _hf_config(self, model: Any) -> Any:
        import transformers

        config = self.copy_config
        if config is None:
            export_config = getattr(model, "export_config", None)  # the TwinkleModel seam
            config = export_config() if callable(export_config) else None
        if config is None:
            raise ConfigError(f"hf_generate with copy_weights: true needs the policy's Hugging Face config: "
                              f"{type(model).__name__} exposes none, pass the sampler option config "
                              f"(a dict with model_type)")
        if isinstance(config, dict):
            spec = dict(config)
            if not spec.get("model_type"):
                raise ConfigError("hf_generate option config must name its model_type (e.g. qwen2, llama)")
            config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
        return config

    def receive_weights(self, update: WeightUpdate) -> None:
        """Load the policy's full state dict (Hugging Face names) into the sampler's own copy."""
        state = update.state_dict
        if update.adapter_name is not None:
            raise ConfigError("hf_generate with copy_weights: true cannot load adapter updates; use copy_weights: "
                              "false for a LoRA policy")
        if not state:
            raise ConfigError("hf_generate received an empty state dict: the policy gathers its weights on one rank "
                              "only (for FSDP2 set strategy_options.full_state_dict_on_all_ranks: true)")
        if self.copy is None:
            self.copy = self._build_copy()
        expected = self.copy.state_dict()
        unexpected = sorted(set(state) - set(expected))
        missing = sorted(set(expected) - set(state) - self._tied_names(self.copy))
        if unexpected or missing:
            raise ConfigError(f"the pushed weights do not fit the sampler's {type(self.copy).__name__}: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
        self.copy.load_state_dict(state, strict=False)
        self.policy_step = update.step

    def _build_copy(self) -> torch.nn.Module:

        if self.copy_config is None:
            raise ConfigError("hf_generate received weights before bind(): bind the policy first")
        # the policy's switch (a custom-code policy's config builds its copy only when the switch is on); explicit,
        # so transformers never asks on stdin
        trust = resolve.trust_remote_code(getattr(self.model, "trust_remote_code", None))
        with resolve.explain_remote_code_refusal("the sampler's copy of the policy"):
            copy = _auto_class(self.copy_config).from_config(self.copy_config, dtype=torch.float32,
                                                             trust_remote_code=trust)
        return copy.to(getattr(self.model, "device", "cpu")).eval()

    @staticmethod
    def _tied_names(module: torch.nn.Module) -> set[str]:
        """State-dict names that alias another parameter (tied embeddings): the policy may omit them."""
        every = set(module.state_dict())
        return every - set(dict(module.named_parameters()) | dict(module.named_buffers()))

    @contextlib.contextmanager
    def _generation(self) -> Iterator[GenerationModule]:
        if self.weight_sync == "in_process":
            if self.model is None:
                raise ConfigError("hf_generate.sample() before bind(): bind the policy first")
            with self.model.generation_module(adapter_name=self.adapter_name) as gen:
                yield gen
            return
        if self.copy is None:
            raise ConfigError("hf_generate with copy_weights: true has no weights yet: call sync_weights first")
        with torch.inference_mode():
            yield GenerationModule(module=self.copy, device=next(self.copy.parameters()).device, lockstep=False)

    def close(self) -> None:
        self.copy = None

    # ------------------------------------------------------------------ sampling
    def sample(self, prompts: list[list[int]], *, n: int, params: SamplingParams,
               seeds: list[list[int]], inputs: Sequence[PromptInputs | None] | None = None) -> list[list[Completion]]:
        self._check_request(prompts, n, params, seeds)
        inputs = list(inputs) if inputs is not None else [None] * len(prompts)
        if len(inputs) != len(prompts):
            raise ConfigError(f"hf_generate got inputs for {len(inputs)} of {len(prompts)} prompts")
        for prompt, extra in zip(prompts, inputs, strict=True):
            if extra is not None:
                extra.check(len(prompt))
        rows = [_Row(i, j, list(prompt), int(seeds[i][j]), inputs[i])
                for i, prompt in enumerate(prompts) for j in range(n)]
        with self._generation() as gen:
            self._check_lengths(gen.module, prompts, params)
            decoder = _Decoder(gen, params, self._eos_ids(gen.module), self.tokenizer)
            # similar lengths share a batch (less padding); the order cannot change a completion
            ordered = sorted(rows, key=lambda row: len(row.prompt))
            size = self.batch_size or max(len(ordered), 1)
            chunks = [ordered[k:k + size] for k in range(0, len(ordered), size)]
            for index in range(decoder.agree_max(len(chunks))):
                decoder.run(chunks[index] if index < len(chunks) else [])
        return [[self._completion(rows[i * n + j]) for j in range(n)] for i in range(len(prompts))]

    def _completion(self, row: _Row) -> Completion:
        text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Completion(token_ids=row.token_ids, logprobs=row.logprobs, finish_reason=row.finish_reason or "length",
                          policy_step=self.policy_step, text=text)

    @staticmethod
    def _check_request(prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[list[int]]) -> None:
        if n < 1:
            raise ConfigError(f"hf_generate needs n >= 1 completions per prompt, got {n}")
        if len(seeds) != len(prompts) or any(len(s) != n for s in seeds):
            raise ConfigError(f"hf_generate needs seeds[i][j] for {len(prompts)} prompts x {n} samples")
        if any(stop == "" for stop in params.stop):
            raise ConfigError("task_options.sampling.stop contains an empty string (it would stop every completion "
                              "at once)")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ConfigError(f"prompt {i} is empty: a completion needs at least one prompt token")

    @staticmethod
    def _check_lengths(module: Any, prompts: list[list[int]], params: SamplingParams) -> None:
        limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        if limit is None:
            return
        for i, prompt in enumerate(prompts):
            if len(prompt) + params.max_new_tokens > limit:
                raise ConfigError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                                  f"{params.max_new_tokens} that exceeds the model's max_position_embeddings "
                                  f"({limit}): shorten or filter the prompts (at most "
                                  f"{limit - params.max_new_tokens} tokens)")

    def _eos_ids(self, module: Any) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer, getattr(module, "generation_config", None)):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                ids.update([value] if isinstance(value, int) else value)
        return ids


class _Decoder:
    """Decodes batches of rows with one lent module; in lockstep every rank runs the same forwards."""

    def __init__(self, gen: GenerationModule, params: SamplingParams, eos_ids: set[int], tokenizer: Any) -> None:
        import torch.distributed as dist

        # the stop tokens (a chat template's end of turn) end a completion like EOS, and are kept like it
        self.gen, self.params, self.tokenizer = gen, params, tokenizer
        self.eos_ids = set(eos_ids) | set(params.stop_token_ids)
        self.pad_id = getattr(tokenizer, "pad_token_id", None)
        if self.pad_id is None:
            self.pad_id = min(eos_ids) if eos_ids else 0
        self.collective = bool(gen.lockstep and dist.is_available() and dist.is_initialized()
                               and dist.get_world_size() > 1)
        self.cache_key, keeps_logits = forward_keywords(gen.module)
        # only the last position's logits are needed: skip the [rows, length, vocab] prefill logits
        self.extra = {"logits_to_keep": 1} if keeps_logits else {}

    def agree_max(self, value: int) -> int:
        """``value``, or in lockstep its maximum over all ranks."""
        if not self.collective:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.int64, device=self.gen.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def _forward(self, **inputs: Any) -> Any:
        return self.gen.module(**inputs, **self.extra)

    def _idle(self) -> None:
        """Run a [1, 1] forward (no cache) per decoding step of the other ranks until none decodes any more."""
        while True:
            self._forward(input_ids=torch.full((1, 1), self.pad_id, device=self.gen.device), use_cache=False)
            if not self.agree_max(0):
                return

    def run(self, rows: list[_Row]) -> None:
        """Decode ``rows`` to completion; an empty list only joins the other ranks' forwards."""
        if not rows:
            self._idle()
            return
        device, width = self.gen.device, max(len(row.prompt) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):  # left padding: every row's next token goes to the same column
            input_ids[r, width - len(row.prompt):] = torch.tensor(row.prompt)
            mask[r, width - len(row.prompt):] = 1
        extra = batch_prompt_inputs([row.inputs for row in rows], starts=[width - len(row.prompt) for row in rows],
                                    lengths=[len(row.prompt) for row in rows], width=width)
        positions = extra.pop("position_ids", None)
        if positions is None:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, mask, positions = input_ids.to(device), mask.to(device), positions.to(device)
        extra = {key: value.to(device) for key, value in extra.items()}
        generators = [torch.Generator(device=device).manual_seed(row.seed) for row in rows]
        out = self._forward(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
        cache, live = getattr(out, self.cache_key), list(rows)
        following = next_positions(positions)  # [rows, 1], or [D, rows, 1] for multi-dimensional positions
        while True:
            logprobs = process_logits(out.logits[:, -1, :], self.params)
            chosen, chosen_logprobs = choose_tokens(logprobs, generators, greedy=self.params.temperature == 0)
            keep = [r for r, (row, token, logprob) in enumerate(zip(live, chosen.tolist(), chosen_logprobs.tolist()))
                    if row.finish_reason is None and not self._append(row, token, logprob)]
            if not self.agree_max(int(bool(keep))):
                return
            if not keep:  # this rank is done while others still decode: match their forwards
                self._idle()
                return
            if len(keep) < len(live) and hasattr(cache, "batch_select_indices"):
                # drop finished rows: no compute is spent on them any more (a cache that cannot drop rows
                # keeps them; they are fed their last token and never read again)
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                chosen, mask, following = chosen[index], mask[index], following.index_select(-2, index)
                live, generators = [live[r] for r in keep], [generators[r] for r in keep]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=-1)
            out = self._forward(input_ids=chosen.unsqueeze(-1), attention_mask=mask, position_ids=following,
                                use_cache=True, **{self.cache_key: cache})
            following = following + 1

    def _append(self, row: _Row, token: int, logprob: float) -> bool:
        """Add a token to ``row``; whether the row is finished (EOS, a stop string, or the length limit)."""
        row.token_ids.append(token)
        row.logprobs.append(logprob)
        if token in self.eos_ids:
            row.finish_reason = "stop"  # the EOS token stays: the policy learns to stop
        elif self.params.stop and self.tokenizer is not None and any(
                stop in self.tokenizer.decode(row.token_ids) for stop in self.params.stop):
            row.finish_reason = "stop"
        elif len(row.token_ids) >= self.params.max_new_tokens:
            row.finish_reason = "length"
        return row.finish_reason is not None
