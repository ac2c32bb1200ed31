"""``twinkle train --dry-run`` refuses what the real run refuses, with the real run's message (issue 26): the check
runs where both paths pass (recipe validation before launch), and the real run's own check is the same function.

The quickstart recipe at ``train.max_steps=1``, in-process through :func:`twinkle_core.cli.main` (exit status 2 and
``twinkle: error: ...`` on stderr for a configuration error).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from twinkle_core import cli
from twinkle_core.errors import ConfigError

RECIPE = str(Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "recipe.yaml")


def train(tmp_path: Path, *argv: str, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``twinkle train`` on the quickstart recipe (one step, no evaluation) into ``tmp_path/out``: status, stderr."""
    code = cli.main(["train", RECIPE, "train.max_steps=1", f"train.output_dir={tmp_path / 'out'}",
                     "train.eval_before_training=false", "data.eval=null", "train.evaluate_options=null", *argv])
    return code, capsys.readouterr().err


def error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("twinkle: error: ")]
    assert lines, stderr[-3000:]
    return lines[-1].removeprefix("twinkle: error: ")


def test_single_strategy_on_two_processes(tmp_path, capsys, monkeypatch):
    from twinkle_core.strategy import SingleProcessStrategy

    code, err = train(tmp_path, "--dry-run", "--nproc-per-node", "2", "strategy=single", capsys=capsys)
    assert code == 2
    dry = error(err)
    assert "strategy 'single' runs one process, but the job has 2" in dry
    # the real run: every launched rank (WORLD_SIZE=2) validates the recipe, and the strategy's setup checks again
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = train(tmp_path, "strategy=single", capsys=capsys)
    assert code == 2 and error(err) == dry
    with pytest.raises(ConfigError) as raised:
        SingleProcessStrategy().setup(None)
    assert str(raised.value) == dry
    assert not (tmp_path / "out").exists()


def test_a_loss_that_needs_what_the_task_does_not_produce(tmp_path, capsys):
    code, err = train(tmp_path, "--dry-run", "loss.name=gkd", capsys=capsys)
    assert code == 2
    dry = error(err)
    assert dry.startswith("loss.name: the loss 'gkd' needs batches with teacher_logits, which the task 'causal_lm' "
                          "does not produce; use task: 'gkd'")
    code, err = train(tmp_path, "loss.name=gkd", capsys=capsys)
    assert code == 2 and error(err) == dry
    assert "KeyError" not in err


def test_a_loss_that_needs_what_the_task_does_not_produce_from_python(tmp_path):
    from twinkle_core.train.loop import train as train_from_python
    from twinkle_core.train.recipe import load_recipe

    recipe = load_recipe(RECIPE, ["train.max_steps=1", f"train.output_dir={tmp_path / 'out'}", "loss.name=gkd",
                                  "train.eval_before_training=false"])
    with pytest.raises(ConfigError, match="the loss 'gkd' needs batches with teacher_logits"):
        train_from_python(recipe)


def test_a_model_option_typo(tmp_path, capsys):
    code, err = train(tmp_path, "--dry-run", "model.options.attn_implementaton=sdpa", capsys=capsys)
    assert code == 2
    dry = error(err)
    assert dry == "TransformersModel got unknown option(s) attn_implementaton (did you mean attn_implementation?)"
    code, err = train(tmp_path, "model.options.attn_implementaton=sdpa", capsys=capsys)
    assert code == 2 and error(err) == dry


def test_resume_latest_with_another_learning_rate(tmp_path, capsys):
    assert train(tmp_path, "train.save_every=1", capsys=capsys)[0] == 0
    code, err = train(tmp_path, "--dry-run", "--resume", "latest", "train.max_steps=2", "optimizer.lr=1e-3",
                      capsys=capsys)
    assert code == 2
    dry = error(err)
    assert dry.startswith(f"train.resume: {tmp_path / 'out' / 'checkpoint-1'} was trained with optimizer.lr=0.003 "
                          f"there but 0.001 in the recipe")
    code, err = train(tmp_path, "--resume", "latest", "train.max_steps=2", "optimizer.lr=1e-3", capsys=capsys)
    assert code == 2 and error(err) == dry
    # the trainer's own check (train() from Python) says the same
    from twinkle_core.train.loop import train as train_from_python
    from twinkle_core.train.recipe import load_recipe

    recipe = load_recipe(RECIPE, ["train.max_steps=2", f"train.output_dir={tmp_path / 'out'}", "optimizer.lr=1e-3",
                                  "train.eval_before_training=false", "train.resume=latest"])
    with pytest.raises(ConfigError) as raised:
        train_from_python(recipe)
    assert str(raised.value) == dry
    # the same learning rate resumes
    assert train(tmp_path, "--dry-run", "--resume", "latest", "train.max_steps=2", capsys=capsys)[0] == 0


def test_an_unprefixed_hub_id(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ("model.model_id=Qwen/Qwen2.5-0.5B", "model.config=null", "model.tokenizer=null")
    code, err = train(tmp_path, "--dry-run", *overrides, capsys=capsys)
    assert code == 2
    dry = error(err)
    real = (f"model path 'Qwen/Qwen2.5-0.5B' does not exist (looked at {tmp_path / 'Qwen' / 'Qwen2.5-0.5B'}). To "
            f"download it from a hub, write hf://Qwen/Qwen2.5-0.5B (Hugging Face) or ms://Qwen/Qwen2.5-0.5B "
            f"(ModelScope).")
    assert dry == f"model.model_id: {real}"
    code, err = train(tmp_path, *overrides, capsys=capsys)
    assert code == 2 and error(err) == dry
    # what resolving it in the real run says (the trainer resolves model.model_id through the model sources)
    from twinkle_core.errors import SourceError
    from twinkle_core.sources.local import LocalSource

    with pytest.raises(SourceError) as raised:
        LocalSource().resolve("Qwen/Qwen2.5-0.5B")
    assert str(raised.value) == real
    assert os.listdir(tmp_path) == []
