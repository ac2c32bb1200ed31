"""The sampler contract for online RL: prompts in, ``n`` completions per prompt with log-probs out.

A sampler is registered by name (``twinkle_register_samplers``) and built by the RL task from the
recipe's ``task_options.sampler`` options. The trainer hands it the policy once (:meth:`Sampler.bind`) and then,
before every rollout, calls :meth:`Sampler.sync_weights`; what that does is the sampler's **weight
sync**, declared by ``weight_sync``:

``"in_process"``
    The sampler generates with the policy's own parameters (``TwinkleModel.generation_module``), so
    the weights are always current and ``sync_weights`` only records the step. LoRA adapters are
    applied as the policy applies them.

``"push"``
    The sampler owns its own copy of the weights (another process, another device, or a snapshot in
    this process). ``sync_weights`` sends it a :class:`WeightUpdate`: the full Hugging Face-named
    state dict of the policy (``TwinkleModel.get_state_dict()``, gathered over model-parallel ranks),
    or only an adapter's tensors plus its config when the policy trains LoRA. The protocol, for an
    out-of-process engine (vLLM, SGLang), is:

    1. the trainer calls ``sync_weights(model, step=k)`` on every rank after optimizer step ``k``
       (collectives inside ``get_state_dict`` need all ranks);
    2. the sampler on the main process of each data-parallel group forwards the update to its engine
       (``load_weights`` of a state dict, or ``add_lora`` with a new adapter id), waits for the engine
       to acknowledge, and records ``step`` so that every later completion reports ``policy_step=k``;
    3. a completion sampled before the update keeps the step it was sampled at: the trainer uses its
       ``logprobs`` as the behaviour policy's log-probs, so a lag is visible rather than silent.

A sampler plugin for GPUs (vLLM, SGLang) implements this class and registers it; the core and the
RL task need no change. A minimal one::

    class EchoSampler(Sampler):
        name = "echo"
        weight_sync = "push"

        def sample(self, prompts, *, n, params, seeds):
            return [[Completion(token_ids=list(p[-1:]), logprobs=[0.0], finish_reason="length",
                                policy_step=self.policy_step) for _ in range(n)] for p in prompts]
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from twinkle_core.model.base import TwinkleModel
    from twinkle_core.prompt_inputs import PromptInputs

WEIGHT_SYNC_MODES = ("in_process", "push")


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn. ``top_k=0`` and ``top_p=1.0`` switch those filters off;
    ``temperature=0`` is greedy decoding. ``stop`` strings end a completion (the stop string is kept)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    #: tokens that end a completion besides the tokenizer's EOS (a chat template's end-of-turn token)
    stop_token_ids: tuple[int, ...] = ()
    #: tokens never drawn (a vision-language model's picture placeholders: a completion cannot show a picture)
    suppress_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"task_options.sampling.temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"task_options.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"task_options.sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"task_options.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # one string is one stop string (tuple("###") would make every character one)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(x, str) and x for x in stop):
            raise ConfigError(f"task_options.sampling.stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = [self.stop_token_ids] if isinstance(self.stop_token_ids, int) else list(self.stop_token_ids)
        if not all(float(t) == int(t) for t in ids):
            raise ConfigError(f"task_options.sampling.stop_token_ids must be integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        suppressed = ([self.suppress_token_ids] if isinstance(self.suppress_token_ids, int)
                      else list(self.suppress_token_ids))
        if not all(float(t) == int(t) for t in suppressed):
            raise ConfigError(f"task_options.sampling.suppress_token_ids must be integers, got "
                              f"{self.suppress_token_ids!r}")
        object.__setattr__(self, "suppress_token_ids", tuple(sorted({int(t) for t in suppressed})))


@dataclass
class Completion:
    """One sampled completion of one prompt.

    ``logprobs[t]`` is the log-probability of ``token_ids[t]`` under the distribution it was drawn from
    (after temperature, top-k and top-p), i.e. the behaviour policy's; ``finish_reason`` is ``"stop"``
    (EOS or a stop string) or ``"length"`` (``max_new_tokens`` reached). ``policy_step`` is the
    optimizer step of the weights that produced it.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_step: int = 0
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightUpdate:
    """What a ``push`` sampler receives after an optimizer step.

    ``state_dict`` holds Hugging Face-named tensors: the whole model (``adapter_name`` None) or the
    named LoRA adapter's tensors in PEFT naming (the sampler was given the adapter's config when it was
    bound, as the model saves it with ``save(..., adapter_name=...)``).
    """

    step: int
    state_dict: dict[str, Any]
    adapter_name: str | None = None


@dataclass(frozen=True)
class GenerationModule:
    """What ``TwinkleModel.generation_module()`` lends a sampler: the network, the device its inputs go to,
    and whether every forward is a collective (``lockstep``: all ranks must run the same number)."""

    module: Any
    device: Any
    lockstep: bool = False


