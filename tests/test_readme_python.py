"""The README's "Training from Python" block runs as printed, with the data path of ``twinkle train``.

The block is ``examples/python_api/train.py`` verbatim; it is run as a file of its own from the repository root
(where the README says to run it) for a few steps, and what it saves loads with plain transformers.
:func:`twinkle.data.build_loader` yields the batches ``twinkle train`` builds from the same ``data:`` section,
and ``TransformersModel.tokenizer`` is set whenever the model has one (else the data path says to pass
``tokenizer=``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.testing.torchrun import thread_env

pytest.importorskip("twinkle_backend_hf")  # the block trains a TransformersModel

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/python_api/train.py"
QUICKSTART = ROOT / "examples" / "quickstart"
MARKER = f"<!-- file: {EXAMPLE} -->\n```python\n"


def _readme_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Training from Python\n", 1)[1].split("\n## ", 1)[0]
    assert MARKER in section, f"the README's Training from Python section has no block for {EXAMPLE}"
    return section.split(MARKER, 1)[1].split("\n```\n", 1)[0]


def _quickstart_config() -> dict:
    import yaml

    return yaml.safe_load((QUICKSTART / "recipe.yaml").read_text())["model"]["config"]


def test_the_readme_block_is_the_example_file():
    assert _readme_block() == (ROOT / EXAMPLE).read_text(encoding="utf-8").rstrip()


@pytest.mark.timeout(300)
def test_the_readme_block_trains_and_saves_a_model(tmp_path):
    script = tmp_path / "readme_train.py"
    script.write_text(_readme_block() + "\n", encoding="utf-8")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update({"OUTPUT_DIR": str(out), "MAX_STEPS": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false", **thread_env()})
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=280)
    print(f"README block, 2 steps: {time.monotonic() - start:.1f} s")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "step 2/2: loss" in result.stdout, result.stdout
    final = out / "final"
    assert f"saved: {final}" in result.stdout, result.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.hidden_size == _quickstart_config()["hidden_size"]
    tokenizer = AutoTokenizer.from_pretrained(final)  # the tokenizer is saved with the model
    assert tokenizer.chat_template


def _quickstart_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QUICKSTART / "tokenizer")


def test_build_loader_yields_the_batches_twinkle_train_builds(tmp_path):
    """The quickstart recipe's data section through the trainer's own builders, and through build_loader."""
    import torch

    from twinkle.data import build_loader
    from twinkle_core.model.data_parallel import DataParallelView
    from twinkle_core.plugins import get_plugins
    from twinkle_core.train import build
    from twinkle_core.train.recipe import load_recipe

    recipe = load_recipe(QUICKSTART / "recipe.yaml", ["data.batch_size=8", "data.seed=3", "data.cache_dir=false"])
    tokenizer = _quickstart_tokenizer()
    task = get_plugins().load("task", recipe.task)()
    dataset, _ = build.load_datasets(recipe, task, tokenizer, tmp_path)
    expected = build.make_loader(recipe, task, dataset, DataParallelView(0, 1), shuffle=True)

    loader = build_loader(QUICKSTART / "train.jsonl", tokenizer=tokenizer, mode="chat", max_length=128,
                          batch_size=8, seed=3)
    assert len(loader) == len(expected) == 375
    for mine, theirs, _ in zip(loader, expected, range(3)):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    assert {"input_ids", "labels"} <= set(mine)


def test_build_loader_passes_data_options_and_refuses_a_bad_mode():
    from twinkle.data import build_loader

    tokenizer = _quickstart_tokenizer()
    packed = build_loader(str(QUICKSTART / "train.jsonl"), tokenizer=tokenizer, max_length=64, packing=True,
                          batch_size=2, shuffle=False)
    assert next(iter(packed))["input_ids"].shape == (2, 64)
    with pytest.raises(ConfigError, match="data.mode: must be 'chat' or 'pretrain'"):
        build_loader(str(QUICKSTART / "train.jsonl"), tokenizer=tokenizer, mode="sft")


def test_a_tokenizer_path_sets_model_tokenizer():
    from twinkle.model import TransformersModel

    model = TransformersModel(config=_quickstart_config(), tokenizer=str(QUICKSTART / "tokenizer"), seed=0)
    assert model.tokenizer is not None and model.tokenizer.chat_template
    assert model.tokenizer("reverse: ab")["input_ids"] == _quickstart_tokenizer()("reverse: ab")["input_ids"]


def test_a_model_directory_with_a_tokenizer_sets_model_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from twinkle.model import TransformersModel

    config = dict(_quickstart_config())
    AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config)).save_pretrained(
        tmp_path / "bare")
    bare = TransformersModel(model_id=str(tmp_path / "bare"), seed=0)
    assert bare.tokenizer is None  # the directory holds no tokenizer: nothing to load
    _quickstart_tokenizer().save_pretrained(tmp_path / "bare")
    model = TransformersModel(model_id=str(tmp_path / "bare"), seed=0)
    assert model.tokenizer is not None and model.tokenizer.chat_template

    from twinkle.data import build_loader

    loader = build_loader(str(QUICKSTART / "train.jsonl"), model=model, max_length=128, batch_size=4)
    assert float(model.forward_backward(inputs=next(iter(loader)))["loss"]) > 0
    with pytest.raises(ConfigError, match="pass tokenizer=") as refusal:
        build_loader(str(QUICKSTART / "train.jsonl"), model=bare)
    assert "NoneType" not in str(refusal.value)


def test_the_data_path_without_a_tokenizer_says_to_pass_one():
    from twinkle_core.data import Template
    from twinkle_core.tasks.causal_lm import CausalLMTask

    for mode in ("chat", "pretrain"):
        with pytest.raises(ConfigError, match="pass tokenizer=") as refusal:
            Template(None, mode=mode)
        assert "NoneType" not in str(refusal.value)
    task = CausalLMTask()
    rows = [json.loads(line) for line in (QUICKSTART / "train.jsonl").read_text().splitlines()[:2]]
    with pytest.raises(ConfigError, match="pass tokenizer="):
        task.load_dataset(rows, None)
