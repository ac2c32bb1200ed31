"""twinkle_core.threads: the torch threads a Twinkle process computes with (an explicit choice wins; otherwise its
share of the free cores), what it says about it, and how a launcher hands the choice to its ranks."""

from __future__ import annotations

import logging

import pytest
import torch

from twinkle_core import threads
from twinkle_core.errors import ConfigError
from twinkle_core.threads import (
    LAUNCHER_VARIABLE,
    ThreadChoice,
    auto_threads,
    cgroup_cpu_limit,
    choose_threads,
    configure_threads,
    explicit_threads,
    launcher_env,
    local_processes,
    threads_for_run,
)


@pytest.fixture
def machine(monkeypatch):
    """A machine with ``cores`` available and a 1-minute load average of ``load`` (None: not known)."""
    state = {"cores": 2, "load": 0.0}
    monkeypatch.setattr(threads, "available_cores", lambda: state["cores"])
    monkeypatch.setattr(threads, "load_average", lambda: state["load"])
    return state


# ---------------------------------------------------------------------- the rule
@pytest.mark.parametrize(("cores", "processes", "load", "expected"), [
    (2, 1, 0.0, 2),     # idle: every core
    (2, 1, 0.4, 2),     # idle-ish: 1.6 free cores round to 2
    (2, 1, 0.7, 1),     # another process on about one core
    (2, 1, 4.0, 1),     # oversubscribed: never below 1
    (2, 2, 0.0, 1),     # two ranks share two cores
    (16, 2, 0.3, 8),    # torchrun's split on an idle machine
    (16, 2, 6.0, 5),    # ten free cores for two ranks
    (16, 1, 20.0, 1),
    (3, 2, 0.0, 1),     # never more than the share of the available cores
    (2, 1, None, 2),    # no load average on this system: the share of the cores
])
def test_auto_threads_takes_the_share_of_the_free_cores(cores, processes, load, expected):
    assert auto_threads(cores, processes, load) == expected


def test_local_processes_is_torchruns_local_world_size():
    assert local_processes({}) == 1
    assert local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_processes({"LOCAL_WORLD_SIZE": "junk"}) == 1


# ---------------------------------------------------------------------- explicit choices win
def test_omp_num_threads_wins_over_the_test_harness_and_the_rule(machine):
    machine["load"] = 0.0
    env = {"OMP_NUM_THREADS": "3", "TWINKLE_TEST_THREADS": "1"}
    assert explicit_threads(env) == (3, "OMP_NUM_THREADS")
    choice = choose_threads(env)
    assert (choice.threads, choice.source) == (3, "OMP_NUM_THREADS")


def test_the_test_harness_setting_wins_over_the_rule(machine):
    machine["load"] = 5.0  # the rule would say 1
    choice = choose_threads({"TWINKLE_TEST_THREADS": "2"})
    assert (choice.threads, choice.source) == (2, "TWINKLE_TEST_THREADS")


def test_the_launchers_omp_num_threads_is_not_a_choice(machine):
    machine["cores"], machine["load"] = 8, 0.0
    env = {"OMP_NUM_THREADS": "4", LAUNCHER_VARIABLE: "4", "LOCAL_WORLD_SIZE": "2"}
    assert explicit_threads(env) is None
    assert choose_threads(env).source == "auto"
    # the user's own value differs from the launcher's: it is the user's
    assert explicit_threads({**env, "OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS")


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_value_is_refused_with_the_fix(value):
    with pytest.raises(ConfigError, match=f"OMP_NUM_THREADS={value!r} is not a positive number of threads; set it "
                                          f"to 1 or more, or unset it"):
        explicit_threads({"OMP_NUM_THREADS": value})


def test_an_empty_value_is_no_choice_and_a_nested_one_gives_its_outer_level():
    assert explicit_threads({"OMP_NUM_THREADS": " "}) is None
    assert explicit_threads({"OMP_NUM_THREADS": "4,2"}) == (4, "OMP_NUM_THREADS")


# ---------------------------------------------------------------------- what it says
def test_the_log_line_names_the_cores_processes_and_how_to_override(machine):
    machine["cores"], machine["load"] = 2, 0.9
    text = choose_threads({"LOCAL_WORLD_SIZE": "2"}).message()
    assert text == ("torch threads: 1 (2 cores available, 2 processes on this machine, load average 0.9; "
                    "set OMP_NUM_THREADS to override)")
    assert choose_threads({"OMP_NUM_THREADS": "2"}).message() == (
        "torch threads: 2 (from OMP_NUM_THREADS; 2 cores available, 1 process on this machine, load average 0.9)")
    machine["cores"], machine["load"] = 1, None
    assert choose_threads({}).message() == ("torch threads: 1 (1 core available, 1 process on this machine; "
                                            "set OMP_NUM_THREADS to override)")


def test_an_oversubscribed_machine_is_warned_about():
    assert ThreadChoice(1, "auto", 2, 1, 1.9).oversubscription_warning() is None
    auto = ThreadChoice(1, "auto", 2, 1, 3.5).oversubscription_warning()
    assert auto.startswith("the machine is oversubscribed: load average 3.5 over the last minute on 2 available cores")
    assert auto.endswith("; this process uses 1 thread")
    explicit = ThreadChoice(2, "OMP_NUM_THREADS", 2, 1, 3.5).oversubscription_warning()
    assert "with 2 threads torch also waits" in explicit and "set OMP_NUM_THREADS=1 (fewer threads are faster" in explicit
    assert "1 available core," in ThreadChoice(1, "auto", 1, 1, 1.5).oversubscription_warning()
    assert ThreadChoice(2, "auto", 2, 1, None).oversubscription_warning() is None


def test_configure_threads_sets_torch_logs_one_line_and_warns(machine, caplog):
    machine["cores"], machine["load"] = 2, 6.0
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="twinkle.threads"):
            choice = configure_threads({"OMP_NUM_THREADS": "2"})
        assert torch.get_num_threads() == 2 == choice.threads
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "twinkle.threads"]
        assert lines[0] == ("INFO", choice.message()) and len(lines) == 2
        assert lines[1][0] == "WARNING" and "set OMP_NUM_THREADS=1" in lines[1][1]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="twinkle.threads"):
            configure_threads({"OMP_NUM_THREADS": "2", "LOCAL_RANK": "1"})
        assert [r.levelname for r in caplog.records if r.name == "twinkle.threads"] == ["INFO"]  # once a machine
    finally:
        torch.set_num_threads(before)