def forward_keywords(module: Any) -> tuple[str, bool]:
    """How a Hugging Face-style causal LM's ``forward`` takes a KV cache, and whether it takes ``logits_to_keep``:
    transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns, then goes away)."""
    import inspect

    accepted = inspect.signature(getattr(module, "get_base_model", lambda: module)().forward).parameters
    return ("cache" if "cache" in accepted else "past_key_values"), "logits_to_keep" in accepted


def sample_seed(base: int, *parts: int) -> int:
    """A 63-bit seed from ``base`` and integer coordinates (rollout, prompt index, sample index).

    Seeding every completion by its coordinates, not by a rank's position in a stream, gives the same
    completions whatever the number of ranks or the batch a prompt lands in.
    """
    digest = hashlib.sha256(repr((int(base), *map(int, parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Sampler(ABC):
    """Generates completions for online RL. ``options`` come from the recipe's ``task_options.sampler`` mapping."""

    name: ClassVar[str] = ""
    #: "in_process" (reads the policy's parameters) or "push" (receives :class:`WeightUpdate` s); a sampler
    #: whose mode depends on its options sets it on the instance before calling ``Sampler.__init__``
    weight_sync: str = "in_process"
    #: whether :meth:`sample` takes ``inputs``: prompts that carry more than token ids (a vision-language prompt's
    #: pictures and positions, :class:`~twinkle_core.prompt_inputs.PromptInputs`); a task with such prompts refuses
    #: a sampler that does not
    takes_prompt_inputs: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ConfigError(f"{type(self).__name__}.weight_sync must be one of {WEIGHT_SYNC_MODES}, "
                              f"got {self.weight_sync!r}")
        self.options = options
        self.model: TwinkleModel | None = None
        self.tokenizer: Any = None
        self.adapter_name: str | None = None
        self.policy_step = 0

    def overlap_refusal(self) -> str | None:
        """Why this sampler cannot generate while the policy trains (asynchronous, one-step-off rollouts), or
        ``None`` when it can. The RL tasks ask before their first asynchronous rollout. By default a sampler that
        reads the policy's own parameters cannot (they change under it); one with its own copy can."""
        if self.weight_sync != "push":
            return ("the sampler needs its own copy of the weights: set task_options.sampler.copy_weights: true "
                    "(hf_generate) or use a sampler with weight_sync 'push'")
        return None

    def bind(self, model: TwinkleModel, tokenizer: Any, *, adapter_name: str | None = None) -> None:
        """Attach the policy being trained (called once, on every rank, before the first rollout)."""
        self.model, self.tokenizer, self.adapter_name = model, tokenizer, adapter_name

    def sync_weights(self, model: TwinkleModel, *, step: int) -> None:
        """Bring the sampler to the policy's weights after optimizer step ``step`` (every rank calls it).

        In process there is nothing to move; a ``push`` sampler gathers a :class:`WeightUpdate` and
        hands it to :meth:`receive_weights`.
        """
        if self.weight_sync == "push":
            state = model.get_state_dict(adapter_name=self.adapter_name)
            self.receive_weights(WeightUpdate(step=step, state_dict=state, adapter_name=self.adapter_name))
        self.policy_step = step

    def receive_weights(self, update: WeightUpdate) -> None:
        """Load a pushed update into the sampler's own copy of the weights (``push`` samplers)."""
        raise NotImplementedError(f"{type(self).__name__} declares weight_sync='push' but cannot receive weights")

    @abstractmethod
    def sample(self, prompts: list[list[int]], *, n: int, params: SamplingParams,
               seeds: list[list[int]], inputs: Sequence[PromptInputs | None] | None = None) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids, no padding); ``seeds[i][j]`` seeds completion
        ``j`` of prompt ``i`` so that the result does not depend on batching or the number of ranks.
        ``inputs[i]``: what prompt ``i`` hands the model besides its ids (only a sampler that declares
        ``takes_prompt_inputs`` is given them; lay them out with
        :func:`~twinkle_core.prompt_inputs.batch_prompt_inputs`)."""

    def close(self) -> None:
        """Release what the sampler holds (engines, threads); the trainer calls it at the end."""


def sample_prompts(sampler: Sampler, prompts: list[list[int]], *, n: int, params: SamplingParams,
                   seeds: list[list[int]], inputs: Sequence[PromptInputs | None] | None = None,
                   ) -> list[list[Completion]]:
    """``sampler.sample`` with prompt ``inputs`` where a prompt has them: a sampler that does not declare
    ``takes_prompt_inputs`` is never handed any (it may predate them), and is refused for prompts that need them."""
    if inputs is None or all(item is None for item in inputs):
        return sampler.sample(prompts, n=n, params=params, seeds=seeds)
    if not sampler.takes_prompt_inputs:
        raise ConfigError(f"sampler {sampler.name or type(sampler).__name__!r} samples from token ids only, but "
                          f"these prompts carry more (a vision-language prompt's pictures and positions); use "
                          f"the hf_generate sampler, which passes them to the policy")
    return sampler.sample(prompts, n=n, params=params, seeds=seeds, inputs=list(inputs))
