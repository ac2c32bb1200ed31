"""How an adapter names its base (twinkle_backend_hf.adapter_base) and the base a config-built model saves for its
adapters (TransformersModel.save_base): a run folder moved whole keeps its adapters usable."""

from __future__ import annotations

import json
import os
import shutil

import torch
from transformers import AutoModelForCausalLM
from twinkle_backend_hf.adapter_base import recorded_base, resolve_recorded_base
from twinkle_backend_hf.commands.checkpoint_loading import resolve_checkpoint
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_hf.testing import make_tiny_model

from twinkle_core import checkpoint

LORA = {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_a_base_inside_the_run_folder_is_recorded_relative_to_the_adapter(tmp_path):
    (tmp_path / "run" / "base").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    staging = str(tmp_path / "run" / ".final.incomplete")  # where the checkpoint writer puts the adapter first
    assert recorded_base(str(tmp_path / "run" / "base"), staging) == os.path.join("..", "base")
    assert recorded_base(str(outside), staging) == str(outside.resolve())  # does not move with the run folder
    assert recorded_base("hf://Qwen/Qwen2.5-0.5B", staging) == "Qwen/Qwen2.5-0.5B"
    assert recorded_base("Qwen/Qwen2.5-0.5B", staging) == "Qwen/Qwen2.5-0.5B"


def test_a_relative_record_is_read_against_the_adapter_directory_then_the_current_one(tmp_path, monkeypatch):
    (tmp_path / "run" / "base").mkdir(parents=True)
    (tmp_path / "run" / "final").mkdir()
    adapter = tmp_path / "run" / "final"
    assert resolve_recorded_base("../base", adapter) == str((tmp_path / "run" / "base").resolve())
    monkeypatch.chdir(tmp_path)  # an adapter written before the rule named a path relative to where it ran
    assert resolve_recorded_base("run/base", adapter) == str((tmp_path / "run" / "base").resolve())
    assert resolve_recorded_base("org/model", adapter) == "org/model"  # a hub id stays one


def test_a_config_built_base_is_saved_without_touching_the_random_state(tmp_path):
    model = make_tiny_model()
    before = torch.random.get_rng_state()
    path = model.save_base(str(tmp_path))
    assert torch.equal(before, torch.random.get_rng_state())  # the adapter's init is what it was without this
    assert path == str(tmp_path / "base") and (tmp_path / "base" / "model.safetensors").is_file()
    (tmp_path / "base" / "model.safetensors").write_bytes(b"stale")  # a previous run's base is replaced
    assert model.save_base(str(tmp_path)) == path
    checkpoint.verify_files(str(tmp_path / "base"))
    built = {name: tensor.clone() for name, tensor in model.hf_model.state_dict().items()}
    model.add_adapter_to_model("default", LORA)
    model.save("final", output_dir=str(tmp_path), adapter_name="default", save_optimizer=False)
    config = json.loads((tmp_path / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == os.path.join("..", "base")
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32).state_dict()
    assert saved.keys() == built.keys()
    for name, tensor in saved.items():  # the weights the adapter was trained on
        torch.testing.assert_close(tensor, built[name], rtol=0, atol=0)
    shutil.move(str(tmp_path), str(tmp_path.parent / f"{tmp_path.name}-moved"))
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    found = resolve_checkpoint(moved / "final")
    assert found.kind == "adapter" and found.base == str((moved / "base").resolve())


def test_a_model_loaded_from_a_directory_saves_no_base(tmp_path):
    make_tiny_model().save("plain", output_dir=str(tmp_path), save_optimizer=False)
    model = TransformersModel(model_id=str(tmp_path / "plain"), seed=0)
    assert model.save_base(str(tmp_path / "run")) is None and not (tmp_path / "run").exists()
    model.add_adapter_to_model("default", LORA)
    model.save("final", output_dir=str(tmp_path / "run"), adapter_name="default", save_optimizer=False)
    config = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "plain").resolve())
