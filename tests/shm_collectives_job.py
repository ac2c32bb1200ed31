"""Two ranks on one host: the shared-memory process group (``twinkle_core.shm_collectives``) against gloo.

Run by ``tests/test_shm_collectives.py`` under torchrun; each check raises on a mismatch."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from twinkle_core import distributed, shm_collectives

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32)


def rank_tensor(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 10 + rank)
    values = torch.randn(numel, generator=generator) * 3
    return values.round().to(dtype) if not dtype.is_floating_point else values.to(dtype)


def check_equal_to_gloo(gloo: dist.ProcessGroup, rank: int) -> None:
    """Every op and dtype, one chunk and several (the last one partial): bitwise gloo's result."""
    sizes = (1, 1000, shm_collectives.SLOT_BYTES // 4 * 2 + 3)
    for seed, (dtype, numel, (name, op)) in enumerate(
            (d, n, o) for d in DTYPES for n in sizes for o in OPS.items()):
        if numel > 1000 and (dtype != torch.float32 or name != "sum"):
            continue  # the multi-chunk path is the same for every op; one is enough
        mine = rank_tensor(rank, numel, dtype, seed)
        reference = mine.clone()
        dist.all_reduce(mine, op=op)
        dist.all_reduce(reference, op=op, group=gloo)
        if not torch.equal(mine, reference):
            raise AssertionError(f"{name} of {numel} {dtype}: max |diff| "
                                 f"{(mine.double() - reference.double()).abs().max()}")


def check_all_gather_equal_to_gloo(gloo: dist.ProcessGroup, rank: int) -> None:
    """Both all-gather forms, every dtype, one slot's worth (shared memory) and more (gloo's): gloo's result."""
    for seed, (dtype, numel) in enumerate((d, n) for d in DTYPES for n in (1, 777)):
        mine = rank_tensor(rank, numel, dtype, 100 + seed).view(-1, 1) if numel > 1 else \
            rank_tensor(rank, numel, dtype, 100 + seed)
        parts, reference = ([torch.empty_like(mine) for _ in range(2)] for _ in range(2))
        dist.all_gather(parts, mine)
        dist.all_gather(reference, mine, group=gloo)
        into = torch.empty((2 * mine.shape[0], *mine.shape[1:]), dtype=dtype)
        dist.all_gather_into_tensor(into, mine)
        if not all(torch.equal(a, b) for a, b in zip(parts, reference)) or not torch.equal(into, torch.cat(reference)):
            raise AssertionError(f"all-gather of {numel} {dtype}: {parts} / {into} != {reference}")
    big = torch.full((shm_collectives.SLOT_BYTES // 4 + 1,), float(rank))  # over one slot: gloo's
    parts = [torch.empty_like(big) for _ in range(2)]
    dist.all_gather(parts, big)
    if [float(p[0]) for p in parts] != [0.0, 1.0] or [float(p[-1]) for p in parts] != [0.0, 1.0]:
        raise AssertionError("an all-gather over one slot went wrong")


def check_many_rounds(rank: int) -> None:
    """Back-to-back all-reduces reuse the two banks of slots: each result must be its own round's."""
    for step in range(200):
        value = torch.full((257,), float(step * 2 + rank))
        dist.all_reduce(value)
        if not torch.all(value == step * 4 + 1):
            raise AssertionError(f"round {step}: {value[:4].tolist()}")
        parts = [torch.empty(3) for _ in range(2)]
        dist.all_gather(parts, torch.full((3,), float(step * 2 + rank)))
        if [p.tolist() for p in parts] != [[step * 2.0] * 3, [step * 2.0 + 1] * 3]:
            raise AssertionError(f"gather round {step}: {parts}")


def check_async_and_future(rank: int) -> None:
    value = torch.tensor([1.0 + rank, 2.0])
    work = dist.all_reduce(value, async_op=True)
    work.wait()
    result = work.get_future().value()[0]
    if result.tolist() != [3.0, 4.0] or value.tolist() != [3.0, 4.0]:
        raise AssertionError(f"async all-reduce gave {value.tolist()}, future {result.tolist()}")
    pair = [torch.tensor([float(rank)]), torch.tensor([10.0 * rank])]
    dist.all_reduce_coalesced(pair)
    if [t.item() for t in pair] != [1.0, 10.0]:
        raise AssertionError(f"coalesced all-reduce gave {pair}")


def check_the_other_collectives(rank: int) -> None:
    mine = torch.arange(4.0) + 10 * rank
    gathered = [torch.empty(4) for _ in range(2)]
    dist.all_gather(gathered, mine)
    into = torch.empty(8)
    dist.all_gather_into_tensor(into, mine)
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, mine)
    swapped = torch.empty(4)
    dist.all_to_all_single(swapped, mine)
    sent = torch.tensor([float(rank)])
    if rank == 0:
        dist.send(sent + 5, dst=1)
    else:
        dist.recv(sent, src=0)
    broadcast = mine.clone()
    dist.broadcast(broadcast, src=1)
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    dist.barrier()
    expected = {"all_gather": [[0, 1, 2, 3], [10, 11, 12, 13]], "into": [0, 1, 2, 3, 10, 11, 12, 13],
                "scatter": [[10, 12], [14, 16]][rank], "swapped": [[0, 1, 10, 11], [2, 3, 12, 13]][rank],
                "sent": [0.0, 5.0][rank], "broadcast": [10, 11, 12, 13], "objects": [{"rank": 0}, {"rank": 1}]}
    got = {"all_gather": [t.tolist() for t in gathered], "into": into.tolist(), "scatter": scattered.tolist(),
           "swapped": swapped.tolist(), "sent": sent.item(), "broadcast": broadcast.tolist(), "objects": objects}
    for key, value in expected.items():
        if got[key] != value:
            raise AssertionError(f"{key}: {got[key]} != {value}")


def check_functional_collectives(rank: int) -> None:
    """DTensor redistributes through torch's functional collectives, which call the group from C++ holding the
    GIL (an all-gather that reached gloo through the C++ base class deadlocked FSDP2's full_state_dict)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (2,))
    local = torch.arange(4.0) + 10 * rank
    sharded = DTensor.from_local(local, mesh, [Shard(0)])
    partial = DTensor.from_local(local, mesh, [Partial()])
    got = {"gathered": sharded.full_tensor().tolist(),
           "summed": partial.redistribute(mesh, [Replicate()]).to_local().tolist(),
           "scattered": partial.redistribute(mesh, [Shard(0)]).to_local().tolist()}
    expected = {"gathered": [0, 1, 2, 3, 10, 11, 12, 13], "summed": [10, 12, 14, 16],
                "scattered": [[10, 12], [14, 16]][rank]}
    if got != expected:
        raise AssertionError(f"{got} != {expected}")


def check_subgroup_shares_memory(rank: int) -> None:
    group = dist.new_group([0, 1])
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=group)
    if value.item() != 3.0 or group.shares_memory is not True:
        raise AssertionError(f"subgroup all-reduce gave {value.item()}, shares memory {group.shares_memory}")


def check_a_missing_peer_times_out_by_name(rank: int) -> None:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    warm = torch.ones(1)
    dist.all_reduce(warm, group=group)  # both ranks map the segment
    if rank == 1:
        return  # skips the next all-reduce
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as error:
        waited = time.monotonic() - started
        if "rank(s) [1]" not in str(error) or not 1.5 < waited < 30:
            raise AssertionError(f"after {waited:.1f} s: {error}") from error
        return
    raise AssertionError("an all-reduce whose peer never came returned")


def main() -> None:
    torch.set_num_threads(1)
    distributed.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_backend() != shm_collectives.BACKEND:
        raise AssertionError(f"joined {dist.get_backend()!r}")
    gloo = dist.new_group([0, 1], backend="gloo")
    check_equal_to_gloo(gloo, rank)
    if dist.group.WORLD.shares_memory is not True:
        raise AssertionError("the default group's all-reduce did not go through shared memory")
    check_all_gather_equal_to_gloo(gloo, rank)
    check_many_rounds(rank)
    check_async_and_future(rank)
    check_the_other_collectives(rank)
    check_functional_collectives(rank)
    check_subgroup_shares_memory(rank)
    check_a_missing_peer_times_out_by_name(rank)
    dist.barrier(group=gloo)
    left = [name for name in os.listdir(shm_collectives.SHM_DIR) if name.startswith(f"twinkle-shm-{os.getpid()}-")]
    if left:
        raise AssertionError(f"segment files left in {shm_collectives.SHM_DIR}: {left}")
    print(f"rank {rank}: shared-memory checks passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
