"""Recipe validation: key paths, suggestions, types, overrides and relative paths."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from twinkle_core.errors import ConfigError, PluginNotFoundError
from twinkle_core.plugins import TwinklePlugins
from twinkle_core.train.recipe import (
    Recipe,
    apply_overrides,
    load_recipe,
    parse_override,
    recipe_from_dict,
    recipe_to_dict,
    validate_plugin_names,
)

MINIMAL = {"model": {"model_id": "/models/tiny"}, "data": {"train": "/data/train.jsonl"}}


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults():
    recipe = recipe_from_dict(MINIMAL)
    assert isinstance(recipe, Recipe)
    assert recipe.task == "causal_lm"
    assert recipe.model.class_name == "TransformersModel"
    assert recipe.model.trust_remote_code is None
    assert recipe.strategy.name is None and recipe.precision == "no"  # None: twinkle_core.mesh.default_strategy
    assert recipe.optimizer.name == "AdamW" and recipe.lr_scheduler.name == "cosine"
    assert recipe.train.gradient_accumulation_steps == 1 and recipe.train.max_grad_norm == 1.0
    assert recipe.train.evaluate_options is None


def test_full_recipe_round_trips(tmp_path):
    path = write(tmp_path, """
        task: causal_lm
        task_options: {pad_to_multiple_of: 8}
        model:
          class_name: TransformersModel
          model_id: hf://Qwen/Qwen2.5-0.5B
          revision: main
          trust_remote_code: false
          attn_implementation: sdpa
          gradient_checkpointing: true
          adapter: {type: lora, r: 8, alpha: 16, target_modules: [q_proj, v_proj]}
          options: {torch_dtype: bfloat16}
        strategy: {name: ddp, options: {find_unused_parameters: false}}
        mesh: {dp: 2}
        precision: bf16
        data: {train: hf://datasets/x, eval: hf://datasets/y, max_length: 512, mode: chat, packing: true,
               batch_size: 4, shuffle: false, seed: 3, options: {truncation: left}}
        loss: {name: cross_entropy, options: {label_smoothing: 0.1}}
        optimizer: {name: AdamW, lr: 1e-4, weight_decay: 0.01, options: {betas: [0.9, 0.95]}}
        lr_scheduler: {name: linear, warmup_ratio: 0.1, options: {min_lr_ratio: 0.1}}
        train:
          output_dir: /tmp/run
          max_steps: 100
          num_epochs: 2
          gradient_accumulation_steps: 4
          max_grad_norm: null
          seed: 1
          log_every: 5
          eval_every: 50
          save_every: 25
          save_total_limit: 2
          eval_before_training: true
          evaluate_options: {max_new_tokens: 16}
          resume: latest
    """)
    recipe = load_recipe(path)
    assert recipe.optimizer.lr == pytest.approx(1e-4)  # YAML reads 1e-4 as a string; it is coerced
    assert recipe.model.adapter["target_modules"] == ["q_proj", "v_proj"]
    assert recipe.mesh == {"dp": 2}
    assert recipe.train.max_grad_norm is None
    again = recipe_from_dict(recipe_to_dict(recipe))
    assert again == recipe


def test_typo_key_names_the_path_and_suggests():
    with pytest.raises(ConfigError) as info:
        recipe_from_dict({**MINIMAL, "train": {"max_step": 10}})
    assert str(info.value) == "train.max_step: unknown key; did you mean train.max_steps?"


def test_misplaced_key_suggests_where_it_lives():
    with pytest.raises(ConfigError, match=r"train\.lerning_rate: unknown key; did you mean optimizer\.lr\?"):
        recipe_from_dict({**MINIMAL, "train": {"lerning_rate": 1e-4}})
    with pytest.raises(ConfigError, match=r"^optimzer: unknown key; did you mean optimizer\?"):
        recipe_from_dict({**MINIMAL, "optimzer": {"lr": 1.0}})
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size: unknown key; did you mean data\.batch_size"):
        recipe_from_dict({**MINIMAL, "per_device_train_batch_size": 4})


def test_unknown_key_without_a_close_match_lists_the_keys():
    with pytest.raises(ConfigError, match=r"strategy\.zzz: unknown key; known keys: name, options"):
        recipe_from_dict({**MINIMAL, "strategy": {"zzz": 1}})


@pytest.mark.parametrize(("override", "message"), [
    ("train.max_steps=ten", "train.max_steps: expected an integer or null, got string 'ten'"),
    ("train.max_steps=true", "train.max_steps: expected an integer or null, got boolean True"),
    ("optimizer.lr=fast", "optimizer.lr: expected a number, got string 'fast'"),
    ("data.shuffle=1", "data.shuffle: expected true or false, got integer 1"),
    ("model.adapter=[1]", "model.adapter: expected a mapping or null, got list [1]"),
    ("train=5", "train: expected a mapping, got integer 5"),
    ("precision=16", "precision: expected a string, got integer 16"),
])
def test_wrong_types_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(MINIMAL, [override])
    assert message in str(info.value)


def test_several_errors_are_reported_together():
    with pytest.raises(ConfigError) as info:
        recipe_from_dict({**MINIMAL, "train": {"max_step": 1, "seed": "x"}})
    text = str(info.value)
    assert text.startswith("invalid recipe:")
    assert "train.max_step: unknown key" in text and "train.seed: expected an integer" in text


@pytest.mark.parametrize(("raw", "message"), [
    ({"data": {"train": "x"}}, "set model.model_id"),
    ({"model": {"config": {"hidden_size": 8}, "tokenizer": "t"}, "data": {"train": "x"}}, "must contain model_type"),
    ({"model": {"config": {"model_type": "llama"}}, "data": {"train": "x"}}, "model.tokenizer: is required"),
    ({"model": {"model_id": "m"}}, "data.train: is required"),
    ({**MINIMAL, "data": {"train": "x", "batch_size": 0}}, "data.batch_size: must be > 0"),
    ({**MINIMAL, "data": {"train": "x", "mode": "sft"}}, "data.mode: must be 'chat' or 'pretrain'"),
    ({**MINIMAL, "optimizer": {"lr": -1}}, "optimizer.lr: must be > 0"),
    ({**MINIMAL, "lr_scheduler": {"warmup_steps": 3, "warmup_ratio": 0.1}}, "not both"),
    ({**MINIMAL, "lr_scheduler": {"warmup_ratio": 1.5}}, "lr_scheduler.warmup_ratio: must be in [0, 1)"),
    ({**MINIMAL, "train": {"gradient_accumulation_steps": 0}}, "train.gradient_accumulation_steps: must be > 0"),
    ({**MINIMAL, "train": {"eval_every": 10}}, "train.eval_every: is set but there is nothing to evaluate"),
    ({**MINIMAL, "mesh": {"dp": 2, "tq": 2}}, "mesh.tq: unknown mesh dimension"),
    ({**MINIMAL, "mesh": {"dp": 0}}, "mesh.dp must be a positive integer"),
    ({**MINIMAL, "model": {"model_id": "m", "options": {"precision": "bf16"}}},
     "model.options.precision: is set by the recipe itself; use precision instead"),
])
def test_semantic_checks(raw, message):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(raw)
    assert message in str(info.value)


def test_config_only_model_is_valid():
    recipe = recipe_from_dict({"model": {"config": {"model_type": "qwen2", "hidden_size": 64}, "tokenizer": "/t"},
                               "data": {"train": "/d"}})
    assert recipe.model.model_id is None and recipe.model.config["model_type"] == "qwen2"


def test_overrides_parse_values_as_yaml():
    recipe = recipe_from_dict(MINIMAL, [
        "optimizer.lr=3e-4", "train.max_steps=10", "data.shuffle=false", "model.adapter.r=16",
        "model.adapter.target_modules=[q_proj, v_proj]", "strategy.options={static_graph: true}",
        "train.max_grad_norm=null", "task_options.pad_to_multiple_of=8", "model.attn_implementation=sdpa",
    ])
    assert recipe.optimizer.lr == pytest.approx(3e-4)
    assert recipe.train.max_steps == 10
    assert recipe.data.shuffle is False
    assert recipe.model.adapter == {"r": 16, "target_modules": ["q_proj", "v_proj"]}
    assert recipe.strategy.options == {"static_graph": True}
    assert recipe.train.max_grad_norm is None
    assert recipe.task_options == {"pad_to_multiple_of": 8}


def test_override_errors():
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        parse_override("train.max_steps")
    with pytest.raises(ConfigError, match="malformed key path"):
        parse_override("train..max_steps=1")
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_overrides({"precision": "bf16"}, ["precision.x=1"])
    with pytest.raises(ConfigError, match=r"train\.max_stepz: unknown key; did you mean train\.max_steps\?"):
        recipe_from_dict(MINIMAL, ["train.max_stepz=3"])
    assert parse_override("a.b=") == (["a", "b"], None)
    assert parse_override("a=x=y") == (["a"], "x=y")


def test_relative_paths_are_relative_to_the_recipe_file(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes"
    (recipes / "data").mkdir(parents=True)
    (recipes / "data" / "train.jsonl").write_text("{}\n")
    (recipes / "tiny").mkdir()
    path = write(recipes, """
        model: {model_id: ./tiny, tokenizer: hf://org/tok}
        data: {train: data/train.jsonl, eval: org/hub-dataset}
        train: {output_dir: runs/a}
    """)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(path, ["data.eval=local.jsonl"])
    assert recipe.model.model_id == str(recipes / "tiny")
    assert recipe.model.tokenizer == "hf://org/tok"  # URIs are left alone
    assert recipe.data.train == str(recipes / "data" / "train.jsonl")
    assert recipe.train.output_dir == str(recipes / "runs" / "a")
    assert recipe.data.eval == "local.jsonl"  # overrides are relative to the working directory
    unresolved = load_recipe(path)
    assert unresolved.data.eval == "org/hub-dataset"  # not a file next to the recipe: kept as written


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    bad = write(tmp_path, "model: {model_id: x\ndata: [", "bad.yaml")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: not valid YAML"):
        load_recipe(bad)
    listy = write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_recipe(listy)
    typo = write(tmp_path, "model: {model_id: /m}\ndata: {train: /d}\ntrain: {save_evry: 3}\n", "typo.yaml")
    with pytest.raises(ConfigError) as info:
        load_recipe(typo)
    assert str(typo) in str(info.value) and "train.save_evry: unknown key; did you mean train.save_every?" in str(
        info.value)


def test_plugin_names_are_checked_before_anything_is_built():
    plugins = TwinklePlugins(autoload=False, disabled=[], extra_modules=[])
    recipe = recipe_from_dict(MINIMAL)
    with pytest.raises(PluginNotFoundError) as info:
        validate_plugin_names(recipe, plugins)
    assert str(info.value).startswith("model.class_name: no model named 'TransformersModel'")
    assert "pip install twinkle-backend-hf" in str(info.value)
    with pytest.raises(PluginNotFoundError, match="^precision: no precision named 'bf17'"):
        validate_plugin_names(recipe_from_dict({**MINIMAL, "model": {"model_id": "/m", "class_name": "X"},
                                                "precision": "bf17"}), _with_model(plugins, "X"))


def _with_model(plugins, name):
    from twinkle_core import ModelRecord, hookimpl

    class Models:
        @hookimpl
        def twinkle_register_models(self):
            yield ModelRecord(name, "builtins:object")

    plugins.pm.register(Models(), name="models-for-test")
    plugins._records.clear()
    return plugins


def test_recipe_module_does_not_import_torch():
    code = ("import sys; from twinkle_core.train.recipe import recipe_from_dict; "
            "recipe_from_dict({'model': {'model_id': 'm'}, 'data': {'train': 'd'}, 'mesh': {'dp': 1}}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_semantic_rule_that_fails_is_reported():
    with pytest.raises(ConfigError) as info:
        recipe_from_dict({"model": {"model_id": "m", "class_name": ""}, "data": {"train": "d", "batch_size": 0},
                          "optimizer": {"weight_decay": -0.1}, "lr_scheduler": {"warmup_ratio": 1.0},
                          "train": {"output_dir": ""}, "mesh": {"fsdq": 2}})
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid recipe:"
    assert sorted(line.strip() for line in lines[1:]) == [
        "data.batch_size: must be > 0, got 0",
        "lr_scheduler.warmup_ratio: must be in [0, 1), got 1.0",
        "mesh.fsdq: unknown mesh dimension; did you mean mesh.fsdp?",
        "model.class_name: must not be empty",
        "optimizer.weight_decay: must be >= 0, got -0.1",
        "train.output_dir: must not be empty",
    ]


def test_a_section_with_a_name_takes_the_name_alone():
    # the spec's own shorthand (strategy=accelerate), in a file or on the command line
    recipe = recipe_from_dict({"task": "causal_lm", "model": {"class_name": "TransformersModel", "model_id": "m"},
                               "strategy": "ddp", "loss": "cross_entropy", "optimizer": "SGD",
                               "data": {"train": "x.jsonl"}}, ["lr_scheduler=cosine", "strategy=accelerate"])
    assert (recipe.strategy.name, recipe.strategy.options) == ("accelerate", {})
    assert (recipe.loss.name, recipe.optimizer.name, recipe.lr_scheduler.name) == ("cross_entropy", "SGD", "cosine")
    with pytest.raises(ConfigError, match="data: expected a mapping, got string"):
        recipe_from_dict({"task": "causal_lm", "model": {"class_name": "TransformersModel", "model_id": "m"},
                          "data": "x.jsonl"})


def test_local_paths_that_do_not_exist_are_named(tmp_path):
    from twinkle_core.train.recipe import check_paths

    (tmp_path / "train.jsonl").write_text("{}\n")
    base = {"task": "causal_lm", "model": {"class_name": "TransformersModel", "model_id": "hf://Qwen/Qwen2.5-0.5B"},
            "data": {"train": str(tmp_path / "train.jsonl")}}
    check_paths(recipe_from_dict(base))  # a hub id: resolved later, not checked here
    bare = {**base, "model": {"class_name": "TransformersModel", "model_id": "Qwen/Qwen2.5-0.5B"}}
    with pytest.raises(ConfigError, match="model.model_id: model path 'Qwen/Qwen2.5-0.5B' does not exist .*"
                                          "write hf://Qwen/Qwen2.5-0.5B"):
        check_paths(recipe_from_dict(bare))  # without a scheme it is a local path, as resolving it says
    bad = {**base, "model": {"class_name": "TransformersModel", "model_id": str(tmp_path / "nowhere")},
           "data": {"train": str(tmp_path / "missing.jsonl"), "eval": str(tmp_path / "train.jsonl")}}
    with pytest.raises(ConfigError) as info:
        check_paths(recipe_from_dict(bad))
    assert "data.train: " in str(info.value) and "missing.jsonl' does not exist" in str(info.value)
    assert "model.model_id: the directory" in str(info.value) and "data.eval" not in str(info.value)
