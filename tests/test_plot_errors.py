"""Every must-fail input of ``twinkle plot`` ends in one line naming the file (or option) and the fix, with a
non-zero exit status: never a Python traceback.

The command runs in-process through ``twinkle_core.cli.main``, as ``twinkle`` runs it: an exception that is not a
:class:`~twinkle_core.errors.TwinkleError` escapes ``main`` and fails the test (it would be a traceback).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from twinkle_core.cli import main

GOOD_LINES = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def _log(run: Path, content: str | bytes | list) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / "logs.jsonl"
    if isinstance(content, list):
        content = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in content)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


@dataclass(frozen=True)
class Case:
    """``make(run)`` writes the run directory and returns the arguments after ``plot``; the error line must contain
    ``names`` (``{run}``: the run directory) and ``fix``."""

    make: Callable[[Path], list[str]]
    names: str
    fix: str


def logged(content: str | bytes | list, *extra: str) -> Callable[[Path], list[str]]:
    def make(run: Path) -> list[str]:
        return [str(_log(run, content)), *[e.format(run=run) for e in extra]]
    return make


def output_below_a_file(run: Path) -> list[str]:
    log = _log(run, GOOD_LINES)
    (run / "notes").write_text("x")
    return [str(log), "--output", str(run / "notes" / "curves.png")]


def output_a_directory(run: Path) -> list[str]:
    log = _log(run, GOOD_LINES)
    (run / "pictures").mkdir()
    return [str(log), "--output", str(run / "pictures")]


CASES: dict[str, Case] = {
    "missing-log": Case(lambda run: [str(run / "logs.jsonl")], "{run}/logs.jsonl", "output directory"),
    "run-directory-without-log": Case(lambda run: (run.mkdir(), [str(run)])[1], "{run}", "output directory"),
    "empty-log": Case(logged(""), "{run}/logs.jsonl", "at least one step"),
    "blank-lines": Case(logged("\n\n  \n"), "{run}/logs.jsonl", "at least one step"),
    "not-json": Case(logged("this is not json\nneither is this\n"), "{run}/logs.jsonl", "at least one step"),
    "binary": Case(logged(b"\x89PNG\r\n\x1a\n\x00\xff\xfe\xfd" * 8), "{run}/logs.jsonl", "at least one step"),
    "json-but-not-objects": Case(logged(["[1, 2]", "3", '"loss"']), "{run}/logs.jsonl", "at least one step"),
    "unknown-metric": Case(logged(GOOD_LINES, "--keys", "los"), "'los'", "loss"),
    "empty-keys": Case(logged(GOOD_LINES, "--keys", " , "), "--keys", "--keys loss"),
    "no-default-metric": Case(logged([{"step": 1, "grad_norm": 0.5}]), "{run}/logs.jsonl", "--keys"),
    "only-non-finite-values": Case(logged(['{"step": 1, "loss": NaN}', '{"step": 2, "loss": Infinity}']),
                                   "{run}/logs.jsonl", "finite"),
    "output-a-directory": Case(output_a_directory, "--output {run}/pictures", "curves.png"),
    "output-below-a-file": Case(output_below_a_file, "{run}/notes", "not a directory"),
    "output-unknown-format": Case(logged(GOOD_LINES, "--output", "{run}/curves.xyz"), "--output {run}/curves.xyz",
                                  ".png"),
    "output-without-suffix": Case(logged(GOOD_LINES, "--output", "{run}/curves"), "--output {run}/curves", ".png"),
    "output-is-the-log": Case(logged(GOOD_LINES, "--output", "{run}/logs.jsonl"), "--output {run}/logs.jsonl",
                              "another file"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plot_must_fail_with_one_clear_line(name, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    case = CASES[name]
    run = tmp_path / "run"
    argv = ["plot", *case.make(run)]
    log = run / "logs.jsonl"
    before = log.read_bytes() if log.is_file() else None
    status = main(argv)
    captured = capsys.readouterr()
    assert status != 0
    assert "Traceback" not in captured.out + captured.err, captured.err
    lines = [line for line in captured.err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("twinkle: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], captured.err
    assert case.names.format(run=run) in errors[0] and case.fix in errors[0], errors[0]
    assert (log.read_bytes() if log.is_file() else None) == before  # the log is never written


@pytest.mark.parametrize("lines", [
    [*GOOD_LINES, "[1, 2]", '{"step": "three", "loss": 1.0}', '{"step": null, "loss": 1.2}', '{"loss": 0.9, '],
    [b"\xff\xfe garbage", *GOOD_LINES],
], ids=["bad-lines-among-good", "binary-line-among-good"])
def test_bad_lines_among_good_ones_are_skipped(lines, tmp_path, capsys):
    """A line cut by a crash, or one that is not a step's record, does not stop the rest of the log drawing."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    content = b"".join((line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line))
                        .encode()) + b"\n" for line in lines)
    (run / "logs.jsonl").write_bytes(content)
    assert main(["plot", str(run), "--output", str(tmp_path / "out.png")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_names_the_install(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    _log(run, GOOD_LINES)
    for module in ("matplotlib", "matplotlib.backend_bases", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("twinkle: error:") == 1 and "pip install matplotlib" in err and "Traceback" not in err, err
