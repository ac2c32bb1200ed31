"""Every must-fail input of ``twinkle chat / export / eval`` ends in one line naming the file (or option) and the
fix, with a non-zero exit status: never a Python traceback.

Tiny models (hidden 32, 2 layers) are saved once per module; each case copies one and breaks it the way a disk,
a copy or an edit breaks a checkpoint. The commands run in-process through ``twinkle_core.cli.main``, as
``twinkle`` runs them: an exception that is not a :class:`~twinkle_core.errors.TwinkleError` escapes ``main`` and
fails the test (it would be a traceback on the terminal).

Also here: a checkpoint whose Twinkle marker was deleted still loads, saying that it cannot be verified.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from twinkle_core.checkpoint_layout import CheckpointLayout
from twinkle_core.cli import main

pytest.importorskip("transformers")
pytest.importorskip("peft")

MARKER = CheckpointLayout.MARKER
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


# ---------------------------------------------------------------------- fixtures
def _tiny_model(tokenizer):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from twinkle_backend_hf.testing import tiny_qwen2_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_qwen2_config(vocab_size=len(tokenizer))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from twinkle_core.checkpoint import atomic_directory
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("command_errors")
    tokenizer = build_tiny_tokenizer()
    model = _tiny_model(tokenizer)
    plain, sharded = root / "plain", root / "sharded"
    for directory, shard in ((plain, "5GB"), (sharded, "30KB")):
        model.save_pretrained(str(directory), safe_serialization=True, max_shard_size=shard)
        tokenizer.save_pretrained(str(directory))
    assert (sharded / "model.safetensors.index.json").is_file()
    marked = root / "run" / "checkpoint-2"
    with atomic_directory(str(marked), is_main=True, metadata={"step": 2}) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    adapter = root / "adapter"
    peft_model = get_peft_model(_tiny_model(tokenizer), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    peft_model.save_pretrained(str(adapter), safe_serialization=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(plain)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    data = root / "eval.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("abc", "hello")))
    return {"plain": plain, "sharded": sharded, "marked": marked, "adapter": adapter, "data": data}


@pytest.fixture(autouse=True)
def no_remote_code(monkeypatch):
    monkeypatch.delenv("TWINKLE_TRUST_REMOTE_CODE", raising=False)


# ---------------------------------------------------------------------- breaking a checkpoint
def _copy(saved: dict, work: Path, which: str = "plain") -> Path:
    target = work / which
    shutil.copytree(saved[which], target)
    return target


def _write(path: Path, content: str | bytes) -> None:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


class Unpickled:
    """Unpickling this makes a directory: a pickled weights file that was loaded leaves the sentinel behind."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.mkdir, (str(self.sentinel),))


def _pickled(path: Path) -> None:
    import pickle

    path.write_bytes(pickle.dumps({"model.embed_tokens.weight": Unpickled(path.parent.parent / "UNPICKLED")}))


def config_without_weights(saved, work):
    ckpt = _copy(saved, work)
    (ckpt / "model.safetensors").unlink()
    return ckpt


def edited_config(content: str | bytes) -> Callable:
    def make(saved, work):
        ckpt = _copy(saved, work)
        _write(ckpt / "config.json", content)
        return ckpt
    return make


def config_with(**changes) -> Callable:
    def make(saved, work):
        ckpt = _copy(saved, work)
        config = json.loads((ckpt / "config.json").read_text())
        config.update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del config[key]
        (ckpt / "config.json").write_text(json.dumps(config))
        return ckpt
    return make


def pickled_weights(saved, work):
    ckpt = _copy(saved, work)
    (ckpt / "model.safetensors").unlink()
    _pickled(ckpt / "pytorch_model.bin")
    return ckpt


def pickled_shards(saved, work):
    ckpt = _copy(saved, work)
    (ckpt / "model.safetensors").unlink()
    _pickled(ckpt / "pytorch_model-00001-of-00001.bin")
    (ckpt / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "pytorch_model-00001-of-00001.bin"}}))
    return ckpt


