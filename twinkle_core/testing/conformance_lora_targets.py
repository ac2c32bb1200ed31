"""The conformance suite's LoRA-target side: ``TwinkleModel.lora_target_modules()`` names, per kind of layer
(attention, MLP, LM head), targets that adapt disjoint layers. A separate class beside ``ModelContract`` (subclassed
with the same ``twinkle_factory`` fixture), so that each contract class stays a readable size."""

from __future__ import annotations

from twinkle_core.testing.conformance_data import LORA_CONFIG, forward_tolerance_of, local_rows, make_batch

__all__ = ["LoraTargetContract"]


class LoraTargetContract:
    def test_lora_target_modules_select_disjoint_layers_by_kind(self, twinkle_factory):
        """``lora_target_modules()``: each kind's names adapt layers (the output changes), no two kinds the same; a
        model that does not tell refuses with ``ConfigError`` naming what to do instead."""
        from twinkle_core.errors import ConfigError
        from twinkle_core.lora import TARGET_KINDS
        from twinkle_core.testing.tolerance import max_abs_diff

        base_model = twinkle_factory(seed=0)
        try:
            targets = base_model.lora_target_modules()
        except ConfigError as exc:  # allowed (the default): the caller then names target_modules itself
            assert "target_modules" in str(exc), f"the refusal must say what to do instead: {exc}"
            return
        assert sorted(targets) == sorted(TARGET_KINDS), f"one list per kind {TARGET_KINDS}, got {sorted(targets)}"
        assert targets["attn"] and targets["mlp"], "the conformance model has attention and MLP layers to adapt"
        batch = local_rows(base_model, make_batch(18))
        base = base_model.forward_only(inputs=batch)["logits"].float()
        layers: dict[str, set[str]] = {}
        for kind, names in targets.items():
            if not names:
                continue
            # one adapter per model (each kind's layers alone), added before its first forward: a data-parallel
            # strategy wraps the model then, and refuses adapters after it; the same seed gives the same base
            model = twinkle_factory(seed=0)
            model.add_adapter_to_model(kind, {**LORA_CONFIG, "target_modules": list(names), "init_lora_weights": False})
            adapted = model.forward_only(inputs=batch, adapter_name=kind)["logits"].float()
            assert max_abs_diff(adapted, base) > 100 * forward_tolerance_of(base), f"the {kind} adapter changes nothing"
            # the adapted layers, by the path before ".lora_A" / ".lora_B" (every backend's adapter keys have one)
            layers[kind] = {key.split(".lora_")[0] for key in model.get_state_dict(adapter_name=kind)}
            assert layers[kind], f"the {kind} adapter has no weights"
        for kind, mine in layers.items():
            for other, theirs in layers.items():
                assert kind == other or not mine & theirs, f"{kind} and {other} both adapt {sorted(mine & theirs)}"
