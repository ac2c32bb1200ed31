"""Run the parity training run (loop.py) on MegatronModels under torchrun; rank 0 writes the results as JSON.

    torchrun --nproc-per-node 2 train_losses.py --out results.json --runs '[{"model": DIR, "mesh": {"tp": 2}}, ...]'

Each run: ``model`` (an HF directory), ``mesh``, optional ``lora`` (start a LoRA adapter from this PEFT
directory and train it instead of the model; ``lora_targets``: its target_modules, default all-linear),
``save`` (save() the trained model / adapter there), ``pp_errors`` (record the errors of forward / backward /
calculate_loss with pipeline parallelism).
Several runs share one job (and its start-up time); the parallel layout may change between them.
"""

import argparse
import copy
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))


def one_run(spec: dict) -> dict:
    import loop
    from twinkle_backend_megatron.model import MegatronModel

    from twinkle_core.testing.conformance import LORA_CONFIG, make_batch

    model = MegatronModel(model_id=spec["model"], mesh=spec.get("mesh") or None,
                          strategy_options=spec.get("strategy_options") or {})
    adapter = None
    if spec.get("lora"):
        adapter = "t"
        model.add_adapter_to_model(adapter, {**copy.deepcopy(LORA_CONFIG),
                                             "target_modules": spec.get("lora_targets") or LORA_CONFIG["target_modules"]})
        model.load(spec["lora"], adapter_name=adapter)
    result = loop.run(model, adapter_name=adapter, length=spec.get("length"))
    if spec.get("pp_errors"):
        errors = {}
        for method, call in (("forward", lambda: model.forward(inputs=make_batch(0))),
                             ("backward", lambda: model.backward(loss=None)),
                             ("calculate_loss", lambda: model.calculate_loss())):
            try:
                call()
                errors[method] = None
            except Exception as exc:  # noqa: BLE001 - the message is what the test checks
                errors[method] = f"{type(exc).__name__}: {exc}"
        result["errors"] = errors
    if spec.get("save"):
        model.save("trained", output_dir=spec["save"], adapter_name=adapter, save_optimizer=False)
    return result


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from twinkle_core import distributed

    results = [one_run(spec) for spec in json.loads(args.runs)]
    if distributed.is_main_process():
        with open(args.out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
