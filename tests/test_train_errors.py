"""Train-side mistakes are one clear error naming the file or option and the fix, not a raw traceback (issue 27).

(a) ``--resume PATH`` where PATH does not exist: refused before anything is built, naming what the output
    directory holds. (b) A checkpoint whose marker was deleted: resuming from it is refused; ``--resume latest``
    skips it with a warning, or fails clearly when no checkpoint is left. (c) ``set_optimizer`` with a negative,
    NaN or infinite ``lr`` or a negative ``weight_decay``. (d) ``forward_backward`` with a batch without
    ``input_ids``: the error names the keys a batch needs and the ones it has.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
import time
from pathlib import Path

import pytest
import yaml

from twinkle_core import checkpoint, cli
from twinkle_core.checkpoint import CheckpointError
from twinkle_core.errors import ConfigError

FAKES = "twinkle_test_loop_fakes"
if FAKES not in sys.modules:  # the same loading as tests/test_loop_reliability.py
    _spec = importlib.util.spec_from_file_location("tests.test_loop", Path(__file__).with_name("test_loop.py"))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["tests.test_loop"] = _module
    _spec.loader.exec_module(_module)
fakes = sys.modules[FAKES]
FakeModel = fakes.FakeModel
registry = fakes.registry  # test_loop.py's autouse fixture: the fake plugin registered, progress off
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart"


def reference_checkpoint(root: Path, name: str, step: int) -> Path:
    """A real checkpoint of the reference backend (weights, twinkle_state/, marker listing every file)."""
    from twinkle_core.testing.conformance import make_batch
    from twinkle_core.testing.reference import make_reference_model

    model = make_reference_model()
    model.set_optimizer("AdamW", lr=1e-2)
    model.forward_backward(inputs=make_batch(step))
    model.clip_grad_and_step(max_grad_norm=1.0)
    return Path(model.save(name, output_dir=str(root), extra_state={"step": step}))


# ---------------------------------------------------------------------- (a) a checkpoint that does not exist
def test_resume_from_a_missing_path_is_refused_before_building_naming_what_there_is(tmp_path):
    recipe = fakes.make_recipe(tmp_path, train={"max_steps": 2, "save_every": 2})
    fakes.run(recipe)
    FakeModel.instances.clear()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        fakes.run(recipe, resume="checkpoint-3")  # a typo'd name under train.output_dir
    elapsed = time.perf_counter() - started
    text = str(info.value)
    assert "--resume: checkpoint 'checkpoint-3' does not exist (neither as a path nor under train.output_dir)" in text
    assert f"{tmp_path / 'out'} holds checkpoint-2, final: pass one of them" in text and "latest" in text
    assert FakeModel.instances == [] and elapsed < 1.0  # before anything was built
    with pytest.raises(ConfigError, match=r"'/no/such/dir' does not exist .* holds checkpoint-2, final"):
        fakes.run(recipe, resume="/no/such/dir")


def test_resume_into_an_empty_directory_says_there_is_nothing(tmp_path):
    with pytest.raises(ConfigError, match="does not exist .*; .* holds no checkpoint$"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}), resume=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="--resume-weights-only: checkpoint .* does not exist"):
        fakes.run(fakes.make_recipe(tmp_path, train={"max_steps": 2}), resume_weights_only=str(tmp_path / "nope"))
    assert FakeModel.instances == []


def test_twinkle_train_refuses_a_missing_resume_path_before_validating(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(fakes.make_recipe(tmp_path, train={"max_steps": 2})))
    from twinkle_core.train import recipe as recipe_module

    def no_validation(*args, **kwargs):
        raise AssertionError("validated the components: the refusal came too late")

    monkeypatch.setattr(recipe_module, "validate_components", no_validation)
    for launch in ([], ["--nproc-per-node", "2"]):  # in this process, and before torchrun would start
        assert cli.main(["train", str(recipe), "--resume", str(tmp_path / "nope"), *launch]) == 2
        err = capsys.readouterr().err
        assert f"twinkle: error: --resume: checkpoint '{tmp_path / 'nope'}' does not exist" in err
        assert "Traceback" not in err


# ---------------------------------------------------------------------- (b) a checkpoint without its marker
def test_a_checkpoint_that_lost_its_marker_is_refused_by_path_and_skipped_by_latest(tmp_path, caplog):
    from twinkle_core.train.checkpointing import check_start

    older = reference_checkpoint(tmp_path, "checkpoint-1", 1)
    newer = reference_checkpoint(tmp_path, "checkpoint-2", 2)
    (newer / checkpoint.MARKER).unlink()
    assert checkpoint.lost_marker(newer) and not checkpoint.lost_marker(older)

    with pytest.raises(CheckpointError) as info:
        check_start(tmp_path, resume=str(newer))
    assert str(info.value) == (
        f"--resume: {newer} has lost its marker {checkpoint.MARKER} (deleted, or left out when the directory was "
        f"copied), so its files cannot be verified and it is not resumed from. Resume from another checkpoint "
        f"(twinkle train --resume latest skips this one), or put the marker back from the original copy")
    with pytest.raises(CheckpointError, match="lost its marker"):  # by name under the output directory too
        check_start(tmp_path, resume="checkpoint-2")
    with pytest.raises(CheckpointError, match="--resume-weights-only: .* lost its marker"):
        check_start(tmp_path, weights_only=str(newer))

    with caplog.at_level(logging.WARNING):
        assert checkpoint.latest_checkpoint(tmp_path) == older
    assert f"skipping checkpoint {newer}: its marker {checkpoint.MARKER} is missing" in caplog.text
    (older / checkpoint.MARKER).unlink()
    assert checkpoint.latest_checkpoint(tmp_path) is None


def test_the_python_api_refuses_a_checkpoint_without_marker_with_one_error(tmp_path):
    from twinkle_core.testing.reference import make_reference_model

    path = reference_checkpoint(tmp_path, "checkpoint-1", 1)
    (path / checkpoint.MARKER).unlink()
    model = make_reference_model()
    model.set_optimizer("AdamW", lr=1e-2)
    with pytest.raises(CheckpointError, match="has lost its marker"):
        model.resume_from_checkpoint(str(path))
    with pytest.raises(CheckpointError, match="does not exist"):
        model.resume_from_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match="is not a Twinkle training checkpoint: it has no "):
        model.resume_from_checkpoint(str(tmp_path / "plain"))


@pytest.fixture
def real_backend(monkeypatch):
    pytest.importorskip("twinkle_backend_hf")
    from twinkle_core.plugins import reset_plugins

    monkeypatch.delenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("TWINKLE_PLUGINS", raising=False)
    reset_plugins()
    yield
    reset_plugins()


def test_twinkle_train_with_deleted_markers(tmp_path, capsys, caplog, real_backend):
    """A real run: resume from the checkpoint whose marker was deleted, then ``--resume latest`` past it, then with
    no checkpoint left to resume."""
    from twinkle_backend_hf.testing import tiny_qwen2_config

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "task": "causal_lm",
        "model": {"class_name": "TransformersModel", "tokenizer": str(QUICKSTART / "tokenizer"),
                  "config": tiny_qwen2_config(262, bos_token_id=0, eos_token_id=0, pad_token_id=0)},
        "precision": "no",
        "data": {"train": str(QUICKSTART / "train.jsonl"), "mode": "chat", "max_length": 32, "batch_size": 2},
        "optimizer": {"name": "AdamW", "lr": 1e-2},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "save_every": 1, "seed": 3},
    }))
    out = tmp_path / "out"
    assert cli.main(["train", str(recipe), "train.max_steps=3", "train.save_every=1"]) == 0
    (out / "checkpoint-3" / checkpoint.MARKER).unlink()
    capsys.readouterr()

    assert cli.main(["train", str(recipe), "--resume", str(out / "checkpoint-3")]) == 1
    err = capsys.readouterr().err
    assert f"twinkle: error: CheckpointError: --resume: {out / 'checkpoint-3'} has lost its marker" in err
    assert "Traceback" not in err

    with caplog.at_level(logging.INFO):
        assert cli.main(["train", str(recipe), "--resume", "latest", "train.max_steps=3"]) == 0
    assert f"skipping checkpoint {out / 'checkpoint-3'}: its marker" in caplog.text
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in caplog.text

    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        (out / name / checkpoint.MARKER).unlink(missing_ok=True)
    capsys.readouterr()
    assert cli.main(["train", str(recipe), "--resume", "latest", "train.max_steps=3"]) == 1
    err = capsys.readouterr().err
    assert (f"CheckpointError: --resume latest: none of the checkpoints under {out} (checkpoint-1, checkpoint-2, "
            f"checkpoint-3) can be resumed from") in err, err
    assert "--overwrite" in err and "Traceback" not in err


# ---------------------------------------------------------------------- (c) learning rate and weight decay
@pytest.mark.parametrize(("options", "shown"), [
    ({"lr": -1}, "lr=-1"), ({"lr": math.nan}, "lr=nan"), ({"lr": math.inf}, "lr=inf"), ({"lr": "3e-4"}, "lr='3e-4'"),
    ({"lr": True}, "lr=True"), ({"lr": 1e-3, "weight_decay": -0.1}, "weight_decay=-0.1"),
    ({"lr": 1e-3, "weight_decay": math.nan}, "weight_decay=nan"),
])
def test_bad_learning_rate_or_weight_decay_is_one_config_error_naming_the_option(options, shown):
    import torch

    from twinkle_core.optim import build_optimizer

    key = shown.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^set_optimizer\('AdamW'\): {shown} is refused; {key} must be a finite "
                                          rf"number >= 0"):
        build_optimizer("AdamW", [torch.nn.Parameter(torch.zeros(2))], **options)


def test_good_learning_rates_still_build():
    import torch

    from twinkle_core.optim import build_optimizer

    weight = torch.nn.Parameter(torch.zeros(2))
    assert build_optimizer("AdamW", [weight], lr=0.0, weight_decay=0).defaults["lr"] == 0.0  # torch allows 0
    assert build_optimizer("SGD", [weight], lr=torch.tensor(0.1)).defaults["lr"] == pytest.approx(0.1)
    assert build_optimizer("AdamW", [weight], lr=3e-4, weight_decay=0.01).defaults["weight_decay"] == 0.01


def test_a_model_refuses_a_negative_learning_rate_through_set_optimizer():
    from twinkle_core.testing.reference import make_reference_model

    model = make_reference_model()
    with pytest.raises(ConfigError, match=r"lr=-1 is refused; lr must be a finite number >= 0"):
        model.set_optimizer("AdamW", lr=-1)
    model.set_optimizer("AdamW", lr=1e-3)  # and the model is still usable


# ---------------------------------------------------------------------- (d) a batch without input_ids
def test_a_batch_without_input_ids_names_the_keys_it_needs_and_has():
    import torch

    from twinkle_core.testing.conformance import make_batch
    from twinkle_core.testing.reference import make_reference_model

    model = make_reference_model()
    model.set_optimizer("AdamW", lr=1e-3)
    batch = {k: v for k, v in make_batch(1).items() if k != "input_ids"}
    for method in ("forward_backward", "forward", "forward_only"):
        with pytest.raises(ConfigError) as info:
            getattr(model, method)(inputs=batch)
        text = str(info.value)
        assert text.startswith(f"ReferenceModel.{method}(inputs=...): the batch has no 'input_ids' or "
                               f"'inputs_embeds'; it has 'attention_mask', 'labels'. A batch needs 'input_ids'"), text
        assert "task.collate(features)" in text
    with pytest.raises(ConfigError, match=r"forward_backward\(inputs=...\): inputs must be a dict of tensors, got "
                                          r"Tensor"):
        model.forward_backward(inputs=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ConfigError, match="it has no keys at all"):
        model.forward_backward(inputs={})
    model.forward_backward(inputs=make_batch(1))  # a whole batch still trains


def test_every_backend_gets_the_check(real_backend):
    import torch
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config

    from twinkle_core.tasks.causal_lm import CausalLMTask

    model = TransformersModel(config=tiny_qwen2_config(64), task=CausalLMTask(), strategy="single")
    model.set_optimizer("AdamW", lr=1e-3)
    with pytest.raises(ConfigError, match=r"TransformersModel.forward_backward\(inputs=...\): the batch has no "
                                          r"'input_ids' or 'inputs_embeds'; it has 'labels'"):
        model.forward_backward(inputs={"labels": torch.ones(2, 4, dtype=torch.long)})
    with pytest.raises(ConfigError, match=r"lr=inf is refused"):
        model.set_optimizer("AdamW", lr=math.inf)