AUTO_MAP = {"AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
NEVER_RUN = "raise SystemExit('this code must never run')\n"


def remote_code(model_type: str) -> Callable:
    """config.json names custom code (``auto_map``): a model type transformers lacks needs it, a known one not."""
    def make(saved, work):
        ckpt = _copy(saved, work)
        config = json.loads((ckpt / "config.json").read_text())
        config.update(model_type=model_type, auto_map=AUTO_MAP)
        (ckpt / "config.json").write_text(json.dumps(config))
        for module in ("configuration_custom.py", "modeling_custom.py"):
            (ckpt / module).write_text(NEVER_RUN)
        return ckpt
    return make


def remote_code_tokenizer(tokenizer_class: str) -> Callable:
    """tokenizer_config.json names custom code: a class transformers lacks needs it, a known one not."""
    def make(saved, work):
        ckpt = _copy(saved, work)
        config = json.loads((ckpt / "tokenizer_config.json").read_text())
        config.update(tokenizer_class=tokenizer_class,
                      auto_map={"AutoTokenizer": [f"tokenization_custom.{tokenizer_class}", None]})
        (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
        (ckpt / "tokenization_custom.py").write_text(NEVER_RUN)
        return ckpt
    return make


def weights_without(tensor: str) -> Callable:
    def make(saved, work):
        from safetensors.torch import load_file, save_file

        ckpt = _copy(saved, work)
        weights = load_file(str(ckpt / "model.safetensors"))
        del weights[tensor]
        save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        return ckpt
    return make


def truncated_weights(saved, work):
    ckpt = _copy(saved, work)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return ckpt


def garbage_weights(saved, work):
    ckpt = _copy(saved, work)
    (ckpt / "model.safetensors").write_bytes(b"this is not a safetensors file\n" * 4)
    return ckpt


def missing_shard(saved, work):
    ckpt = _copy(saved, work, "sharded")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    shards[-1].unlink()
    return ckpt


def truncated_shard(saved, work):
    ckpt = _copy(saved, work, "sharded")
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return ckpt


def garbage_index(saved, work):
    ckpt = _copy(saved, work, "sharded")
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    return ckpt


def index_outside(saved, work):
    """The shard index names a file outside the checkpoint (an edit, or a hostile copy)."""
    ckpt = _copy(saved, work, "sharded")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "../plain/model.safetensors" for k in index["weight_map"]}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    _copy(saved, work)
    return ckpt


def without_tokenizer(saved, work):
    ckpt = _copy(saved, work)
    for name in TOKENIZER_FILES:
        (ckpt / name).unlink(missing_ok=True)
    return ckpt


def garbage_file(name: str, which: str = "plain", content: str = '{"truncated": ') -> Callable:
    def make(saved, work):
        ckpt = _copy(saved, work, which)
        (ckpt / name).write_text(content)
        return ckpt
    return make


def marker_garbage(saved, work):
    ckpt = _copy(saved, work, "marked")
    (ckpt / MARKER).write_text("{not json")
    return ckpt


def adapter_without_weights(saved, work):
    ckpt = _copy(saved, work, "adapter")
    (ckpt / "adapter_model.safetensors").unlink()
    return ckpt


def adapter_pickled(saved, work):
    ckpt = _copy(saved, work, "adapter")
    (ckpt / "adapter_model.safetensors").unlink()
    _pickled(ckpt / "adapter_model.bin")
    return ckpt


def adapter_truncated(saved, work):
    ckpt = _copy(saved, work, "adapter")
    weights = ckpt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    return ckpt


def adapter_config_with(**changes) -> Callable:
    def make(saved, work):
        ckpt = _copy(saved, work, "adapter")
        config = json.loads((ckpt / "adapter_config.json").read_text())
        config.update(changes)
        (ckpt / "adapter_config.json").write_text(json.dumps(config))
        return ckpt
    return make


def adapter_base_without_weights(saved, work):
    base = config_without_weights(saved, work)
    ckpt = _copy(saved, work, "adapter")
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    return ckpt


def adapter_base_pickled(saved, work):
    base = pickled_weights(saved, work)
    ckpt = _copy(saved, work, "adapter")
    config = json.loads((ckpt / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    return ckpt


def adapter_base_not_a_model(saved, work):
    (work / "empty").mkdir()
    return adapter_config_with(base_model_name_or_path=str(work / "empty"))(saved, work)


def adapter_for_another_model(saved, work):
    """An adapter whose base has other shapes (hidden 64 instead of 32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = _copy(saved, work)
    config = json.loads((base / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128)
    (base / "model.safetensors").unlink()
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(str(base))
    ckpt = _copy(saved, work, "adapter")
    adapter_config = json.loads((ckpt / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(base)
    (ckpt / "adapter_config.json").write_text(json.dumps(adapter_config))
    return ckpt


# ---------------------------------------------------------------------- the cases
@dataclass(frozen=True)
class Case:
    """``make(saved, work)`` builds the broken checkpoint; the one error line must contain ``names`` (with
    ``{ckpt}`` the checkpoint's path, ``{work}`` the case's directory) and ``fix``."""

    make: Callable
    names: str
    fix: str
    commands: tuple[str, ...] = ("chat", "export", "eval")
    options: dict[str, list[str]] = field(default_factory=dict)  # extra arguments per command


CASES: dict[str, Case] = {
    "config-without-weights": Case(config_without_weights, "{ckpt}", "model.safetensors"),
    "config-not-json": Case(edited_config("{not json"), "{ckpt}/config.json", "copy"),
    "config-empty": Case(edited_config(""), "{ckpt}/config.json", "copy"),
    "config-a-list": Case(edited_config("[1, 2]"), "{ckpt}/config.json", "JSON object"),
    "config-unknown-model-type": Case(config_with(model_type="no_such_model"), "{ckpt}/config.json",
                                      "pip install -U transformers"),
    "config-without-model-type": Case(config_with(model_type=None), "{ckpt}/config.json", "model_type"),
    "config-wrong-value-type": Case(config_with(num_hidden_layers="two"), "{ckpt}", "config.json"),
    "config-other-shapes": Case(config_with(hidden_size=64, intermediate_size=128), "{ckpt}", "config.json"),
    "pickled-weights": Case(pickled_weights, "{ckpt}/pytorch_model.bin", "safetensors"),
    "pickled-shards": Case(pickled_shards, "{ckpt}/pytorch_model", "safetensors"),
    "remote-code-not-trusted": Case(remote_code("custom_tiny"), "{ckpt}/config.json", "--trust-remote-code"),
    "remote-code-tokenizer-not-trusted": Case(remote_code_tokenizer("CustomTokenizer"),
                                              "{ckpt}/tokenizer_config.json", "--trust-remote-code"),
    "weights-missing-a-tensor": Case(weights_without("model.norm.weight"), "{ckpt}", "model.norm.weight"),
    "truncated-weights": Case(truncated_weights, "{ckpt}/model.safetensors", "another copy"),
    "garbage-weights": Case(garbage_weights, "{ckpt}/model.safetensors", "another copy"),
    "missing-shard": Case(missing_shard, "{ckpt}/model-0000", "another copy"),
    "truncated-shard": Case(truncated_shard, "{ckpt}/model-00001", "another copy"),
    "garbage-shard-index": Case(garbage_index, "{ckpt}/model.safetensors.index.json", "another copy"),
    "shard-index-names-a-path": Case(index_outside, "{ckpt}/model.safetensors.index.json", "another copy"),
    "no-tokenizer": Case(without_tokenizer, "{ckpt}", "save_pretrained"),
    "garbage-tokenizer-json": Case(garbage_file("tokenizer.json"), "{ckpt}/tokenizer.json", "another copy"),
    "garbage-tokenizer-config": Case(garbage_file("tokenizer_config.json"), "{ckpt}/tokenizer_config.json",
                                     "another copy"),
    "garbage-generation-config": Case(garbage_file("generation_config.json"), "{ckpt}/generation_config.json",
                                      "another copy"),
    "tokenizer-json-wrong-schema": Case(garbage_file("tokenizer.json", content='{"version": "1.0"}'), "{ckpt}",
                                        "another copy"),
    "tokenizer-config-a-list": Case(garbage_file("tokenizer_config.json", content="[1]"),
                                    "{ckpt}/tokenizer_config.json", "JSON object"),
    "config-binary": Case(edited_config(b"\x00\xff\xfe binary"), "{ckpt}/config.json", "another copy"),
    "garbage-marker": Case(marker_garbage, f"{{ckpt}}/{MARKER}", "another copy"),
    "adapter-without-weights": Case(adapter_without_weights, "{ckpt}", "adapter_model.safetensors"),
    "adapter-pickled": Case(adapter_pickled, "{ckpt}/adapter_model.bin", "safetensors"),
    "adapter-truncated": Case(adapter_truncated, "{ckpt}/adapter_model.safetensors", "another copy"),
    "adapter-config-not-json": Case(garbage_file("adapter_config.json", "adapter"), "{ckpt}/adapter_config.json",
                                    "copy"),
    "adapter-unknown-peft-type": Case(adapter_config_with(peft_type="NO_SUCH_METHOD"), "{ckpt}/adapter_config.json",
                                      "peft"),
    "adapter-base-not-cached": Case(adapter_config_with(base_model_name_or_path="twinkle-test/no-such-model"),
                                    "twinkle-test/no-such-model", "--base"),
    "adapter-base-without-weights": Case(adapter_base_without_weights, "{work}/plain", "model.safetensors"),
    "adapter-base-pickled": Case(adapter_base_pickled, "{work}/plain/pytorch_model.bin", "safetensors"),
    "adapter-base-not-a-model": Case(adapter_base_not_a_model, "{work}/empty", "--base DIR"),
    "adapter-for-another-model": Case(adapter_for_another_model, "{ckpt}", "--base"),
    "device-not-a-device": Case(lambda saved, work: saved["plain"], "--device bogus", "cpu",
                                commands=("chat", "eval"), options={"chat": ["--device", "bogus"],
                                                                    "eval": ["--device", "bogus"]}),
    "device-not-on-this-machine": Case(lambda saved, work: saved["plain"], "--device cuda:99", "--device",
                                       commands=("chat", "eval"), options={"chat": ["--device", "cuda:99"],
                                                                           "eval": ["--device", "cuda:99"]}),
    "device-meta": Case(lambda saved, work: saved["plain"], "--device meta", "cpu",
                        commands=("chat", "eval"), options={"chat": ["--device", "meta"], "eval": ["--device", "meta"]}),
}


def _argv(command: str, ckpt: Path, saved: dict, work: Path, options: list[str]) -> list[str]:
    device = [] if "--device" in options else ["--device", "cpu"]
    if command == "chat":
        return ["chat", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2", *device, *options]
    if command == "eval":
        return ["eval", str(ckpt), str(saved["data"]), "--no-generate", *device, *options]
    return ["export", str(ckpt), "--output", str(work / "exported"), *options]


def one_error_line(capsys, *words: str) -> str:
    """The one ``twinkle: error:`` line, the last of stderr; no traceback anywhere."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("twinkle: error:")]
    assert "Traceback" not in captured.out + captured.err, captured.err
    assert len(errors) == 1 and lines[-1] == errors[0], captured.err  # one line, and nothing after it
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


MUST_FAIL = [pytest.param(name, command, id=f"{command}-{name}")
             for name, case in CASES.items() for command in case.commands]


@pytest.mark.parametrize("name, command", MUST_FAIL)
def test_must_fail_with_one_clear_line(name, command, saved, tmp_path, capsys):
    case = CASES[name]
    work = tmp_path / name
    work.mkdir()
    ckpt = case.make(saved, work)
    capsys.readouterr()
    status = main(_argv(command, ckpt, saved, tmp_path, case.options.get(command, [])))
    assert status != 0
    one_error_line(capsys, case.names.format(ckpt=ckpt, work=work), case.fix)
    assert not (tmp_path / "exported").exists()
    assert not (work / "UNPICKLED").exists(), "a pickled weights file was unpickled"


# ---------------------------------------------------------------------- output and data options
def test_eval_output_directory_is_refused(saved, tmp_path, capsys):
    for extra in ([], ["--overwrite"]):
        assert main(["eval", str(saved["plain"]), str(saved["data"]), "--output", str(tmp_path), *extra]) != 0
        one_error_line(capsys, f"--output {tmp_path}", "eval_results.json")


def test_export_output_an_existing_file_is_refused(saved, tmp_path, capsys):
    target = tmp_path / "exported"
    target.write_text("keep me")
    for extra in ([], ["--overwrite"]):
        assert main(["export", str(saved["plain"]), "--output", str(target), *extra]) != 0
        one_error_line(capsys, f"--output {target}", "new directory")
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("content, fix", [
    ("{not json\n", "JSON"),
    (b"\xff\xfe\x00binary\x00\n", "UTF-8"),
    ("", "no rows"),
    ('{"prompt": "x"}\n', "'messages'"),
], ids=["not-json", "binary", "empty", "unknown-rows"])
def test_eval_bad_data_is_one_clear_line(content, fix, saved, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    _write(data, content)
    assert main(["eval", str(saved["plain"]), str(data), "--no-generate", "--device", "cpu"]) != 0
    one_error_line(capsys, str(data), fix)


def test_eval_data_directory_is_one_clear_line(saved, tmp_path, capsys):
    assert main(["eval", str(saved["plain"]), str(tmp_path), "--no-generate", "--device", "cpu"]) != 0
    one_error_line(capsys, str(tmp_path), "JSONL")


# ---------------------------------------------------------------------- custom code
def test_custom_code_of_a_known_model_type_is_not_run_and_says_so(saved, tmp_path, capsys):
    ckpt = remote_code("qwen2")(saved, tmp_path)
    capsys.readouterr()
    assert main(_argv("chat", ckpt, saved, tmp_path, [])) == 0
    err = capsys.readouterr().err
    assert f"{ckpt / 'config.json'} names custom code (auto_map) that is not run" in err, err


def test_custom_tokenizer_code_is_not_run_and_says_so(saved, tmp_path, capsys):
    """transformers loads tokenizer.json with its own classes when the custom tokenizer code may not run."""
    ckpt = remote_code_tokenizer("PreTrainedTokenizerFast")(saved, tmp_path)
    capsys.readouterr()
    assert main(_argv("chat", ckpt, saved, tmp_path, [])) == 0
    err = capsys.readouterr().err
    assert f"{ckpt / 'tokenizer_config.json'} names custom code (auto_map) that is not run" in err, err


def test_the_trust_switch_reaches_the_checkpoint(saved, monkeypatch):
    from twinkle_backend_hf.commands.checkpoint_loading import resolve_checkpoint

    assert resolve_checkpoint(saved["plain"]).trust_remote_code is False
    assert resolve_checkpoint(saved["plain"], trust_remote_code=True).trust_remote_code is True
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "1")
    assert resolve_checkpoint(saved["plain"]).trust_remote_code is True


# ---------------------------------------------------------------------- a deleted marker
@pytest.mark.parametrize("command", ["chat", "export", "eval"])
@pytest.mark.parametrize("via", ["checkpoint", "run-directory"])
def test_a_deleted_marker_proceeds_and_says_it_is_not_verified(command, via, saved, tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = run / "checkpoint-2"
    shutil.copytree(saved["marked"], ckpt)
    (ckpt / MARKER).unlink()
    capsys.readouterr()
    status = main(_argv(command, ckpt if via == "checkpoint" else run, saved, tmp_path, []))
    err = capsys.readouterr().err
    assert status == 0, err
    assert "Traceback" not in err and "error" not in err, err
    assert f"{ckpt}: no Twinkle marker: not verified" in err and "cannot be checked" in err, err
