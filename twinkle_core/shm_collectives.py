"""Shared-memory all-reduce and all-gather for CPU process groups whose ranks share one host.

gloo moves every all-reduce through loopback TCP: about 1.7 ms for a few bytes and 2.3 ms for 1 MB between two
local ranks. Tensor parallelism all-reduces activations several times per layer and waits for each, and
data parallelism all-reduces every gradient, so on a CPU host gloo's latency is a large share of a step.

The process group :data:`BACKEND` is gloo with two collectives replaced. ``all_reduce`` of a contiguous tensor goes
through a shared-memory segment of the group: each rank copies its tensor (in chunks of at most :data:`SLOT_BYTES`)
into its own slot, publishes the chunk's sequence number, waits until every rank has published it, and reduces the
slots in rank order, so every rank computes bitwise the same result (for two ranks, the same ``a + b`` as gloo).
``all_gather`` of a tensor of at most one slot publishes it the same way and copies every rank's slot out. The
slots alternate between two banks: a rank that has seen every peer arrive at round ``n`` knows they all finished
reading round ``n - 1``, so round ``n + 1`` may overwrite that bank.

Every other collective (reduce-scatter, broadcast, all-to-all, send/recv, barrier, larger all-gathers) is gloo's:
the group holds a ``ProcessGroupGloo`` and hands those calls to it.

The segment is made on a group's first all-reduce or all-gather, and only where it can be shared: rank 0 creates a file in
``/dev/shm`` with a random token in it, the other ranks open it and check the token, and all of them agree through
the group's store. On separate hosts or containers (a peer cannot open the file, or reads another token) the group
keeps gloo's collectives. The file is unlinked as soon as every rank has mapped it, so nothing is left behind.

The publish/read protocol relies on x86-64's store ordering (a peer that reads the new sequence number also reads
the data written before it); on other architectures :func:`supported` is false and the strategies join a plain
gloo group. ``TWINKLE_SHM_COLLECTIVES=0`` turns it off everywhere.
"""

from __future__ import annotations

import os
import platform
import secrets
import time
from datetime import timedelta
from typing import Any

from twinkle_core.envflags import env_flag

#: the name ``torch.distributed`` knows this process group by
BACKEND = "twinkle_shm"
#: the environment switch (on by default)
ENV_SWITCH = "TWINKLE_SHM_COLLECTIVES"
#: bytes of one rank's slot in one bank; larger tensors go through in chunks of this size
SLOT_BYTES = 4 << 20
#: one 64-byte line per rank for its sequence number, so ranks never write the same cache line
FLAG_STRIDE_BYTES = 64
SHM_DIR = "/dev/shm"
#: the ``torch.profiler`` events around each shared-memory all-reduce and all-gather
PROFILER_EVENT = f"{BACKEND}:all_reduce"
GATHER_PROFILER_EVENT = f"{BACKEND}:all_gather"
#: reductions done in shared memory; the others (bitwise ops, AVG, PREMUL_SUM) stay gloo's, errors included
_ELEMENTWISE_OPS = ("SUM", "PRODUCT", "MIN", "MAX")
#: bytes at the start of the segment after the sequence numbers: rank 0's random token, checked by the others
_TOKEN_BYTES = 64
#: polls before a waiting rank starts yielding its core, and seconds of yielding before it sleeps between polls
_BUSY_POLLS = 64
_YIELD_SECONDS = 0.002
_SLEEP_SECONDS = 0.0002


def supported() -> tuple[bool, str]:
    """Whether this machine can run the shared-memory all-reduce, and why not."""
    if not env_flag(ENV_SWITCH, default=True):
        return False, f"{ENV_SWITCH} is off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"the publish protocol needs x86-64 store ordering, this is {platform.machine()}"
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)):
        return False, f"{SHM_DIR} is not a writable directory"
    return True, ""


def register() -> None:
    """Make :data:`BACKEND` known to ``torch.distributed`` (idempotent)."""
    import torch.distributed as dist

    if BACKEND.upper() not in dist.Backend._plugins:  # noqa: SLF001 - torch keeps its registry there
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])


