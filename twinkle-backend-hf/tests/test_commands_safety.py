"""``twinkle chat / export / eval`` verify a checkpoint before using it and never destroy what they read.

A tiny Qwen2 model with the test tokenizer is saved the way ``twinkle train`` saves a checkpoint (through
``atomic_directory``, so it carries ``twinkle_checkpoint.json`` with every file's size and sha256); the commands run
in-process through ``twinkle_core.cli.main``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from twinkle_core.checkpoint_layout import CheckpointLayout
from twinkle_core.cli import main

pytest.importorskip("transformers")

MARKER = CheckpointLayout.MARKER
EXPORT_MARKER = "twinkle_export.json"


def _save_model(directory: Path, *, marker: bool) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from twinkle_backend_hf.testing import tiny_qwen2_config

    from twinkle_core.checkpoint import atomic_directory
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = AutoConfig.for_model(**tiny_qwen2_config(vocab_size=len(tokenizer)))
    model = AutoModelForCausalLM.from_config(config)

    def write(path: str) -> None:
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)

    if marker:
        with atomic_directory(str(directory), is_main=True, metadata={"step": 2}) as staging:
            write(staging)
    else:
        directory.mkdir(parents=True)
        write(str(directory))
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    data = root / "eval.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("abc", "hello")))
    return {"final": _save_model(root / "run" / "final", marker=True),
            "plain": _save_model(root / "plain", marker=False), "data": data}


@pytest.fixture()
def final(saved, tmp_path):
    """A private copy of the marked checkpoint (inside a run directory) that a test may damage."""
    copy = tmp_path / "run" / "final"
    shutil.copytree(saved["final"], copy)
    return copy


def _one_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.count("twinkle: error:") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 100] ^= 0xFF  # inside the tensor data: safetensors still loads it
    path.write_bytes(bytes(raw))


@pytest.fixture()
def no_loading(monkeypatch):
    """Fail the test if a command loads any weights or tokenizer (it must refuse before)."""
    from twinkle_backend_hf.commands import checkpoint_loading

    def refuse(*args, **kwargs):
        raise AssertionError("a command loaded a checkpoint it should have refused")

    monkeypatch.setattr(checkpoint_loading, "load_model", refuse)
    monkeypatch.setattr(checkpoint_loading, "load_tokenizer", refuse)


# ---------------------------------------------------------------------- eval --output
def test_eval_output_into_the_checkpoint_is_refused_and_the_file_kept(final, saved, capsys, no_loading):
    weights = final / "model.safetensors"
    before = weights.read_bytes()
    for extra in ([], ["--overwrite"]):
        assert main(["eval", str(final), str(saved["data"]), "--output", str(weights), *extra]) == 2
        _one_error(capsys, str(weights), "inside the checkpoint", "outside")
    assert main(["eval", str(final), str(saved["data"]), "--output", str(final / "results.json")]) == 2
    _one_error(capsys, "inside the checkpoint")
    assert weights.read_bytes() == before and not (final / "results.json").exists()


def test_eval_output_over_the_data_file_is_refused(final, saved, tmp_path, capsys, no_loading):
    data = tmp_path / "data.jsonl"
    shutil.copy(saved["data"], data)
    before = data.read_bytes()
    assert main(["eval", str(final), str(data), "--output", str(data), "--overwrite"]) == 2
    _one_error(capsys, str(data), "data file")
    assert data.read_bytes() == before


def test_eval_output_existing_file_needs_overwrite(final, saved, tmp_path, capsys):
    out = tmp_path / "results.json"
    out.write_text("keep me")
    assert main(["eval", str(final), str(saved["data"]), "--output", str(out), "--no-generate"]) == 2
    _one_error(capsys, str(out), "--overwrite")
    assert out.read_text() == "keep me"
    assert main(["eval", str(final), str(saved["data"]), "--output", str(out), "--no-generate", "--overwrite",
                 "--device", "cpu"]) == 0
    assert json.loads(out.read_text())["metrics"]["num_examples"] == 2
    assert not list(tmp_path.glob(".*incomplete"))


def test_eval_output_below_a_file_is_one_clear_error(final, saved, tmp_path, capsys, no_loading):
    (tmp_path / "a").write_text("x")
    assert main(["eval", str(final), str(saved["data"]), "--output", str(tmp_path / "a" / "r.json")]) == 2
    _one_error(capsys, f"{tmp_path / 'a'} is a file, not a directory")
    assert main(["export", str(final), "--output", str(tmp_path / "a" / "out")]) == 2
    _one_error(capsys, f"{tmp_path / 'a'} is a file, not a directory")


def test_eval_output_directory_is_one_clear_error(final, saved, tmp_path, capsys, no_loading):
    assert main(["eval", str(final), str(saved["data"]), "--output", str(tmp_path)]) == 2
    _one_error(capsys, str(tmp_path), "is a directory", "eval_results.json")


# ---------------------------------------------------------------------- export --output
def test_export_output_into_or_over_the_checkpoint_is_refused(final, tmp_path, capsys, no_loading):
    before = sorted(p.name for p in final.iterdir())
    for output in (final / "hf", final, final.parent, tmp_path):
        assert main(["export", str(final), "--output", str(output), "--overwrite"]) == 2
        _one_error(capsys, f"--output {output}", "choose a directory outside it")
    assert sorted(p.name for p in final.iterdir()) == before


def test_export_output_an_existing_file_is_refused(final, tmp_path, capsys, no_loading):
    target = tmp_path / "model.bin"
    target.write_text("keep me")
    for extra in ([], ["--overwrite"]):
        assert main(["export", str(final), "--output", str(target), *extra]) == 2
        _one_error(capsys, str(target), "is a file", "new directory")
    assert target.read_text() == "keep me"


def test_export_overwrite_replaces_only_a_previous_export(final, tmp_path, capsys, no_loading):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    assert main(["export", str(final), "--output", str(other), "--overwrite"]) == 2
    _one_error(capsys, str(other), "holds files but no model")
    assert (other / "todo.txt").read_text() == "mine"


def test_export_writes_its_own_marker_atomically(final, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(final), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{final}: " in err and f"verified against {MARKER}" in err
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert "model.safetensors" in marker["files"] and "config.json" in marker["files"]
    assert not (out / MARKER).exists() and not list(tmp_path.glob(".*incomplete"))

    # the export is verified when it is read back: a flipped byte in it is refused
    _flip_byte(out / "model.safetensors")
    assert main(["chat", str(out), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]) == 1
    _one_error(capsys, str(out / "model.safetensors"), "corrupt", EXPORT_MARKER, "earlier")


def test_export_that_fails_midway_leaves_the_previous_export(final, tmp_path, capsys, monkeypatch):
    out = tmp_path / "exported"
    assert main(["export", str(final), "--output", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    from transformers import PreTrainedTokenizerBase

    def broken(self, save_directory, *args, **kwargs):
        (Path(save_directory) / "tokenizer.json").write_text("{partial")  # the disk filled up mid-file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", broken)
    assert main(["export", str(final), "--output", str(out), "--overwrite"]) == 1
    _one_error(capsys, f"could not write {out}", "disk is full", "nothing was replaced")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".*incomplete"))


# ---------------------------------------------------------------------- verification
@pytest.mark.parametrize("argv", [
    ["chat", "{ckpt}", "--prompt", "hi", "--max-new-tokens", "2"],
    ["eval", "{ckpt}", "{data}", "--no-generate"],
    ["export", "{ckpt}", "--output", "{tmp}/exported"],
])
def test_a_flipped_byte_is_refused_before_loading(argv, final, saved, tmp_path, capsys, no_loading):
    weights = final / "model.safetensors"
    _flip_byte(weights)
    args = [a.format(ckpt=final.parent, data=saved["data"], tmp=tmp_path) for a in argv]  # the run directory
    assert main(args) == 1
    _one_error(capsys, str(weights), "corrupt", MARKER, "earlier OUTPUT_DIR/checkpoint-N")
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("command", ["chat", "eval", "export"])
def test_a_file_listed_in_the_marker_but_missing_is_refused(command, final, saved, tmp_path, capsys, no_loading):
    (final / "generation_config.json").unlink()
    extra = {"chat": ["--prompt", "hi"], "eval": [str(saved["data"])], "export": ["-o", str(tmp_path / "x")]}
    assert main([command, str(final), *extra[command]]) == 1
    _one_error(capsys, str(final / "generation_config.json"), "is missing", MARKER, "use another copy")


def test_a_plain_hugging_face_directory_says_it_is_not_verified(saved, capsys):
    assert main(["chat", str(saved["plain"]), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert f"{saved['plain']}: no Twinkle marker: not verified" in capsys.readouterr().err


def test_a_sound_checkpoint_says_it_was_verified(final, capsys):
    assert main(["chat", str(final), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert f"files verified against {MARKER}" in capsys.readouterr().err
