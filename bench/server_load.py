"""(n) The training service under load: N concurrent Tinker-SDK clients, one tenant each, on one `twinkle serve`.

Each client loops ``forward_backward`` (cross_entropy, ``--batch`` datums of ``--seq-len`` tokens, data drawn from
its own seed) and ``optim_step``; every ``--sample-every`` steps it saves weights for a sampler and samples. Per
configuration (``--clients 1,4,8``) the script reports:

* tokens/s trained (all tenants together) and per tenant, against one tenant alone;
* p50 / p99 latency per request type (the time ``.result()`` took, queueing included);
* the server's resident memory over time (VmRSS of the server process, sampled every second);
* errors (must be 0) and *lost updates*: at the end every tenant's adapter is exported and compared, bitwise, with
  the same requests replayed serially in this process on a fresh host of the same base (same seeds, one thread).

Requests of different tenants are not batched into one forward/backward: each tenant's step runs alone on the
model (the scheduler's lanes), which is what makes the replay bitwise equal and tenants isolated. The throughput
rows measure what that costs.

    python bench/server_load.py --clients 1,4,8 --duration 60          # the README row
    python bench/server_load.py --clients 8 --duration 240              # several minutes, 8 clients
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, markdown_table, write_result  # noqa: E402

LR = 5e-3


def tenant_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + step)
    return [[rng.randrange(1, vocab) for _ in range(seq_len + 1)] for _ in range(batch)]


def to_datums(rows: list[list[int]]) -> list[Any]:
    import tinker

    return [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(r[:-1]),
                               loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
            for r in rows]


class Client(threading.Thread):
    def __init__(self, index: int, base_url: str, key: str, args: argparse.Namespace, stop_at: float,
                 vocab: int) -> None:
        super().__init__(daemon=True)
        self.index, self.base_url, self.key, self.args, self.stop_at = index, base_url, key, args, stop_at
        self.vocab = vocab
        self.latencies: dict[str, list[float]] = {}
        self.steps = 0
        self.tokens = 0
        self.errors: list[str] = []
        self.export_path: str | None = None

    def timed(self, kind: str, future: Any) -> Any:
        start = time.perf_counter()
        value = future.result()
        self.latencies.setdefault(kind, []).append(time.perf_counter() - start)
        return value

    def run(self) -> None:
        import tinker
        from twinkle_server.testing import TINY_BASE

        try:
            service = tinker.ServiceClient(base_url=self.base_url, api_key=self.key)
            client = service.create_lora_training_client(base_model=TINY_BASE, rank=self.args.rank,
                                                        seed=self.index).result()
            while time.monotonic() < self.stop_at:
                rows = tenant_batch(self.index, self.steps, self.args.batch, self.args.seq_len, self.vocab)
                self.timed("forward_backward", client.forward_backward(to_datums(rows), "cross_entropy"))
                self.timed("optim_step", client.optim_step(tinker.types.AdamParams(learning_rate=LR)))
                self.steps += 1
                self.tokens += self.args.batch * self.args.seq_len
                if self.args.sample_every and self.steps % self.args.sample_every == 0:
                    sampler = self.timed("save_weights_for_sampler",
                                         client.save_weights_for_sampler(f"s{self.steps}"))
                    sampling = service.create_sampling_client(model_path=sampler.path).result()
                    prompt = tinker.types.ModelInput.from_ints(rows[0][:8])
                    params = tinker.types.SamplingParams(max_tokens=8, temperature=1.0, seed=self.steps)
                    self.timed("sample", sampling.sample(prompt, num_samples=2, sampling_params=params))
            self.export_path = self.timed("save_weights_for_sampler", client.save_weights_for_sampler("final")).path
        except Exception as exc:  # counted and reported: the benchmark's verdict is "0 errors"
            self.errors.append(f"{type(exc).__name__}: {exc}")


def server_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def replay_equal(clients: list[Client], state_dir: Path, args: argparse.Namespace) -> dict[str, bool]:
    """Replay every tenant's requests serially on a fresh in-process host; compare exported adapters bitwise."""
    import torch
    from safetensors.torch import load_file
    from twinkle_server.host import AdamStep, Datum, ModelHost
    from twinkle_server.testing import TINY_BASE, tiny_model_section

    torch.set_num_threads(1)
    verdict = {}
    with tempfile.TemporaryDirectory() as tmp:
        host = ModelHost(TINY_BASE, tiny_model_section(), state_dir=Path(tmp), max_lora_rank=32)
        for c in clients:
            adapter = f"replay-{c.index}"
            host.create_adapter(adapter, rank=args.rank, seed=c.index)
            for step in range(c.steps):
                rows = tenant_batch(c.index, step, args.batch, args.seq_len, host.vocab_size)
                data = [Datum(tokens=r[:-1], loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
                        for r in rows]
                host.forward_backward(adapter, data, "cross_entropy")
                host.optim_step(adapter, AdamStep(learning_rate=LR))
            out = Path(tmp) / f"export-{c.index}"
            host.export_adapter(adapter, out)
            mine = load_file(str(out / "adapter_model.safetensors"))
            served_dir = exported_dir(state_dir, c.export_path)
            served = load_file(str(served_dir / "adapter_model.safetensors"))
            verdict[f"tenant{c.index}"] = (mine.keys() == served.keys()
                                           and all(torch.equal(mine[k], served[k]) for k in mine))
    return verdict


def exported_dir(state_dir: Path, tinker_path: str) -> Path:
    """The server-side directory of a sampler checkpoint (this benchmark runs on the server's machine)."""
    import json

    registry = json.loads((state_dir / "registry.json").read_text())
    return Path(registry["checkpoints"][tinker_path]["path"])


def run_configuration(n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from twinkle_server.testing import TINY_QWEN, ServerProcess, tiny_server_config

    keys = {f"tenant{i}": f"tml-bench-tenant-{i:04d}" for i in range(n)}
    config = tiny_server_config(root / f"clients{n}", tenants=keys,
                                limits={"max_queued_per_tenant": 64})
    rss: list[tuple[float, float]] = []
    with ServerProcess(config) as server:
        start = time.monotonic()
        stop_at = start + args.duration
        clients = [Client(i, server.base_url, keys[f"tenant{i}"], args, stop_at, TINY_QWEN["vocab_size"])
                   for i in range(n)]
        for c in clients:
            c.start()
        while any(c.is_alive() for c in clients):
            rss.append((time.monotonic() - start, server_rss(server.process.pid)))
            time.sleep(1.0)
        wall = time.monotonic() - start
    errors = [e for c in clients for e in c.errors]
    replay = replay_equal(clients, root / f"clients{n}" / "state", args) if not errors else {}
    latencies: dict[str, list[float]] = {}
    for c in clients:
        for kind, values in c.latencies.items():
            latencies.setdefault(kind, []).extend(values)
    tokens = sum(c.tokens for c in clients)
    return {
        "clients": n, "wall_s": wall, "steps": [c.steps for c in clients], "tokens": tokens,
        "tokens_per_s": tokens / args.duration, "errors": errors, "replay_bitwise_equal": replay,
        "latency_s": {k: {"n": len(v), "p50": statistics.median(v),
                          "p99": sorted(v)[min(len(v) - 1, int(0.99 * len(v)))]} for k, v in latencies.items()},
        "server_rss_mb": {"start": rss[0][1] if rss else None, "max": max(r for _, r in rss) if rss else None,
                          "end": rss[-1][1] if rss else None, "samples": rss[:: max(1, len(rss) // 60)]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,4,8", help="comma-separated numbers of concurrent tenants")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds each configuration trains")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--sample-every", type=int, default=10, help="0: never sample")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 and 2 clients, 8 s each")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    counts = [1, 2] if args.quick else [int(x) for x in args.clients.split(",")]
    if args.quick:
        args.duration = 8.0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            print(f"--- {n} client(s), {args.duration:.0f} s", flush=True)
            results.append(run_configuration(n, args, Path(tmp)))
    alone = results[0]["tokens_per_s"] / results[0]["clients"]
    rows = []
    for r in results:
        lat = r["latency_s"]
        rows.append([r["clients"], fmt(r["tokens_per_s"]), fmt(r["tokens_per_s"] / r["clients"]),
                     fmt(r["tokens_per_s"] / r["clients"] / alone),
                     *(f"{fmt(lat[k]['p50'])} / {fmt(lat[k]['p99'])}" if k in lat else "-"
                       for k in ("forward_backward", "optim_step", "sample")),
                     fmt(r["server_rss_mb"]["max"]), len(r["errors"]),
                     "yes" if r["replay_bitwise_equal"] and all(r["replay_bitwise_equal"].values()) else "NO"])
    print(markdown_table(["clients", "tokens/s", "per tenant", "vs alone", "fwd_bwd p50/p99 s", "optim p50/p99 s",
                          "sample p50/p99 s", "server RSS max MiB", "errors", "replay bitwise"], rows))
    path = write_result("server_load", {"configurations": results, "args": vars(args)}, out_dir=args.out_dir)
    print(f"wrote {path}")
    failed = any(r["errors"] or not r["replay_bitwise_equal"] or not all(r["replay_bitwise_equal"].values())
                 for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
