"""``FullParameterHost``: a base model hosted for one tenant's full-parameter training.

A ``base_models`` entry with ``full_parameter: {owner: alice}`` is built as a plain ``TransformersModel`` (strategy
``single``, every parameter trainable) instead of the shared ``MultiLoraTransformersModel`` of a
:class:`~twinkle_server.host.ModelHost`. Only its owner sees it: for any other tenant :func:`visible_to` is false,
so the service answers the 404 of a model that is not hosted and leaves it out of every listing. The owner trains
the model itself (no adapters) through the native API (:mod:`twinkle_server.native_full`) with the calls of a local
``TransformersModel``; the Tinker API, which trains LoRA adapters only, refuses it by name (:func:`tinker_refusal`).

This module imports no torch at import time: the service asks :func:`visible_to` of every host.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.errors import ConfigError


def build_full_model(section: dict[str, Any]) -> Any:
    """A ``TransformersModel`` (one process, strategy ``single``, every parameter trainable) from a recipe-style
    model section, its initial weights drawn from the section's ``seed`` (default 0)."""
    from twinkle_backend_hf.model import TransformersModel

    from twinkle_server.base_model import build_from_section

    if section.get("class_name", "TransformersModel") != "TransformersModel":
        raise ConfigError(f"model.class_name {section['class_name']!r}: a full-parameter base model is a "
                          f"TransformersModel")
    if section.get("strategy", "single") != "single":
        raise ConfigError(f"model.strategy {section['strategy']!r}: a full-parameter base model runs in the server's "
                          f"process (strategy single)")
    return build_from_section(section, TransformersModel)


class FullParameterHost:
    """One base model trained in full by ``owner``: :attr:`model` (the ``TransformersModel``), ``tokenizer``,
    ``vocab_size`` and ``max_positions`` (the context length), as the native API reads them of any host. It has
    no adapters: its calls run with ``adapter_name=None`` (the model itself)."""

    def __init__(self, name: str, model: dict[str, Any], *, owner: str) -> None:
        self.name, self.owner = name, owner
        self.model = build_full_model(dict(model))
        self.tokenizer = self.model.tokenizer
        config = self.model.export_config().get_text_config()
        self.vocab_size: int = config.vocab_size
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)

    def native_sample(self, adapter_name: None, prompts: list[list[int]], n: int, params: Any,
                      seeds: list[list[int]]) -> list[list[dict[str, Any]]]:
        """The native API's ``sample`` with the model's current weights."""
        from twinkle_server.native_generate import generate

        return generate(self.model, self.tokenizer, None, prompts, n, params, seeds)


def is_full_parameter(host: Any) -> bool:
    return isinstance(host, FullParameterHost)


def visible_to(host: Any, tenant: str | None) -> bool:
    """Whether ``tenant`` may know that ``host`` exists: every shared host, and a full-parameter host for its
    owner only (``None``, no tenant: shared hosts only)."""
    return not isinstance(host, FullParameterHost) or (tenant is not None and host.owner == tenant)


def tinker_refusal(base_model: str) -> tuple[str, str]:
    """What the Tinker API refuses on a full-parameter base (its owner's request), and what to use instead."""
    return (f"LoRA training and sampling of {base_model!r}, which this server hosts for full-parameter training",
            f"train and sample it with Twinkle's native client, twinkle_server.client.TransformersModel("
            f"model_id={base_model!r}, base_url=..., api_key=...), which trains all its parameters")


def adapter_refusal(base_model: str) -> str:
    """Why the native API adds no adapter to a full-parameter base."""
    return (f"{base_model!r} is hosted for full-parameter training: it has no adapters; train the model itself "
            f"(call set_loss, set_optimizer, forward_backward ... without add_adapter_to_model and without "
            f"adapter_name)")


__all__ = ["FullParameterHost", "adapter_refusal", "build_full_model", "is_full_parameter", "tinker_refusal",
           "visible_to"]
