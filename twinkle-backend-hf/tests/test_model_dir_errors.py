"""A local model directory transformers cannot load is one error naming the directory or its config.json and the
fix, from ``TransformersModel``, its tokenizer loader, ``twinkle train`` and ``--dry-run`` (before anything is
built), never transformers' traceback or its list of every architecture it knows."""

from __future__ import annotations

import json

import pytest
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_hf.testing import tiny_qwen2_config

from twinkle_core import cli
from twinkle_core.errors import ConfigError, SourceError, TwinkleError
from twinkle_core.train.recipe import load_recipe


def model_dir(path, **changes):
    """A model directory with only a config.json (the tiny Qwen2 one, changed by ``changes``; None drops a key)."""
    path.mkdir()
    config = {**tiny_qwen2_config(), **changes}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def recipe(tmp_path, model_id, *more, config=None):
    """A recipe training ``model_id`` (built from ``config``, a YAML mapping, when given); ``more``: other lines."""
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    path = tmp_path / "recipe.yaml"
    model = f"{{model_id: {model_id}" + (f", config: {config}}}" if config else "}")
    path.write_text("\n".join(["task: causal_lm", f"model: {model}",
                               "data: {train: train.jsonl, mode: pretrain}", *more]) + "\n")
    return path


def not_a_dump(message):
    """transformers lists every architecture it knows (hundreds); the error names one at most."""
    import transformers.models.auto.configuration_auto as auto

    named = [t for t in auto.CONFIG_MAPPING.keys() if f"'{t}'" in message or f"`{t}`" in message]  # noqa: SIM118
    assert len(named) <= 1, named
    assert "\n" not in message


# ---------------------------------------------------------------------- an unknown model_type
def test_unknown_model_type_names_the_file_the_type_and_the_fixes(tmp_path):
    path = model_dir(tmp_path / "m", model_type="qwen99")
    with pytest.raises(ConfigError) as info:
        TransformersModel(model_id=str(path))
    message = str(info.value)
    assert f"{path / 'config.json'}: model_type 'qwen99' is not an architecture transformers" in message
    assert "pip install --upgrade transformers" in message and "did you mean 'qwen" in message
    assert "model.trust_remote_code: true" in message and "auto_map" in message
    not_a_dump(message)


def test_dry_run_refuses_an_unknown_model_type_before_building(tmp_path, capsys):
    model_dir(tmp_path / "m", model_type="qwen99")
    with pytest.raises(ConfigError, match=r"recipe\.yaml: model\.model_id: .*config\.json: model_type 'qwen99'"):
        load_recipe(recipe(tmp_path, "./m"))
    assert cli.main(["train", str(recipe(tmp_path, "./m")), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinkle: error: ") and "model_type 'qwen99'" in err and "Traceback" not in err


def test_a_model_with_its_own_code_is_left_to_the_trust_switch(tmp_path, monkeypatch):
    monkeypatch.delenv("TWINKLE_TRUST_REMOTE_CODE", raising=False)
    path = model_dir(tmp_path / "m", model_type="qwen99", auto_map={"AutoConfig": "configuration_x.XConfig"})
    TransformersModel.check_model_directory(str(path))
    load_recipe(recipe(tmp_path, "./m"))  # the switch is asked for when the model is loaded
    with pytest.raises(ConfigError, match="custom code.*model.trust_remote_code: true"):
        TransformersModel(model_id=str(path))


@pytest.mark.parametrize(("content", "expected"), [
    ('{"model_type": ', r"config\.json: not valid JSON \(line 1, column 16"),
    ("[1, 2]", r"config\.json: must be a JSON object of settings, got a list"),
    ("{}", r"config\.json has no model_type, so transformers cannot tell which architecture"),
])
def test_a_damaged_config_names_the_file(tmp_path, content, expected):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(content)
    with pytest.raises(TwinkleError, match=expected):
        TransformersModel(model_id=str(path))
    with pytest.raises(ConfigError, match=rf"model\.model_id: .*{expected}"):
        load_recipe(recipe(tmp_path, "./m"))


def test_a_known_model_type_passes(tmp_path):
    path = model_dir(tmp_path / "m")
    TransformersModel.check_model_directory(str(path))
    assert load_recipe(recipe(tmp_path, "./m")).model.model_id == str(path)


def test_model_config_in_the_recipe_skips_the_directory_s_config(tmp_path):
    model_dir(tmp_path / "m", model_type="qwen99")
    load_recipe(recipe(tmp_path, "./m", config="{model_type: qwen2}"))


# ---------------------------------------------------------------------- no config.json
def test_an_empty_model_directory_names_the_directory(tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    with pytest.raises(SourceError, match=r"model directory '.*empty' is empty: it has no config\.json"):
        TransformersModel(model_id=str(path))
    with pytest.raises(SourceError, match=r"cannot load a tokenizer from '.*empty': the directory is empty"):
        TransformersModel.load_tokenizer(str(path))


def test_twinkle_train_with_an_empty_model_directory_is_one_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    path = recipe(tmp_path, "./empty", "train: {output_dir: out, max_steps: 1}")
    assert cli.main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("twinkle: error: SourceError: ") and "empty" in err and "Traceback" not in err


def test_a_directory_with_only_weights_is_refused_by_the_dry_run(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"")
    expected = r"model directory '.*m' has no config\.json \(it holds model\.safetensors\)"
    with pytest.raises(ConfigError, match=rf"model\.model_id: {expected}"):
        load_recipe(recipe(tmp_path, "./m"))
    with pytest.raises(SourceError, match=expected):
        TransformersModel(model_id=str(path))


def test_a_tokenizer_only_directory_still_loads(tmp_path):
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")
    assert TransformersModel.load_tokenizer(str(tmp_path / "tok")) is not None
    load_recipe(recipe(tmp_path, "./tok", config="{model_type: qwen2}"))


def test_a_model_directory_without_a_tokenizer_says_so(tmp_path):
    path = model_dir(tmp_path / "m")  # transformers would build an empty tokenizer from config.json alone
    (path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SourceError, match=r"cannot load a tokenizer from '.*m': the directory holds no tokenizer file "
                                          r"\(.*; it holds config\.json, model\.safetensors\); .*model\.tokenizer"):
        TransformersModel.load_tokenizer(str(path))


def test_a_tokenizer_transformers_cannot_place_names_the_model_type(tmp_path):
    path = model_dir(tmp_path / "m", model_type="qwen99")
    (path / "tokenizer_config.json").write_text("{}")  # no tokenizer_class: transformers asks config.json
    with pytest.raises(ConfigError, match=r"config\.json: model_type 'qwen99'") as info:
        TransformersModel.load_tokenizer(str(path))
    assert info.value.__cause__ is not None  # transformers' own error stays available


def test_a_model_read_from_a_subfolder_is_left_to_transformers(tmp_path):
    (tmp_path / "m").mkdir()
    TransformersModel.check_model_directory(str(tmp_path / "m"), model_kwargs={"subfolder": "main"})
    with pytest.raises(SourceError, match="is empty"):
        TransformersModel.check_model_directory(str(tmp_path / "m"), model_kwargs={})
