"""The ``grpo`` task: online RL from verifiable rewards (GRPO, DAPO, Dr. GRPO, GSPO, RLOO, REINFORCE++).

Each optimizer step trains on micro-batches the task makes itself (``Task.next_training_batch``): when
its queue is empty it draws a batch of prompts from the data loader, samples ``num_generations``
completions of each with the policy's current weights (the sampler), scores them (the rewards), turns
the scores into advantages, and queues the completions for ``ppo_epochs`` passes of mini-batches. After
every optimizer step the sampler is brought to the new weights (``Task.after_step``).

``task_options`` (all optional):

* ``num_generations`` (8): completions per prompt (a GRPO group);
* ``sampler``: ``{"name": "hf_generate", ...options}`` (default: ``hf_generate`` on the policy's own weights);
* ``sampling``: ``temperature`` (1.0), ``top_p``, ``top_k``, ``max_new_tokens`` (64), ``stop`` strings;
* ``rewards``: a list of ``{"name": <registered name or module:function>, "weight": 1.0, "options": {}}`` (or
  plain names); ``on_nan``: ``zero`` (default: a NaN score adds nothing, and is counted) or ``error``;
* ``advantage``: ``grpo`` (default; group mean and std), ``dr_grpo`` (group mean only), ``rloo`` or
  ``reinforce_pp``; ``advantage_options`` are passed to it;
* ``ppo_epochs`` (1): passes over each rollout; ``micro_batch_size``: completions per micro-batch (default:
  one rollout split into the model's ``gradient_accumulation_steps`` micro-batches, i.e. one optimizer step
  per pass; see "Gradient accumulation" below); with several mini-batches or epochs the completions are
  shuffled per epoch;
* ``reference``: ``auto`` (default: ``adapter`` with a LoRA adapter, else ``model``, and only when the loss's
  ``beta`` is not 0), ``adapter``, ``model`` or ``none``: where the KL term's reference log-probs come from;
* ``dynamic_sampling`` (false) and ``max_sampling_rounds`` (4), ``overlong_filter`` (false),
  ``overlong_penalty``: ``{"max_length": L, "cache_length": C}`` (DAPO's soft overlong punishment);
* ``max_prompt_length``, ``prompt_over_length`` (``skip`` or ``truncate_left``), ``chat_template`` (auto);
* ``accuracy_reward``: the reward whose mean the logs call ``accuracy`` (default: the first);
* ``environment``: ``{name, options, max_turns (4), max_total_tokens (512), step_timeout_s (30)}``: multi-turn
  agentic rollouts with a registered (or ``module:Class``) environment instead of single completions, only the
  model's tokens trained (:mod:`twinkle_rl.agent_rollout`); ``rewards`` are then optional;
* ``seed``: of the sampling (default 0; every completion is seeded by its rollout, prompt and index, so
  the completions do not depend on the number of ranks, and a resumed run samples the same ones).

The loss defaults to ``grpo``; its ``temperature`` defaults to the sampling temperature, and ``dr_grpo``'s
constant ``max_completion_length`` to the sampling ``max_new_tokens`` (``loss_options``; ``loss.options`` win).

Gradient accumulation. One rollout (``data.batch_size`` prompts x ``num_generations`` completions per rank) is
sampled, scored and turned into advantages whole, then cut into micro-batches for ``forward_backward``; the
optimizer steps once per mini-batch of ``gradient_accumulation_steps`` micro-batches. The losses divide the
summed micro-batch losses once per step, so a rollout in ``k`` micro-batches trains exactly as in one (up to
float32 rounding) with ``1/k`` of the activation memory. A rollout must fill whole optimizer steps: the
recipe check refuses, before anything is built, a rollout that does not divide into ``micro_batch_size``
micro-batches or whose micro-batches (times ``ppo_epochs``) are not a multiple of
``train.gradient_accumulation_steps``; and a rollout used up in the middle of an optimizer step (the next one
would join the same step) is a ConfigError at once. Without ``micro_batch_size`` each rollout is split into the
model's ``gradient_accumulation_steps`` micro-batches (``train.gradient_accumulation_steps`` under ``twinkle
train``, which passes it to ``set_optimizer``; from Python, ``set_optimizer(..., gradient_accumulation_steps=N)``),
and the recipe check refuses a rollout that does not divide into that many.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import torch

from twinkle_core.environments import load_environment
from twinkle_core.errors import ConfigError
from twinkle_core.loss.logprobs import tempered_token_logprobs
from twinkle_core.model.train_configs import TrainingSetup
from twinkle_core.sampling import SamplingParams
from twinkle_core.task import Task
from twinkle_rl.advantages import ESTIMATORS
from twinkle_rl.agent_rollout import ENVIRONMENT_REWARD, AgentRolloutEngine, AgentSettings, agent_summary
from twinkle_rl.agent_turns import ChatTurns
from twinkle_rl.checks import integer, optional_integer
from twinkle_rl.experience import masked_rows, micro_batch_order, select_rows
from twinkle_rl.one_step_off import InflightRollout, check_one_step_off
from twinkle_rl.online_report import evaluate_prompts, summarise
from twinkle_rl.prompts import PromptFeature, collate_prompts, read_prompts
from twinkle_rl.reference import ReferenceProvider, make_reference
from twinkle_rl.rewards import RewardSet
from twinkle_rl.rollout import DataParallel, Rollout, RolloutEngine, RolloutStats

logger = logging.getLogger("twinkle.rl")

#: the losses whose log-probs are computed at a temperature (the sampling one by default)
POLICY_LOSSES = frozenset({"grpo", "dapo", "dr_grpo", "gspo", "ppo"})
REFERENCES = ("auto", "adapter", "model", "none")


def _sampling_params(options: dict[str, Any] | None) -> SamplingParams:
    options = dict(options or {})
    known = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"task_options.sampling got unknown option(s) {unknown}; known: {', '.join(sorted(known))}")
    return SamplingParams(**options)


def _check_estimator_options(advantage: str, options: dict[str, Any], num_generations: int) -> None:
    """Run the estimator once on a dummy group, so that an unknown or out-of-range ``advantage_options`` entry
    fails when the task is built rather than at the first rollout."""
    try:
        ESTIMATORS[advantage](torch.zeros(1, max(num_generations, 2), dtype=torch.float64), **options)
    except TypeError as exc:
        raise ConfigError(f"task_options.advantage_options {options!r} do not fit advantage {advantage!r}: {exc}") from None


def _checked_overlong_penalty(penalty: Any) -> dict[str, int] | None:
    if penalty is None:
        return None
    if not isinstance(penalty, dict) or set(penalty) != {"max_length", "cache_length"}:
        raise ConfigError(f"task_options.overlong_penalty must be {{max_length: L, cache_length: C}}, got {penalty!r}")
    max_length = integer("task_options.overlong_penalty.max_length", penalty["max_length"], low=1)
    cache_length = integer("task_options.overlong_penalty.cache_length", penalty["cache_length"], low=1)
    if cache_length > max_length:
        raise ConfigError(f"task_options.overlong_penalty: cache_length ({cache_length}) must be <= max_length "
                          f"({max_length})")
    return {"max_length": max_length, "cache_length": cache_length}


def split_problems(rollout: int, micro_batch_size: Any, epochs: Any, accumulation: int) -> list[str]:
    """Why a rollout of ``rollout`` completions does not fill whole optimizer steps of ``accumulation``
    micro-batches (the recipe check's part of the task); the option values may still be unchecked."""
    if not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool) or micro_batch_size < 1:
        if micro_batch_size is not None:
            return []  # the task's constructor names a wrong micro_batch_size
        if rollout % accumulation == 0:
            return []  # one rollout, split into the accumulation's micro-batches
        return [f"train.gradient_accumulation_steps: {accumulation} does not divide a rollout of {rollout} "
                f"completions (data.batch_size x num_generations) into equal micro-batches: change "
                f"data.batch_size, num_generations or the accumulation"]
    if rollout % micro_batch_size:
        return [f"task_options.micro_batch_size: {micro_batch_size} does not divide a rollout of {rollout} "
                f"completions (data.batch_size x num_generations)"]
    per_pass = rollout // micro_batch_size
    passes = epochs if isinstance(epochs, int) and not isinstance(epochs, bool) and epochs >= 1 else 1
    if (per_pass * passes) % accumulation:
        return [f"train.gradient_accumulation_steps: {accumulation} does not divide the {per_pass * passes} "
                f"micro-batches a rollout makes ({rollout} completions / micro_batch_size {micro_batch_size} x "
                f"ppo_epochs {passes}): the next rollout would be sampled in the middle of an optimizer step; "
                f"choose micro_batch_size = {rollout} / (gradient_accumulation_steps x mini-batches per pass)"]
    return []


