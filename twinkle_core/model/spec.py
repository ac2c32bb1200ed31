"""The one construction spec every model class takes: what the trainer fills in from a recipe, and the keyword
arguments every ``TwinkleModel`` constructor accepts (a backend adds its own through ``options``).

    spec = ModelSpec(model_id="Qwen/Qwen2.5-0.5B", strategy="native_fsdp", precision="bf16", task=task, seed=0)
    model = spec.build(TransformersModel)           # TransformersModel(model_id=..., strategy=..., ...)

:data:`RECIPE_KEYS` says which recipe key fills each field, so a recipe's ``model.options`` cannot set one of
them behind the recipe's back. Importing this module imports no torch (recipe checking runs without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    model_id: str | None = None
    config: Any = None
    strategy: Any = None
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    mesh: Any = None
    precision: Any = "no"
    task: Any = None
    tokenizer: Any = None
    trust_remote_code: bool | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    seed: int = 42
    #: the model class's own options (a recipe's ``model.options``), passed as keyword arguments too
    options: Mapping[str, Any] = field(default_factory=dict)

    def arguments(self) -> dict[str, Any]:
        """The constructor's keyword arguments."""
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        named["strategy_options"] = dict(self.strategy_options)
        clash = sorted(set(named) & set(self.options))
        if clash:
            raise ValueError(f"ModelSpec.options may not set {clash}: they are fields of the spec")
        return {**named, **self.options}

    def build(self, model_cls: type) -> Any:
        return model_cls(**self.arguments())


#: the recipe key each field of :class:`ModelSpec` comes from
RECIPE_KEYS: dict[str, str] = {
    "model_id": "model.model_id", "config": "model.config", "strategy": "strategy.name",
    "strategy_options": "strategy.options", "mesh": "mesh", "precision": "precision", "task": "task",
    "tokenizer": "model.tokenizer", "trust_remote_code": "model.trust_remote_code",
    "attn_implementation": "model.attn_implementation", "gradient_checkpointing": "model.gradient_checkpointing",
    "seed": "train.seed",
}

__all__ = ["RECIPE_KEYS", "ModelSpec"]
