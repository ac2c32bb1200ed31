"""The VLM parity run (vlm_run.py) on a vision-language MegatronModel under torchrun; rank 0 writes JSON.

    torchrun --nproc-per-node 2 vlm_losses.py --model DIR --rows ROWS.json --mesh '{"tp": 2}' --out OUT.json \
        [--task-options JSON] [--save DIR]

``--task-options``: the vlm task's (default ``vlm_run.TASK_OPTIONS``); ``--save``: save() the trained model there
(Hugging Face files) for the export round trip.
"""

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--mesh", type=json.loads, default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--task-options", type=json.loads, default=None)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    import vlm_run
    from twinkle_vlm.compat import allow_processors_without_torchvision

    from twinkle_core import distributed

    allow_processors_without_torchvision()
    with open(args.rows) as fh:
        rows = json.load(fh)
    model, task = vlm_run.megatron_vlm(args.model, mesh=args.mesh, task_options=args.task_options)
    result = vlm_run.run(model, task, rows)
    if args.save:
        model.save("trained", output_dir=args.save, save_optimizer=False)
    if distributed.is_main_process():
        with open(args.out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
