"""``ModelHost``: one base model (a multi-tenant model: ``MultiLoraTransformersModel``, ``MultiLoraMegatronModel``)
and every model operation the service runs on it.

Each training adapter (one per Tinker run) is a LoRA adapter of the shared, frozen base with its own AdamW
optimizer; each sampler is an exported adapter loaded as an extra, never trained adapter of the model that samples
(:mod:`twinkle_server.sampler_pool`: the host's model, or the Hugging Face twin of a base that cannot lend its
network, see :mod:`twinkle_server.base_model`). Adapter and sampler ids are the caller's; inside the models they get
names of the host's own (``tenant3``, ``sampler7``), so any id works.

Tinker's semantics, as built here:

* losses are sums (:mod:`twinkle_server.tinker_losses`): the core is told ``num_tokens=0``, so the gradients of
  every ``forward_backward`` up to ``optim_step`` are summed without any normalisation;
* target tokens are aligned with the input positions (no shift): ``target_logprobs[b, t] = log p(target[b, t] |
  tokens[b, :t+1])``;
* ``optim_step`` applies every field of Adam's parameters (decoupled weight decay, ``grad_clip_norm=0``: no
  clipping), then clears the gradients;
* LoRA: rank ``r``, ``lora_alpha`` = :data:`LORA_ALPHA`, on the attention / MLP linear layers and the LM head as
  ``train_attn`` / ``train_mlp`` / ``train_unembed`` say (the layers the model names by kind:
  ``lora_target_modules()``); ``B = 0`` at creation, so a new adapter is the base model.

Every request is validated completely before the model is touched: a refused request (:class:`BadRequest`) leaves
the adapter as it was. All methods are called from one worker thread, never concurrently.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import secrets
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from twinkle_core import checkpoint, distributed
from twinkle_core.loss.base import Loss, LossOutput
from twinkle_server import sampling
from twinkle_server.base_model import build_from_section, hosting_class, sampling_model
from twinkle_server.errors import BadRequest, NotFound, TooManyRequests
from twinkle_server.sampler_pool import SamplerPool, remove_adapter
from twinkle_server.sampling import SampledSequence, SampleParams

__all__ = ["AdamStep", "Datum", "ForwardResult", "ModelHost", "SampleParams", "SampledSequence"]

#: LoRA's alpha for every adapter (scale ``alpha / r``), as Tinker's LoRA learning-rate guidance assumes
LORA_ALPHA = 32
#: loss_fn_inputs holding token ids (int64); every other input is float32
INT_INPUTS = frozenset({"target_tokens"})
#: the marker of a saved training state (its metadata: the adapter's settings; its file list: integrity)
STATE_MARKER = "twinkle_server_state.json"
_WEIGHTS = "adapter"  # the model's own checkpoint inside a state directory
_PREFIX = "loss_fn_inputs:"  # batch keys of the loss inputs (the network reads only its own keys)


@dataclass
class Datum:
    tokens: list[int]
    loss_fn_inputs: dict[str, list[float] | list[int]]


@dataclass
class ForwardResult:
    per_datum: list[dict[str, list[float]]]
    metrics: dict[str, float]


@dataclass
class AdamStep:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass
class _Adapter:
    name: str  # inside the model
    settings: dict[str, Any]  # rank, seed, train_mlp, train_attn, train_unembed
    loss: TinkerCoreLoss = field(default_factory=lambda: TinkerCoreLoss())


class TinkerCoreLoss(Loss):
    """The core ``Loss`` around a Tinker loss: target log-probs (float32, no shift) from ``outputs["logits"]``, the
    Tinker loss's sum back-propagated as is (``num_tokens=0``: never normalised). ``result`` keeps the last
    :class:`~twinkle_server.tinker_losses.LossResult` for the host to return."""

    name = "tinker"

    def __init__(self) -> None:
        self.tinker_loss: Any = None
        self.result: Any = None

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any], context: Any = None) -> LossOutput:
        targets = inputs[_PREFIX + "target_tokens"]
        logprobs = torch.log_softmax(outputs["logits"].float(), dim=-1)
        target_logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        loss_inputs = {k[len(_PREFIX):]: v for k, v in inputs.items() if k.startswith(_PREFIX)}
        self.result = self.tinker_loss(target_logprobs, loss_inputs, inputs["attention_mask"].bool())
        return LossOutput(loss=self.result.loss, num_tokens=0)


def build_model(section: dict[str, Any], *, max_lora_rank: int) -> Any:
    """The multi-tenant model (:func:`~twinkle_server.base_model.hosting_class`) of a recipe-style model section, in
    this process (the class's default strategy for one process: ``single``, Megatron's ``megatron``, unless the
    section names one: a worker group's ranks run a data-parallel one, see ray_host.py)."""
    return build_from_section(section, hosting_class(section.get("class_name")),
                              options={"max_lora_rank": max_lora_rank, "max_tenants": None})


class ModelHost:
    """One hosted base model. Besides the service's interface: :attr:`model` (the multi-tenant model that trains),
    :attr:`samplers` (the :class:`~twinkle_server.sampler_pool.SamplerPool` on the model that samples),
    ``max_positions`` (the context length), ``eos_ids``, ``adapter_ids()``, ``adapter_settings(id)``,
    ``add_lora_adapter`` / ``remove_lora_adapter`` (adapters configured by the caller, for the native API),
    ``model_adapter_name(id)``, ``state_info(directory)`` (what a saved state holds, verified) and
    ``unload_sampler(id)``. ``max_loaded_samplers`` bounds the sampler adapters kept in memory."""

    def __init__(self, name: str, model: dict, *, state_dir: Path, max_lora_rank: int = 64,
                 max_adapters: int | None = None, max_loaded_samplers: int = 8) -> None:
        self.name, self.state_dir, self.max_lora_rank = name, Path(state_dir), max_lora_rank
        self.max_adapters, self.max_loaded_samplers = max_adapters, max(1, max_loaded_samplers)
        build = functools.partial(build_model, max_lora_rank=max_lora_rank)
        self.model = build(dict(model))
        self.tokenizer = self.model.tokenizer
        self.samplers = SamplerPool(sampling_model(self.model, dict(model), build), name=name,
                                    max_lora_rank=max_lora_rank, max_loaded=self.max_loaded_samplers)
        config = self.model.export_config().get_text_config()
        self.vocab_size: int = config.vocab_size
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.eos_ids = _eos_ids(self.tokenizer, config, getattr(self.samplers.model.network, "generation_config", None))
        self._targets = self.model.lora_target_modules()
        self._adapters: dict[str, _Adapter] = {}
        self._lora_adapters: set[str] = set()  # add_lora_adapter's, by their names inside the model
        self._count = 0

    # ------------------------------------------------------------------ adapters
    def create_adapter(self, adapter_id: str, *, rank: int, seed: int | None = None, train_mlp: bool = True,
                       train_attn: bool = True, train_unembed: bool = True) -> None:
        if adapter_id in self._adapters:
            raise BadRequest(f"adapter {adapter_id!r} already exists on {self.name}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.max_lora_rank:
            raise BadRequest(f"LoRA rank {rank!r} is not supported by {self.name}: use an integer from 1 to "
                             f"max_lora_rank={self.max_lora_rank}")
        self._check_room("delete a training run or try again later")
        wanted = [kind for kind, on in (("attn", train_attn), ("mlp", train_mlp), ("unembed", train_unembed)) if on]
        targets = sorted({t for kind in wanted for t in self._targets[kind]})
        if not targets:
            raise BadRequest(f"nothing to train: {self.name} has no LoRA-able layers for {wanted or 'none'}; enable "
                             f"train_attn, train_mlp or train_unembed")
        settings = {"rank": rank, "seed": seed, "train_mlp": bool(train_mlp), "train_attn": bool(train_attn),
                    "train_unembed": bool(train_unembed)}
        entry = _Adapter(name=self._new_name("tenant"), settings=settings)
        with torch.random.fork_rng():  # the adapter's initialisation, seeded; the global stream is left alone
            torch.manual_seed(seed if seed is not None else secrets.randbits(62))
            self.model.add_adapter_to_model(entry.name, {"r": rank, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0,
                                                         "target_modules": targets})
        try:
            self.model.set_optimizer("AdamW", adapter_name=entry.name, lr=0.0)
            self.model.set_loss(entry.loss, adapter_name=entry.name)
        except BaseException:
            self._remove(entry.name)
            raise
        self._adapters[adapter_id] = entry

    def remove_adapter(self, adapter_id: str) -> None:
        self._remove(self._adapter(adapter_id).name)
        del self._adapters[adapter_id]

    def add_lora_adapter(self, adapter_id: str, config: dict[str, Any], *, seed: int) -> None:
        """A LoRA adapter with the caller's own PEFT ``config`` (the native API), named ``adapter_id`` inside
        :attr:`model`, its initial weights drawn right after ``torch.manual_seed(seed)``; its loss and optimizer are
        the caller's to set on :attr:`model`. It counts against ``max_adapters`` with the training adapters: both
        live in the one model. ``adapter_id`` must differ from the host's own names (``tenant<n>``, ``sampler<n>``,
        ``hostbase``); the native API's start with ``native_``."""
        if adapter_id in self.model.tenants():  # the host's own names share the model's namespace
            raise BadRequest(f"adapter {adapter_id!r} already exists on {self.name}")
        self._check_room("remove one of your adapters or try again later")
        with torch.random.fork_rng(devices=[]):  # the initial weights depend on the seed only
            torch.manual_seed(seed)
            self.model.add_adapter_to_model(adapter_id, config)
        self._lora_adapters.add(adapter_id)

    def remove_lora_adapter(self, adapter_id: str) -> None:
        if adapter_id not in self._lora_adapters:
            raise NotFound(f"no adapter {adapter_id!r} on {self.name}")
        self._remove(adapter_id)
        self._lora_adapters.discard(adapter_id)

    def adapter_ids(self) -> list[str]:
        return sorted(self._adapters)

    def adapter_settings(self, adapter_id: str) -> dict[str, Any]:
        """``rank``, ``seed``, ``train_mlp``, ``train_attn``, ``train_unembed`` and the optimizer ``step``."""
        entry = self._adapter(adapter_id)
        return {**entry.settings, "step": self.model.train_state(entry.name).step}

    def model_adapter_name(self, adapter_id: str) -> str:
        """The adapter's name inside :attr:`model` (for tests and diagnostics)."""
        return self._adapter(adapter_id).name

    # ------------------------------------------------------------------ training
    def forward_backward(self, adapter_id: str, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None,
                         *, backward: bool = True) -> ForwardResult:
        from twinkle_server.tinker_losses import tinker_loss

        entry = self._adapter(adapter_id)
        loss = tinker_loss(loss_fn, loss_fn_config)
        batch, lengths = self._batch(data, loss)
        entry.loss.tinker_loss, entry.loss.result = loss, None
        try:
            if backward:
                self.model.forward_backward(inputs=batch, adapter_name=entry.name)
            else:
                outputs = self.model.forward_only(inputs=batch, adapter_name=entry.name)
                with torch.no_grad():
                    entry.loss(outputs, batch)
            result = entry.loss.result
        finally:
            entry.loss.tinker_loss = entry.loss.result = None
        per_token = {k: v.detach().float().cpu() for k, v in result.per_token.items()}
        per_datum = [{k: v[i, :n].tolist() for k, v in per_token.items()} for i, n in enumerate(lengths)]
        return ForwardResult(per_datum=per_datum, metrics={k: float(v) for k, v in result.metrics.items()})

    def check_data(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None) -> None:
        """Refuse (BadRequest) what ``forward_backward`` would refuse, without touching the model: a worker group's
        ranks each check the whole request before any of them runs its share."""
        from twinkle_server.tinker_losses import tinker_loss

        self._batch(data, tinker_loss(loss_fn, loss_fn_config))

    def _batch(self, data: list[Datum], loss: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The padded batch (on the model's device) and each datum's length; BadRequest for anything wrong."""
        if not data:
            raise BadRequest("no data: send at least one datum")
        if "target_tokens" not in loss.required_inputs:
            raise BadRequest(f"loss {loss.name!r} does not read target_tokens; the host computes target log-probs")
        columns: dict[str, list[torch.Tensor]] = {"input_ids": []}
        for i, datum in enumerate(data):
            n = len(datum.tokens)
            if n == 0:
                raise BadRequest(f"datum {i} has no tokens")
            if self.max_positions is not None and n > self.max_positions:
                raise BadRequest(f"datum {i} has {n} tokens, more than the model's context of {self.max_positions}")
            columns["input_ids"].append(_ids(datum.tokens, self.vocab_size, f"datum {i} model_input"))
            try:  # exactly the inputs the loss reads: a missing one, or one it would silently ignore, is refused
                loss.check_inputs(datum.loss_fn_inputs)
            except BadRequest as exc:
                raise BadRequest(f"datum {i}: {exc.message}") from exc
            for key, values in datum.loss_fn_inputs.items():
                if len(values) != n:
                    raise BadRequest(f"datum {i}: loss_fn_inputs[{key!r}] has {len(values)} values but the datum has "
                                     f"{n} tokens; every loss_fn_input needs one value per token")
                where = f"datum {i} loss_fn_inputs[{key!r}]"
                columns.setdefault(_PREFIX + key, []).append(
                    _ids(values, self.vocab_size, where) if key in INT_INPUTS else _floats(values, where))
        lengths = [len(d.tokens) for d in data]
        width, device = max(lengths), self.model.device
        batch = {key: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)
                 for key, rows in columns.items()}
        batch["attention_mask"] = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
        return batch, lengths

    def optim_step(self, adapter_id: str, params: AdamStep) -> dict[str, float]:
        entry = self._adapter(adapter_id)
        _check_adam(params)
        state = self.model.train_state(entry.name)
        for group in state.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        limit = params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf
        norm = self.model.clip_grad_norm(limit, adapter_name=entry.name)
        skipped = state.skipped_steps
        self.model.step(adapter_name=entry.name)
        self.model.zero_grad(adapter_name=entry.name)
        return {"grad_norm": float(norm), "learning_rate": float(params.learning_rate), "step": float(state.step),
                "skipped": float(state.skipped_steps - skipped)}

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, adapter_id: str, directory: Path, *, optimizer: bool = True) -> None:
        """Weights (and with ``optimizer`` the AdamW state and step counter) under ``directory``, atomically.
        Gradients accumulated since the last ``optim_step`` are not part of the state."""
        entry = self._adapter(adapter_id)
        meta = {"base_model": self.name, "adapter": entry.settings, "optimizer": bool(optimizer)}
        # every rank of a data-parallel model takes part (the model's save is collective); the main one writes
        with checkpoint.atomic_directory(str(directory), is_main=distributed.is_main_process(), metadata=meta,
                                         marker=STATE_MARKER) as tmp:
            self.model.save(_WEIGHTS, output_dir=tmp, adapter_name=entry.name, save_optimizer=optimizer)

    def state_info(self, directory: Path) -> dict[str, Any]:
        """What ``save_state`` recorded: ``base_model``, ``adapter`` (create_adapter's settings), ``optimizer``;
        the directory's files are verified first (BadRequest naming a missing or damaged one)."""
        try:
            checkpoint.verify_files(directory, marker=STATE_MARKER)
            with open(os.path.join(directory, STATE_MARKER)) as fh:
                return {k: v for k, v in json.load(fh).items() if k != "files"}
        except (checkpoint.CheckpointError, OSError, ValueError) as exc:
            raise BadRequest(f"{directory} is not a usable saved state: {exc}") from exc

    def load_state(self, adapter_id: str, directory: Path, *, optimizer: bool = True) -> None:
        """Restore weights (and with ``optimizer`` the AdamW state and step) saved by ``save_state``; the adapter is
        created from the saved settings when it does not exist. Pending gradients are dropped."""
        info = self.state_info(directory)
        saved = info["adapter"]
        if optimizer and not info.get("optimizer"):
            raise BadRequest(f"{directory} was saved without optimizer state; load its weights only (optimizer=False)")
        if adapter_id not in self._adapters:
            self.create_adapter(adapter_id, **saved)
        mine = self._adapters[adapter_id]
        layout = ("rank", "train_mlp", "train_attn", "train_unembed")
        if any(mine.settings[k] != saved[k] for k in layout):
            raise BadRequest(f"{directory} holds an adapter of {({k: saved[k] for k in layout})}, but adapter "
                             f"{adapter_id!r} is {({k: mine.settings[k] for k in layout})}; create the run with "
                             f"the same LoRA settings")
        self.model.zero_grad(adapter_name=mine.name)
        weights = os.path.join(directory, _WEIGHTS)
        if optimizer:
            with _global_rng_kept():  # resuming restores the RNG streams of the run that saved: not the server's
                self.model.resume_from_checkpoint(weights, adapter_name=mine.name)
        else:
            self.model.load(weights, adapter_name=mine.name)
            self.model.set_optimizer("AdamW", adapter_name=mine.name, lr=0.0)  # a fresh optimizer

    def export_adapter(self, adapter_id: str, directory: Path) -> None:
        """A plain PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), atomically."""
        directory = Path(directory)
        self.model.save(directory.name, output_dir=str(directory.parent),
                        adapter_name=self._adapter(adapter_id).name, save_optimizer=False)

    # ------------------------------------------------------------------ sampling
    def load_sampler(self, sampler_id: str, directory: Path | None) -> None:
        """Make ``sampler_id`` sample from the PEFT adapter exported at ``directory`` (``None``: the base model).
        Loaded now, so a bad directory fails here; at most ``max_loaded_samplers`` stay in memory (the least
        recently used is reloaded from its directory when it is next used)."""
        self.samplers.load(sampler_id, directory)

    def unload_sampler(self, sampler_id: str) -> None:
        self.samplers.unload(sampler_id)

    def sample(self, sampler_id: str | None, prompt: list[int], num_samples: int,
               params: SampleParams) -> list[SampledSequence]:
        sampling.check_tokens(prompt, self.vocab_size, "prompt")
        if not prompt:
            raise BadRequest("the prompt is empty: sampling needs at least one prompt token")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise BadRequest(f"num_samples must be a positive integer, got {num_samples!r}")
        how = sampling.plan(params, len(prompt), max_positions=self.max_positions, eos_ids=self.eos_ids,
                            tokenizer=self.tokenizer)
        with self.samplers.generation(sampler_id) as gen:
            return sampling.generate(gen.module, gen.device, prompt, num_samples, params, how, self.tokenizer)

    def native_sample(self, adapter_name: str, prompts: list[list[int]], n: int, params: Any,
                      seeds: list[list[int]]) -> list[list[dict[str, Any]]]:
        """The native API's ``sample`` with the current weights of ``adapter_name`` (its name inside :attr:`model`).
        A model that cannot lend its network samples on its twin: the adapter is exported and loaded there for the
        call, as ``save_weights_for_sampler`` does."""
        from twinkle_server.native_generate import generate

        if self.samplers.model is self.model:
            return generate(self.model, self.tokenizer, adapter_name, prompts, n, params, seeds)
        with tempfile.TemporaryDirectory(prefix="native-sample-", dir=self.state_dir) as tmp:
            exported, sampler_id = Path(tmp) / "adapter", f"native-sample:{adapter_name}"
            self.model.save(exported.name, output_dir=tmp, adapter_name=adapter_name, save_optimizer=False)
            self.samplers.load(sampler_id, exported)
            try:
                return generate(self.samplers.model, self.tokenizer, self.samplers.adapter(sampler_id), prompts, n,
                                params, seeds)
            finally:
                self.samplers.unload(sampler_id)

    def compute_logprobs(self, sampler_id: str | None, tokens: list[int]) -> list[float | None]:
        sampling.check_tokens(tokens, self.vocab_size, "prompt")
        if not tokens:
            raise BadRequest("the prompt is empty: compute_logprobs needs at least one token")
        if self.max_positions is not None and len(tokens) > self.max_positions:
            raise BadRequest(f"the prompt has {len(tokens)} tokens, more than the model's context of "
                             f"{self.max_positions}")
        with self.samplers.generation(sampler_id) as gen:
            return sampling.score(gen.module, gen.device, tokens)

    # ------------------------------------------------------------------ helpers
    def _adapter(self, adapter_id: str) -> _Adapter:
        entry = self._adapters.get(adapter_id)
        if entry is None:
            raise NotFound(f"no adapter {adapter_id!r} on {self.name}")
        return entry

    def _remove(self, name: str) -> None:
        remove_adapter(self.model, name)

    def _check_room(self, hint: str) -> None:
        held = len(self._adapters) + len(self._lora_adapters)
        if self.max_adapters is not None and held >= self.max_adapters:
            raise TooManyRequests(f"{self.name} already holds {held} adapters (max_adapters={self.max_adapters}); "
                                  f"{hint}")

    def _new_name(self, kind: str) -> str:
        self._count += 1
        return f"{kind}{self._count}"


def _ids(values: list[Any], vocab_size: int, where: str) -> torch.Tensor:
    """Token ids as int64; BadRequest for non-integers or ids outside the vocabulary."""
    try:
        raw = torch.as_tensor(values, dtype=torch.float64)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{where}: token ids must be integers ({exc})") from exc
    bad = ~torch.isfinite(raw) | (raw != raw.round()) | (raw < 0) | (raw >= vocab_size)
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        raise BadRequest(f"{where}: {values[k]!r} at position {k} is not a token id of this model (integers 0 to "
                         f"{vocab_size - 1}); tokenize with the base model's tokenizer")
    return raw.long()


def _floats(values: list[Any], where: str) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{where}: values must be numbers ({exc})") from exc
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        raise BadRequest(f"{where}: {values[k]!r} at position {k} is not a finite number; NaN and infinity are "
                         f"refused (they would poison the adapter)")
    return tensor


def _check_adam(p: AdamStep) -> None:
    ranges = {"learning_rate": lambda v: v >= 0, "beta1": lambda v: 0 <= v < 1, "beta2": lambda v: 0 <= v < 1,
              "eps": lambda v: v > 0, "weight_decay": lambda v: v >= 0, "grad_clip_norm": lambda v: v >= 0}
    for name, ok in ranges.items():
        value = getattr(p, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise BadRequest(f"adam_params.{name}={value!r} is out of range (learning_rate, weight_decay, "
                             f"grad_clip_norm >= 0; 0 <= beta < 1; eps > 0; all finite)")


def _eos_ids(tokenizer: Any, config: Any, generation_config: Any) -> set[int]:
    """The tokens that end a sample: the tokenizer's, the model config's and the generation config's EOS ids."""
    ids: set[int] = set()
    for source in (tokenizer, config, generation_config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    state = checkpoint.capture_rng_state()
    try:
        yield
    finally:
        checkpoint.restore_rng_state(state)
