"""The torchrun environment a group's actors get, from where Ray placed them (no cluster needed)."""

from __future__ import annotations

from twinkle_ray.rank_layout import Placed, rank_environments


def test_one_node_cpu_ranks_look_like_torchrun():
    envs = rank_environments([Placed("n1", "127.0.0.1"), Placed("n1", "127.0.0.1")], 29555)
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", "29555")}
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in envs)


def test_two_nodes_number_local_ranks_per_node_and_rendezvous_on_rank_zeros_node():
    placed = [Placed("a", "10.0.0.1"), Placed("b", "10.0.0.2"), Placed("a", "10.0.0.1"), Placed("b", "10.0.0.2")]
    envs = rank_environments(placed, 1234)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["NODE_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2"] * 4
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"}


def test_accelerators_restore_torchruns_view_of_the_node():
    """Ray shows each actor its own GPU; torchrun shows all of the node's and picks one by LOCAL_RANK."""
    placed = [Placed("a", "h", {"GPU": ["3"]}), Placed("a", "h", {"GPU": ["1"]}), Placed("b", "g", {"GPU": ["0"]})]
    envs = rank_environments(placed, 1)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,3", "1,3", "0"]
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "0", "0"]  # the position of the actor's own device


def test_npu_devices_use_ascends_variable():
    envs = rank_environments([Placed("a", "h", {"NPU": ["0"]}), Placed("a", "h", {"NPU": ["1"]})], 1)
    assert [e["ASCEND_RT_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
