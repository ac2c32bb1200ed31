"""What trains: each part of a VLM (vision / projector / language) is ``full``, ``lora`` or ``frozen``.

Task options ``train_vision`` / ``train_projector`` / ``train_language``; defaults ``frozen`` / ``full``
/ ``lora`` (the usual VLM SFT recipe). Two seams carry the plan to the model:

* :func:`apply_plan` -- from ``Task.prepare_model``: ``requires_grad`` of the base weights (only
  ``full`` parts train; ``lora`` parts' base weights stay frozen under their adapters);
* :func:`adapter_config` -- from ``Task.adapter_config`` when the backend adds the recipe's adapter:
  LoRA targets restricted to the ``lora`` parts, ``full`` parts trained through PEFT's
  ``modules_to_save`` (so plain ``peft.PeftModel.from_pretrained`` restores them with the adapter).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from twinkle_core.errors import ConfigError
from twinkle_vlm.families import PARTS, VLMFamily, family_for, part_of, strip_wrappers

MODES = ("full", "lora", "frozen")
DEFAULT_PLAN = {"vision": "frozen", "projector": "full", "language": "lora"}


def plan_from_options(options: Mapping[str, Any]) -> dict[str, str]:
    """``{"vision": mode, "projector": mode, "language": mode}`` from the task options."""
    plan = {}
    for part in PARTS:
        mode = options.get(f"train_{part}") or DEFAULT_PLAN[part]
        if mode not in MODES:
            raise ConfigError(f"task_options.train_{part} must be one of {', '.join(MODES)}, got {mode!r}")
        plan[part] = mode
    return plan


def apply_plan(network: torch.nn.Module, plan: Mapping[str, str]) -> None:
    """Make exactly the ``full`` parts' weights trainable (every parameter belongs to a part)."""
    family = family_for(network)
    for name, param in network.named_parameters():
        part = part_of(name, family)
        if part is None:
            raise ConfigError(f"parameter {name} of {family.model_type} belongs to no part "
                              f"(twinkle_vlm.families knows {family.vision + family.projector + family.language})")
        param.requires_grad_(plan[part] == "full")


def needs_adapter(plan: Mapping[str, str]) -> bool:
    return "lora" in plan.values()


def require_adapter(plan: Mapping[str, str], adapters: list[str]) -> None:
    """Refuse a plan with a ``lora`` part on a model without an adapter (those parts would silently stay frozen)."""
    if needs_adapter(plan) and not adapters:
        lora = [f"train_{p}: lora" for p, m in plan.items() if m == "lora"]
        raise ConfigError(f"task_options {', '.join(lora)} needs a LoRA adapter: set model.adapter (e.g. "
                          f"{{type: lora, r: 8, lora_alpha: 16}}), or train those parts full / frozen")


def adapter_config(network: torch.nn.Module, config: Any, plan: Mapping[str, str]) -> Any:
    """The recipe's LoRA config restricted to the plan's parts, in the form it came in: a dict (the backend
    converts it) or a ``peft.LoraConfig`` (what the HF backend hands ``Task.adapter_config``)."""
    import copy

    if not needs_adapter(plan):
        raise ConfigError("model.adapter is set but no part trains with LoRA: set one of task_options."
                          "train_vision / train_projector / train_language to lora, or remove model.adapter")
    if isinstance(config, Mapping):
        if config.get("type", "lora") != "lora":
            return config  # the backend refuses what it cannot place, with its own message
        lora: Any = dict(config)
        requested, saved = lora.get("target_modules"), list(lora.get("modules_to_save") or [])
    else:
        import peft

        if not isinstance(config, peft.LoraConfig):
            raise ConfigError(f"the vlm task places LoRA adapters only, got a {type(config).__name__}")
        lora = copy.deepcopy(config)
        requested, saved = lora.target_modules, list(lora.modules_to_save or [])
    family = family_for(network)
    targets = lora_target_regex(network, family, plan, requested)
    to_save = saved + [m for m in full_part_modules(network, family, plan) if m not in saved] or None
    if isinstance(lora, dict):
        return {**lora, "target_modules": targets, "modules_to_save": to_save}
    lora.target_modules, lora.modules_to_save = targets, to_save
    return lora


def _linear_leaves(network: torch.nn.Module, family: VLMFamily, parts: set[str]) -> list[str]:
    output = network.get_output_embeddings()
    leaves = set()
    for name, module in network.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output or ".lora_" in name:
            continue
        # a layer that already carries an adapter (another tenant's) keeps its Linear as ``base_layer``
        name = strip_wrappers(name.removesuffix(".base_layer"))
        if part_of(name, family) in parts and not name.endswith("lm_head"):
            leaves.add(name.rsplit(".", 1)[-1])
    return sorted(leaves)


