"""What a base-model entry of the server config builds besides its section's checks (``host.build_model``): the
multi-tenant model class that hosts it, and the model that samples for it.

* ``class_name`` names a registered model class (default ``TransformersModel``): a multi-tenant one
  (``MultiTenantMixin``: ``MultiLoraTransformersModel``, ``MultiLoraMegatronModel``) hosts the base as is; any other
  is hosted by its multi-tenant variant, registered as ``MultiLora<class_name>``.
* Sampling runs on a model that lends its network to an in-process sampler (``TwinkleModel.generation_module``).
  A model that cannot (megatron-core's network takes no KV cache and is cut over ranks) samples on a Hugging Face
  twin: a ``MultiLoraTransformersModel`` (one process) holding the same base weights, into which the exported
  PEFT adapters are loaded. The base is frozen, so the twin never needs refreshing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twinkle_core.errors import ConfigError

__all__ = ["MODEL_KEYS", "TWIN_KEYS", "build_from_section", "hosting_class", "lends_network", "sampling_model"]

#: the keys of a model section the Hugging Face twin is built from: the weights' source and how they are read
#: (a backend's own ``options``, its strategy and training switches are not the twin's)
TWIN_KEYS = frozenset({"path", "model_id", "revision", "config", "tokenizer", "trust_remote_code", "precision", "seed"})
_DEFAULT_CLASS = "TransformersModel"
#: the keys of a base model's ``model`` section (a recipe's model section, plus ``strategy`` for a worker group)
MODEL_KEYS = frozenset({"class_name", "path", "model_id", "revision", "config", "tokenizer", "trust_remote_code",
                        "attn_implementation", "gradient_checkpointing", "options", "precision", "seed", "strategy"})


def build_from_section(section: dict[str, Any], model_class: type, *, options: dict[str, Any] | None = None) -> Any:
    """``model_class`` built in this process from a base model's ``model`` section (checked: unknown keys, the
    weights' source), with ``options`` added to the section's own. The strategy is the section's, else the class's
    default for one process."""
    from twinkle_core.model.spec import ModelSpec
    from twinkle_core.sources.resolve import resolve_model, trust_remote_code

    unknown = sorted(set(section) - MODEL_KEYS)
    if unknown:
        raise ConfigError(f"model section: unknown key(s) {unknown}; known: {sorted(MODEL_KEYS)}")
    if section.get("path") and section.get("model_id") and section["path"] != section["model_id"]:
        raise ConfigError("model section: give path or model_id, not both")
    model_id = section.get("path") or section.get("model_id")
    if model_id is None and section.get("config") is None:
        raise ConfigError("model section needs path (a model directory), model_id or config (a transformers config)")
    trust = trust_remote_code(section.get("trust_remote_code"))
    tokenizer_uri = section.get("tokenizer") or model_id
    tokenizer = (model_class.load_tokenizer(resolve_model(tokenizer_uri), trust_remote_code=trust)
                 if tokenizer_uri else None)
    merged = {**dict(section.get("options") or {}), **(options or {})}
    if section.get("revision"):
        merged["revision"] = section["revision"]
    spec = ModelSpec(model_id=model_id, config=section.get("config"), strategy=section.get("strategy"),
                     precision=section.get("precision", "no"), tokenizer=tokenizer, trust_remote_code=trust,
                     attn_implementation=section.get("attn_implementation"),
                     gradient_checkpointing=bool(section.get("gradient_checkpointing", False)),
                     seed=int(section.get("seed", 0)), options=merged)
    return spec.build(model_class)


def hosting_class(class_name: str | None) -> type:
    """The multi-tenant model class that hosts a base model named ``class_name`` in a server config."""
    from twinkle_core.model.multi_tenant import MultiTenantMixin
    from twinkle_core.plugins import get_plugins

    name = class_name or _DEFAULT_CLASS
    plugins = get_plugins()
    plugins.get("model", name)  # PluginNotFoundError naming the installed classes and the package to install
    registered = plugins.names("model")
    for candidate in (name, f"MultiLora{name}"):
        if candidate in registered:
            cls = plugins.load("model", candidate)
            if isinstance(cls, type) and issubclass(cls, MultiTenantMixin):
                return cls
    hosts = sorted(n for n in registered if n.startswith("MultiLora"))
    raise ConfigError(f"model.class_name {name!r}: the server hosts many tenants' LoRA adapters on one base, which "
                      f"needs a multi-tenant model class (MultiTenantMixin), and none is registered as "
                      f"MultiLora{name}; use one of {hosts}")


def lends_network(model: Any) -> bool:
    """Whether ``model`` lends its network to an in-process sampler (``generation_module`` refuses with
    ``ConfigError`` where it cannot)."""
    try:
        with model.generation_module():
            return True
    except ConfigError:
        return False


def sampling_model(model: Any, section: dict[str, Any], build: Callable[[dict[str, Any]], Any]) -> Any:
    """The model that samples for the base ``model`` hosts: ``model`` itself when it lends its network, else its
    Hugging Face twin, built by ``build`` (``host.build_model``) from the section's :data:`TWIN_KEYS`: from the same
    checkpoint (``path`` / ``model_id``: the same tensors ``model`` loaded) or, for a ``config`` (random init), with
    ``model.get_state_dict()`` (full Hugging Face tensors) copied in."""
    if lends_network(model):
        return model
    if model.export_config() is None:
        raise ConfigError(f"{type(model).__name__} neither lends its network to a sampler nor has a Hugging Face "
                          f"form (export_config() is None): the server cannot sample from it")
    twin = build({**{k: v for k, v in section.items() if k in TWIN_KEYS}, "class_name": "MultiLoraTransformersModel"})
    if not (section.get("path") or section.get("model_id")):
        twin.network.load_state_dict(model.get_state_dict(), strict=True)
    return twin
