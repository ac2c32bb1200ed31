"""``TransformersModel``: any Hugging Face causal LM (or encoder) under the ``TwinkleModel`` API.

``attn_implementation``: ``None`` lets transformers choose (``sdpa`` wherever the architecture supports
it, else ``eager``); ``"flash_attention_2"`` where flash-attn is installed and the GPU supports it.

Built from ``model_id`` (any source the core resolves: ``ms://``, ``hf://``, a local path) or from a
``transformers`` config (random init). Full fine-tuning, or PEFT adapters via
``add_adapter_to_model``; QLoRA with ``quantization={"bits": 4}`` (aliases ``load_in_4bit`` / ``load_in_8bit`` /
``quantization_bit``; see :mod:`twinkle_backend_hf.quantization`). ``tokenizer``: a tokenizer object, or a local
directory / ``hf://`` / ``ms://`` id to load one from; without it, ``model.tokenizer`` is the model directory's own tokenizer where it has one (``None``
for a model built from a config alone). ``save()`` writes what ``AutoModelForCausalLM.from_pretrained`` (full
weights, safetensors) or ``peft.PeftModel.from_pretrained`` (adapters) loads directly.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from twinkle_backend_hf import adapters, compat, lora_targets, model_dir
from twinkle_backend_hf import quantization as qlora
from twinkle_backend_hf.generation_config import write_end_of_turn_generation_config
from twinkle_core.errors import ConfigError
from twinkle_core.model.adapter_states import FULL_MODEL
from twinkle_core.model.torch_model import TorchTwinkleModel
from twinkle_core.sources import resolve

#: the transformers auto class behind each ``Task.model_kind``
_AUTO_CLASSES = {"causal_lm": "AutoModelForCausalLM", "encoder": "AutoModel",
                 "token_value": "AutoModelForTokenClassification",
                 "sequence_score": "AutoModelForSequenceClassification",
                 "image_text_to_text": "AutoModelForImageTextToText"}
#: kinds whose network has one label: a value per token, or a score per sequence (read at its last non-pad token)
_SCALAR_HEAD_KINDS = frozenset({"token_value", "sequence_score"})


def disable_head_dropout(module: torch.nn.Module) -> None:
    """transformers' token-classification heads apply a dropout (default 0.1) before the score layer: a PPO critic
    trained through it has other values than the eval-mode ones its rollout recorded, and they depend on the random
    state, so on the data-parallel layout. A scalar head trains without it (the saved config says so too)."""
    module.config.classifier_dropout = 0.0
    if isinstance(getattr(module, "dropout", None), torch.nn.Dropout):
        module.dropout.p = 0.0


#: model kinds whose forward takes ``use_cache`` (training never wants a KV cache)
_GENERATIVE_KINDS = frozenset({"causal_lm", "image_text_to_text"})

#: causal LMs whose logits are exactly ``lm_head(final normed hidden states)`` (no soft-capping or scaling after
#: the head), so a loss may apply the head itself; each is checked against its unfused logits in
#: tests/test_fused_lm_head.py
_PLAIN_HEAD_MODEL_TYPES = frozenset({
    "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text", "llama", "mistral", "glm4",
    "deepseek_v3", "deepseek_v4", "internlm3",
})


class TransformersModel(TorchTwinkleModel):
    model_input_keys = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds")
    #: one transformers auto class per kind (``_AUTO_CLASSES``)
    supported_model_kinds = tuple(_AUTO_CLASSES)

    def __init__(self, *, model_id: str | None = None, config: Any = None, revision: str | None = None,
                 trust_remote_code: bool | None = None, attn_implementation: str | None = None,
                 gradient_checkpointing: bool = False, auto_class: str | None = None,
                 model_kwargs: dict[str, Any] | None = None, quantization: Any = None, load_in_4bit: bool = False,
                 load_in_8bit: bool = False, quantization_bit: int | None = None, **kwargs: Any) -> None:
        if model_id is None and config is None:
            raise ConfigError("TransformersModel needs model_id= (a path, hf:// or ms:// id) or config= "
                              "(a transformers config or a dict with model_type)")
        #: QLoRA: the base is loaded quantised by bitsandbytes (None: full precision)
        self.quantization = qlora.settings_from_options(
            quantization, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit, quantization_bit=quantization_bit)
        if self.quantization is not None:
            qlora.check_source(model_id)
            qlora.check_model_kwargs(model_kwargs or {})
        self.model_id, self.config_spec, self.revision = model_id, config, revision
        self.trust_remote_code = resolve.trust_remote_code(trust_remote_code)
        self.attn_implementation = attn_implementation
        self.gradient_checkpointing = gradient_checkpointing
        self.auto_class = auto_class
        self.model_kwargs = model_kwargs or {}
        self.model_path: str | None = None
        self.saved_base: str | None = None  # where save_base wrote a config-built base
        tokenizer = kwargs.get("tokenizer")
        if isinstance(tokenizer, (str, os.PathLike)):  # a directory or hub id: loaded like the trainer loads it
            kwargs["tokenizer"] = self.load_tokenizer(resolve.resolve_model(os.fspath(tokenizer)),
                                                      trust_remote_code=self.trust_remote_code)
        super().__init__(**kwargs)
        if self.tokenizer is None and self.model_path is not None and model_dir.holds_tokenizer_file(self.model_path):
            # the model's own tokenizer: what save() writes next to the weights, and what data is tokenised with
            self.tokenizer = self.load_tokenizer(self.model_path, trust_remote_code=self.trust_remote_code)

    @classmethod
    def check_adapter_config(cls, config: Any) -> None:
        adapters.to_peft_config(config)  # builds a peft.LoraConfig only: no network

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        super().check_options(options)
        qlora.check_model_options(options)

    def set_optimizer(self, optimizer: Any, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        if qlora.is_quantized(self.hf_model) and self.adapter_states.resolve(adapter_name) == FULL_MODEL:
            raise ConfigError(qlora.FULL_FINE_TUNING_REFUSAL)
        super().set_optimizer(optimizer, adapter_name=adapter_name, **kwargs)

    @classmethod
    def load_tokenizer(cls, path: str, *, trust_remote_code: bool = False) -> Any:
        from transformers import AutoTokenizer

        # outermost, so that the refusal to run a repository's code keeps its own message
        with model_dir.explain_unloadable_tokenizer(path), \
                resolve.explain_remote_code_refusal(f"the tokenizer at {path}"):
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

    @classmethod
    def check_model_directory(cls, path: str, *, model_kwargs: dict[str, Any] | None = None, **options: Any) -> None:
        """Refuse, naming the directory or its ``config.json`` and the fix, a local model directory transformers
        cannot load a model from (empty, only weights, a damaged config.json, an unknown ``model_type``): the
        recipe checker calls it before anything is built (with the recipe's ``model.options``), ``build_network``
        before loading. Reads JSON only; a model read from a GGUF file or a subfolder is left to transformers."""
        if not (isinstance(model_kwargs, dict) and {"gguf_file", "subfolder"} & set(model_kwargs)):
            model_dir.check_model_directory(path)

    # ------------------------------------------------------------------ building
    def _auto_class(self) -> Any:
        import transformers

        name = self.auto_class or _AUTO_CLASSES.get(getattr(self.task, "model_kind", "causal_lm"))
        if name is None:
            raise ConfigError(f"TransformersModel cannot build a network of model_kind "
                              f"{getattr(self.task, 'model_kind', None)!r}; it builds {', '.join(_AUTO_CLASSES)}")
        return getattr(transformers, name)

    def _hf_config(self) -> Any:
        import transformers

        spec = self.config_spec
        if isinstance(spec, transformers.PretrainedConfig):
            return spec
        spec = dict(spec)
        model_type = spec.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.config must name its model_type (e.g. qwen2, llama, qwen3_moe)")
        return transformers.AutoConfig.for_model(model_type, **spec)

    @contextlib.contextmanager
    def _explain_attention(self) -> Iterator[None]:
        """transformers raises a bare ImportError for an attention kernel that is not installed: say what to do."""
        try:
            yield
        except ImportError as exc:
            if not self.attn_implementation:
                raise
            raise ConfigError(f"model.attn_implementation={self.attn_implementation!r} needs a package that is not "
                              f"installed ({exc}); install it (flash_attention_2: pip install flash-attn, on a CUDA "
                              f"machine) or use attn_implementation: sdpa") from exc

    def build_network(self) -> torch.nn.Module:
        auto = self._auto_class()
        common: dict[str, Any] = {"trust_remote_code": self.trust_remote_code, **self.model_kwargs}
        if self.attn_implementation:
            common["attn_implementation"] = self.attn_implementation
        kind = getattr(self.task, "model_kind", None)
        value_head = kind in _SCALAR_HEAD_KINDS
        if self.model_id is not None:
            from twinkle_core.sources.resolve import resolve_model

            self.model_path = resolve_model(self.model_id, revision=self.revision)
            if self.config_spec is None:  # the directory's own config.json says what to build
                self.check_model_directory(self.model_path, model_kwargs=self.model_kwargs)
            extra = {"config": self._hf_config()} if self.config_spec is not None else {}
            if value_head and not extra:
                extra = {"num_labels": 1}
            elif value_head:
                extra["config"] = copy.deepcopy(extra["config"])  # never the caller's config object
                extra["config"].num_labels = 1
            if self.quantization is not None:  # QLoRA: the base's linear layers load as bitsandbytes layers
                qlora.check_strategy(self.strategy, self.precision)
                qlora.check_device(self.device, self.quantization.bits, self.quantization.quant_type)
                extra.update(qlora.load_kwargs(self.quantization, self.device))
            with resolve.explain_remote_code_refusal(f"the model {self.model_id!r}"), self._explain_attention():
                module = auto.from_pretrained(self.model_path, dtype=torch.float32, **extra, **common)
            if self.quantization is not None:
                module = qlora.prepare_for_training(module)
        else:
            config = self._hf_config()
            if value_head:
                config = copy.deepcopy(config)
                config.num_labels = 1
            with self._explain_attention():
                module = auto.from_config(config, dtype=torch.float32, **common)
        if value_head:
            disable_head_dropout(module)
        if self.gradient_checkpointing:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(module, "enable_input_require_grads"):
                module.enable_input_require_grads()
        if getattr(module.config, "use_cache", None):
            module.config.use_cache = False
        if kind == "sequence_score":
            self._name_score_padding(module.config)
        return module

    def _name_score_padding(self, config: Any) -> None:
        """A sequence score is read at each row's last token that is not padding, so the network must know the
        pad token: the config's, else the tokenizer's pad (or EOS) token. Set on the built network's config, as
        TRL's reward trainer does, so the embedding's trained rows stay as the checkpoint has them. Without one,
        a batch of more than one row is refused at its forward (:meth:`run_network`)."""
        if getattr(config, "pad_token_id", None) is not None:
            return
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None and self.model_path is not None and model_dir.holds_tokenizer_file(self.model_path):
            tokenizer = self.load_tokenizer(self.model_path, trust_remote_code=self.trust_remote_code)
        pad = getattr(tokenizer, "pad_token_id", None)
        config.pad_token_id = pad if pad is not None else getattr(tokenizer, "eos_token_id", None)

    def export_config(self) -> Any:
        return self.hf_model.config

    def lora_target_modules(self) -> dict[str, list[str]]:
        return lora_targets.by_kind(self.hf_model)

    @property
    def network(self) -> Any:
        """The underlying ``transformers`` model (inside PEFT's wrapper when adapters exist)."""
        module = self.module
        return module.get_base_model() if hasattr(module, "get_base_model") else module

    hf_model = network  # the name Hugging Face users look for

    def output_layer(self) -> torch.nn.Linear | None:
        if getattr(self.task, "model_kind", "causal_lm") != "causal_lm":
            return None
        if self.hf_model.config.model_type not in _PLAIN_HEAD_MODEL_TYPES:
            return None
        head = self.hf_model.get_output_embeddings()
        return head if type(head) is torch.nn.Linear else None  # a LoRA- or fp8-wrapped head computes more

    def run_network(self, module: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(inputs)  # the core hands over network_input_keys only (the task's model_inputs included)
        if getattr(self.task, "model_kind", "causal_lm") in _GENERATIVE_KINDS:
            kwargs["use_cache"] = False
        if (getattr(self.task, "model_kind", None) == "sequence_score" and self.hf_model.config.pad_token_id is None
                and kwargs["input_ids"].shape[0] > 1):
            raise ConfigError("a sequence-score network (e.g. the reward_model task) reads each row's score at its "
                              "last non-padding token, but neither the model config nor the tokenizer names a pad "
                              "token; set model.config.pad_token_id or give a tokenizer with a pad or EOS token")
        out = module(**kwargs)
        return {k: v for k, v in out.items() if v is not None}

    # ------------------------------------------------------------------ adapters
    def adapter_config_for(self, config: Any) -> Any:
        return adapters.to_peft_config(config)

    def attach_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        self.module = adapters.add_adapter(self.module, adapter_name, config)
        self.module.to(self.device)

    def detach_adapter(self, adapter_name: str) -> None:
        self.module.delete_adapter(adapter_name)

    @contextlib.contextmanager
    def activate_adapter(self, adapter_name: str | None) -> Iterator[None]:
        if adapter_name is None:
            yield
            return
        adapters.activate(self.module, adapter_name)
        yield

    def deactivate_adapters(self) -> contextlib.AbstractContextManager[None]:
        # PEFT switches every LoRA layer off and, in a finally, back on with the same active adapter (whose
        # weights it makes trainable again); self.module is the PeftModel under every strategy
        return self.module.disable_adapter()

    def adapter_parameter_names(self, adapter_name: str) -> list[str]:
        return adapters.parameter_names(self.module, adapter_name)

    # ------------------------------------------------------------------ disk
    def write_weights(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str | None) -> None:
        if adapter_name is not None:
            causal = getattr(self.task, "model_kind", "causal_lm") == "causal_lm"
            adapters.save_adapter(self.module, adapter_name, state_dict, directory,
                                  task_type="CAUSAL_LM" if causal else None, base=self.adapter_base())
        else:
            compat.unwrap_without_importing_deepspeed()  # no DeepSpeed import (4.5 s, a warning) without DeepSpeed
            self.hf_model.save_pretrained(directory, state_dict={k: v.detach().cpu() for k, v in state_dict.items()},
                                          safe_serialization=True)
            # generate() on the saved model stops at the chat template's end of turn, not only at EOS
            write_end_of_turn_generation_config(directory, self.hf_model, self.tokenizer)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
            _warn_if_tokenizer_changes_on_reload(self.tokenizer, directory, trust_remote_code=self.trust_remote_code)

    def save_base(self, output_dir: str) -> str | None:
        """A base built from ``config`` (random init) is saved as ``output_dir/base`` (a transformers directory with
        the tokenizer, and a marker), before the adapter is added. A base from ``model_id`` is left where it is."""
        if self.model_id is not None:
            return None
        from twinkle_backend_hf.adapter_base import SAVED_BASE_NAME
        from twinkle_core import checkpoint

        path = os.path.join(output_dir, SAVED_BASE_NAME)
        # written at every start (a resumed run rebuilds the same weights from config and seed; a run that changed
        # the config replaces a stale base), from the network as built: not through the strategy, whose wrapping
        # must come after the adapter
        is_main = self.strategy.is_main_process
        with checkpoint.atomic_directory(path, is_main=is_main, metadata={"saved_base": True}) as staging:
            if is_main:
                self.write_weights(staging, dict(self.hf_model.state_dict()), None)
        self.saved_base = path
        return path

    def adapter_base(self) -> str | None:
        """The base adapters record: the saved base, the ``hf://`` id it was built from, or its local directory."""
        if self.saved_base is not None:
            return self.saved_base
        if isinstance(self.model_id, str) and self.model_id.startswith("hf://"):
            return self.model_id
        return self.model_path

    def read_weights(self, directory: str, adapter_name: str | None) -> dict[str, torch.Tensor]:
        if adapter_name is not None:
            return adapters.load_adapter_state(self.module, adapter_name, directory)
        # from_pretrained applies the same key conversions that save_pretrained undid, so the result is
        # keyed like a freshly built module whatever the architecture's checkpoint layout.
        loaded = self._auto_class().from_pretrained(directory, dtype=torch.float32,
                                                    trust_remote_code=self.trust_remote_code)
        prefix = "" if self.module is self.hf_model else "base_model.model."
        return {prefix + k: v for k, v in loaded.state_dict().items()}

    def describe(self) -> dict[str, Any]:
        config = self.hf_model.config
        return {"class": type(self).__name__, "model_type": config.model_type, "model_id": self.model_id,
                "vocab_size": config.get_text_config().vocab_size,  # a VLM's sits in its text config
                "attn_implementation": self.attn_implementation,
                "gradient_checkpointing": self.gradient_checkpointing,
                "trust_remote_code": self.trust_remote_code,
                "quantization": self.quantization.describe() if self.quantization is not None else None}



_PROBE = "Twinkle probe: 12 + 30 = 42.\n  indented line\tand a tab"
logger = logging.getLogger("twinkle.hf")


def _warn_if_tokenizer_changes_on_reload(tokenizer: Any, directory: str, *, trust_remote_code: bool) -> None:
    """transformers may load a saved tokenizer as the architecture's own class (e.g. ``Qwen2Tokenizer``),
    which can re-tokenise differently from the tokenizer the model was trained with. Say so at save time."""
    import transformers

    # the switch the model was loaded with: a custom tokenizer's code runs only when it is on, and never asks on stdin
    with resolve.explain_remote_code_refusal(f"the tokenizer saved in {directory}"):
        reloaded = transformers.AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    if reloaded(_PROBE)["input_ids"] != tokenizer(_PROBE)["input_ids"]:
        logger.warning("the tokenizer saved in %s loads back as %s and tokenises differently from the "
                       "training tokenizer (%s); users of this checkpoint will get different token ids. "
                       "Use a tokenizer whose pre-tokenisation matches the architecture's tokenizer class.",
                       directory, type(reloaded).__name__, type(tokenizer).__name__)