def test_a_command_can_print_the_lines_itself(machine):
    machine["cores"], machine["load"] = 2, 3.0
    said = []
    before = torch.get_num_threads()
    try:
        choice = configure_threads({}, say=said.append)
    finally:
        torch.set_num_threads(before)
    assert said == [choice.message(), choice.oversubscription_warning()] and choice.threads == 1


def test_threads_for_run_gives_the_callers_setting_back(machine):
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with threads_for_run({"OMP_NUM_THREADS": str(other)}) as choice:
        assert torch.get_num_threads() == other == choice.threads
    assert torch.get_num_threads() == before


# ---------------------------------------------------------------------- the launcher
def test_the_launcher_passes_its_choice_marked_unless_the_user_chose(machine):
    machine["cores"], machine["load"] = 16, 0.0
    assert launcher_env(2, {}) == {"OMP_NUM_THREADS": "8", LAUNCHER_VARIABLE: "8"}
    assert launcher_env(2, {"OMP_NUM_THREADS": "3"}) == {}
    # the test harness's setting is for the ranks to read; the launcher still replaces torchrun's default
    assert launcher_env(2, {"TWINKLE_TEST_THREADS": "1"})["OMP_NUM_THREADS"] == "8"


# ---------------------------------------------------------------------- the cores available
def _cgroup(tmp_path, lines, files):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text("\n".join(lines) + "\n")
    for name, text in files.items():
        path = tmp_path / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "sys", tmp_path / "proc" / "cgroup"


def test_a_cgroup_v2_quota_limits_the_cores(tmp_path):
    sysfs, proc = _cgroup(tmp_path, ["0::/job/step"], {"job/cpu.max": "250000 100000\n",
                                                       "job/step/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(sysfs, proc) == 2  # 2.5 CPUs on the parent cgroup: 2 whole ones


def test_a_cgroup_v1_quota_limits_the_cores(tmp_path):
    sysfs, proc = _cgroup(tmp_path, ["4:memory:/x", "2:cpu,cpuacct:/"],
                          {"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(sysfs, proc) == 1  # half a CPU: still one thread


def test_no_quota_is_no_limit(tmp_path):
    sysfs, proc = _cgroup(tmp_path, ["1:cpu:/", "0::/"], {"cpu/cpu.cfs_quota_us": "-1\n",
                                                          "cpu/cpu.cfs_period_us": "100000\n",
                                                          "cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(sysfs, proc) is None
    assert cgroup_cpu_limit(tmp_path / "nowhere", tmp_path / "no-such-file") is None


def test_available_cores_reads_affinity_and_quota(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    assert threads.available_cores() == 4
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 3)
    assert threads.available_cores() == 3


def test_torchrun_ranks_get_the_launchers_choice_and_the_launcher_keeps_its_environment(machine, monkeypatch):
    import argparse

    from torch.distributed import run as torchrun

    from twinkle_core.launch import TorchrunRuntime, TrainJob

    machine["cores"], machine["load"] = 16, 0.0
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(LAUNCHER_VARIABLE, raising=False)
    seen = {}
    monkeypatch.setattr(torchrun, "main", lambda argv: seen.update(
        {name: threads.os.environ.get(name) for name in ("OMP_NUM_THREADS", LAUNCHER_VARIABLE)}))
    args = argparse.Namespace(nproc_per_node=4, nnodes=1, node_rank=0, master_addr=None, master_port=None)
    assert TorchrunRuntime().launch(TrainJob("r.yaml"), args) == 0
    assert seen == {"OMP_NUM_THREADS": "4", LAUNCHER_VARIABLE: "4"}
    assert "OMP_NUM_THREADS" not in threads.os.environ and LAUNCHER_VARIABLE not in threads.os.environ

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice goes through untouched
    assert TorchrunRuntime().launch(TrainJob("r.yaml"), args) == 0
    assert seen == {"OMP_NUM_THREADS": "2", LAUNCHER_VARIABLE: None}
