"""Save a training checkpoint at one parallel layout, resume it at others (under torchrun); rank 0 writes JSON.

    torchrun --nproc-per-node 2 reshard.py --model DIR --ckpt DIR --out results.json \
        --runs '[{"save": {"tp": 2}, "resume": [{"dp": 2}, {"pp": 2}]}]'

Each run trains ``STEPS`` AdamW steps at the ``save`` mesh, checkpoints after ``SAVE_AT`` of them and
records the uninterrupted losses; every ``resume`` mesh builds a fresh model, resumes from the
checkpoint and trains the remaining steps. ``options`` are the strategy options of every model.
"""

import argparse
import json
import os
import warnings

STEPS, SAVE_AT = 6, 3


def _model(path: str, mesh: dict, options: dict):
    from twinkle_backend_megatron.model import MegatronModel

    model = MegatronModel(model_id=path, mesh=mesh, strategy_options=options)
    model.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01)
    model.set_lr_scheduler("cosine", num_training_steps=STEPS, num_warmup_steps=1)
    return model


def _train(model, start: int, stop: int) -> list[float]:
    from twinkle_core.testing.conformance import local_rows, make_batch

    losses = []
    for step in range(start, stop):
        model.forward_backward(inputs=local_rows(model, make_batch(100 + step)))
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(model.calculate_metric()["loss"])
    return losses


def one_run(path: str, ckpt: str, spec: dict) -> dict:
    options = spec.get("options") or {}
    model = _model(path, spec["save"], options)
    _train(model, 0, SAVE_AT)
    saved = model.save(f"step-{SAVE_AT}", output_dir=ckpt)
    result = {"uninterrupted": _train(model, SAVE_AT, STEPS), "resumed": []}
    for mesh in spec["resume"]:
        fresh = _model(path, mesh, options)
        fresh.resume_from_checkpoint(saved)
        result["resumed"].append({"mesh": mesh, "losses": _train(fresh, SAVE_AT, STEPS)})
    # the control: the same weights without the optimizer state must train differently
    control = _model(path, spec["resume"][-1], options)
    control.load(saved)
    result["weights_only"] = _train(control, SAVE_AT, STEPS)
    return result


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    for name in ("--model", "--ckpt", "--runs", "--out"):
        parser.add_argument(name, required=True)
    args = parser.parse_args()

    from twinkle_core import distributed

    results = [one_run(args.model, os.path.join(args.ckpt, str(i)), spec) for i, spec in enumerate(json.loads(args.runs))]
    if distributed.is_main_process():
        with open(args.out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
