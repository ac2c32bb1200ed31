"""Vision-language models (Qwen2.5-VL, the ``vlm`` task) on MegatronModel: the Hugging Face vision tower in front of
megatron-core's GPTModel with multimodal RoPE (``twinkle_backend_megatron.vision``).

Parity: the tiny Qwen2.5-VL trained 3 AdamW steps with the vlm task (vision frozen, projector and language full) on
a padded batch of four image chats gives the same losses, pre-clip gradient norms and final logits on the HF
backend (one process) and on Megatron with TP=2, PP=2, DP=2 (and one rank), within the HF reference's own float noise (its
distance from the same run with its rows reversed and from the run in float64, ``twinkle_core.testing.tolerance``).
The trained Megatron model's saved files load with ``AutoModelForImageTextToText`` and give its logits.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from torchrun_job import torchrun

from twinkle_core.errors import ConfigError
from twinkle_core.testing.tolerance import (
    assert_within_spread,
    forward_tolerance,
    max_abs_diff,
    sum_tolerance,
)

pytest.importorskip("twinkle_vlm")

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "scripts"))
import vlm_run  # noqa: E402

SCRIPT = os.path.join(HERE, "scripts", "vlm_losses.py")
#: an upper bound of the tokens a step's loss averages (4 rows of at most 40 tokens)
TOKENS_PER_STEP = 4 * 40
#: an upper bound of the trainable parameters (projector + language of the tiny model)
PARAMETERS = 200_000
#: the longest chain of reductions between the weights and a logit: the vision blocks and merger, then the decoder
DEPTH, WIDTH = 2 + 1 + 2, 128


@pytest.fixture(scope="module", autouse=True)
def _processors_without_torchvision() -> None:
    from twinkle_vlm.compat import allow_processors_without_torchvision

    allow_processors_without_torchvision()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny Qwen2.5-VL, the image chats, and the HF backend's run on them (with its own float noise)."""
    from twinkle_vlm.testing import build_vlm_model, save_tiny_vlm

    root = tmp_path_factory.mktemp("vlm")
    model_dir = str(save_tiny_vlm("qwen2_5_vl", root / "model"))
    rows = vlm_run.colour_rows(root)
    (root / "rows.json").write_text(json.dumps(rows))

    def reference(options: dict, reverse_rows: bool = False, exact: bool = False) -> dict:
        model, task = build_vlm_model(model_dir, task_options=options)
        if exact:
            model.hf_model.double()
        return vlm_run.run(model, task, rows, reverse_rows=reverse_rows)

    def references(options: dict) -> dict:
        return {**reference(options), "reordered": reference(options, reverse_rows=True),
                "exact": reference(options, exact=True)}

    return SimpleNamespace(dir=model_dir, rows=rows, rows_path=root / "rows.json",
                           ref=references(vlm_run.TASK_OPTIONS), references=references)


def _assert_parity(got: dict, want: dict) -> None:
    reordered, exact = want["reordered"], want["exact"]
    assert_within_spread("losses", got["losses"], want["losses"], reordered["losses"],
                         floor=sum_tolerance(TOKENS_PER_STEP, max(want["losses"])), exact_reference=exact["losses"])
    assert_within_spread("pre-clip grad norms", got["norms"], want["norms"], reordered["norms"],
                         floor=sum_tolerance(PARAMETERS, max(want["norms"])), exact_reference=exact["norms"])
    assert_within_spread("final logits", got["logits"], want["logits"], reordered["logits"],
                         floor=_logits_tolerance(want["logits"]), exact_reference=exact["logits"])


def _logits_tolerance(logits) -> float:
    return forward_tolerance(float(torch.as_tensor(logits).abs().max()), depth=DEPTH, width=WIDTH)


def _trains(model) -> dict[str, bool]:
    """Which parts train: ``{"vision": ..., "projector": ..., "language": ...}`` (all of a part's weights agree)."""
    parts: dict[str, set[bool]] = {"vision": set(), "projector": set(), "language": set()}
    for name, param in model.network.named_parameters():
        part = "projector" if ".merger." in name else "vision" if name.startswith("model.visual.") else "language"
        parts[part].add(param.requires_grad)
    assert all(len(values) == 1 for values in parts.values()), parts
    return {part: values.pop() for part, values in parts.items()}


def test_single_rank_matches_hf_with_frozen_vision(vlm):
    model, task = vlm_run.megatron_vlm(vlm.dir)
    assert _trains(model) == {"vision": False, "projector": True, "language": True}
    _assert_parity(vlm_run.run(model, task, vlm.rows), vlm.ref)


#: the vision tower alone trains (its weights are replicated over the TP ranks)
VISION_ONLY = {"train_vision": "full", "train_projector": "frozen", "train_language": "frozen"}


def test_single_rank_trains_the_vision_tower_alone_as_hf_does(vlm):
    options = VISION_ONLY
    model, task = vlm_run.megatron_vlm(vlm.dir, task_options=options)
    assert _trains(model) == {"vision": True, "projector": False, "language": False}
    _assert_parity(vlm_run.run(model, task, vlm.rows), vlm.references(options))


