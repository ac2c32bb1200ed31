"""Recipe options bound to the component they configure, and the model / strategy / mesh check, before launch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from twinkle_core import ModelRecord, hookimpl
from twinkle_core.errors import ConfigError
from twinkle_core.options import accepted_options, check_options
from twinkle_core.plugins import TwinklePlugins
from twinkle_core.train.recipe import recipe_from_dict, validate_components

FAKES = "twinkle_test_options_fakes"
sys.modules.setdefault(FAKES, sys.modules[__name__])  # a stable import name for the records below


# ---------------------------------------------------------------------- components
class Base:
    def __init__(self, *, size: int = 1, name: str = "base", **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"unknown {sorted(unknown)}")


class Forwarding(Base):
    def __init__(self, *, rank: int = 8, **kwargs: Any) -> None:
        super().__init__(name="fixed", **kwargs)


class Storing:
    def __init__(self, required: int, **options: Any) -> None:
        self.options = options


class Plain:
    pass


def schedule(optimizer: Any, total_steps: int, warmup: int = 0) -> None:
    """A scheduler-like function: the caller passes the optimizer positionally."""


def test_forwarded_kwargs_follow_the_init_chain():
    accepted = accepted_options(Forwarding)
    assert accepted.names == {"rank", "size"}  # ``name`` is passed by Forwarding itself
    assert not accepted.open and not accepted.required
    check_options(Forwarding, {"rank": 4, "size": 2}, where="model.options")
    with pytest.raises(ConfigError) as info:
        check_options(Forwarding, {"sise": 2}, where="model.options")
    assert str(info.value) == ("model.options.sise: Forwarding has no option 'sise'; did you mean "
                               "model.options.size? known options: rank, size")


def test_stored_kwargs_cannot_be_checked_but_required_arguments_can():
    accepted = accepted_options(Storing)
    assert accepted.open and accepted.required == {"required"}
    check_options(Storing, {"required": 1, "anything": 2}, where="task_options")
    with pytest.raises(ConfigError, match=r"^task_options: Storing requires required; set task_options\.required$"):
        check_options(Storing, {"anything": 2}, where="task_options")


def test_a_class_without_init_takes_no_options():
    with pytest.raises(ConfigError, match="Plain has no option 'x'; known options: none"):
        check_options(Plain, {"x": 1}, where="loss.options")


def test_provided_and_positional_arguments():
    provided = {"total_steps": "train.max_steps"}
    check_options(schedule, {"warmup": 3}, where="lr_scheduler.options", positional=1, provided=provided)
    with pytest.raises(ConfigError) as info:
        check_options(schedule, {"total_steps": 3, "warmpu": 1}, where="lr_scheduler.options", positional=1,
                      provided=provided)
    assert str(info.value).splitlines() == [
        "invalid options:",
        "  lr_scheduler.options.total_steps: is set by the recipe itself; use train.max_steps instead",
        "  lr_scheduler.options.warmpu: schedule has no option 'warmpu'; did you mean lr_scheduler.options.warmup? "
        "known options: warmup",
    ]
    with pytest.raises(ConfigError, match="did you mean train.max_steps"):
        check_options(schedule, {"total_step": 3}, where="lr_scheduler.options", positional=1, provided=provided)


# ---------------------------------------------------------------------- recipes
class ToyModel:
    """Takes what the training loop passes to every model class, plus ``rank``."""

    supported_strategies: tuple[str, ...] | None = None

    def __init__(self, *, model_id: Any = None, config: Any = None, strategy: Any = "single",
                 strategy_options: Any = None, mesh: Any = None, precision: Any = "no", task: Any = None,
                 tokenizer: Any = None, trust_remote_code: Any = None, attn_implementation: Any = None,
                 gradient_checkpointing: bool = False, seed: int = 42, rank: int = 8, **unknown: Any) -> None:
        if unknown:
            raise ConfigError(f"ToyModel got unknown option(s) {sorted(unknown)}")


class MegatronOnlyModel(ToyModel):
    supported_strategies = ("megatron",)


@hookimpl
def twinkle_register_models():
    yield ModelRecord("ToyModel", f"{FAKES}:ToyModel")
    yield ModelRecord("MegatronOnlyModel", f"{FAKES}:MegatronOnlyModel")


@pytest.fixture(scope="module")
def plugins():
    return TwinklePlugins(autoload=False, disabled=[], extra_modules=[FAKES])


def recipe(**sections: Any):
    return recipe_from_dict({"model": {"class_name": "ToyModel", "model_id": "/m"}, "data": {"train": "/d"},
                             **sections})


def test_a_valid_recipe_passes(plugins):
    validate_components(recipe(model={"class_name": "ToyModel", "model_id": "/m", "options": {"rank": 4}},
                               optimizer={"options": {"betas": [0.9, 0.95]}},
                               lr_scheduler={"options": {"min_lr_ratio": 0.1}},
                               loss={"options": {"label_smoothing": 0.1}},
                               data={"train": "/d", "options": {"truncation": "left"}},
                               train={"evaluate_options": {"anything": 1}}), plugins)


@pytest.mark.parametrize(("sections", "message"), [
    ({"model": {"class_name": "ToyModel", "model_id": "/m", "options": {"rnak": 4}}},
     "model.options.rnak: ToyModel has no option 'rnak'; did you mean model.options.rank? known options: rank"),
    ({"model": {"class_name": "ToyModel", "model_id": "/m", "options": {"attn_implementaton": "sdpa"}}},
     "did you mean model.attn_implementation?"),
    ({"optimizer": {"options": {"bets": [0.9, 0.95]}}},
     "optimizer.options.bets: AdamW has no option 'bets'; did you mean optimizer.options.betas?"),
    ({"optimizer": {"options": {"lr": 0.1}}}, "optimizer.options.lr: is set by the recipe itself; use optimizer.lr"),
    ({"lr_scheduler": {"options": {"min_lr": 0.1}}}, "did you mean lr_scheduler.options.min_lr_ratio?"),
    ({"loss": {"options": {"label_smothing": 0.1}}}, "did you mean loss.options.label_smoothing?"),
    ({"data": {"train": "/d", "options": {"truncaton": "left"}}}, "did you mean data.options.truncation?"),
    ({"mesh": {"tp": 2}}, "strategy 'single' implements only the mesh dimension(s) none (one process); this mesh has tp=2"),
    ({"model": {"class_name": "MegatronOnlyModel", "model_id": "/m"}, "strategy": "single"},
     "MegatronOnlyModel runs on the 'megatron' strategy only; got strategy 'single'"),
])
def test_bad_options_and_combinations_fail_before_anything_is_built(plugins, sections, message):
    with pytest.raises(ConfigError) as info:
        validate_components(recipe(**sections), plugins)
    assert message in str(info.value)


def test_cli_fails_before_torchrun_for_an_impossible_combination(tmp_path):
    pytest.importorskip("twinkle_backend_hf")
    path = tmp_path / "bad.yaml"
    (tmp_path / "model").mkdir()  # the files exist: only the combination is wrong
    (tmp_path / "data.jsonl").write_text("{}\n")
    path.write_text(textwrap.dedent("""
        model: {class_name: TransformersModel, model_id: ./model}
        strategy: {name: ddp}
        mesh: {tp: 2}
        data: {train: data.jsonl}
        train: {output_dir: out}
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_") and k not in ("WORLD_SIZE", "RANK")}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(path), "--nproc-per-node", "2"],
                            capture_output=True, text=True, env=env, timeout=300)
    print(f"twinkle train bad.yaml -> error in {time.perf_counter() - started:.1f} s")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "strategy 'ddp' implements only the mesh dimension(s) dp; this mesh has tp=2" in result.stderr
    assert "torch.distributed" not in result.stderr and not (tmp_path / "out").exists()
