"""(g) Time to the first optimizer step of ``twinkle train examples/quickstart/recipe.yaml``.

Every measurement is a fresh process (``python -m twinkle_core.cli train ...``, what the ``twinkle`` command
runs), so nothing is imported or cached in advance. The phase split comes from the trainer's own start-up
timer (``summary.json`` -> ``startup``: wall and CPU seconds per phase, counted from the start of the process):

* ``python_startup`` - the interpreter and the command's imports, up to ``twinkle train`` starting;
* ``recipe``         - reading and validating the recipe (``load_recipe``, ``check_paths``);
* ``plugins``        - plugin discovery (entry points; no component is imported);
* ``validate``       - ``validate_components``: imports torch and the backend's classes, checks options;
* ``imports``        - the trainer loading the task and model classes (already imported by then);
* ``tokenizer``      - loading the tokenizer (this is where transformers is first imported);
* ``data``           - reading and tokenising the training and evaluation sets;
* ``model``          - building the model (importing its transformers modeling code), loss and optimizer;
* ``setup``          - data loader, scheduler, output directory, the training log;
* ``eval_before``    - the evaluation before training (the quickstart turns it on: 200 generations);
* ``first_step``     - the first optimizer step itself.

The measured runs set ``train.eval_before_training=false`` and ``train.evaluate_options=null`` (only the end of
the run changes: no generation pass after training), so that "before the first step" is the framework's start-up;
one more run (not with ``--quick``) uses the recipe as it is to time ``eval_before``. Also measured from the
outside (fresh processes until they exit, median wall and CPU): a bare interpreter, ``import twinkle_core.cli``,
``twinkle --help`` and ``twinkle train --dry-run`` (start-up + recipe + plugins + validate); and, timed inside
fresh processes, the imports of the libraries the quickstart cannot avoid (torch, transformers and its
AutoTokenizer, the Qwen2 modeling code): the floor under any start-up of this recipe.

    python bench/first_step.py          # 3 runs (~2 min on 2 idle cores)
    python bench/first_step.py --quick  # 1 run, no eval-before run (~40 s)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as C

RECIPE = C.QUICKSTART / "recipe.yaml"
TARGET_S = 3.0
PHASES = ("python_startup", "recipe", "plugins", "validate", "imports", "tokenizer", "data", "model", "setup",
          "eval_before", "first_step")
NOT_STARTUP = ("first_step", "eval_before")  # what "before the first step" leaves out
FAST_END = ["train.eval_before_training=false", "train.evaluate_options=null"]
FLOOR = "import torch + transformers + AutoTokenizer + Qwen2 modeling"  # what the quickstart cannot avoid
LIBRARIES = {
    "import torch": "import torch",
    "import transformers + AutoTokenizer": "import torch, transformers; transformers.AutoTokenizer",
    FLOOR: "import torch, transformers, transformers.models.qwen2.modeling_qwen2; transformers.AutoTokenizer",
}


def child_env(threads: int) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


def run_child(cmd: list[str], env: dict[str, str], timeout: float = 600) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stderr); raises on a non-zero exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=C.ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stderr


def train_once(env: dict[str, str], extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="twinkle-first-step-") as out:
        cmd = [sys.executable, "-m", "twinkle_core.cli", "train", str(RECIPE), "train.max_steps=1",
               f"train.output_dir={out}", *extra]
        wall, cpu, _ = run_child(cmd, env)
        startup = json.loads((Path(out) / "summary.json").read_text())["startup"]
    phases, cpus = startup["phases"], startup["cpu"]
    skipped = sum(phases.get(k, 0.0) for k in NOT_STARTUP)
    skipped_cpu = sum(cpus.get(k, 0.0) for k in NOT_STARTUP)
    return {"startup": startup, "process_wall_s": round(wall, 3), "process_cpu_s": round(cpu, 3),
            # from the start of the process to the start of the first step, less any evaluation before it
            "before_first_step_s": round(startup["total_s"] - skipped, 4),
            "before_first_step_cpu_s": round(startup["cpu_total_s"] - skipped_cpu, 4),
            "to_first_step_end_s": startup["total_s"]}


def timed_import(code: str) -> str:
    """A child program that runs ``code`` and prints its own wall and CPU seconds (not the interpreter's exit,
    which after importing torch takes a few tenths of a second more)."""
    return ("import time, json; w, c = time.perf_counter(), time.process_time()\n" + code
            + "\nprint(json.dumps({'wall': time.perf_counter() - w, 'cpu': time.process_time() - c}))")


def outside(env: dict[str, str], repeats: int, quick: bool) -> dict[str, Any]:
    """Whole processes (wall and CPU until they exit) and, in process, the imports of the libraries."""
    py = sys.executable
    cases = {"bare interpreter (python -c pass)": [py, "-c", "pass"],
             "import twinkle_core.cli": [py, "-c", "import twinkle_core.cli"],
             "twinkle --help": [py, "-m", "twinkle_core.cli", "--help"],
             "twinkle train --dry-run": [py, "-m", "twinkle_core.cli", "train", str(RECIPE), "--dry-run"]}
    if not quick:
        cases.update({name: [py, "-c", timed_import(code)] for name, code in LIBRARIES.items()})
    result = {}
    for name, cmd in cases.items():
        walls, cpus = [], []
        for _ in range(repeats):
            if name in LIBRARIES:  # the child's own measurement of the imports
                done = subprocess.run(cmd, cwd=C.ROOT, env=env, capture_output=True, text=True, check=True)
                own = json.loads(done.stdout.strip().splitlines()[-1])
                wall, cpu = own["wall"], own["cpu"]
            else:
                wall, cpu, _ = run_child(cmd, env)
            walls.append(wall)
            cpus.append(cpu)
        result[name] = {"wall_s": C.stats(walls), "cpu_s": C.stats(cpus),
                        "measured": "in process, the imports only" if name in LIBRARIES else "the whole process"}
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = [p for p in PHASES if any(p in r["startup"]["phases"] for r in runs)]
    return {
        "phases_wall_s": {p: C.stats([r["startup"]["phases"].get(p, 0.0) for r in runs]) for p in names},
        "phases_cpu_s": {p: C.stats([r["startup"]["cpu"].get(p, 0.0) for r in runs]) for p in names},
        "before_first_step_s": C.stats([r["before_first_step_s"] for r in runs]),
        "before_first_step_cpu_s": C.stats([r["before_first_step_cpu_s"] for r in runs]),
        "to_first_step_end_s": C.stats([r["to_first_step_end_s"] for r in runs]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=3)
    args = parser.parse_args()
    q = args.quick
    repeats = args.repeats or (1 if q else 3)
    env = child_env(args.threads)

    with C.LoadMonitor() as mon:
        runs = [train_once(env, FAST_END) for _ in range(repeats)]
        as_is = None if q else train_once(env, [])  # the recipe unchanged: its evaluation before training
        outer = outside(env, repeats, q)

    summary = summarize(runs)
    median = summary["before_first_step_s"]["median"]
    payload = {
        "question": f"seconds from the start of `twinkle train examples/quickstart/recipe.yaml train.max_steps=1` "
                    f"to its first optimizer step, and where they go (target <= {TARGET_S} s)",
        "settings": {"quick": q, "repeats": repeats, "threads": args.threads, "recipe": str(RECIPE.relative_to(C.ROOT)),
                     "overrides": ["train.max_steps=1", "train.output_dir=<temporary>", *FAST_END],
                     "command": "python -m twinkle_core.cli train examples/quickstart/recipe.yaml train.max_steps=1 "
                                "train.output_dir=<tmp> " + " ".join(FAST_END)},
        "result": summary,
        "runs": runs,
        "recipe_as_is": as_is,
        "outside": outer,
        "library_imports_cpu_s": (outer[FLOOR]["cpu_s"]["median"] if FLOOR in outer else None),
        "target_s": TARGET_S,
        "meets_target": median <= TARGET_S,
    }
    path = C.write_result("first_step", payload, mon, args.out_dir)
    walls, cpus = summary["phases_wall_s"], summary["phases_cpu_s"]
    print("phase            wall s   CPU s")
    for name in walls:
        print(f"{name:15s} {walls[name]['median']:7.3f} {cpus[name]['median']:7.3f}")
    print(f"before the first step: {median:.2f} s wall, {summary['before_first_step_cpu_s']['median']:.2f} s CPU "
          f"(target <= {TARGET_S} s: {'yes' if median <= TARGET_S else 'no'}); first step done "
          f"{summary['to_first_step_end_s']['median']:.2f} s after the process started")
    if payload["library_imports_cpu_s"] is not None:
        print(f"of which unavoidable: importing torch, transformers, AutoTokenizer and the Qwen2 modeling code takes "
              f"{payload['library_imports_cpu_s']:.2f} s CPU on its own")
    if as_is is not None:
        print(f"recipe as is: eval before training {as_is['startup']['phases'].get('eval_before', 0.0):.2f} s; "
              f"first step done {as_is['to_first_step_end_s']:.2f} s after the start")
    for name, r in outer.items():
        print(f"{name}: {r['wall_s']['median']:.2f} s wall, {r['cpu_s']['median']:.2f} s CPU")
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