def _create_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    gloo = ProcessGroupGloo(store, rank, size, timeout)
    group = _shared_memory_group_class()(store, rank, size, timeout, gloo)
    # torch looks the group's CPU backend up itself: to shut it down, to batch sends (_start_coalescing), for
    # device meshes
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)  # noqa: SLF001
    return group


class Segment:
    """One group's mapped shared-memory file: the per-rank sequence numbers and two banks of per-rank slots."""

    def __init__(self, raw: Any, size: int) -> None:
        import torch

        self.raw = raw
        self.size = size
        flag_bytes = FLAG_STRIDE_BYTES * size
        self.flags = raw[:flag_bytes].view(torch.int64)[:: FLAG_STRIDE_BYTES // 8]
        self.data = raw[flag_bytes + _TOKEN_BYTES:]

    @staticmethod
    def nbytes(size: int) -> int:
        return FLAG_STRIDE_BYTES * size + _TOKEN_BYTES + 2 * size * SLOT_BYTES

    def slot(self, bank: int, rank: int, nbytes: int, dtype: Any) -> Any:
        start = (bank * self.size + rank) * SLOT_BYTES
        return self.data[start:start + nbytes].view(dtype)


def _open_segment(store: Any, rank: int, size: int, timeout_s: float) -> Segment | None:
    """Map the group's segment on every rank, or agree (through the store) that it cannot be shared."""
    import torch

    nbytes = Segment.nbytes(size)
    token_at = FLAG_STRIDE_BYTES * size
    raw = None
    if rank == 0:
        token = secrets.token_hex(_TOKEN_BYTES // 2)
        path = os.path.join(SHM_DIR, f"twinkle-shm-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS on first write
                os.posix_fallocate(descriptor, 0, nbytes)
            finally:
                os.close(descriptor)
            raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            raw[token_at:token_at + _TOKEN_BYTES].copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
        except OSError:
            if os.path.exists(path):
                os.unlink(path)
            path, raw = "", None
        store.set("twinkle_shm/path", path)
        store.set("twinkle_shm/token", token)
        shared = raw is not None
    else:
        path = store.get("twinkle_shm/path").decode()
        token = store.get("twinkle_shm/token").decode()
        if path and os.path.exists(path) and os.path.getsize(path) == nbytes:
            raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            seen = bytes(raw[token_at:token_at + _TOKEN_BYTES].tolist()).decode(errors="replace")
            if seen != token:
                raw = None  # a file of the same name on another host's /dev/shm
        shared = raw is not None
    # every rank counts itself in, and counts a failure as a large number, so one read tells all of them
    store.add("twinkle_shm/arrived", 1 if shared else size + 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := store.add("twinkle_shm/arrived", 0)) < size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"shared-memory collectives: {size - arrived} rank(s) of this group did not map its "
                               f"segment within {timeout_s:.0f} s (this is rank {rank}); set {ENV_SWITCH}=0 to use "
                               "gloo's collectives instead")
        time.sleep(0.001)
    if rank == 0 and path:
        os.unlink(path)
    if arrived != size:
        return None
    return Segment(raw, size)


def _shared_memory_group_class() -> type:
    """The ``torch.distributed.ProcessGroup`` subclass (built on first use: torch is imported lazily)."""
    global _GROUP_CLASS
    if _GROUP_CLASS is None:
        _GROUP_CLASS = _build_group_class()
    return _GROUP_CLASS


_GROUP_CLASS: type | None = None


def _build_group_class() -> type:
    import torch
    import torch.distributed as dist

    combine = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum}

    class CompletedWork(dist._Work):  # noqa: SLF001 - the base class torch gives Python process groups
        """The shared-memory collectives are synchronous: their work is done when it is returned."""

        def __init__(self, result: Any) -> None:
            super().__init__()
            self._future = torch.futures.Future()
            self._future.set_result(result)

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def is_success(self) -> bool:
            return True

        def get_future(self) -> Any:
            return self._future

    class SharedMemoryGroup(dist.ProcessGroup):
        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, gloo: Any) -> None:
            super().__init__(rank, size)
            self._store = store
            self._rank = rank
            self._size = size
            self._timeout_s = timeout.total_seconds()
            self._gloo = gloo
            self._segment: Segment | None = None
            self._opened = False
            self._round = 0

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return BACKEND

        @property
        def shares_memory(self) -> bool | None:
            """Whether this group's all-reduces and all-gathers go through shared memory (None before the first)."""
            return (self._segment is not None) if self._opened else None

        def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:
            if len(inputs) == 1 and len(outputs[0]) == self._size and \
                    self._gathers_in_shared_memory(inputs[0], outputs[0]):
                self._all_gather(inputs[0], outputs[0])
                return CompletedWork(outputs)
            return self._gloo.allgather(outputs, inputs, *_given(opts))

        def all_gather_single(self, output: Any, tensor: Any, opts: Any = None) -> Any:
            if (output.is_contiguous() and output.dtype == tensor.dtype and output.device.type == "cpu"
                    and output.numel() == tensor.numel() * self._size
                    and self._gathers_in_shared_memory(tensor, [])):
                self._all_gather(tensor, list(output.view(self._size, -1).unbind(0)))
                return CompletedWork([output])
            return self._gloo._allgather_base(output, tensor, *_given(opts))  # noqa: SLF001 - gloo's binding

        _allgather_base = all_gather_single

        def all_gather_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> Any:
            for output, tensor in zip(outputs, inputs):
                self.all_gather_single(output, tensor, opts).wait()
            return CompletedWork(outputs)

        def reduce_scatter_single_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any = None) -> Any:
            for output, tensor in zip(outputs, inputs):
                self._gloo._reduce_scatter_base(output, tensor, *_given(opts)).wait()  # noqa: SLF001
            return CompletedWork(outputs)

        allgather_into_tensor_coalesced = all_gather_single_coalesced
        reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

        def allreduce_coalesced(self, tensors: list[Any], opts: Any = None) -> Any:
            opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
            name = _op_name(opts.reduceOp)
            if not self._in_shared_memory(tensors, name):
                return self._gloo.allreduce_coalesced(tensors, opts)
            for tensor in tensors:
                self._all_reduce(tensor, name)
            return CompletedWork(tensors)

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            if isinstance(tensors, torch.Tensor):  # the binding's one-tensor form
                tensors = [tensors]
            if opts is None or isinstance(opts, dist.ReduceOp):
                op, opts = opts, dist.AllreduceOptions()
                if op is not None:
                    opts.reduceOp = op
            name = _op_name(opts.reduceOp)
            if not self._in_shared_memory(tensors, name):
                return self._gloo.allreduce(tensors, opts)
            for tensor in tensors:
                self._all_reduce(tensor, name)
            return CompletedWork(tensors)

        # ---------------------------------------------------------------- the shared-memory path
        def _in_shared_memory(self, tensors: list[Any], name: str) -> bool:
            if self._size == 1 or name not in _ELEMENTWISE_OPS:
                return False
            if name != "SUM" and any(t.is_complex() for t in tensors):
                return False
            if not all(_plain(t) for t in tensors):
                return False
            return self._segment_ready()

        def _gathers_in_shared_memory(self, tensor: Any, outputs: list[Any]) -> bool:
            """One chunk's worth, gathered into CPU tensors of its own dtype and size (gloo's rule too)."""
            if self._size == 1 or not _plain(tensor) or tensor.is_complex():
                return False
            if tensor.numel() * tensor.element_size() > SLOT_BYTES:
                return False
            if any(not _plain(o) or o.dtype != tensor.dtype or o.numel() != tensor.numel() for o in outputs):
                return False
            return self._segment_ready()

        def _segment_ready(self) -> bool:
            if not self._opened:
                self._opened = True
                self._segment = _open_segment(self._store, self._rank, self._size, self._timeout_s)
            return self._segment is not None

        def _all_reduce(self, tensor: Any, name: str) -> None:
            flat = torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor.view(-1)
            per_chunk = SLOT_BYTES // flat.element_size()
            with torch.profiler.record_function(PROFILER_EVENT):  # so a profile tells it from computation
                for start in range(0, max(flat.numel(), 1), per_chunk):
                    self._reduce_chunk(flat[start:start + per_chunk], name)

        def _all_gather(self, tensor: Any, outputs: list[Any]) -> None:
            with torch.profiler.record_function(GATHER_PROFILER_EVENT):
                slots = self._exchange(tensor.reshape(-1))
                for output, slot in zip(outputs, slots):
                    output.view(-1).copy_(slot)

        def _exchange(self, chunk: Any) -> list[Any]:
            """Publish ``chunk`` in this rank's slot of the next round; every rank's slot once all have."""
            segment = self._segment
            self._round += 1
            bank = self._round % 2
            nbytes = chunk.numel() * chunk.element_size()
            slots = [segment.slot(bank, r, nbytes, chunk.dtype) for r in range(self._size)]
            slots[self._rank].copy_(chunk)
            segment.flags[self._rank] = self._round  # published after the data (x86-64 keeps store order)
            self._wait_for_peers()
            return slots

        def _reduce_chunk(self, chunk: Any, name: str) -> None:
            slots = self._exchange(chunk)
            # in rank order on every rank, so all of them hold bitwise the same result
            function = combine[name]
            function(slots[0], slots[1], out=chunk)
            for r in range(2, self._size):
                function(chunk, slots[r], out=chunk)

        def _wait_for_peers(self) -> None:
            flags, target = self._segment.flags, self._round
            polls = 0
            started = None
            while int(flags.min()) < target:
                polls += 1
                if polls <= _BUSY_POLLS:
                    continue
                now = time.monotonic()
                if started is None:
                    started = now
                waited = now - started
                if waited > self._timeout_s:
                    late = [r for r in range(self._size) if int(flags[r]) < target]
                    raise RuntimeError(
                        f"shared-memory collective: rank(s) {late} of this group did not reach collective "
                        f"#{target} within {self._timeout_s:.0f} s (this is rank {self._rank}); a peer crashed "
                        f"or skipped a collective. Set {ENV_SWITCH}=0 to use gloo's collectives instead")
                if waited < _YIELD_SECONDS:
                    os.sched_yield()
                else:
                    time.sleep(_SLEEP_SECONDS)

    # Every other collective is gloo's. torch calls a Python process group's methods holding the
    # GIL (from Python, and from C++ such as the functional collectives), and gloo's worker thread may need the
    # GIL to finish an earlier collective: a call that reached gloo through the C++ base class would wait on that
    # thread while holding the GIL. So each one is defined here and goes to gloo's own binding, which releases it.
    for name, gloo_name in _GLOO_METHODS.items():
        setattr(SharedMemoryGroup, name, _to_gloo(gloo_name))
    return SharedMemoryGroup


#: the process group's method -> the ProcessGroupGloo binding that does it
_GLOO_METHODS = {
    "allgather_coalesced": "allgather_coalesced", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base", "_reduce_scatter_base": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base", "alltoall_base": "alltoall_base", "alltoall": "alltoall",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
    "monitored_barrier": "monitored_barrier", "send": "send", "recv": "recv", "recv_anysource": "recv_anysource",
}


def _to_gloo(gloo_name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._gloo, gloo_name)(*args, **kwargs)

    method.__name__ = gloo_name
    return method


def _plain(tensor: Any) -> bool:
    """A dense, contiguous CPU tensor of a type the shared-memory path copies and reduces."""
    import torch

    return (tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_sparse
            and tensor.dtype != torch.bool)


def _given(opts: Any) -> tuple[Any, ...]:
    return () if opts is None else (opts,)


def _op_name(op: Any) -> str:
    import torch.distributed as dist

    for name in _ELEMENTWISE_OPS:
        if op == getattr(dist.ReduceOp, name):
            return name
    return str(op)

