"""Conformance tests of the task side: one per model kind (``Task.model_kind``).

Part of the suite: ``pytest --pyargs twinkle_core.testing.conformance`` collects it (``TestTaskContract``) next to
``ModelContract``, and a backend's tests subclass it beside ``ModelContract`` with the same ``twinkle_factory``
fixture. A separate class rather than a base of ``ModelContract``: each stays a readable size. For each kind, the target's model class either declares it
(``supported_model_kinds``, ``None``: every kind) and builds the network the kind promises, or refuses a task of
that kind with ``ConfigError`` before building anything:

* ``causal_lm``: ``logits`` of shape ``[B, T, V]``;
* ``token_value``: one value per token, ``logits`` of shape ``[B, T, 1]``, that trains (a PPO critic, a reward
  model);
* ``sequence_score``: one score per sequence, ``logits`` of shape ``[B, 1]`` read at each row's last token that is
  not padding, that trains (a Bradley–Terry reward model);
* ``encoder``: the final hidden states, ``last_hidden_state`` of shape ``[B, T, H]`` (an embedding model).
"""

from __future__ import annotations

from typing import Any

import pytest

from twinkle_core.testing.conformance_data import CONFORMANCE_VOCAB_SIZE, local_rows, make_batch

#: the kinds every target is checked on
MODEL_KINDS = ("causal_lm", "token_value", "sequence_score", "encoder")


def kind_task(kind: str) -> Any:
    """A task asking for a network of ``kind`` and leaving its outputs as they are."""
    from twinkle_core.task import Task

    class KindTask(Task):
        name = f"conformance_{kind}"

        def load_dataset(self, path, tokenizer, **data_options):
            return []

        def collate(self, features):
            return {}

    task = KindTask()
    task.model_kind = kind
    return task


def _declares(model_cls: type, kind: str) -> bool:
    from twinkle_core.capabilities import model_kinds

    kinds = model_kinds(model_cls)
    return kinds is None or kind in kinds


def _value_loss(outputs: dict[str, Any], inputs: dict[str, Any]) -> Any:
    """Squared distance of every attended token's value to 1 (a sum, with its token count)."""
    from twinkle_core.loss.base import LossOutput

    mask = inputs["attention_mask"].to(outputs["logits"].device).float()
    values = outputs["logits"].squeeze(-1).float()
    return LossOutput(loss=(((values - 1.0) ** 2) * mask).sum(), num_tokens=mask.sum())


def _assert_trains(model: Any, batch: dict[str, Any], loss: Any, logits: Any, message: str) -> None:
    """Three AdamW steps on ``batch`` with ``loss`` lower it from its value on ``logits`` (the untrained outputs)."""
    import torch

    model.set_loss(loss)
    model.set_optimizer("AdamW", lr=1e-2)
    before = float(loss({"logits": logits}, batch).loss)
    for _ in range(3):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
    after = model.forward_only(inputs=batch)["logits"]
    assert torch.isfinite(after).all()
    assert float(loss({"logits": after}, batch).loss) < before, message


class TaskContract:
    """Needs the suite's ``twinkle_factory`` fixture (``factory(seed=, task=)`` builds a model for the task).

    ``twinkle_task_for_kind`` (``kind -> Task``) gives the task each kind is checked with: by default one that
    leaves the network's outputs as they are; a task plugin overrides it to put its own task through the same
    checks (a reward model's task for ``token_value``), on every backend it is run against."""

    @pytest.fixture
    def twinkle_task_for_kind(self) -> Any:
        return kind_task

    @pytest.mark.parametrize("kind", MODEL_KINDS)
    def test_each_model_kind_is_built_or_refused_before_building(self, twinkle_factory, twinkle_task_for_kind, kind,
                                                                 monkeypatch):
        from twinkle_core.errors import ConfigError

        task = twinkle_task_for_kind(kind)
        assert task.model_kind == kind, f"the task for kind {kind!r} asks for {task.model_kind!r}"
        model_cls = type(twinkle_factory(seed=0))
        if _declares(model_cls, kind):
            model = twinkle_factory(seed=0, task=task)
            getattr(self, f"_check_{kind}")(model)
            return

        def build_network(self: Any) -> Any:
            raise AssertionError(f"{model_cls.__name__} started building a network for a kind it does not declare")

        monkeypatch.setattr(model_cls, "build_network", build_network)
        with pytest.raises(ConfigError, match=f"model_kind '{kind}'.*{model_cls.__name__}"):
            twinkle_factory(seed=0, task=task)

    def _check_causal_lm(self, model: Any) -> None:
        batch = local_rows(model, make_batch(50))
        logits = model.forward_only(inputs=batch)["logits"]
        assert tuple(logits.shape) == (*batch["input_ids"].shape, CONFORMANCE_VOCAB_SIZE)

    def _check_token_value(self, model: Any) -> None:

        batch = local_rows(model, make_batch(51))
        values = model.forward_only(inputs=batch)["logits"]
        assert tuple(values.shape) == (*batch["input_ids"].shape, 1), "a token_value network has one output a token"
        _assert_trains(model, batch, _value_loss, values, "the value head must train")

    def _check_sequence_score(self, model: Any) -> None:

        from twinkle_core.loss.base import LossOutput

        # one row per rank: a network that reads the score at the last non-pad token needs no pad token for it
        batch = local_rows(model, make_batch(53, rows=model.get_train_configs()["dp_size"]))

        def score_loss(outputs: dict[str, Any], inputs: dict[str, Any]) -> Any:
            return LossOutput(loss=((outputs["logits"].squeeze(-1).float() - 1.0) ** 2).sum(),
                              num_tokens=outputs["logits"].shape[0])

        scores = model.forward_only(inputs=batch)["logits"]
        assert tuple(scores.shape) == (batch["input_ids"].shape[0], 1), "a sequence_score network has one output a row"
        _assert_trains(model, batch, score_loss, scores, "the score head must train")

    def _check_encoder(self, model: Any) -> None:
        batch = local_rows(model, make_batch(52))
        outputs = model.forward_only(inputs=batch)
        assert "last_hidden_state" in outputs, f"an encoder returns last_hidden_state, got {sorted(outputs)}"
        hidden = outputs["last_hidden_state"]
        assert hidden.dim() == 3 and tuple(hidden.shape[:2]) == tuple(batch["input_ids"].shape)
