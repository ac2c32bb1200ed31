"""Developer sessions: one per distribution, the conformance runs, lint, slow tests and the demo.

Sessions reuse one environment (``.venv``, made by scripts/bootstrap.sh) so torch is installed once;
run e.g. ``nox -s core``, ``nox -s hf``, ``nox -s conformance-hf``, ``nox -s parity``, ``nox -s slow``, ``nox -s demo``.
``nox -s core_alone`` is the exception: a fresh virtualenv with twinkle-core and nothing else.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "core", "hf", "megatron", "npu", "ray", "server", "embedding", "rl", "vlm", "conformance"]

ROOT = os.path.dirname(os.path.abspath(__file__))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "TWINKLE_NO_PROGRESS": "1"}
PYTEST = [PYTHON, "-m", "pytest", "--import-mode=importlib", "-p", "no:cacheprovider"]
TORCH = "torch==2.13.0"  # a CPU build; the version scripts/bootstrap.sh installs


def _bootstrap(session: nox.Session) -> None:
    session.run("bash", "scripts/bootstrap.sh", external=True)


def _pytest(session: nox.Session, *args: str) -> None:
    _bootstrap(session)
    session.run(*PYTEST, *args, *session.posargs, env=ENV, external=True, success_codes=[0])


@nox.session
def lint(session: nox.Session) -> None:
    _bootstrap(session)
    session.run(PYTHON, "-m", "ruff", "check", ".", external=True)


@nox.session
def core(session: nox.Session) -> None:
    """twinkle-core: contracts, plugins, losses, data, loop, CLI, and the suite against the reference backend."""
    _pytest(session, "tests", "-m", "not slow")


@nox.session(venv_backend="venv", reuse_venv=False, default=False)
def core_alone(session: nox.Session) -> None:
    """twinkle-core by itself in a fresh virtualenv (no backend, no optional extra): its declared
    dependencies suffice, and the tests that need a backend or an optional package skip."""
    session.install(TORCH)  # first and pinned, so that pip never resolves a bare torch to a CUDA build
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "--import-mode=importlib", "-p", "no:cacheprovider", "tests",
                "-m", "not slow", *session.posargs, env=ENV)


@nox.session
def hf(session: nox.Session) -> None:
    _pytest(session, "twinkle-backend-hf/tests", "-m", "not slow")


@nox.session
def megatron(session: nox.Session) -> None:
    _pytest(session, "twinkle-backend-megatron/tests", "-m", "not slow")


@nox.session
def npu(session: nox.Session) -> None:
    """twinkle-backend-npu on the CPU, through the fake torch_npu in twinkle_backend_npu.testing: accelerator
    selection and refusals, HCCL setup, kernel swaps, and the conformance suite on the fake NPU (1 rank and ddp)."""
    _pytest(session, "twinkle-backend-npu/tests", "-m", "not slow")


@nox.session
def ray(session: nox.Session) -> None:
    """twinkle-ray on a real local Ray cluster (loopback): worker groups, the model proxy, the sampler actor and
    reward pool, `twinkle train --runtime ray` against torchrun, restarts and a 2-node cluster."""
    _pytest(session, "twinkle-ray/tests", "-m", "not slow")


@nox.session
def server(session: nox.Session) -> None:
    """twinkle-server: the scheduler, tenancy and registry; a real `twinkle serve` on loopback driven by the
    unmodified Tinker SDK and by the native client; kill -9 and restart; the console in headless chromium; a base
    model on a Ray worker group (twinkle-ray, installed in .venv by scripts/bootstrap.sh: the server's `ray` extra)."""
    _pytest(session, "twinkle-server/tests", "-m", "not slow")


@nox.session
def vlm(session: nox.Session) -> None:
    """plugins/twinkle-vlm: data formats, the vlm task, per-part training, strategies, export, the quickstart."""
    _pytest(session, "plugins/twinkle-vlm/tests", "-m", "not slow")


@nox.session
def embedding(session: nox.Session) -> None:
    _pytest(session, "plugins/twinkle-embedding/tests", "-m", "not slow")


@nox.session
def rl(session: nox.Session) -> None:
    """plugins/twinkle-rl: preference training and online RL (sampler, rewards, advantages, losses, the grpo / ppo
    tasks end to end, 2-rank and Megatron equality, the quickstarts)."""
    _pytest(session, "plugins/twinkle-rl/tests", "-m", "not slow")


@nox.session(name="conformance")
@nox.parametrize("target", ["hf", "megatron"])
def conformance(session: nox.Session, target: str) -> None:
    """The core's conformance suite, unchanged, against one registered target (single process)."""
    _pytest(session, "--pyargs", "twinkle_core.testing.conformance", "--twinkle-backend", target)


@nox.session(name="conformance-distributed")
@nox.parametrize("target", ["hf-ddp", "hf-fsdp", "hf-zero2", "hf-zero3"])
def conformance_distributed(session: nox.Session, target: str) -> None:
    _bootstrap(session)
    session.run(PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", "29511", "-m", "pytest", "-p", "no:cacheprovider", "-q", "--pyargs",
                "twinkle_core.testing.conformance", "--twinkle-backend", target, env=ENV, external=True)


@nox.session
@nox.parametrize("threads", ["1", "2"])
def parity(session: nox.Session, threads: str) -> None:
    """The parity tests with THREADS threads per process. CI (scripts/test.sh) runs every test with 1 thread and
    the in-process parity tests again with 2; `nox -s "parity(threads='2')"` reruns the multi-process ones too."""
    _bootstrap(session)
    session.run(*PYTEST, "tests", "twinkle-backend-hf/tests", "twinkle-backend-megatron/tests",
                "twinkle-backend-npu/tests", "twinkle-ray/tests", "twinkle-server/tests", "plugins",
                "-m", "parity and not slow", *session.posargs, env={**ENV, "TWINKLE_TEST_THREADS": threads},
                external=True, success_codes=[0])


@nox.session
def slow(session: nox.Session) -> None:
    """Long-running tests (quickstart accuracy, real-model fine-tuning)."""
    _pytest(session, "tests", "twinkle-backend-hf/tests", "twinkle-backend-npu/tests", "twinkle-ray/tests",
            "twinkle-server/tests", "plugins", "-m", "slow")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: its test builds it with mkdocs build --strict (into a temporary directory) and
    loads it in headless chromium. ``mkdocs serve`` shows it while you write."""
    _pytest(session, "tests/test_docs_site.py")


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job: the quickstart training run."""
    _bootstrap(session)
    session.run(os.path.join(ROOT, ".venv", "bin", "twinkle"), "train", "examples/quickstart/recipe.yaml",
                external=True, env={"HF_HUB_OFFLINE": "1"})