def lora_target_regex(network: torch.nn.Module, family: VLMFamily, plan: Mapping[str, str],
                      requested: Any) -> str:
    """A PEFT ``target_modules`` regex (full match on module names) for the linear layers of the ``lora``
    parts; ``requested`` (the recipe's ``target_modules``: ``all-linear``, unset, or layer names) picks
    which of their layers."""
    lora_parts = {p for p, m in plan.items() if m == "lora"}
    available = _linear_leaves(network, family, lora_parts)
    if requested in (None, "all-linear"):
        leaves = available
    elif isinstance(requested, str):
        raise ConfigError(f"model.adapter.target_modules for a VLM is all-linear or a list of layer names "
                          f"(e.g. [q_proj, v_proj]), got the pattern {requested!r}: the vlm task places the "
                          f"adapter on the parts set to lora")
    else:
        leaves = sorted(set(requested) & set(available))
        if not leaves:
            raise ConfigError(f"model.adapter.target_modules {sorted(requested)} names no linear layer of the "
                              f"parts trained with LoRA ({', '.join(sorted(lora_parts))}); they have: "
                              f"{', '.join(available)}")
    output = network.get_output_embeddings()
    modules = dict(network.named_modules())
    # LoRA never goes on the LM head (as PEFT's all-linear): the roots are the modules holding layers
    roots = [p for part in lora_parts for p in family.prefixes(part) if modules.get(p) is not output]
    # prefixes of other parts nested inside a LoRA root (Qwen's merger inside the vision module)
    nested = [p for part in set(PARTS) - lora_parts for p in family.prefixes(part)
              if any(p.startswith(r + ".") for r in roots)]
    alt = "|".join
    exclude = f"(?!(?:{alt(map(re.escape, nested))})\\.)" if nested else ""
    return (f"^{exclude}(?:{alt(map(re.escape, roots))})\\.(?:.*\\.)?(?:{alt(map(re.escape, leaves))})$")


def full_part_modules(network: torch.nn.Module, family: VLMFamily, plan: Mapping[str, str]) -> list[str]:
    """Module names that PEFT's ``modules_to_save`` must copy to train the ``full`` parts: each part's
    roots, or, where a root holds another part that is not ``full``, its children with parameters."""
    modules = dict(network.named_modules())
    names: list[str] = []
    for part, mode in plan.items():
        if mode != "full":
            continue
        for root in family.prefixes(part):
            if root not in modules:
                continue
            if not any(p.startswith(root + ".") for q, m in plan.items() if m != "full" for p in family.prefixes(q)):
                names += _savable(root, modules[root])
                continue
            for child, module in modules[root].named_children():
                full_name = f"{root}.{child}"
                if part_of(full_name, family) == part and any(True for _ in module.parameters()):
                    names += _savable(full_name, module)
    return names


def _savable(name: str, module: torch.nn.Module) -> list[str]:
    """PEFT cannot copy a container (Qwen3-VL's ``deepstack_merger_list``): its elements instead."""
    if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        return [f"{name}.{child}" for child, _ in module.named_children()]
    return [name]


class TrainablePartsMixin:
    """What a VLM task adds to the core's ``Task`` for the model side: the vision inputs its forward takes
    (``Task.model_inputs``) and the per-part training plan (``Task.adapter_config``; its ``prepare_model``
    calls :meth:`prepare_parts`). Mix in before ``Task``."""

    #: every vision tensor the supported families' forwards take (a batch carries those of its family)
    model_inputs: tuple[str, ...] = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                     "second_per_grid_ts", "mm_token_type_ids", "token_type_ids", "image_sizes")
    options: dict[str, Any]

    @property
    def parts_plan(self) -> dict[str, str]:
        return plan_from_options(self.options)

    def prepare_parts(self, model: Any) -> None:
        apply_plan(model.network, self.parts_plan)

    def adapter_config(self, model: Any, config: Any) -> Any:
        return adapter_config(model.network, config, self.parts_plan)

    def next_training_batch(self, model: Any, draw: Any) -> Any:
        # the adapter is added after prepare_model, so a LoRA part without one shows only when training starts
        if not getattr(self, "_adapter_checked", False):
            require_adapter(self.parts_plan, model.get_train_configs()["adapters"])
            self._adapter_checked = True
        return super().next_training_batch(model, draw)  # type: ignore[misc]


def trainable_parts(network: torch.nn.Module) -> dict[str, int]:
    """Trainable parameter count per part (for logs and tests)."""
    family = family_for(network)
    counts = dict.fromkeys(PARTS, 0)
    for name, param in network.named_parameters():
        if param.requires_grad:
            counts[part_of(name, family)] += param.numel()
    return counts


__all__ = ["DEFAULT_PLAN", "MODES", "TrainablePartsMixin", "adapter_config", "apply_plan", "full_part_modules", "lora_target_regex",
           "needs_adapter", "plan_from_options", "require_adapter", "trainable_parts"]
