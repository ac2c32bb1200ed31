"""The "Writing a plugin" and "Writing a backend" pages' files (docs/) run as printed.

``examples/writing_a_backend/toy_backend.py`` passes the whole conformance suite as a registered target, and
``examples/writing_a_plugin/reward_plugin.py`` (a Bradley-Terry reward model on a real scalar head) registers,
trains to a separating score on the HF backend, exports a checkpoint plain ``transformers`` loads, and goes through
the suite's task side (``TaskContract``) on the HF backend (built, its head trains) and on the toy backend
(refused before building: the toy declares ``causal_lm`` only). Both import public names only
(checked here too).
"""

from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.plugins import TwinklePlugins, get_plugins, reset_plugins
from twinkle_core.testing.conformance import TaskContract

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_DIR = os.path.join(ROOT, "examples", "writing_a_backend")
PLUGIN_DIR = os.path.join(ROOT, "examples", "writing_a_plugin")


@pytest.fixture
def registered(monkeypatch):
    """The two example modules importable and registered like installed plugins, for one test."""
    monkeypatch.syspath_prepend(BACKEND_DIR)
    monkeypatch.syspath_prepend(PLUGIN_DIR)
    reset_plugins(TwinklePlugins(extra_modules=["toy_backend", "reward_plugin"]))
    yield get_plugins()
    reset_plugins()


@pytest.mark.parametrize("path", [os.path.join(BACKEND_DIR, "toy_backend.py"),
                                  os.path.join(PLUGIN_DIR, "reward_plugin.py")])
def test_the_examples_import_only_public_names(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [node.module or "", *(alias.name for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            private = [part for part in name.split(".") if part.startswith("_") and not part.startswith("__")]
            assert not private, f"{path} imports {name}"
    source = open(path, encoding="utf-8").read()
    assert "twinkle_backend_" not in source  # a plugin or a backend depends on the core only


def test_the_toy_backend_passes_the_conformance_suite(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([BACKEND_DIR, os.environ.get("PYTHONPATH", "")]),
           "TWINKLE_PLUGINS": "toy_backend"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "twinkle_core.testing.conformance",
         "--twinkle-backend", "toy"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.split("\n")[-2], result.stdout[-500:]


def test_the_plugins_register_by_name(registered):
    assert registered.load("model", "ToyModel").__name__ == "ToyModel"
    assert registered.load("task", "pairwise_reward").default_loss == "pairwise_logistic"
    assert registered.load("loss", "pairwise_logistic").__name__ == "PairwiseLogisticLoss"
    assert "toy" in registered.names("conformance")


def _pairs(count: int, seed: int) -> list[dict[str, list[int]]]:
    """Preference pairs over a 64-token vocabulary: the chosen reply ends with one of the tokens 3-6, the rejected
    one with one of 7-10 (an untrained head orders some pairs wrongly)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = [rng.randrange(10, 64) for _ in range(rng.randrange(3, 7))]
        reply = [rng.randrange(10, 64) for _ in range(rng.randrange(1, 4))]
        rows.append({"chosen": prompt + reply + [rng.randrange(3, 7)], "rejected": prompt + reply + [rng.randrange(7, 11)]})
    return rows


def test_the_reward_task_trains_a_real_scalar_head_and_exports_it(registered, tmp_path):
    pytest.importorskip("twinkle_backend_hf")
    import torch
    from transformers import AutoModelForTokenClassification
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _pairs(32, seed=0)))
    task = registered.load("task", "pairwise_reward")()
    model = TransformersModel(config=tiny_qwen2_config(), task=task, seed=0)  # the loss: the task's default
    model.set_optimizer("AdamW", lr=3e-3)
    train = task.load_dataset(str(data), tokenizer=None)
    held_out = _pairs(16, seed=1)
    before = task.evaluate(model, held_out, None)["pair_accuracy"]
    losses = []
    for step in range(40):
        batch = task.collate(train[(step * 8) % 32: (step * 8) % 32 + 8])
        losses.append(float(model.forward_backward(inputs=batch)["loss"]))
        model.clip_grad_and_step(max_grad_norm=1.0)
    after = task.evaluate(model, held_out, None)["pair_accuracy"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert after == 1.0 and before < 1.0, (before, after)

    path = model.save("final", output_dir=str(tmp_path / "run"), save_optimizer=False)
    plain = AutoModelForTokenClassification.from_pretrained(path)  # a real head, loadable without Twinkle
    batch = task.collate(held_out[:4])
    values = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ours = model.forward_only(inputs=batch)["logits"]
    torch.testing.assert_close(values, ours.to(values.dtype), atol=1e-5, rtol=1e-4)


def test_a_backend_without_the_kind_refuses_the_task_before_building(registered):
    toy = registered.load("model", "ToyModel")
    built = []
    original = toy.build_network
    toy.build_network = lambda self: built.append(1) or original(self)
    try:
        with pytest.raises(ConfigError, match="token_value") as refusal:
            toy(task=registered.load("task", "pairwise_reward")())
    finally:
        toy.build_network = original
    assert not built
    assert "ToyModel" in str(refusal.value)


def _page(name: str) -> str:
    return open(os.path.join(ROOT, "docs", name), encoding="utf-8").read()


@pytest.mark.parametrize(("page", "relative"), [("writing-a-plugin.md", "examples/writing_a_plugin/reward_plugin.py"),
                                                ("writing-a-backend.md", "examples/writing_a_backend/toy_backend.py")])
def test_the_pages_blocks_are_exactly_the_files(page, relative):
    text = _page(page)
    marker = f"<!-- file: {relative} -->\n```python\n"
    assert marker in text, f"docs/{page} has no block for {relative}"
    block = text.split(marker, 1)[1].split("\n```\n", 1)[0]
    assert block == open(os.path.join(ROOT, relative), encoding="utf-8").read().rstrip()


def test_the_pages_seam_table_is_generated_from_the_index():
    from twinkle_core.contracts import render_markdown

    block = _page("writing-a-plugin.md").split(
        "<!-- seams: begin (generated by python -m twinkle_core.contracts) -->\n", 1)[1]
    assert block.split("\n<!-- seams: end -->", 1)[0] == render_markdown().strip(), (
        "regenerate the seam table of docs/writing-a-plugin.md with python -m twinkle_core.contracts")


def _reward_task_for_kind(kind):
    """The conformance suite's task for each kind, with the example plugin's task for ``token_value``."""
    from reward_plugin import PairwiseRewardTask

    from twinkle_core.testing.conformance_tasks import kind_task

    return PairwiseRewardTask() if kind == "token_value" else kind_task(kind)


class TestTheRewardTaskOnTheToyBackend(TaskContract):
    """The toy backend declares causal_lm only: the reward task is refused before anything is built."""

    @pytest.fixture
    def twinkle_factory(self, registered):
        return registered.load("conformance", "toy")

    @pytest.fixture
    def twinkle_task_for_kind(self):
        return _reward_task_for_kind


class TestTheRewardTaskOnTheHFBackend(TaskContract):
    """TransformersModel builds the reward task's token_value network, and its head trains."""

    @pytest.fixture
    def twinkle_factory(self, registered):
        return pytest.importorskip("twinkle_backend_hf.testing").make_tiny_model

    @pytest.fixture
    def twinkle_task_for_kind(self):
        return _reward_task_for_kind
