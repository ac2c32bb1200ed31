"""Bad input is one clear error naming the key, file, line or name, not a traceback or a silent NaN run."""

from __future__ import annotations

import json
import textwrap

import pytest

from twinkle_core.errors import ConfigError, DataFormatError, SourceError
from twinkle_core.names import validate_name
from twinkle_core.sources.local import LocalSource, check_model_directory
from twinkle_core.train.recipe import load_recipe, recipe_from_dict

MINIMAL = {"model": {"model_id": "/models/tiny"}, "data": {"train": "/data/train.jsonl"}}
CONVERSATION = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("transformers")
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


def task(**options):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    return CausalLMTask(**options)


# ---------------------------------------------------------------------- recipe numbers
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan"])
def test_non_finite_learning_rate_is_refused(tmp_path, value):
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(f"""
        model: {{model_id: /m}}
        data: {{train: /d.jsonl}}
        optimizer: {{lr: {value}}}
    """))
    with pytest.raises(ConfigError, match=r"recipe\.yaml: optimizer\.lr: must be a finite number, got -?(nan|inf)$"):
        load_recipe(path)


@pytest.mark.parametrize("key", ["optimizer.weight_decay", "train.max_grad_norm", "lr_scheduler.warmup_ratio"])
def test_non_finite_float_keys_are_refused(key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be a finite number, got nan$"):
        recipe_from_dict(MINIMAL, [f"{key}=.nan"])


def test_max_length_too_small_for_a_sample(tok):
    with pytest.raises(ConfigError, match=r"^data\.max_length: must be at least 2 to hold a prompt and an answer"):
        recipe_from_dict(MINIMAL, ["data.max_length=1"])
    with pytest.raises(ConfigError, match="max_length must be at least 2"):
        task().load_dataset([CONVERSATION], tok, max_length=1)
    with pytest.raises(DataFormatError, match="no sample has a trained token left after truncating to max_length=4"):
        task().load_dataset([CONVERSATION], tok, max_length=4)  # the prompt alone is longer


def test_unknown_truncation_side(tok):
    for key in ("data.options.truncation", "task_options.truncation"):
        with pytest.raises(ConfigError, match=rf"^{key}: must be one of 'right', 'left', 'error', got 'middle'$"):
            recipe_from_dict(MINIMAL, [f"{key}=middle"])
    with pytest.raises(ConfigError, match="truncation must be one of 'right', 'left', 'error', got 'middle'"):
        task(truncation="middle").load_dataset([CONVERSATION], tok)


def test_left_truncation_keeps_the_end(tok):
    full = task().load_dataset([CONVERSATION], tok)[0]
    short = task(truncation="left").load_dataset([CONVERSATION], tok, max_length=6)[0]
    assert short.input_ids == full.input_ids[-6:]
    assert short.labels[0] == -100 and short.labels[1:] == full.labels[-5:]


# ---------------------------------------------------------------------- tokenizer and data files
def test_tokenizer_without_chat_template(tok):
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    plain = build_tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template.*set model.tokenizer.*data.mode: pretrain"):
        task().load_dataset([CONVERSATION], plain)
    assert task().load_dataset([{"text": "hello"}], plain, mode="pretrain")  # pretrain data needs none


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_empty_data_file_names_the_file(tok, tmp_path, text):
    path = tmp_path / "train.jsonl"
    path.write_text(text)
    with pytest.raises(DataFormatError, match=r"train\.jsonl: the file is empty") as info:
        task().load_dataset(path, tok)
    assert info.value.path == str(path)


def test_non_utf8_jsonl_names_file_and_line(tok, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes((json.dumps(CONVERSATION) + "\n").encode() + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataFormatError, match=r"train\.jsonl:2: not valid UTF-8 \(byte 0xe9") as info:
        task().load_dataset(path, tok)
    assert info.value.line == 2


def test_utf8_bom_is_accepted(tok, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(CONVERSATION) + "\n").encode())
    assert len(task().load_dataset(path, tok)) == 1


# ---------------------------------------------------------------------- model directories
def test_model_directory_without_config_json(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(SourceError, match=r"model directory '.*model' has no config\.json"):
        LocalSource().resolve(str(model))
    (model / "model.safetensors").unlink()
    with pytest.raises(SourceError, match=r"has no config\.json"):
        check_model_directory(model)
    (model / "config.json").write_text("{}")
    check_model_directory(model)


def test_model_directory_one_level_too_high(tmp_path):
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text("{}")
    with pytest.raises(SourceError, match=r"has no config\.json\. It is in a subdirectory: use .*qwen"):
        LocalSource().resolve(str(tmp_path))


# ---------------------------------------------------------------------- names
@pytest.mark.parametrize(("name", "reason"), [
    ("", "must not be empty"),
    ("a.b", r"must not contain '\.'"),
    ("a/b", "must not contain path separators"),
    ("a\\b", "must not contain path separators"),
    ("..", r"must not contain '\.\.'"),
    ("/abs", "must not be an absolute path"),
    ("a\nb", "must not contain control characters"),
])
def test_bad_names_are_refused(name, reason):
    with pytest.raises(ConfigError, match=rf"^adapter name .* {reason}"):
        validate_name("adapter name", name)


def test_checkpoint_names_may_contain_dots():
    for name in ("checkpoint-10", "final", "step_3.5"):
        assert validate_name("checkpoint name", name, allow_dots=True) == name
    with pytest.raises(ConfigError, match=r"^checkpoint name '\.\.' must not contain '\.\.'"):
        validate_name("checkpoint name", "..", allow_dots=True)


def test_add_adapter_to_model_refuses_a_dotted_name():
    pytest.importorskip("torch")
    from twinkle_core.testing.reference import make_reference_model

    model = make_reference_model()
    with pytest.raises(ConfigError, match=r"^adapter name 'a\.b' must not contain '\.'"):
        model.add_adapter_to_model("a.b", {"type": "lora", "r": 2})
    with pytest.raises(ConfigError, match="adapter name '' must not be empty"):
        model.add_adapter_to_model("", {"type": "lora", "r": 2})
    model.add_adapter_to_model("a_b", {"type": "lora", "r": 2})
    with pytest.raises(ConfigError, match="adapter name 'a_b' is already in use"):
        model.add_adapter_to_model("a_b", {"type": "lora", "r": 2})


@pytest.mark.parametrize("name", ["../outside", "/abs/path", "a/b", ""])
def test_checkpoint_names_stay_inside_output_dir(tmp_path, name):
    from twinkle_core.testing.reference import make_reference_model

    model = make_reference_model()
    with pytest.raises(ConfigError, match="checkpoint name"):
        model.save(name, output_dir=str(tmp_path / "out"))
    assert not (tmp_path / "outside").exists()
