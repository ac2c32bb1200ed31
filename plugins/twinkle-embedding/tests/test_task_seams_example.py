"""A task plugin with a head, an exported file and a loss that reads the context runs through every seam.

The example is the code between the ``README example`` markers (an earlier README printed it; the README's
"Writing a plugin" is now examples/writing_a_plugin/reward_plugin.py, whose head is a real scalar head); the
test runs it on the core's reference model and checks each seam.
"""

from __future__ import annotations

# --- README example: begin ---
import json
import os

import torch

from twinkle_core.loss.base import Loss, LossOutput
from twinkle_core.task import Task


class ScoreTask(Task):
    name = "score"

    def load_dataset(self, path, tokenizer, **data_options):  # rows: {"input_ids": [...], "target": 0.5}
        return [json.loads(line) for line in open(path)]

    def collate(self, features):  # equal lengths, for brevity
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "target": torch.tensor([float(f["target"]) for f in features])}

    def process_outputs(self, outputs, inputs):  # every forward (training and evaluation), before the loss
        return {**outputs, "scores": outputs["logits"][:, -1, 0]}

    def on_export(self, model, directory, adapter_name):  # main process, inside the checkpoint being written
        with open(os.path.join(directory, "score_head.json"), "w") as f:
            json.dump({"head": "last_token", "logit": 0}, f)


class ScoreMSE(Loss):
    def __call__(self, outputs, inputs, context=None):  # context: LossContext (dp/sp groups, sizes, rank)
        error = (outputs["scores"] - inputs["target"]).pow(2)
        return LossOutput(loss=error.sum(), num_tokens=error.numel(),
                          metrics={"dp_ranks": context.dp_size if context else 1})


# --- README example: end ---

from twinkle_core.loss.base import LossContext  # noqa: E402
from twinkle_core.testing.reference import make_reference_model  # noqa: E402


class _SpyLoss(ScoreMSE):
    """The example's loss, remembering the context it was called with."""

    context: LossContext | None = None

    def __call__(self, outputs, inputs, context=None):
        self.context = context
        return super().__call__(outputs, inputs, context=context)


def test_the_readme_task_plugin_runs_through_every_seam(tmp_path):
    model = make_reference_model(task=ScoreTask())  # any TorchTwinkleModel; `twinkle train` passes task= itself
    model.set_loss(ScoreMSE())

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input_ids": [1, 2, 3], "target": 0.5}\n{"input_ids": [4, 5, 6], "target": -1.0}\n')
    task = model.task
    spy = _SpyLoss()  # the example's loss, watched
    model.set_loss(spy)
    model.set_optimizer("AdamW", lr=1e-3)

    outputs = model.forward_backward(inputs=task.collate(task.load_dataset(str(rows), None)))
    assert outputs["scores"].shape == (2,)  # process_outputs ran before the loss
    assert isinstance(spy.context, LossContext) and spy.context.dp_size == 1
    assert outputs["dp_ranks"] == 1
    model.step()

    path = model.save("final", output_dir=str(tmp_path / "run"))
    with open(os.path.join(path, "score_head.json")) as f:
        assert json.load(f) == {"head": "last_token", "logit": 0}  # on_export wrote into the saved directory