class OnlineRLTask(Task):
    name: ClassVar[str] = "grpo"
    default_loss: ClassVar[str] = "grpo"
    model_kind: ClassVar[str] = "causal_lm"
    provides: ClassVar[frozenset[str]] = frozenset({"advantages", "old_logps", "ref_logps"})
    has_eval_loss: ClassVar[bool] = False
    curve_keys: ClassVar[tuple[str, ...]] = ("reward_mean", "accuracy", "completion_length_mean")
    #: the step line: how the rollouts score (``accuracy``: the reward marked as one), how stale they are (one step
    #: off), and where the time went
    console_keys: ClassVar[tuple[str, ...]] = ("reward_mean", "reward_std", "accuracy", "policy_lag",
                                               "generation_time_s", "reward_time_s", "weight_sync_time_s",
                                               "rollout_wait_s")
    #: ``num_generations`` when the recipe does not set it
    default_num_generations: ClassVar[int] = 8

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        """A rollout must fill whole optimizer steps (see "Gradient accumulation" in the module)."""
        options = recipe.task_options
        n = options.get("num_generations", cls.default_num_generations)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return []  # the task's constructor names it
        return split_problems(recipe.data.batch_size * n, options.get("micro_batch_size"),
                              options.get("ppo_epochs", 1), recipe.train.gradient_accumulation_steps)

    def __init__(self, *, num_generations: int = 8, sampler: dict[str, Any] | None = None,
                 sampling: dict[str, Any] | None = None, rewards: list[Any] | None = None, on_nan: str = "zero",
                 advantage: str = "grpo", advantage_options: dict[str, Any] | None = None, ppo_epochs: int = 1,
                 micro_batch_size: int | None = None, reference: str = "auto", dynamic_sampling: bool = False,
                 max_sampling_rounds: int = 4, overlong_filter: bool = False,
                 overlong_penalty: dict[str, int] | None = None, max_prompt_length: int | None = None,
                 prompt_over_length: str = "skip", chat_template: bool | None = None,
                 accuracy_reward: str | None = None, adapter_name: str | None = None, seed: int = 0,
                 one_step_off: bool = False, environment: dict[str, Any] | str | None = None) -> None:
        num_generations = integer("task_options.num_generations", num_generations, low=1)
        ppo_epochs = integer("task_options.ppo_epochs", ppo_epochs, low=1)
        micro_batch_size = optional_integer("task_options.micro_batch_size", micro_batch_size, low=1)
        if advantage not in ESTIMATORS:
            raise ConfigError(f"task_options.advantage must be one of {', '.join(sorted(ESTIMATORS))}, "
                              f"got {advantage!r}")
        if advantage in ("grpo", "dr_grpo", "rloo") and num_generations < 2:
            raise ConfigError(f"task_options.advantage={advantage} compares completions of one prompt: "
                              f"num_generations must be >= 2, got {num_generations}")
        if reference not in REFERENCES:
            raise ConfigError(f"task_options.reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
        if not rewards and environment is None:
            raise ConfigError("task_options.rewards: online RL needs at least one reward, e.g. "
                              "[{name: exact_match, options: {field: answer}}]")
        super().__init__(num_generations=num_generations, sampler=sampler, sampling=sampling, rewards=rewards,
                         advantage=advantage, ppo_epochs=ppo_epochs, micro_batch_size=micro_batch_size,
                         reference=reference, seed=seed, environment=environment)
        self.params = _sampling_params(sampling)
        self.sampler_spec = dict(sampler or {"name": "hf_generate"})
        self.reward_set = RewardSet(rewards, on_nan=on_nan) if rewards else None
        self.agent = AgentSettings.parse(environment) if environment is not None else None
        self.environment = load_environment(self.agent.name, self.agent.options) if self.agent else None
        self.num_generations, self.advantage = num_generations, advantage
        self.advantage_options = dict(advantage_options or {})
        if self.advantage_options:
            _check_estimator_options(advantage, self.advantage_options, num_generations)
        self.ppo_epochs, self.micro_batch_size = ppo_epochs, micro_batch_size
        self.reference = reference
        self.dynamic = dict(dynamic_sampling=bool(dynamic_sampling),
                            max_sampling_rounds=integer("task_options.max_sampling_rounds", max_sampling_rounds, low=1),
                            overlong_filter=bool(overlong_filter),
                            overlong_penalty=_checked_overlong_penalty(overlong_penalty))
        self.prompt_options = dict(
            max_prompt_length=optional_integer("task_options.max_prompt_length", max_prompt_length, low=1),
            over_length=prompt_over_length, use_chat_template=chat_template)
        self.accuracy_reward = accuracy_reward
        self.adapter_name, self.seed = adapter_name, integer("task_options.seed", seed)
        self.tokenizer: Any = None
        self.engine: RolloutEngine | None = None
        self.provider: ReferenceProvider | None = None
        self.queue: list[dict[str, Any]] = []
        self.one_step_off = bool(one_step_off)
        self.inflight: InflightRollout | None = None
        self.inflight_state: dict[str, Any] | None = None  # from a checkpoint: relaunched at the next rollout
        self.train_features: list[PromptFeature] = []
        self.rollouts = 0
        #: the most completions a rollout of this run held (a shorter one, the last data batch of an epoch, makes
        #: as many micro-batches) and the model's optimizer step when the current rollout was drawn
        self.largest_rollout = 0
        self.rollout_step: int | None = None
        self.stats = RolloutStats()

    # ------------------------------------------------------------------ data
    def check_prompt_data(self, mode: str | None, options: dict[str, Any]) -> None:
        """Refuse the data options a prompt dataset cannot take (a mode other than chat, packing)."""
        if mode not in (None, "chat"):
            raise ConfigError(f"data.mode: the {self.name} task reads prompt rows, got mode {mode!r}")
        if options.get("packing"):
            raise ConfigError(f"data.packing: the {self.name} task makes its own batches of completions; "
                              f"remove data.packing")

    def prompt_length_limit(self, max_length: int | None) -> int | None:
        """``max_prompt_length``, or else what ``data.max_length`` leaves after ``max_new_tokens`` (None: no
        limit)."""
        limit = self.prompt_options["max_prompt_length"]
        if limit is None and max_length is not None:
            limit = max(int(max_length) - self.params.max_new_tokens, 1)
        return limit

    def load_dataset(self, path: Any, tokenizer: Any, *, max_length: int | None = None, mode: str | None = None,
                     **unused: Any) -> list[PromptFeature]:
        self.check_prompt_data(mode, unused)
        self.tokenizer = tokenizer
        options = dict(self.prompt_options, max_prompt_length=self.prompt_length_limit(max_length))
        features, counts = read_prompts(path, tokenizer, **options)
        self.prompt_counts = counts
        return features

    def collate(self, features: list[Any]) -> dict[str, Any]:
        return collate_prompts(features)

    def micro_batches_per_data_batch(self, batch_size: int, *, gradient_accumulation_steps: int = 1) -> int:
        # without micro_batch_size a rollout is split into the accumulation's micro-batches ("Gradient accumulation")
        completions = batch_size * self.num_generations
        per_pass = max(completions // self.micro_batch_size, 1) if self.micro_batch_size else gradient_accumulation_steps
        return self.ppo_epochs * per_pass

    def loss_options(self, loss_name: str) -> dict[str, Any]:
        options: dict[str, Any] = {"temperature": self.params.temperature or 1.0} if loss_name in POLICY_LOSSES else {}
        if loss_name == "dr_grpo":  # Dr. GRPO's constant length: the generation limit (the recipe's loss.options win)
            options["max_completion_length"] = self.params.max_new_tokens
        return options

    # ------------------------------------------------------------------ set-up
    def _pad_token_id(self) -> int:
        tok = self.tokenizer
        pad = getattr(tok, "pad_token_id", None)
        return int(pad if pad is not None else tok.eos_token_id)

    def _engine(self, model: Any) -> RolloutEngine:
        if self.engine is None:
            from twinkle_core.plugins import get_plugins

            if self.tokenizer is None:
                raise ConfigError(f"the {self.name} task needs load_dataset(path, tokenizer) before training")
            spec = dict(self.sampler_spec)
            sampler = get_plugins().load("sampler", spec.pop("name", "hf_generate"))(**spec)
            name = self.adapter_name or (self._only_adapter(model))
            sampler.bind(model, self.tokenizer, adapter_name=name)
            # a push sampler's copy starts from the current weights (also those of a resumed checkpoint)
            sampler.sync_weights(model, step=TrainingSetup.of(model).step)
            params = self.params
            end_of_turn = self._end_of_turn_ids()
            if end_of_turn:
                params = SamplingParams(**{**params.__dict__, "stop_token_ids": tuple(sorted(
                    set(params.stop_token_ids) | end_of_turn))})
            options = dict(sampler=sampler, rewards=self.reward_set, params=params,
                           num_generations=self.num_generations, estimator=self.advantage,
                           estimator_options=self.advantage_options, seed=self.seed,
                           pad_token_id=self._pad_token_id(), dp=DataParallel.of(model), **self.dynamic)
            self.engine = (RolloutEngine(**options) if self.agent is None else AgentRolloutEngine(
                environment=self.environment, turns=ChatTurns(self.tokenizer), settings=self.agent, **options))
        return self.engine

    def _end_of_turn_ids(self) -> set[int]:
        if not getattr(self.tokenizer, "chat_template", None) or self.prompt_options["use_chat_template"] is False:
            return set()
        from twinkle_core.data.template import Template

        return set(Template(self.tokenizer, mode="chat").end_of_turn_ids)

    @staticmethod
    def _only_adapter(model: Any) -> str | None:
        adapters = list(TrainingSetup.of(model).adapters)
        if len(adapters) > 1:
            raise ConfigError(f"the model has several adapters {adapters}; name the one this task trains with "
                              f"task_options.adapter_name")
        return adapters[0] if adapters else None

    def _reference(self, model: Any) -> ReferenceProvider | None:
        loss = TrainingSetup.of(model).loss
        beta = float(loss.option("beta", 0.0)) if loss is not None else 0.0
        if not beta:
            return None
        if self.provider is None:
            choice = self.reference
            if choice == "auto":
                choice = "adapter" if TrainingSetup.of(model).adapters else "model"
            if choice == "none":
                raise ConfigError(f"loss {loss.name!r} has beta={loss.option('beta')} (a KL term) but "
                                  f"task_options.reference is none; set a reference or beta: 0")
            self.provider = make_reference(choice, adapter_name=self.adapter_name)
            self.provider.prepare(model)
        return self.provider

    def prepare_dataset(self, model: Any, dataset: Any, *, split: str, output_dir: str) -> Any:
        if split == "train":
            self.train_features = list(dataset)  # a resumed one-step-off run relaunches its in-flight prompts
        # the frozen reference must copy the initial weights: before a resumed run loads its checkpoint
        if split == "train" and self.reference in ("auto", "model"):
            self._reference(model)
        return dataset

    # ------------------------------------------------------------------ training batches
    def _micro_batches(self, model: Any, rollout_size: int) -> int:
        """How many micro-batches each pass over a rollout of ``rollout_size`` completions makes."""
        self.largest_rollout = max(self.largest_rollout, rollout_size)
        if self.micro_batch_size:
            if self.largest_rollout % self.micro_batch_size:
                raise ConfigError(f"task_options.micro_batch_size={self.micro_batch_size} must divide the "
                                  f"{self.largest_rollout} completions of a rollout (data.batch_size prompts x "
                                  f"num_generations)")
            return self.largest_rollout // self.micro_batch_size
        return TrainingSetup.of(model).gradient_accumulation_steps

    def _check_step_boundary(self, model: Any) -> None:
        """A new rollout is drawn at an optimizer-step boundary: were the previous one's micro-batches used up
        while the model is still at the step it was drawn at, both would train in one optimizer step."""
        step = TrainingSetup.of(model).step
        if self.rollout_step is not None and step == self.rollout_step:
            raise ConfigError(
                f"the {self.name} task's rollout {self.rollouts - 1} was used up in the middle of an optimizer step "
                f"(the model is still at step {step}, where that rollout was drawn), so the next rollout would join "
                f"the same step: the optimizer accumulates more micro-batches than a rollout makes "
                f"({self.ppo_epochs} epoch(s) x micro-batches per pass). With twinkle train set "
                f"task_options.micro_batch_size to (data.batch_size x num_generations) / "
                f"train.gradient_accumulation_steps; from Python, set_optimizer(..., gradient_accumulation_steps=N) "
                f"splits each rollout into N micro-batches")
        self.rollout_step = step

    def _next_rollout(self, model: Any, draw: Any) -> Rollout:
        engine = self._engine(model)
        if not self.one_step_off:
            return engine.run(draw, self.rollouts, self.stats)
        check_one_step_off(engine)
        if self.inflight is None:  # the first rollout, or (an older checkpoint) the prompts of the one in flight
            self.inflight = InflightRollout(engine, self._inflight_features(draw), self.rollouts)
        current, self.inflight = self.inflight, None
        waiting = time.perf_counter()
        rollout = current.result()
        self.stats.add("rollout_wait_s", time.perf_counter() - waiting)
        self.stats.merge(current.stats)
        step = TrainingSetup.of(model).step
        self.stats.add("policy_lag", (step - current.policy_step) * len(rollout.completions))
        # the sampler is idle now: give it the current weights, then sample the next rollout while this one trains
        self._sync_weights(model, step)
        self.inflight = InflightRollout(engine, list(draw()["prompts"]), self.rollouts + 1)
        return rollout

    def _inflight_features(self, draw: Any) -> list[PromptFeature]:
        if self.inflight_state is None:
            return list(draw()["prompts"])
        indices, self.inflight_state = self.inflight_state["prompt_index"], None
        logger.warning("the checkpoint holds only the prompts of its in-flight rollout (written by an older "
                       "version): they are sampled again with the checkpoint's weights, so this resume is not exact")
        return [self.train_features[i] for i in indices]

    def next_training_batch(self, model: Any, draw: Any) -> dict[str, Any]:
        if not self.queue:
            self._check_step_boundary(model)
            rollout = self._next_rollout(model, draw)
            size = rollout.batch["input_ids"].shape[0]
            micro_batches = self._micro_batches(model, size)
            self._after_rollout(model, rollout, max(-(-size // micro_batches), 1))
            mini_batches = micro_batches // TrainingSetup.of(model).gradient_accumulation_steps
            order = micro_batch_order(size, micro_batches=micro_batches, epochs=self.ppo_epochs,
                                      shuffle=self.ppo_epochs > 1 or mini_batches > 1,
                                      seed=self.seed, rollout=self.rollouts)
            self.queue = [select_rows(rollout.batch, rows) if rows.numel() else masked_rows(rollout.batch)
                          for rows in order]
            self.rollouts += 1
        return self.prepare_batch(model, self.queue.pop(0))

    def _after_rollout(self, model: Any, rollout: Rollout, chunk_size: int) -> None:
        """Complete a rollout's experience before it is queued (the ppo task adds the critic's advantages, running
        the critic ``chunk_size`` completions at a time)."""

    def prepare_batch(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        provider = self._reference(model)
        if provider is not None and "ref_logps" not in batch:
            with torch.no_grad():
                logits = provider.logits(model, batch)
                logps = tempered_token_logprobs(logits, batch["labels"].to(logits.device),
                                                temperature=self.params.temperature or 1.0).logps
            batch = {**batch, "ref_logps": logps.detach().float().cpu()}
        return batch

    def after_step(self, model: Any, *, step: int) -> None:
        # one step off: the sampler is busy with the next rollout; it gets the weights when that one is collected
        if self.engine is not None and not self.one_step_off:
            self._sync_weights(model, step)

    def _sync_weights(self, model: Any, step: int) -> None:
        started = time.perf_counter()
        self.engine.sampler.sync_weights(model, step=step)
        self.stats.add("weight_sync_time_s", time.perf_counter() - started)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, model: Any, dataset: Any, tokenizer: Any, *, limit: int | None = None, batch_size: int = 16,
                 temperature: float = 0.0, num_generations: int = 1) -> dict[str, float]:
        """Rewards of completions of the held-out prompts (``data.eval``), greedy by default: ``reward_mean``,
        ``reward/<name>``, ``accuracy`` and ``completion_length_mean``. Each rank answers its share."""
        if dataset is None:
            raise ConfigError(f"the {self.name} task evaluates on data.eval; set it")
        engine = self._engine(model)
        if self.inflight is not None:  # the sampler is busy on its thread: let it finish, then evaluate the policy
            self.inflight.wait()
            engine.sampler.sync_weights(model, step=TrainingSetup.of(model).step)
        prompts = list(dataset)[: None if limit is None else int(limit)]
        if isinstance(engine, AgentRolloutEngine):
            return engine.evaluate(prompts, seed=self.seed, batch_size=batch_size, temperature=temperature,
                                   num_generations=num_generations, accuracy_reward=self.accuracy_reward)
        return evaluate_prompts(engine, prompts, seed=self.seed, batch_size=batch_size, temperature=temperature,
                                num_generations=num_generations, accuracy_reward=self.accuracy_reward)

    # ------------------------------------------------------------------ state and logs
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rollouts": self.rollouts, "queue": [dict(b) for b in self.queue],
                                 "largest_rollout": self.largest_rollout, "rollout_step": self.rollout_step}
        # one step off: the sampled in-flight rollout itself (waits for it), so that a resume is exact
        inflight = self.inflight.state() if self.inflight is not None else self.inflight_state
        if inflight is not None:
            state["inflight"] = inflight
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollouts = int(state.get("rollouts", 0))
        self.queue = [dict(b) for b in state.get("queue", [])]
        self.largest_rollout = int(state.get("largest_rollout", 0))
        self.rollout_step = state.get("rollout_step")
        inflight = state.get("inflight")
        if inflight is not None and "sampled" in inflight:
            self.inflight, self.inflight_state = InflightRollout.restored(inflight), None
        else:  # none, or an older checkpoint's prompts: sampled again at the next rollout
            self.inflight_state = inflight

    def step_metrics(self) -> dict[str, float]:
        stats, self.stats = self.stats, RolloutStats()
        dp = self.engine.dp if self.engine is not None else DataParallel()
        names = self.reward_set.names if self.reward_set is not None else []
        if self.agent is not None:  # the environment's reward first: the default accuracy
            return {**summarise(stats, dp, reward_names=[ENVIRONMENT_REWARD, *names],
                                accuracy_reward=self.accuracy_reward, one_step_off=self.one_step_off,
                                dynamic_sampling=self.dynamic["dynamic_sampling"]), **agent_summary(stats, dp)}
        return summarise(stats, dp, reward_names=names, accuracy_reward=self.accuracy_reward,
                         one_step_off=self.one_step_off, dynamic_sampling=self.dynamic["dynamic_sampling"])

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.cancel()
            self.inflight = None
        if self.engine is not None:
            self.engine.sampler.close()
