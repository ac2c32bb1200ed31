"""Conformance tests of the model seams online RL uses: ``generation_module`` and ``sibling``.

Part of the suite: :class:`~twinkle_core.testing.conformance.ModelContract` inherits
:class:`GenerationContract`, so every backend that runs the suite (``--pyargs twinkle_core.testing.conformance``
or a ``ModelContract`` subclass) runs these too. Both seams are optional: a model class that cannot lend its
network to an in-process sampler, or cannot build a sibling, raises ``ConfigError`` and passes; one that does
either must do it right.

The helpers come from :mod:`twinkle_core.testing.conformance_data`, which every suite module shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from twinkle_core.testing.conformance_data import (
    LORA_CONFIG,
    assert_state_equal,
    forward_tolerance_of,
    local_rows,
    make_batch,
    snapshot,
)

#: prompt tokens fed at once (the prefill); the remaining tokens of a row are fed one at a time through the cache
PREFILL_TOKENS = 5


@contextlib.contextmanager
def _lent_module(model: Any, adapter_name: str | None = None) -> Iterator[Any]:
    """``model.generation_module(...)``'s ``GenerationModule``, or None when the model refuses with ConfigError
    (when called, or when entered: a context manager built from a generator raises on entry)."""
    from twinkle_core.errors import ConfigError

    with contextlib.ExitStack() as stack:
        try:
            gen = stack.enter_context(model.generation_module(adapter_name=adapter_name))
        except ConfigError as exc:
            assert str(exc), "a refusal must say why"
            gen = None
        yield gen


def _field(out: Any, *names: str) -> Any:
    """The first present field of a forward's output: a Hugging Face ``ModelOutput`` (both a mapping and an
    object) or a plain dict."""
    for name in names:
        value = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if value is not None:
            return value
    return None


def _decode_logits(gen: Any, input_ids: Any) -> Any:
    """Logits of every position of ``input_ids`` [rows, length], computed the way a sampler does: a prefill of
    the first :data:`PREFILL_TOKENS` tokens with ``use_cache=True``, then one token per forward with the cache."""
    import torch

    ids = input_ids.to(gen.device)
    rows, length = ids.shape
    from twinkle_core.sampling import forward_keywords

    key, _ = forward_keywords(gen.module)
    mask = torch.ones_like(ids)
    positions = torch.arange(length, device=ids.device).expand(rows, length)
    out = gen.module(input_ids=ids[:, :PREFILL_TOKENS], attention_mask=mask[:, :PREFILL_TOKENS],
                     position_ids=positions[:, :PREFILL_TOKENS], use_cache=True)
    pieces = [_field(out, "logits")]
    cache = _field(out, key, "past_key_values")
    assert cache is not None, "a forward with use_cache=True must return its KV cache"
    for t in range(PREFILL_TOKENS, length):
        out = gen.module(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                         use_cache=True, **{key: cache})
        pieces.append(_field(out, "logits"))
        returned = _field(out, key, "past_key_values")
        cache = cache if returned is None else returned  # a DynamicCache also grows in place
    return torch.cat(pieces, dim=1)


def _training_flags(module: Any) -> list[bool]:
    return [m.training for m in module.modules()]


def _sibling_task() -> Any:
    """A plain causal-LM task for ``sibling(task=...)`` (the Task class is imported lazily, like every
    torch-side import of the suite)."""
    from twinkle_core.task import Task

    class SiblingTask(Task):
        name = "conformance_sibling"

        def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> list:
            return []

        def collate(self, features: list) -> dict:
            return {}

    return SiblingTask()


class GenerationContract:
    """``generation_module`` and ``sibling``. Needs the ``twinkle_factory`` fixture, like ``ModelContract``."""

    # ------------------------------------------------------------------ generation_module
    def test_generation_module_decodes_with_a_cache_like_forward_only(self, twinkle_factory):
        """The lent network, prefilled and then fed one token at a time through its KV cache, gives the logits
        ``forward_only`` gives at the same positions (fp32: two code paths of one forward), without gradients,
        in evaluation mode inside and in the model's own mode again outside."""
        from twinkle_core.testing.tolerance import max_abs_diff

        model = twinkle_factory(seed=0)
        model.set_optimizer("SGD", lr=0.1)
        batch = local_rows(model, make_batch(40, rows=8, length=9))
        model.forward_backward(inputs=batch)  # the model is in training mode, as in a training loop
        model.clip_grad_and_step()
        want = model.forward_only(inputs=batch)["logits"].float()
        trained_again = model.forward(inputs=batch)["logits"].detach().float()  # back in training mode
        with _lent_module(model) as gen:
            if gen is None:
                return  # the model cannot lend its network: a push sampler copies get_state_dict() instead
            module = gen.module
            assert not any(_training_flags(module)), "the lent network must be in evaluation mode"
            got = _decode_logits(gen, batch["input_ids"]).float()
            assert not got.requires_grad, "the lent network must run without gradients"
            assert isinstance(gen.lockstep, bool)
        assert tuple(got.shape) == tuple(want.shape)
        tolerance = forward_tolerance_of(want)
        assert max_abs_diff(got.cpu(), want.cpu()) <= tolerance, (
            f"cached decoding differs from forward_only: {max_abs_diff(got.cpu(), want.cpu()):.3g} > {tolerance:.3g}")
        assert all(_training_flags(module)), "training mode must come back when the sampler is done"
        again = model.forward(inputs=batch)["logits"].detach().float()
        assert max_abs_diff(again, trained_again) <= tolerance, "the lent network must come back unchanged"

    def test_export_config_builds_a_network_the_state_dict_fits(self, twinkle_factory):
        """``export_config()`` is None, or a transformers config from which a causal LM is built that takes every
        tensor of ``get_state_dict()`` (what a push sampler's copy is made of)."""
        model = twinkle_factory(seed=0)
        config = model.export_config()
        state = model.get_state_dict()
        if config is None or not state:  # no Hugging Face form, or a rank that holds no gathered weights
            return
        import torch
        from transformers import AutoModelForCausalLM

        from twinkle_core.sources.resolve import trust_remote_code

        trust = trust_remote_code(getattr(model, "trust_remote_code", None))
        network = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust)
        expected = set(network.state_dict())
        tied = expected - set(dict(network.named_parameters()) | dict(network.named_buffers()))
        assert not set(state) - expected, f"get_state_dict() names the config's network lacks: {sorted(set(state) - expected)[:5]}"
        assert not expected - set(state) - tied, f"tensors get_state_dict() leaves out: {sorted(expected - set(state) - tied)[:5]}"
        network.load_state_dict({k: v.detach().cpu().float() for k, v in state.items()}, strict=False)

    def test_generation_module_applies_the_adapter(self, twinkle_factory):
        """With ``adapter_name``, the lent network runs that adapter (B != 0 changes the logits), and after
        the sampler is done the model's forwards are as before."""
        from twinkle_core.testing.tolerance import max_abs_diff

        model = twinkle_factory(seed=0)
        model.add_adapter_to_model("policy", {**LORA_CONFIG, "init_lora_weights": False})
        batch = local_rows(model, make_batch(42, rows=8, length=8))
        adapted = model.forward_only(inputs=batch, adapter_name="policy")["logits"].float()
        base = model.forward_only(inputs=batch, adapter_name="policy", disable_adapters=True)["logits"].float()
        tolerance = forward_tolerance_of(adapted)
        assert max_abs_diff(adapted, base) > 100 * tolerance, "the adapter (B != 0) must change the logits"
        with _lent_module(model, adapter_name="policy") as gen:
            if gen is None:
                return
            got = _decode_logits(gen, batch["input_ids"]).float().cpu()
        assert max_abs_diff(got, adapted.cpu()) <= tolerance, (
            f"the lent network must run the adapter: {max_abs_diff(got, adapted.cpu()):.3g} > {tolerance:.3g}")
        after = model.forward_only(inputs=batch, adapter_name="policy")["logits"].float()
        assert max_abs_diff(after, adapted) <= tolerance
        assert all(p.requires_grad for p in model.trainable_parameters(adapter_name="policy")), \
            "the adapter must stay trainable after lending"

    # ------------------------------------------------------------------ sibling
    def test_sibling_is_a_separate_trainable_model(self, twinkle_factory):
        """``sibling(task=...)``: a new model of the same class, with the same strategy and precision, built from
        the source (not the original's trained weights), whose parameters are its own: training it leaves the
        original's weights untouched."""
        import torch

        from twinkle_core.errors import ConfigError

        original = twinkle_factory(seed=0)
        untrained = snapshot(original.get_state_dict())
        original.set_optimizer("SGD", lr=0.1)
        batch = local_rows(original, make_batch(43))
        original.forward_backward(inputs=batch)
        original.clip_grad_and_step()
        trained = snapshot(original.get_state_dict())
        task = _sibling_task()
        try:
            sibling = original.sibling(task=task)
        except ConfigError as exc:
            assert str(exc), "a refusal must say why"
            return
        assert type(sibling) is type(original)
        assert sibling is not original
        assert getattr(sibling, "task", task) is task, "the sibling serves the task it was given"
        ours = {id(p) for p in original.trainable_parameters()}
        theirs = {id(p) for p in sibling.trainable_parameters()}
        assert theirs and not ours & theirs, "a sibling must not share parameter objects with the original"
        configs, original_configs = sibling.get_train_configs(), original.get_train_configs()
        for key in ("strategy", "precision", "dp_size", "dp_rank"):
            assert configs[key] == original_configs[key], key
        assert configs["optimizer"] is None and configs["step"] == 0, "a sibling has its own (unset) optimizer"
        try:
            assert_state_equal(untrained, snapshot(sibling.get_state_dict()))
        except AssertionError as exc:
            raise AssertionError(f"a sibling is built from the source like the original was, not from the "
                                 f"original's trained weights: {exc}") from None
        sibling.set_optimizer("SGD", lr=0.1)
        sibling.forward_backward(inputs=batch)
        sibling.clip_grad_and_step()
        assert_state_equal(trained, snapshot(original.get_state_dict()))
        moved = snapshot(sibling.get_state_dict())
        assert any(not torch.equal(moved[k], untrained[k]) for k in moved), "the sibling must train"
        assert original.get_train_configs()["step"] == 1 and sibling.get_train_configs()["step"] == 1
