"""The ``vlm_preference`` task (DPO on image chats) on 2 CPU ranks, DDP and FSDP2, trains as one process: the same
losses and DPO metrics (``rewards/*``, ``logps/*``) step by step, with either reference: the LoRA policy's base
(the default plan: vision frozen, projector full, LoRA on the language model) and, with every part trained fully, a
frozen copy of the initial model (under FSDP2 itself sharded). Each rank gets 2 of the 4 colour pairs whole: the
trainer's ``DataLoader`` deals pairs, so a pair's two sequences, their image copies and reference log-probs stay on
one rank. Every run is ``scripts/vlm_parity.py --task vlm_preference`` through the Python API (the trainer's calls:
``prepare_model``, ``load_dataset``, ``prepare_dataset``, ``DataLoader``, ``prepare_batch``, ``forward_backward``)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.testing.tolerance import forward_tolerance, max_abs_diff
from twinkle_core.testing.torchrun import run_torchrun

pytest.importorskip("twinkle_rl")

SCRIPT = Path(__file__).parent / "scripts" / "vlm_parity.py"
_spec = importlib.util.spec_from_file_location("vlm_parity_constants", SCRIPT)  # imports nothing heavy
PARITY = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(PARITY)
REFERENCES = ("auto", "model")  # the adapter's base (LoRA), a frozen copy (full fine-tuning)


class PreferenceRuns:
    """Each strategy's runs once per module: one torchrun job per strategy, running both references in turn."""

    def __init__(self, root: Path, model_dir: Path, rows: list) -> None:
        self.root, self.model_dir = root, model_dir
        self.rows = root / "rows.json"
        self.rows.write_text(json.dumps(rows))
        self.results: dict[str, dict] = {}

    def get(self, strategy: str | None, reference: str) -> dict:
        name = strategy or "single"
        if name not in self.results:
            out = self.root / f"{name}.json"
            args = ["--task", "vlm_preference", "--reference", *REFERENCES]
            result = run_torchrun([SCRIPT, out, self.model_dir, self.rows, *args,
                                   *(["--strategy", strategy] if strategy else [])],
                                  nproc=2 if strategy else 1, timeout=240, env={"DS_ACCELERATOR": "cpu"})
            assert result.returncode == 0, result.output[-6000:]
            print(f"{name} job: {result.seconds:.1f} s")
            self.results[name] = json.loads(out.read_text())
        return self.results[name][reference]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_vlm_dir, colour_rows) -> PreferenceRuns:
    return PreferenceRuns(tmp_path_factory.mktemp("vlm-preference-parity"), tiny_vlm_dir("qwen2_5_vl"), colour_rows)


def tolerances(single: dict[str, Any], model_dir: Path) -> dict[str, float]:
    """How far each logged quantity of a step may move when only the arithmetic's order changes.

    A rank's forward sees 4 of the 8 sequences: other padded lengths and image counts, so other matrix-product and
    attention shapes, reordering the sums inside each layer, and the gradients are summed over the ranks instead
    of over one batch. A sequence's answer log-prob sum then moves within one forward's rounding bound
    (``forward_tolerance``, as test_preference.py bounds a step against plain transformers) on the log-probs'
    magnitude. From step 2 on, the weights differ too: SGD without clipping moves them by lr times gradients that
    carry the same relative rounding, which shifts a log-prob by at most that relative error times how far the
    steps moved it; the magnitude therefore adds the log-probs' total movement. Then, with ``beta``:
    ``logps/*`` (the policy's sums, averaged over pairs) one bound; ``rewards/chosen|rejected``
    (``beta (pi - ref)``) two; ``rewards/margins`` and the loss (a mean of ``-log sigmoid(beta h)``, whose slope in
    ``beta h`` is below 1) four."""
    metrics = single["metrics"]
    logps = [metrics["logps/chosen"], metrics["logps/rejected"]]
    movement = max(sum(abs(b - a) for a, b in zip(s, s[1:])) for s in logps)
    magnitude = max(abs(x) for s in logps for x in s) + movement
    config = json.loads((model_dir / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    logp = forward_tolerance(magnitude, width=max(text["vocab_size"], text["intermediate_size"], text["hidden_size"]),
                             depth=text["num_hidden_layers"] + vision["depth"])
    beta = PARITY.BETA
    return {"logps/chosen": logp, "logps/rejected": logp, "rewards/chosen": 2 * beta * logp,
            "rewards/rejected": 2 * beta * logp, "rewards/margins": 4 * beta * logp, "loss": 4 * beta * logp}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("strategy", ["ddp", "native_fsdp"])
def test_two_ranks_train_pairs_as_one_process(runs, tiny_vlm_dir, strategy, reference):
    single = runs.get(None, reference)
    # before the first step the policy is its reference: every implicit reward 0, the loss ln 2; then it learns
    assert single["losses"][0] == pytest.approx(math.log(2), abs=1e-6) and single["losses"][-1] < single["losses"][0]
    assert single["metrics"]["rewards/margins"][-1] > 0, single["metrics"]
    run = runs.get(strategy, reference)
    assert run["world_size"] == 2 and run["dp_size"] == 2, run
    bounds = tolerances(single, tiny_vlm_dir("qwen2_5_vl"))
    got = {"loss": run["losses"], **run["metrics"]}
    want = {"loss": single["losses"], **single["metrics"]}
    for key, bound in bounds.items():
        delta = max_abs_diff(got[key], want[key])
        assert delta <= bound, f"{strategy} {reference} {key}: max |2 ranks - 1 process| = {delta:.3g} > {bound:.3g}" \
                               f"\n 2 ranks:   {got[key]}\n 1 process: {want[key]}"
        print(f"{strategy} {reference} {key}: max |d| = {delta:.3g} (tolerance {bound:.3g})")
    # the share of pairs the policy ranks right: step 1 ties exactly (h = 0, the policy is its reference on every
    # rank); after it every pair's margin is at least 0.049 (measured), beyond the margin bound, so no pair flips
    assert got["rewards/accuracies"] == want["rewards/accuracies"]
    if strategy == "native_fsdp":  # vision blocks and decoder layers are their own units (FSDP2 names them FSDP<C>)
        assert {"FSDPQwen2_5_VLVisionBlock", "FSDPQwen2_5_VLDecoderLayer"} <= set(run["fsdp_units"]), run["fsdp_units"]
        if reference == "model":  # the frozen copy is sharded like the policy and its forward gathers its weights
            assert run["reference_wrapped_class"].startswith("FSDP"), run["reference_wrapped_class"]
