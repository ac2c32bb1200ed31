"""The ``TwinkleModel`` training API that every backend implements.

Every method takes an optional ``adapter_name``: ``None`` means the model itself (full
fine-tuning, or the only adapter); a name scopes the call to that adapter's weights, optimizer,
scheduler, loss and counters.

A training step, the long way and the short way::

    model.set_optimizer("AdamW", lr=1e-4)
    model.set_lr_scheduler("cosine", num_training_steps=100, num_warmup_steps=10)
    for batch in loader:
        model.forward_backward(inputs=batch)        # forward + calculate_loss + backward
        model.clip_grad_and_step(max_grad_norm=1.0)  # clip_grad_norm + step + zero_grad + lr_step

Gradient accumulation is exact: losses are sums over tokens and gradients are divided by the global
token count of all accumulated micro-batches (over all data-parallel ranks) before clipping.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from twinkle_core.errors import ConfigError
from twinkle_core.model.data_parallel import DataParallelView


class TwinkleModel(ABC):
    #: strategies (by name) this model class runs on; ``None``: any. Checked with the strategy's own
    #: ``mesh_dimensions`` before anything is built (see :mod:`twinkle_core.capabilities`)
    supported_strategies: ClassVar[tuple[str, ...] | None] = None
    #: one sentence appended to the error when a strategy is refused (why the model needs its strategy)
    strategy_note: ClassVar[str] = ""
    #: the ``Task.model_kind`` values this class builds a network for (``"causal_lm"``, ``"token_value"`` ...);
    #: ``None``: any. A task of another kind is refused before anything is built
    #: (:func:`twinkle_core.capabilities.check_model_kind`)
    supported_model_kinds: ClassVar[tuple[str, ...] | None] = None

    #: the batch keys that carry the tokens the network reads: a batch must hold at least one (:meth:`check_inputs`)
    token_input_keys: ClassVar[tuple[str, ...]] = ("input_ids", "inputs_embeds")

    @classmethod
    def load_tokenizer(cls, path: str, *, trust_remote_code: bool = False) -> Any:
        """The tokenizer stored at ``path`` (a local directory), loaded the way this backend reads them.

        The trainer calls it on the recipe's model class, so that twinkle-core itself needs no
        tokenizer library. The default refuses: a backend that can load tokenizers overrides it.
        """
        raise ConfigError(f"{cls.__name__} cannot load a tokenizer (from {path}): load it yourself and pass "
                          f"tokenizer=, or use a model class whose backend can (such as TransformersModel)")

    @classmethod
    def check_model_directory(cls, path: str, **options: Any) -> None:
        """Refuse, naming the file and the fix, a local model directory this class could not build a model from
        (a damaged ``config.json``, an unknown architecture), reading files only; ``options`` are the recipe's
        ``model.options``. ``twinkle train`` and ``--dry-run`` call it before anything is built, when the model is
        built from the directory's own ``config.json``. Default: accept (the build reports what it finds)."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Refuse, without building anything, recipe ``model.options`` this class's constructor would refuse where
        its signature cannot tell (options taken by ``**kwargs`` and checked inside). ``twinkle train`` and
        ``--dry-run`` call it before launching. Default: accept."""

    @classmethod
    def check_adapter_config(cls, config: Any) -> None:
        """Refuse an adapter config this class would refuse in ``add_adapter_to_model``, without building anything
        (``twinkle train`` and ``--dry-run`` call it before launching). Default: accept."""

    @property
    def data_parallel(self) -> DataParallelView:
        """This process's data-parallel coordinates (:class:`~twinkle_core.model.data_parallel.DataParallelView`):
        the trainer shards data by them, rollouts reduce over their group. Default: every process is a
        data-parallel rank; a model with tensor / pipeline / sequence parallelism returns its strategy's."""
        return DataParallelView.of_world()

    @property
    def reshards_checkpoints(self) -> bool:
        """Whether a training checkpoint of this model resumes on another number of processes (the trainer then
        accepts a changed layout on ``--resume``). Default: no; a model whose strategy reshards says so."""
        return False

    @property
    def network(self) -> Any:
        """The backend's own network, unwrapped (no strategy or adapter wrapper): what a task reads a config
        from or adapts in ``prepare_model``. A model without a torch network raises ``ConfigError``."""
        raise ConfigError(f"{type(self).__name__} exposes no network (TwinkleModel.network)")

    # ------------------------------------------------------------------ compute
    def check_inputs(self, inputs: Any, *, call: str = "forward") -> None:
        """Refuse a batch the network cannot run on before it gets there: ``inputs`` must be a mapping holding one
        of :attr:`token_input_keys`. The error (a ``ConfigError``) names the keys a batch needs and the ones it has.
        ``TorchTwinkleModel`` calls it at the start of ``forward``, ``forward_backward`` and ``forward_only``;
        ``call`` names the method in the message."""
        where = f"{type(self).__name__}.{call}(inputs=...)"
        needs = (f"a batch needs {self.token_input_keys[0]!r} (the token ids, shape [batch, length]), usually with "
                 f"'attention_mask', and 'labels' where a loss is computed; the task's collate makes one "
                 f"(task.collate(features), or a data loader over the task's data set)")
        if not isinstance(inputs, Mapping):
            raise ConfigError(f"{where}: inputs must be a dict of tensors, got {type(inputs).__name__}; {needs}")
        if not any(key in inputs for key in self.token_input_keys):
            wanted = " or ".join(repr(key) for key in self.token_input_keys)
            given = ", ".join(repr(str(key)) for key in inputs) or "no keys at all"
            raise ConfigError(f"{where}: the batch has no {wanted}; it has {given}. {needs[0].upper()}{needs[1:]}")

    @abstractmethod
    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        """Training-mode forward that keeps the graph for a later ``calculate_loss`` / ``backward``."""

    @abstractmethod
    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                     disable_adapters: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Evaluation forward without gradients.

        ``disable_adapters=True`` runs the base model with every adapter switched off (the reference model of
        preference training with LoRA); ``adapter_name`` still picks the adapter (tenant) whose call it is.
        Afterwards the adapters are active again, also when the forward raised. Without adapters the flag
        changes nothing. A model class that cannot switch its adapters off raises ``ConfigError``.
        """

    def generation_module(self, *, adapter_name: str | None = None) -> contextlib.AbstractContextManager[Any]:
        """Lend the network to an in-process sampler: a context manager yielding a
        :class:`~twinkle_core.sampling.GenerationModule` whose ``module`` is a Hugging Face-style causal LM
        (``module(input_ids=, attention_mask=, position_ids=, use_cache=True)`` plus its KV-cache argument) in
        evaluation mode, without gradients, under the model's precision, with ``adapter_name``'s adapter
        active. Training mode comes back on exit. ``lockstep`` tells the sampler that each forward is a
        collective (sharded weights are gathered): every rank must then run the same number of forwards.

        A model whose network cannot run that way (Megatron's) raises ``ConfigError``; a ``push`` sampler
        builds its own copy from ``get_state_dict()`` instead.
        """
        raise ConfigError(f"{type(self).__name__} cannot lend its network to an in-process sampler; use a sampler "
                          f"with weight_sync='push' (hf_generate with copy_weights: true)")

    @abstractmethod
    def calculate_loss(self, *, inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None,
                       adapter_name: str | None = None, **kwargs: Any) -> Any:
        """Apply the adapter's loss to ``outputs`` (default: the last ``forward``). Returns ``LossOutput``."""

    @abstractmethod
    def backward(self, *, loss: Any = None, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (default: the last ``calculate_loss``) and count its tokens."""

    @abstractmethod
    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                         **kwargs: Any) -> dict[str, Any]:
        """``forward`` + ``calculate_loss`` + ``backward``; the outputs carry ``loss`` (mean) and ``num_tokens``."""

    # ------------------------------------------------------------------ optimisation
    @abstractmethod
    def clip_grad_norm(self, max_grad_norm: float = 1.0, norm_type: float = 2.0, *,
                       adapter_name: str | None = None) -> float:
        """Normalise accumulated gradients, clip them to ``max_grad_norm``; return the norm *before* clipping."""

    @abstractmethod
    def step(self, *, adapter_name: str | None = None) -> None:
        """Apply the optimizer."""

    @abstractmethod
    def zero_grad(self, *, adapter_name: str | None = None) -> None: ...

    @abstractmethod
    def lr_step(self, *, adapter_name: str | None = None) -> None:
        """Advance the learning-rate scheduler."""

    @abstractmethod
    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, norm_type: float = 2.0, *,
                           adapter_name: str | None = None) -> float | None:
        """``clip_grad_norm`` + ``step`` + ``zero_grad`` + ``lr_step`` once every
        ``gradient_accumulation_steps`` calls (see ``set_optimizer``); returns the norm or ``None``."""

    # ------------------------------------------------------------------ configuration
    @abstractmethod
    def set_loss(self, loss: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        """A registered name, a ``Loss`` class, an instance, or a callable ``fn(outputs, inputs)``."""

    @abstractmethod
    def set_optimizer(self, optimizer: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        """A registered name (``"AdamW"``), an optimizer class, or an instance.

        ``gradient_accumulation_steps=N`` in ``kwargs`` sets how many ``clip_grad_and_step`` calls make one step.
        """

    @abstractmethod
    def set_lr_scheduler(self, scheduler: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        """A registered name (``"cosine"``), a scheduler class, or an instance."""

    @abstractmethod
    def trainable_parameters(self, *, adapter_name: str | None = None) -> list[Any]:
        """The parameters an optimizer for ``adapter_name`` (or the full model) updates."""

    @abstractmethod
    def add_adapter_to_model(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        """Add a trainable adapter (LoRA ...) named ``adapter_name``."""

    # ------------------------------------------------------------------ state
    @abstractmethod
    def save(self, name: str, *, output_dir: str, adapter_name: str | None = None,
             save_optimizer: bool = True, extra_state: dict[str, Any] | None = None) -> str:
        """Write ``output_dir/name`` atomically; return its path."""

    def save_base(self, output_dir: str) -> str | None:
        """Save the base model for the adapters that will be trained on it, when it can be loaded from nowhere
        else (e.g. randomly initialised from a config): the trainer calls it on every process, once the model is
        built and before the recipe's adapter is added; the adapters then record the saved directory as their
        base. Returns that directory, or None when nothing needed saving. Default: nothing."""
        return None

    @abstractmethod
    def load(self, path: str, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Load weights (full model or adapter) written by ``save``."""

    @abstractmethod
    def resume_from_checkpoint(self, path: str, *, adapter_name: str | None = None) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler, RNG and counters; return the saved ``extra_state``."""

    def frozen_copy(self) -> TwinkleModel:
        """A new model of this class, built from the same source with the same strategy (options, mesh) and
        precision, holding this model's current weights, placed and sharded like it; it only evaluates.

        The copy has no optimizer and no parameter that requires a gradient; its training methods raise
        ``ConfigError("a frozen copy does not train ...")``. A model with adapters refuses: its base model is
        ``forward_only(disable_adapters=True)``.
        """
        raise ConfigError(f"{type(self).__name__} cannot make a frozen copy of itself")

    def sibling(self, *, task: Any, **overrides: Any) -> TwinkleModel:
        """A new, trainable model of this class built from the same source, with the same strategy (options,
        mesh) and precision mode, for another task: a PPO critic is a sibling of the policy whose task asks
        for a per-token value head (``model_kind = "token_value"``). It has its own weights (from the source,
        not this model's trained ones), optimizer and loss. ``overrides`` replace constructor arguments."""
        raise ConfigError(f"{type(self).__name__} cannot build a sibling model")

    def export_config(self) -> Any:
        """The Hugging Face (``transformers``) config of the network whose weights ``get_state_dict()`` returns and
        ``save`` exports, or ``None`` when the model has no Hugging Face form. A sampler that keeps its own copy of
        the policy builds it from this config."""
        return None

    def lora_target_modules(self) -> dict[str, list[str]]:
        """The PEFT ``target_modules`` names of the layers this model's LoRA adapters can adapt, by kind (the keys
        are :data:`twinkle_core.lora.TARGET_KINDS`): ``"attn"`` the attention projections, ``"mlp"`` the
        feed-forward projections, ``"unembed"`` the LM head; ``[]`` for a kind this model cannot adapt. The kinds'
        names select disjoint layers, so an adapter whose ``target_modules`` joins some kinds' lists adapts exactly
        those kinds (what a service's ``train_attn`` / ``train_mlp`` / ``train_unembed`` switches choose). A model
        that cannot tell raises ``ConfigError`` (the default): give ``target_modules`` yourself."""
        raise ConfigError(f"{type(self).__name__} does not say which layers its LoRA adapters can target "
                          f"(TwinkleModel.lora_target_modules); give the adapter's target_modules yourself")

    @abstractmethod
    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        """The full (unsharded) weights of the model or of one adapter."""

    @abstractmethod
    def add_metric(self, metric: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None: ...

    @abstractmethod
    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        """Aggregate the metrics of the micro-batches since the last call (over all data-parallel ranks)."""

    @abstractmethod
    def get_train_configs(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        """A plain-dict description of the model, strategy, precision, optimizer, scheduler, loss and step.

        It follows the schema :data:`twinkle_core.model.train_configs.TrainConfigs` (the keys every
        model returns and their types, e.g. ``lr``: the optimizer's current learning rate or ``None``);
        :func:`twinkle_core.model.train_configs.check_train_configs` lists a result's deviations.
        """
