"""The native client: a hosted base model under the ``TwinkleModel`` API, so a training script runs remotely by
changing one import::

    from twinkle_server.client import TransformersModel     # was: from twinkle_backend_hf import TransformersModel

    model = TransformersModel(model_id="Qwen/Qwen2.5-0.5B-Instruct",          # a base model the server hosts
                              base_url="http://127.0.0.1:8000", api_key="tml-...")  # or TWINKLE_SERVER_URL / _API_KEY
    model.add_adapter_to_model("default", {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})
    model.set_loss("cross_entropy")
    model.set_optimizer("AdamW", lr=1e-4, gradient_accumulation_steps=4)
    model.set_lr_scheduler("cosine", num_training_steps=1000, num_warmup_steps=50)
    for batch in loader:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
    model.save("final", output_dir="outputs")      # outputs/final: a plain PEFT adapter directory

What differs from a local model, and why:

* the server trains LoRA adapters on a shared, frozen base, and refuses LoRA options that would change the base
  (``bias`` other than ``none``, PiSSA-style initialisations, ``modules_to_save``) and ranks above the base model's
  ``max_lora_rank``; a base model the server hosts for your full-parameter training (``full_parameter: {owner:
  you}`` in its config) has no adapters instead: every call trains the model itself, as on a local
  ``TransformersModel`` without adapters, and ``save`` downloads a Hugging Face model directory;
* losses, optimizers, schedulers and metrics are chosen by their registered *name* plus options (no code crosses
  the wire); ``forward`` / ``calculate_loss`` / ``backward`` do not exist separately (the graph stays on the
  server): use ``forward_backward``;
* an adapter's initial weights are drawn with ``torch.manual_seed(seed)`` right before it is added
  (``add_adapter_to_model(..., seed=)``, default: the model's ``seed``), so they do not depend on what else the
  server did;
* ``forward_backward`` returns the loss, token count and metrics (not the logits, unless
  ``return_outputs=["logits"]``); ``forward_only`` returns the logits;
* ``save`` writes the checkpoint on the server (weights and training state) and downloads the adapter's weights,
  config and tokenizer into ``output_dir/name``; ``load`` / ``resume_from_checkpoint`` take the name of a
  checkpoint saved on the server (a path's last component);
* ``sample`` draws completions with the adapter's current weights (the core's ``hf_generate`` sampler on the
  server); :class:`RemoteSampler` offers it as a core :class:`~twinkle_core.sampling.Sampler`.

Preference training runs as in process: ``PreferenceTask.prepare_batch(model, batch)`` adds ``ref_logps`` through
``model.forward_only(disable_adapters=True)``; GRPO batches (``old_logps``, ``advantages``) train through
``forward_backward`` with ``set_loss("grpo", ...)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import httpx

from twinkle_core.errors import ConfigError
from twinkle_core.model.base import TwinkleModel
from twinkle_core.sampling import Completion, Sampler, SamplingParams
from twinkle_server import errors, tensor_wire
from twinkle_server.full_host import adapter_refusal

log = logging.getLogger("twinkle.client")

API = "/twinkle/v1"
#: constructor arguments of a local TransformersModel that the server decides for the hosted model
SERVER_DECIDES = frozenset({"config", "revision", "trust_remote_code", "attn_implementation", "gradient_checkpointing",
                            "auto_class", "model_kwargs", "strategy", "strategy_options", "mesh", "precision",
                            "kernels", "max_lora_rank", "max_tenants"})
_ERRORS = {400: errors.BadRequest, 401: errors.Unauthorized, 404: errors.NotFound, 413: errors.PayloadTooLarge,
           429: errors.TooManyRequests, 503: errors.Unavailable}
#: the LoRA options of a peft config object that are sent (a dict is sent as it is)
_LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora", "rank_pattern",
                "alpha_pattern", "layers_to_transform", "init_lora_weights", "bias")


class ServerError(errors.ServiceError):
    """The server failed (HTTP 5xx); its message says what failed."""

    status = 500
    category = "server"


def _error(response: httpx.Response) -> errors.ServiceError:
    try:
        body = response.json()
        message = body.get("error") or body.get("detail") or response.text
    except ValueError:
        message = response.text or response.reason_phrase
    if not isinstance(message, str):
        message = str(message)
    cls = _ERRORS.get(response.status_code, ServerError if response.status_code >= 500 else errors.BadRequest)
    exc = cls(f"{message} (HTTP {response.status_code})")
    exc.status = response.status_code
    return exc


class RemoteModel(TwinkleModel):
    """A base model hosted by ``twinkle serve`` at ``base_url``, trained through the native API.

    ``base_model`` (or ``model_id``, its name in a local script) names the hosted base model; with neither, the
    server's only one. ``api_key`` / ``base_url`` default to the environment's ``TWINKLE_API_KEY`` /
    ``TWINKLE_SERVER_URL``. ``seed`` seeds the adapters' initial weights. ``wait_s``: how long one HTTP request
    waits for its call before polling the call's future; ``timeout_s``: how long a call may take in all.
    """

    supported_model_kinds = ("causal_lm",)

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, base_model: str | None = None,
                 model_id: str | None = None, seed: int = 42, task: Any = None, tokenizer: Any = None,
                 wait_s: float = 30.0, timeout_s: float = 3600.0, **local_options: Any) -> None:
        unknown = sorted(set(local_options) - SERVER_DECIDES)
        if unknown:
            raise TypeError(f"RemoteModel got unknown argument(s) {unknown}")
        if local_options:
            log.warning("the server decides %s for the hosted model; ignored here", ", ".join(sorted(local_options)))
        base_url = base_url or os.environ.get("TWINKLE_SERVER_URL")
        api_key = api_key or os.environ.get("TWINKLE_API_KEY") or os.environ.get("TINKER_API_KEY")
        if not base_url:
            raise ConfigError("RemoteModel needs base_url= (the server, e.g. http://127.0.0.1:8000) or "
                              "TWINKLE_SERVER_URL in the environment")
        if not api_key:
            raise ConfigError("RemoteModel needs api_key= or TWINKLE_API_KEY in the environment")
        if base_model and model_id and base_model != model_id:
            raise ConfigError(f"base_model={base_model!r} and model_id={model_id!r} differ; give one")
        self.base_url = base_url.rstrip("/")
        self.seed, self.task, self.tokenizer = seed, task, tokenizer
        self.wait_s, self.timeout_s = float(wait_s), float(timeout_s)
        self._http = httpx.Client(base_url=self.base_url, headers={"X-API-Key": api_key},
                                  timeout=httpx.Timeout(self.wait_s + 60.0, connect=30.0))
        served = self._get(f"{API}/models")
        hosted = {m["name"]: m for m in served["models"]}
        name = base_model or model_id
        if name is None:
            if len(hosted) != 1:
                raise ConfigError(f"the server hosts {sorted(hosted)}; name one with base_model=")
            name = next(iter(hosted))
        if name not in hosted:
            raise errors.NotFound(f"base model {name!r} is not hosted by {self.base_url}; hosted: {sorted(hosted)}")
        self.base_model = name
        self.model_id = name
        self.info = hosted[name]
        #: the base model is hosted for this tenant's full-parameter training: no adapters, calls train the model
        self.full_parameter = bool(self.info.get("full_parameter"))
        self.methods = tuple(served["methods"])
        self.registered = {kind: tuple(served[kind]) for kind in ("losses", "optimizers", "schedulers", "metrics")}
        #: the tenant's adapters on this base model (also those of an earlier client: the server keeps them)
        self._adapters: list[str] = [] if self.full_parameter else [
            a["name"] for a in self._get(f"{API}/adapters", params={"base_model": name})["adapters"]]

    # ------------------------------------------------------------------ HTTP
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RemoteModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check(self, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise _error(response)
        return response.json()

    def _get(self, path: str, **kwargs: Any) -> Any:
        return self._check(self._http.get(path, **kwargs))

    def _finish(self, response: httpx.Response) -> Any:
        """The result of a call answered 200, or (202) of its future, polled until it ends."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            body = self._check(response)
            if response.status_code != 202:
                return body["result"]
            if time.monotonic() > deadline:
                raise errors.Unavailable(f"call {body['future']} did not finish within timeout_s={self.timeout_s}")
            response = self._http.get(f"{API}/futures/{body['future']}", params={"wait_s": self.wait_s})

    def _call(self, method: str, adapter_name: str | None, **args: Any) -> Any:
        name = self._resolve(adapter_name)
        payload = {"method": method, "args": tensor_wire.encode(args), "wait_s": self.wait_s}
        if self.full_parameter:  # the model itself, named by its base model
            response = self._http.post(f"{API}/full/call", json={**payload, "base_model": self.base_model})
        else:
            response = self._http.post(f"{API}/adapters/{name}/call", json=payload)
        return tensor_wire.decode(self._finish(response), where=f"{method} result")

    def _checkpoints(self, adapter: str | None) -> tuple[str, dict[str, str]]:
        """The URL of the checkpoints of ``adapter`` (of the model, on a full-parameter base) and its query."""
        if self.full_parameter:
            return f"{API}/full/checkpoints", {"base_model": self.base_model}
        return f"{API}/adapters/{adapter}/checkpoints", {}

    def _resolve(self, adapter_name: str | None) -> str | None:
        """``adapter_name``, or the only adapter (as a local model resolves ``None``); ``None`` on a full-parameter
        base (the model itself)."""
        if self.full_parameter:
            if adapter_name is not None:
                raise ConfigError(adapter_refusal(self.base_model))
            return None
        if adapter_name is not None:
            return adapter_name
        if len(self._adapters) == 1:
            return self._adapters[0]
        if not self._adapters:
            raise ConfigError("the server trains LoRA adapters on its shared base model (no full fine-tuning): "
                              "add one with add_adapter_to_model(name, config) first")
        raise ConfigError(f"several adapters {self._adapters}; pass adapter_name=")

    # ------------------------------------------------------------------ adapters
    def add_adapter_to_model(self, adapter_name: str, config: Any, *, seed: int | None = None,
                             replace: bool = False, **kwargs: Any) -> None:
        """Add a LoRA adapter named ``adapter_name`` (``config``: a dict, or a ``peft.LoraConfig``), its weights
        drawn with ``torch.manual_seed(seed)`` (default: this model's ``seed``). ``replace``: remove an adapter of
        that name first (its weights, optimizer and counters are lost; its checkpoints stay)."""
        if kwargs:
            raise TypeError(f"add_adapter_to_model got unknown argument(s) {sorted(kwargs)}")
        if self.full_parameter:
            raise ConfigError(adapter_refusal(self.base_model))
        if not isinstance(config, dict):
            config = {k: getattr(config, k) for k in _LORA_FIELDS if getattr(config, k, None) is not None}
            if isinstance(config.get("target_modules"), (set, frozenset)):
                config["target_modules"] = sorted(config["target_modules"])
        if replace and adapter_name in self._adapters:
            self.remove_adapter(adapter_name)
        body = {"name": adapter_name, "base_model": self.base_model, "config": config,
                "seed": self.seed if seed is None else int(seed), "wait_s": self.wait_s}
        self._finish(self._http.post(f"{API}/adapters", json=body))
        if adapter_name not in self._adapters:
            self._adapters.append(adapter_name)

    def remove_adapter(self, adapter_name: str) -> None:
        self._finish(self._http.delete(f"{API}/adapters/{adapter_name}", params={"wait_s": self.wait_s}))
        if adapter_name in self._adapters:
            self._adapters.remove(adapter_name)

    def adapters(self) -> list[str]:
        """The tenant's adapters on this base model, as the server has them now."""
        found = self._get(f"{API}/adapters", params={"base_model": self.base_model})["adapters"]
        self._adapters = [a["name"] for a in found]
        return list(self._adapters)

    # ------------------------------------------------------------------ configuration
    def set_loss(self, loss: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        if not isinstance(loss, str):
            raise ConfigError(f"a remote model takes a registered loss name (one of {', '.join(self.registered['losses'])}) "
                              f"and its options; no code crosses the wire, so {type(loss).__name__} cannot be sent")
        self._call("set_loss", adapter_name, loss=loss, options=kwargs)

    def set_optimizer(self, optimizer: Any, *, adapter_name: str | None = None, gradient_accumulation_steps: int = 1,
                      **kwargs: Any) -> None:
        if not isinstance(optimizer, str):
            raise ConfigError(f"a remote model takes a registered optimizer name (one of "
                              f"{', '.join(self.registered['optimizers'])}); {type(optimizer).__name__} cannot be sent")
        self._call("set_optimizer", adapter_name, optimizer=optimizer,
                   gradient_accumulation_steps=gradient_accumulation_steps, options=kwargs)

    def set_lr_scheduler(self, scheduler: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        if not isinstance(scheduler, str):
            raise ConfigError(f"a remote model takes a registered scheduler name (one of "
                              f"{', '.join(self.registered['schedulers'])}); {type(scheduler).__name__} cannot be sent")
        self._call("set_lr_scheduler", adapter_name, scheduler=scheduler, options=kwargs)

    def add_metric(self, metric: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        if not isinstance(metric, str):
            raise ConfigError(f"a remote model takes a registered metric name (one of "
                              f"{', '.join(self.registered['metrics'])}); {type(metric).__name__} cannot be sent")
        self._call("add_metric", adapter_name, metric=metric, options=kwargs)

    # ------------------------------------------------------------------ compute
    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                         return_outputs: Sequence[str] = (), temperature: float = 1.0, **kwargs: Any) -> dict[str, Any]:
        """``forward`` + loss + ``backward`` on the server; returns ``loss`` (mean), ``num_tokens`` and the loss's
        metrics, plus the per-token outputs named in ``return_outputs`` that the forward produced (``logits``;
        ``label_logprobs`` / ``label_mask``: see :meth:`forward_only`)."""
        self.check_inputs(inputs, call="forward_backward")
        return self._call("forward_backward", adapter_name, inputs=_plain_batch(inputs),
                          return_outputs=list(return_outputs), temperature=temperature)

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None, disable_adapters: bool = False,
                     return_outputs: Sequence[str] = ("logits",), temperature: float = 1.0,
                     **kwargs: Any) -> dict[str, Any]:
        """An evaluation forward on the server (``disable_adapters``: the base model, e.g. a LoRA policy's
        reference). Returns ``logits`` by default; ``return_outputs=["label_logprobs", "label_mask"]`` returns instead
        the shifted log-probabilities ``[B, T - 1]`` of the batch's ``labels`` under ``softmax(logits /
        temperature)`` (0 where masked) and their mask, computed on the server: what a reference model is asked for,
        at a fraction of the logits' size (the server refuses logits over its response limit)."""
        self.check_inputs(inputs, call="forward_only")
        return self._call("forward_only", adapter_name, inputs=_plain_batch(inputs),
                          disable_adapters=disable_adapters, return_outputs=list(return_outputs),
                          temperature=temperature)

    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        raise ConfigError("a remote model keeps the autograd graph on the server: call forward_backward(inputs=...) "
                          "(forward + loss + backward in one call), or forward_only for evaluation")

    def calculate_loss(self, *, inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None,
                       adapter_name: str | None = None, **kwargs: Any) -> Any:
        raise ConfigError("a remote model computes its loss inside forward_backward (set it with set_loss)")

    def backward(self, *, loss: Any = None, adapter_name: str | None = None, **kwargs: Any) -> None:
        raise ConfigError("a remote model back-propagates inside forward_backward")

    # ------------------------------------------------------------------ optimisation
    def clip_grad_norm(self, max_grad_norm: float = 1.0, norm_type: float = 2.0, *,
                       adapter_name: str | None = None) -> float:
        return float(self._call("clip_grad_norm", adapter_name, max_grad_norm=max_grad_norm, norm_type=norm_type))

    def step(self, *, adapter_name: str | None = None) -> None:
        self._call("step", adapter_name)

    def zero_grad(self, *, adapter_name: str | None = None) -> None:
        self._call("zero_grad", adapter_name)

    def lr_step(self, *, adapter_name: str | None = None) -> None:
        self._call("lr_step", adapter_name)

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, norm_type: float = 2.0, *,
                           adapter_name: str | None = None) -> float | None:
        norm = self._call("clip_grad_and_step", adapter_name, max_grad_norm=max_grad_norm, norm_type=norm_type)
        return None if norm is None else float(norm)

    def trainable_parameters(self, *, adapter_name: str | None = None) -> list[Any]:
        raise ConfigError("a remote model's parameters live on the server; get_state_dict() returns copies of an "
                          "adapter's weights")

    # ------------------------------------------------------------------ state
    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        return self._call("calculate_metric", adapter_name, reset=reset)

    def get_train_configs(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        if adapter_name is None and len(self._adapters) != 1 and not self.full_parameter:
            return self._without_adapter()
        return self._call("get_train_configs", adapter_name)

    def _without_adapter(self) -> dict[str, Any]:
        """What a local model reports with no adapter (or several and none named): the model, no training state."""
        return {"class": type(self).__name__, "base_model": self.base_model, "adapter_name": None,
                "adapters": list(self._adapters), "strategy": {"name": "remote"}, "precision": "server",
                "optimizer": None, "lr_scheduler": None, "loss": None, "lr": None, "gradient_accumulation_steps": 1,
                "dp_rank": 0, "dp_size": 1, "trainable_parameters": 0, "step": 0,
                "max_lora_rank": self.info.get("max_lora_rank")}

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        """The adapter's weights (PEFT names with the adapter's name, as a local multi-adapter model has them)."""
        return self._call("get_state_dict", adapter_name)

    def save(self, name: str, *, output_dir: str, adapter_name: str | None = None, save_optimizer: bool = True,
             extra_state: dict[str, Any] | None = None) -> str:
        """Save the adapter on the server (weights, and with ``save_optimizer`` its training state, as checkpoint
        ``name``), then download its weights, adapter config and tokenizer into ``output_dir/name``: a plain PEFT
        adapter directory (on a full-parameter base: the model's config, safetensors and tokenizer, a Hugging Face
        model directory). Returns that local path."""
        adapter = self._resolve(adapter_name)
        saved = self._call("save", adapter, name=name, save_optimizer=save_optimizer, extra_state=extra_state)
        return self._download(adapter, saved["name"], [f for f in saved["files"] if f["weights"]], output_dir)

    def download(self, name: str, *, output_dir: str, adapter_name: str | None = None) -> str:
        """Download the weights of checkpoint ``name`` saved on the server into ``output_dir/name``."""
        adapter = self._resolve(adapter_name)
        url, query = self._checkpoints(adapter)
        files = self._get(f"{url}/{name}", params=query)["files"]
        return self._download(adapter, name, [f for f in files if f["weights"]], output_dir)

    def checkpoints(self, *, adapter_name: str | None = None) -> list[str]:
        """The names of the adapter's checkpoints saved on the server."""
        url, query = self._checkpoints(self._resolve(adapter_name))
        return self._get(url, params=query)["checkpoints"]

    def _download(self, adapter: str | None, name: str, files: list[dict[str, Any]], output_dir: str) -> str:
        url, query = self._checkpoints(adapter)
        final = os.path.join(output_dir, name)
        staging = os.path.join(output_dir, f".{name}.incomplete")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            for entry in files:
                rel = entry["path"]
                target = os.path.realpath(os.path.join(staging, rel))
                if not target.startswith(os.path.realpath(staging) + os.sep):
                    raise errors.BadRequest(f"the server listed a file outside the checkpoint: {rel!r}")
                os.makedirs(os.path.dirname(target), exist_ok=True)
                digest = hashlib.sha256()
                with self._http.stream("GET", f"{url}/{name}/files/{rel}", params=query) as response:
                    if response.status_code >= 400:
                        response.read()
                        raise _error(response)
                    with open(target, "wb") as handle:
                        for block in response.iter_bytes():
                            digest.update(block)
                            handle.write(block)
                if digest.hexdigest() != entry["sha256"]:
                    raise errors.Unavailable(f"{rel} of checkpoint {name!r} arrived damaged (sha256 mismatch); "
                                             f"download it again")
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final

    def load(self, path: str, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        """Load the weights of the adapter's checkpoint named ``path`` (or a path's last component) on the server."""
        self._call("load", adapter_name, name=os.path.basename(os.path.normpath(path)))

    def resume_from_checkpoint(self, path: str, *, adapter_name: str | None = None) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler and counters from the adapter's checkpoint named ``path`` (or a
        path's last component) on the server; returns its ``extra_state``."""
        return self._call("resume_from_checkpoint", adapter_name, name=os.path.basename(os.path.normpath(path)))

    # ------------------------------------------------------------------ sampling
    def sample(self, prompts: Sequence[Sequence[int]], *, n: int = 1, max_new_tokens: int = 64,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (),
               stop_token_ids: Sequence[int] = (), seed: int | None = None,
               seeds: Sequence[Sequence[int]] | None = None, adapter_name: str | None = None) -> list[list[Completion]]:
        """``n`` completions of each prompt (token ids) with the adapter's current weights: token ids and the
        log-probabilities of the distribution they were drawn from. ``seeds[i][j]`` seeds completion ``j`` of prompt
        ``i`` (as the RL task seeds its rollouts); else ``seed`` derives them (random when ``None``)."""
        groups = self._call("sample", adapter_name, prompts=[[int(t) for t in p] for p in prompts], n=n,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop=list(stop), stop_token_ids=[int(t) for t in stop_token_ids], seed=seed,
                            seeds=None if seeds is None else [[int(s) for s in row] for row in seeds])
        return [[Completion(token_ids=c["token_ids"], logprobs=c["logprobs"], finish_reason=c["finish_reason"],
                            text=c["text"]) for c in group] for group in groups]


def _plain_batch(inputs: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors (on the CPU) and plain values; ``None`` entries are left out."""
    return {k: v for k, v in inputs.items() if v is not None}


class RemoteSampler(Sampler):
    """The core sampler contract over :meth:`RemoteModel.sample`: completions from the adapter's current weights
    on the server (``weight_sync`` ``in_process``: there is nothing to push). Bind it to a :class:`RemoteModel`."""

    name = "twinkle_remote"
    weight_sync = "in_process"

    def sample(self, prompts: list[list[int]], *, n: int, params: SamplingParams,
               seeds: list[list[int]]) -> list[list[Completion]]:
        if not isinstance(self.model, RemoteModel):
            raise ConfigError("RemoteSampler samples through a RemoteModel: bind(model) one first")
        groups = self.model.sample(prompts, n=n, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                                   top_p=params.top_p, top_k=params.top_k, stop=params.stop,
                                   stop_token_ids=params.stop_token_ids, seeds=seeds, adapter_name=self.adapter_name)
        for group in groups:
            for completion in group:
                completion.policy_step = self.policy_step
        return groups


#: the one-import change: ``from twinkle_server.client import TransformersModel``
TransformersModel = RemoteModel

__all__ = ["RemoteModel", "RemoteSampler", "ServerError", "TransformersModel"]
