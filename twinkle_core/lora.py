"""LoRA settings: the one data type every backend reads an adapter config into, then converts to its own layers.

An adapter config is a dict in PEFT's terms (``{"type": "lora", "r": 8, "lora_alpha": 16, "target_modules":
"all-linear"}``, the recipe's ``model.adapter``) or a ``peft.LoraConfig``. :meth:`LoraSettings.from_config` checks
it once, with the same errors on every backend: an option PEFT does not have is refused with PEFT's name for it
(``alpha`` -> ``lora_alpha``), an option the backend does not implement is refused naming the backend. Importing
this module imports nothing (``peft`` only when :meth:`LoraSettings.to_peft` builds a config)::

    settings = LoraSettings.from_config(config, backend="the Megatron backend", supported=MEGATRON_OPTIONS)
    settings.r, settings.alpha, settings.target_modules   # what a backend's own LoRA layers need
    settings.to_peft()                                     # a peft.LoraConfig (the one given, when one was)
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.errors import ConfigError

__all__ = ["ALIASES", "OPTIONS", "TARGET_KINDS", "LoraSettings"]

#: the kinds of layer ``TwinkleModel.lora_target_modules()`` names LoRA targets for: attention projections, feed-forward
#: projections, the LM head (a service's ``train_attn`` / ``train_mlp`` / ``train_unembed`` switches)
TARGET_KINDS = ("attn", "mlp", "unembed")

#: other frameworks' names for PEFT's LoRA options
ALIASES = {"alpha": "lora_alpha", "rank": "r", "dropout": "lora_dropout", "target": "target_modules"}
#: PEFT ``LoraConfig`` options a dict config may give; a backend passes the subset it implements as ``supported``
OPTIONS = frozenset({
    "r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora", "modules_to_save",
    "init_lora_weights", "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern", "exclude_modules",
    "target_parameters",
})
#: PEFT's defaults of the options every backend reads
_DEFAULTS = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": None, "bias": "none",
             "use_rslora": False, "use_dora": False, "init_lora_weights": True}


@dataclass(frozen=True)
class LoraSettings:
    """One LoRA adapter's settings (PEFT's meaning and defaults for every option)."""

    r: int
    alpha: float
    dropout: float
    #: PEFT's ``target_modules``: names, a regular expression, ``"all-linear"`` or ``None``
    target_modules: Any
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False
    init_lora_weights: Any = True
    #: every option as given (PEFT's keyword arguments), the ones above included; read only
    given: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: the ``peft.LoraConfig`` the settings were read from, if any (:meth:`to_peft` returns it as is)
    peft_config: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_config(cls, config: Any, *, backend: str, supported: Collection[str] = OPTIONS) -> LoraSettings:
        """Read a dict (``type: lora`` and PEFT's option names) or a ``peft.LoraConfig``; ``backend`` names the
        backend in errors (``"the Megatron backend"``); ``supported``: the options a dict may give on it."""
        if isinstance(config, Mapping):
            return cls._from_dict(config, backend=backend, supported=supported)
        if any(base.__name__ == "LoraConfig" for base in type(config).__mro__):  # peft.LoraConfig, without peft
            given = {name: getattr(config, name) for name in sorted(OPTIONS) if hasattr(config, name)}
            return cls._of(given, peft_config=config)
        raise ConfigError(f"adapter config must be a dict or a peft.LoraConfig, got {type(config).__name__}")

    @classmethod
    def _from_dict(cls, config: Mapping[str, Any], *, backend: str, supported: Collection[str]) -> LoraSettings:
        given = dict(config)
        kind = given.pop("type", "lora")
        if kind != "lora":
            raise ConfigError(f"adapter type {kind!r} is not supported by {backend} in a dict config (only 'lora')")
        unknown = sorted(set(given) - OPTIONS)
        if unknown:
            meant = {key: ALIASES.get(key) or next(iter(difflib.get_close_matches(key, supported, n=1)), None)
                     for key in unknown}
            hints = "; ".join(f"did you mean {m!r} for {k!r}?" for k, m in meant.items() if m)
            raise ConfigError(f"unknown LoRA option(s) {unknown}" + (f"; {hints}" if hints else "")
                              + f" Known: {sorted(supported)}")
        unsupported = sorted(set(given) - set(supported))
        if unsupported:
            raise ConfigError(f"LoRA option(s) {unsupported} are not supported by {backend}; supported: "
                              f"{sorted(supported)}")
        return cls._of(given)

    @classmethod
    def _of(cls, given: dict[str, Any], peft_config: Any = None) -> LoraSettings:
        value = {**_DEFAULTS, **{k: v for k, v in given.items() if k in _DEFAULTS}}
        return cls(r=value["r"], alpha=value["lora_alpha"], dropout=value["lora_dropout"],
                   target_modules=value["target_modules"], bias=value["bias"], use_rslora=bool(value["use_rslora"]),
                   use_dora=bool(value["use_dora"]), init_lora_weights=value["init_lora_weights"],
                   given=dict(given), peft_config=peft_config)

    def options_set(self, names: Collection[str]) -> list[str]:
        """Which of the options ``names`` are set (given and not empty / false), in ``names``' order."""
        return [name for name in names if self.given.get(name)]

    def to_peft(self) -> Any:
        """A ``peft.LoraConfig`` of these settings (no task type: the backend wraps the network itself)."""
        if self.peft_config is not None:
            return self.peft_config
        import peft

        return peft.LoraConfig(task_type=None, **self.given)
