"""``grad_allreduce`` on 2 CPU ranks (gloo, two spawned processes): a step sums the ranks' gradients (a parameter
with a gradient on one rank only takes part as zeros on the other; one without a gradient anywhere stays without),
and ``set_optimizer`` gives every rank rank 0's weights. The whole model path (many tenants' adapters, Tinker's sum
losses) runs end to end in twinkle-server's ``test_ray_host.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from twinkle_backend_hf.strategies.grad_allreduce import GradAllReduceStrategy

    from twinkle_core.strategy import OptimizerHandle

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        strategy = GradAllReduceStrategy()
        shared, one_rank, unused = (torch.nn.Parameter(torch.full((2,), float(rank + 1))) for _ in range(3))
        optimizer = torch.optim.SGD([shared, one_rank, unused], lr=0.1)
        _, handle = strategy.prepare_optimizer(torch.nn.Module(), optimizer, parameters=[shared, one_rank, unused])
        assert isinstance(handle, OptimizerHandle)
        weights = [p.detach().clone() for p in (shared, one_rank, unused)]
        shared.grad = torch.tensor([1.0, 2.0]) * (rank + 1)
        if rank == 1:
            one_rank.grad = torch.tensor([5.0, 6.0])
        strategy.scale_gradients(torch.nn.Module(), handle, 0.5)
        torch.save({"weights": weights, "grads": [shared.grad, one_rank.grad, unused.grad]}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_step_sums_the_ranks_gradients_and_set_optimizer_takes_rank_0s_weights(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(init, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"{rank}.pt")
        assert all(torch.equal(w, torch.ones(2)) for w in saved["weights"]), saved["weights"]  # rank 0's
        shared, one_rank, unused = saved["grads"]
        assert torch.equal(shared, torch.tensor([1.5, 3.0]))  # (1 + 2) x [1, 2] x 0.5
        assert torch.equal(one_rank, torch.tensor([2.5, 3.0]))  # rank 1's alone, x 0.5
        assert unused is None