def test_packed_rows_give_the_hf_logits(vlm):
    """Packed rows: ``[4, batch, seq]`` positions, row 0 restarting per sample (each sample attends to itself)."""
    from twinkle_vlm.testing import build_vlm_model, vlm_batch

    options = {**vlm_run.TASK_OPTIONS, "packing": True, "max_length": 80}
    hf, hf_task = build_vlm_model(vlm.dir, task_options=options)
    batch = vlm_batch(hf_task, hf, vlm.rows)
    assert batch["position_ids"].shape[0] == 4 and int((batch["position_ids"][0] == 0).sum()) > batch["input_ids"].shape[0]
    want = hf.forward_only(inputs=batch)["logits"]
    model, task = vlm_run.megatron_vlm(vlm.dir, task_options=options)
    got = model.forward_only(inputs=vlm_batch(task, model, vlm.rows))["logits"]
    assert max_abs_diff(got, want) <= _logits_tolerance(want)


def test_refuses_what_it_cannot_run_yet(vlm):
    from twinkle_backend_megatron.vision import VisionLanguageNetwork

    options = {"sequence_parallel": False, "distributed_optimizer": False}
    with pytest.raises(ConfigError, match="mesh.vpp > 1"):
        VisionLanguageNetwork().check_layout(SimpleNamespace(pp=2, vpp=2, cp=1), options)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        VisionLanguageNetwork().check_layout(SimpleNamespace(pp=1, vpp=1, cp=1), {**options, "sequence_parallel": True})
    model, _ = vlm_run.megatron_vlm(vlm.dir)
    with pytest.raises(ConfigError, match="train_language: full"):
        model.add_adapter_to_model("t", {"type": "lora", "r": 4, "lora_alpha": 8})


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_two_ranks_match_hf_and_export_a_checkpoint_transformers_loads(vlm, tmp_path, mesh):
    """TP=2, and PP=2 (the tower on the first stage; two micro-batches of two rows, each with its own images)."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText
    from twinkle_vlm.testing import build_vlm_model, vlm_batch

    out, saved = tmp_path / "results.json", tmp_path / "saved"
    job = torchrun([SCRIPT, "--model", vlm.dir, "--rows", vlm.rows_path, "--mesh", json.dumps(mesh),
                    "--out", out, "--save", saved], nproc=2, timeout=300)
    assert job.returncode == 0, job.output
    got = json.loads(out.read_text())
    _assert_parity(got, vlm.ref)

    # the exported files: transformers loads them as the VLM, with the trained weights and the same logits
    exported, task = build_vlm_model(str(saved / "trained"), task_options=vlm_run.TASK_OPTIONS)
    batch = vlm_batch(task, exported, vlm.rows)
    logits = exported.forward_only(inputs=batch)["logits"].double() * batch["attention_mask"][..., None]
    assert max_abs_diff(logits, got["logits"]) <= _logits_tolerance(got["logits"])
    # written in the layout transformers writes (model.layers.*, visual.*), MegatronModel starts from them again
    with safe_open(str(saved / "trained" / "model.safetensors"), "pt") as files:
        assert {key.split(".")[0] for key in files.keys()} == {"model", "visual", "lm_head"}
        assert not any(key.startswith("model.language_model.") for key in files.keys())
    again, again_task = vlm_run.megatron_vlm(str(saved / "trained"))
    logits = again.forward_only(inputs=vlm_batch(again_task, again, vlm.rows))["logits"].double()
    assert max_abs_diff(logits * batch["attention_mask"][..., None], got["logits"]) <= _logits_tolerance(got["logits"])
    start = AutoModelForImageTextToText.from_pretrained(vlm.dir).state_dict()
    trained = AutoModelForImageTextToText.from_pretrained(str(saved / "trained")).state_dict()
    assert trained.keys() == start.keys()
    changed = {name for name in start if not torch.equal(start[name], trained[name])}
    assert not any(name.startswith("model.visual.") and ".merger." not in name for name in changed), changed
    assert any(".merger." in name for name in changed) and any("language_model" in name for name in changed)


@pytest.mark.distributed
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2}], ids=["tp2", "dp2"])
def test_two_ranks_train_the_replicated_vision_tower_as_hf_does(vlm, tmp_path, mesh):
    """TP: its gradients are equal on both ranks and counted once in the gradient norm. DP: they are summed over
    the ranks; every rank feeds all rows (a VLM batch cannot be cut by row after collation), so the global batch
    is the rows twice: the same token-mean loss and gradient as the reference's."""
    out = tmp_path / "results.json"
    job = torchrun([SCRIPT, "--model", vlm.dir, "--rows", vlm.rows_path, "--mesh", json.dumps(mesh),
                    "--task-options", json.dumps(VISION_ONLY), "--out", out], nproc=2, timeout=300)
    assert job.returncode == 0, job.output
    _assert_parity(json.loads(out.read_text()), vlm.references(VISION_ONLY))
