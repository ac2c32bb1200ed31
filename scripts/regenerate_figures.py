"""Regenerate the measured figures the examples' READMEs state, from the recipes' current defaults.

    python scripts/regenerate_figures.py --only dpo --only grpo       # README claim vs a fresh run, per figure
    python scripts/regenerate_figures.py --only grpo --check          # exit 1 when a README figure differs
    python scripts/regenerate_figures.py --workspace /tmp/figs         # keep the runs (default: a temporary folder)
    python scripts/regenerate_figures.py --only dpo --override optimizer.options.implementation=foreach
    python scripts/regenerate_figures.py --list                        # which examples, and why the others are not

``dpo-foreach`` and ``grpo-foreach`` regenerate the figures the DPO and GRPO READMEs give for
``optimizer.options.implementation=foreach`` (the runs are deterministic, but the fused default and the foreach
kernel round differently and end at different models). Runs with the same overrides share a workspace folder, so
``--only dpo --only grpo`` trains the shared SFT step once, and a kept ``--workspace`` skips runs that finished.

Each example runs its README's commands at full length from the repository root, with ``OMP_NUM_THREADS=1``
(the runs are deterministic then) and every output under the workspace, then reads the figures from the run's
``logs.jsonl`` or from the example's own measuring script. The README's figures are read by a small extractor per
example (the rows of its tables, a few sentences), so a figure compares as printed: ``0.990`` matches a
regenerated 0.9900 but not 0.9867. Wall times are machine-dependent and are printed, not checked.

Examples whose figures need several processes, a server, a hub model or many minutes are not here yet (the
``NOT_REGENERATED`` table says why); ``--list`` prints both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@dataclass(frozen=True)
class Figure:
    """One README figure: what it measures, as the README prints it, and the fresh value."""

    name: str
    claimed: str | None
    value: float | None

    @property
    def matches(self) -> bool:
        return self.claimed is not None and self.value is not None and self.claimed == as_printed(self.value,
                                                                                                  self.claimed)


def as_printed(value: float, like: str) -> str:
    """``value`` printed the way ``like`` is (``0.990``, ``0.36``, ``36 %``, ``4.6``)."""
    number = like.rstrip(" %")
    decimals = len(number.split(".", 1)[1]) if "." in number else 0
    if like.endswith("%"):
        return f"{value * 100:.{decimals}f}{like[len(number):]}"
    return f"{value:.{decimals}f}"


class Runner:
    """Runs commands from the repository root with deterministic threads, logging each to the workspace."""

    def __init__(self, workspace: Path, overrides: tuple[str, ...] = ()):
        workspace.mkdir(parents=True, exist_ok=True)
        self.workspace = workspace
        self.overrides = overrides  # appended to every ``twinkle train``: a figure's dependence on an option
        self.seconds: dict[str, float] = {}

    def run(self, label: str, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TWINKLE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false", "TWINKLE_TENSORBOARD": "0"}
        log = self.workspace / f"{label}.log"
        start = time.monotonic()
        with log.open("w") as fh:
            code = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        self.seconds[label] = time.monotonic() - start
        print(f"  {label}: {self.seconds[label]:.0f} s (log: {log})", flush=True)
        if code.returncode != 0:
            raise SystemExit(f"{label} failed with exit code {code.returncode}; see {log}")

    def train(self, label: str, recipe: str, *overrides: str) -> Path:
        """``twinkle train RECIPE`` into WORKSPACE/LABEL; returns that folder (skipped when its final exists)."""
        out = self.workspace / label
        if (out / "final").is_dir():
            print(f"  {label}: reusing {out}")
            return out
        self.run(label, "-m", "twinkle_core.cli", "train", str(EXAMPLES / recipe), f"train.output_dir={out}",
                 *overrides, *self.overrides)
        return out

    def measure_dpo(self, label: str, checkpoint: Path, *extra: str) -> dict:
        target = self.workspace / f"{label}.json"
        if not target.is_file():
            self.run(label, str(EXAMPLES / "dpo" / "measure.py"), str(checkpoint),
                     str(EXAMPLES / "dpo" / "eval.jsonl"), "--json", str(target), *extra)
        return json.loads(target.read_text())


def read_logs(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]


def evals_by_step(out: Path) -> dict[int, dict]:
    return {record["step"]: record for record in read_logs(out) if record.get("event") == "eval"}


def table_rows(text: str) -> dict[str, list[str]]:
    """Every markdown table row of ``text``: first cell -> the other cells, bold marks and notes removed.

    A label that occurs in several tables keeps its first row; the extractors split the text by heading
    first where that matters."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        numbers = [re.sub(r"\*\*", "", cell).split(" (", 1)[0].strip() for cell in cells[1:]]
        rows.setdefault(cells[0], numbers)
    return rows


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of any level."""
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(r"\n#+ ", body, maxsplit=1)[0]


def sentence_number(text: str, pattern: str) -> str | None:
    found = re.search(pattern, text)
    return found.group(1) if found else None


# --- examples/dpo ------------------------------------------------------------------------------------------------


def dpo_claims(readme: str) -> dict[str, str | None]:
    start = table_rows(section(readme, "## Measured SFT start point"))
    after = table_rows(section(readme, "## Step 2: DPO"))
    claims: dict[str, str | None] = {}
    for group in ("all", "reverse", "upper", "double"):
        for column, kind in enumerate(("chosen", "rejected", "other")):
            claims[f"sft {group} {kind}"] = start[group][column]
    claims["sft upper chosen (kernel note)"] = sentence_number(
        " ".join(readme.split()), r"right less often: (\d\.\d+), against \d\.\d+ with foreach")
    claims["sft fluent (chosen or rejected)"] = sentence_number(readme, r"So (\d+ %) of answers are one of the two")
    claims["sft log pi(chosen) > log pi(rejected)"] = sentence_number(
        readme, r"log π\(chosen\) > log π\(rejected\) on (\d+ %) of pairs")
    for stage, column in (("sft", 0), ("dpo", 1)):  # the DPO table repeats the SFT start in its first column
        claims[f"{stage} chosen (DPO table)"] = after["greedy answer is the chosen one"][column]
        claims[f"{stage} rejected (DPO table)"] = after["greedy answer is the rejected one"][column]
        claims[f"{stage} log pi(chosen) > log pi(rejected) (DPO table)"] = after["log π(chosen) > log π(rejected)"][
            column]
    claims["dpo reward accuracy"] = after["DPO reward accuracy (against the SFT reference)"][1]
    claims["dpo mean reward margin (trainer)"] = sentence_number(readme, r"\(mean margin (\d+\.\d+)\)")
    return claims


def dpo_foreach_claims(readme: str) -> dict[str, str | None]:
    """The columns of the DPO table measured with ``optimizer.options.implementation=foreach``."""
    after = table_rows(section(readme, "## Step 2: DPO"))
    claims: dict[str, str | None] = {}
    for stage, column in (("sft", 2), ("dpo", 3)):
        claims[f"{stage} chosen (DPO table)"] = after["greedy answer is the chosen one"][column]
        claims[f"{stage} rejected (DPO table)"] = after["greedy answer is the rejected one"][column]
        claims[f"{stage} log pi(chosen) > log pi(rejected) (DPO table)"] = after["log π(chosen) > log π(rejected)"][
            column]
    claims["dpo reward accuracy"] = after["DPO reward accuracy (against the SFT reference)"][3]
    kernels = " ".join(section(readme, "### Which figures depend on the AdamW kernel").split())
    start = re.search(r"the SFT start point answers (\d\.\d+) chosen, (\d\.\d+) rejected and (\d\.\d+) other", kernels)
    for i, kind in enumerate(("chosen", "rejected", "other")):
        claims[f"sft all {kind}"] = start.group(i + 1) if start else None
    claims["sft upper chosen"] = sentence_number(kernels, r"right less often: \d\.\d+, against (\d\.\d+) with foreach")
    return claims


def dpo_figures(runner: Runner) -> dict[str, float]:
    sft = runner.train("dpo_sft", "dpo/sft.yaml")
    dpo = runner.train("dpo_dpo", "dpo/recipe.yaml", f"model.model_id={sft / 'final'}")
    before = runner.measure_dpo("dpo_measure_sft", sft / "final")
    after = runner.measure_dpo("dpo_measure_dpo", dpo / "final", "--reference", str(sft / "final"))
    figures = {f"sft {group} {kind}": rates[kind] for group, rates in before["greedy"].items()
               for kind in ("chosen", "rejected", "other")}
    figures["sft upper chosen (kernel note)"] = before["greedy"]["upper"]["chosen"]
    figures["sft fluent (chosen or rejected)"] = 1 - before["greedy"]["all"]["other"]
    figures["sft log pi(chosen) > log pi(rejected)"] = before["logp_accuracy"]
    for stage, result in (("sft", before), ("dpo", after)):
        figures[f"{stage} chosen (DPO table)"] = result["greedy"]["all"]["chosen"]
        figures[f"{stage} rejected (DPO table)"] = result["greedy"]["all"]["rejected"]
        figures[f"{stage} log pi(chosen) > log pi(rejected) (DPO table)"] = result["logp_accuracy"]
    figures["dpo reward accuracy"] = after["reward_accuracy"]
    # the trainer's held-out evaluation: its margin is the DPO reward's (times beta); its preferred rate (greedy,
    # 12 new tokens) agrees with measure.py's chosen rate
    last = max(evals_by_step(dpo).items())[1]
    figures["dpo mean reward margin (trainer)"] = last["eval_rewards/margins"]
    figures["dpo eval_preferred_rate (trainer)"] = last["eval_preferred_rate"]
    return figures


# --- examples/grpo -----------------------------------------------------------------------------------------------


def grpo_claims(readme: str) -> dict[str, str | None]:
    row = table_rows(readme)["greedy exact match"]
    per_operation = re.search(r"`upper` is right on (\d\.\d+) of the prompts, `reverse` on (\d\.\d+) and `double` "
                              r"on (\d\.\d+)", " ".join(readme.split()))
    claims = {"grpo exact match, step 0": row[0], "grpo exact match, step 20": row[1],
              "grpo exact match, step 60": row[2]}
    for i, operation in enumerate(("upper", "reverse", "double")):
        claims[f"grpo {operation} exact match, last step"] = per_operation.group(i + 1) if per_operation else None
    return claims


def grpo_foreach_claims(readme: str) -> dict[str, str | None]:
    row = table_rows(readme)["greedy exact match, `optimizer.options.implementation=foreach`"]
    per_operation = re.search(r"with foreach: `upper` (\d\.\d+), `reverse` (\d\.\d+), `double` (\d\.\d+)",
                              " ".join(readme.split()))
    claims = {"grpo exact match, step 0": row[0], "grpo exact match, step 20": row[1],
              "grpo exact match, step 60": row[2]}
    for i, operation in enumerate(("upper", "reverse", "double")):
        claims[f"grpo {operation} exact match, last step"] = per_operation.group(i + 1) if per_operation else None
    return claims


def grpo_figures(runner: Runner) -> dict[str, float]:
    sft = runner.train("dpo_sft", "dpo/sft.yaml")  # the DPO quickstart's step 1, shared
    grpo = runner.train("grpo", "grpo/recipe.yaml", f"model.model_id={sft / 'final'}")
    figures = {f"grpo exact match, step {step}": record["eval_accuracy"]
               for step, record in sorted(evals_by_step(grpo).items())}
    # per operation: the DPO quickstart's held-out pairs are the same prompts, their chosen answer the right one
    final = runner.measure_dpo("grpo_measure", grpo / "final")
    for operation in ("upper", "reverse", "double"):
        figures[f"grpo {operation} exact match, last step"] = final["greedy"][operation]["chosen"]
    return figures


# --- examples/lora_sft -------------------------------------------------------------------------------------------


def lora_sft_claims(readme: str) -> dict[str, str | None]:
    found = re.search(r"held-out loss (\d+\.\d+) -> (\d+\.\d+), exact match\s+(\d+\.\d+) -> (\d+\.\d+)", readme)
    names = ("eval loss, step 0", "eval loss, last step", "exact match, step 0", "exact match, last step")
    return {f"lora_sft {name}": found.group(i + 1) if found else None for i, name in enumerate(names)}


def lora_sft_figures(runner: Runner) -> dict[str, float]:
    evals = evals_by_step(runner.train("lora_sft", "lora_sft/recipe.yaml"))
    first, last = evals[min(evals)], evals[max(evals)]
    return {"lora_sft eval loss, step 0": first["eval_loss"], "lora_sft eval loss, last step": last["eval_loss"],
            "lora_sft exact match, step 0": first["eval_exact_match"],
            "lora_sft exact match, last step": last["eval_exact_match"]}


# --- examples/multi_tenant ---------------------------------------------------------------------------------------


def multi_tenant_claims(readme: str) -> dict[str, str | None]:
    found = re.search(r"held-out loss on double (\d+\.\d+) for tenant_double vs (\d+\.\d+) / (\d+\.\d+) for "
                      r"tenant_reverse / tenant_upper", " ".join(readme.split()))
    tenants = ("tenant_double", "tenant_reverse", "tenant_upper")  # the README's order
    return {f"multi_tenant {tenant} on double": found.group(i + 1) if found else None
            for i, tenant in enumerate(tenants)}


def multi_tenant_figures(runner: Runner) -> dict[str, float]:
    out = runner.workspace / "multi_tenant"
    if not (out / "results.json").is_file():
        runner.run("multi_tenant", str(EXAMPLES / "multi_tenant" / "train.py"), "--output-dir", str(out))
    held_out = json.loads((out / "results.json").read_text())["held_out_loss"]
    return {f"multi_tenant {tenant} on double": losses["double"] for tenant, losses in held_out.items()}


@dataclass(frozen=True)
class Example:
    """The figures of ``examples/FOLDER/README.md`` that runs with ``overrides`` regenerate."""

    name: str
    folder: str
    claims: Callable[[str], dict[str, str | None]]
    figures: Callable[[Runner], dict[str, float]]
    overrides: tuple[str, ...] = ()

    @property
    def readme(self) -> Path:
        return EXAMPLES / self.folder / "README.md"

    def compare(self, runner: Runner) -> list[Figure]:
        claims = self.claims(self.readme.read_text(encoding="utf-8"))
        values = self.figures(runner)
        return [Figure(name, claims.get(name), values.get(name)) for name in {**claims, **values}]


FOREACH = ("optimizer.options.implementation=foreach",)
EXAMPLES_WITH_FIGURES = (
    Example("dpo", "dpo", dpo_claims, dpo_figures),
    Example("dpo-foreach", "dpo", dpo_foreach_claims, dpo_figures, FOREACH),
    Example("grpo", "grpo", grpo_claims, grpo_figures),
    Example("grpo-foreach", "grpo", grpo_foreach_claims, grpo_figures, FOREACH),
    Example("lora_sft", "lora_sft", lora_sft_claims, lora_sft_figures),
    Example("multi_tenant", "multi_tenant", multi_tenant_claims, multi_tenant_figures),
)

#: examples whose READMEs state measured figures that this script does not regenerate, and why
NOT_REGENERATED = {
    "embedding": "starts from all-MiniLM-L6-v2 and runs 260 s; add it here when its figures are next touched",
    "serve": "needs `twinkle serve` running in another process and the Tinker SDK client",
    "vlm": "a 96 s run with torch's default threads; its figures were measured with 2 threads",
    "fsdp2_full": "2 processes for 500 steps; its figures (exact match 0.875, the quickstart's 1.0) predate the "
                  "fused AdamW default too",
    "reward_model": "a new example; its figures are not yet ported to this script",
    "quickstart": "its figures are in the repository README, not in an example README; a 3 min run",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [example.name for example in EXAMPLES_WITH_FIGURES]
    parser.add_argument("--only", action="append", choices=names, help="this example only (repeatable)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a README figure differs")
    parser.add_argument("--workspace", help="where the runs go (kept; reused by a later call)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every run, e.g. optimizer.options.implementation=foreach")
    parser.add_argument("--list", action="store_true", help="the examples regenerated and those left, with why")
    args = parser.parse_args(argv)
    if args.list:
        for name in names:
            print(f"{name}: regenerated")
        for name, why in NOT_REGENERATED.items():
            print(f"{name}: not regenerated ({why})")
        return 0
    chosen = [example for example in EXAMPLES_WITH_FIGURES if not args.only or example.name in args.only]
    with tempfile.TemporaryDirectory(prefix="twinkle-figures-") as scratch:
        workspace = Path(args.workspace or scratch)
        workspace.mkdir(parents=True, exist_ok=True)
        differing = 0
        runners: list[Runner] = []
        for example in chosen:
            overrides = (*example.overrides, *args.override)
            # runs with the same overrides share a folder: the DPO and GRPO quickstarts share their SFT step
            runners.append(Runner(workspace / ("+".join(overrides) or "defaults"), overrides))
            runner = runners[-1]
            print(f"{example.name}{''.join(f' {o}' for o in overrides)}:", flush=True)
            figures = example.compare(runner)
            width = max(len(figure.name) for figure in figures)
            print(f"  {'figure':<{width}}  {'README':>8}  {'regenerated':>11}")
            for figure in figures:
                fresh = "-" if figure.value is None else as_printed(figure.value, figure.claimed or "0.000")
                mark = "" if figure.claimed is None or figure.matches else "   <- differs"
                differing += bool(mark)
                print(f"  {figure.name:<{width}}  {figure.claimed or '-':>8}  {fresh:>11}{mark}")
        for runner in runners:
            for label, seconds in runner.seconds.items():
                print(f"wall time {runner.workspace.name}/{label}: {seconds:.0f} s")
    if differing:
        print(f"{differing} README figure(s) differ from the regeneration")
    return 1 if args.check and differing else 0


if __name__ == "__main__":
    sys.exit(main())
