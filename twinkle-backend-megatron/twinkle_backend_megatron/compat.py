"""CPU compatibility layer for megatron-core (pinned to :data:`SUPPORTED_VERSION`).

megatron-core assumes CUDA in a few dozen places that have nothing to do with the maths: tensors
allocated with ``device="cuda"`` or ``device=torch.cuda.current_device()``, ``torch.cuda.synchronize()``
barriers, a CUDA random-number tracker, and ``tensor.type() == "torch.cuda.FloatTensor"`` checks.
On a machine without a GPU (CI, laptops) those calls fail, although the layers, pipeline schedules
and optimizers run correctly on CPU tensors over gloo. :func:`apply` makes them run there.

The layer is applied only when ``torch.cuda.is_available()`` is False; on GPUs megatron-core runs
exactly as shipped. Every patch is scoped to megatron-core:

1. **torch seen by megatron-core** — each ``megatron.core.*`` module's global name ``torch`` is
   replaced by :class:`_CpuTorch`, a transparent view of ``torch`` whose tensor factories map a CUDA
   device to the CPU and whose ``torch.cuda`` answers ``current_device()`` with the CPU and makes
   ``synchronize()`` / streams / events no-ops. ``torch`` itself is not modified: only code
   inside megatron-core sees the view (modules imported later are patched by an import hook).
2. **RNG tracker** — Megatron forks a "model-parallel" CUDA generator around dropout and weight
   init; on CPU the tracker keeps CPU generator states instead.
3. **type checks** — the gradient-clipping assert on ``torch.cuda.FloatTensor`` and the
   ``DistributedOptimizer`` / ``Float16OptimizerWithFloat16Params`` parameter-type checks accept the
   CPU tensor types of the same dtypes, and the tied output layer of the last pipeline stage is not
   moved with ``.cuda()`` (only inside those functions, see :func:`_cpu_tensors_look_like_cuda`).
4. **autocast device** — the TP linear autograd functions are decorated with
   ``torch.amp.custom_fwd/custom_bwd(device_type="cuda")``, so under CPU autocast (``bf16`` / ``fp16``
   precision) their backward would run outside autocast with mixed dtypes; they are re-decorated
   for the CPU.
5. **Transformer Engine absent** — ``moe_utils.te_general_gemm`` is referenced although it is only
   imported with Transformer Engine; it is defined as ``None`` (the code's own fallback test).
6. **CUDA stream advice** — the TP linear layers advise setting ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (a CUDA
   stream setting) once per rank; there is no CUDA stream on CPU, so the advice is marked as given (megatron's
   own ``warned`` flag) instead of being printed by every rank.

Anything else CUDA-only (context parallelism needs Transformer Engine attention; the all-to-all MoE
dispatcher needs CUDA streams; fp8) is refused up front by the model with a clear error instead of being
patched. Sequence parallelism is not CUDA-only: megatron-core's local spec only lacks a norm that allows it,
which :mod:`twinkle_backend_megatron.norms` provides.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from typing import Any

import torch

from twinkle_core.errors import UnsupportedHardwareError

#: the megatron-core release this layer is written and tested against
SUPPORTED_VERSION = "0.16.1"

_applied = False
_lock = threading.Lock()

# torch functions that allocate and take ``device=``; called from megatron-core with a CUDA device
_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "empty_like", "zeros_like",
              "ones_like", "full_like", "rand", "randn", "randint", "randperm", "empty_strided", "linspace")


def megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def needs_cpu_layer() -> bool:
    return not torch.cuda.is_available()


def check_version() -> None:
    found = megatron_version()
    if found != SUPPORTED_VERSION:
        raise UnsupportedHardwareError(
            f"twinkle-backend-megatron runs megatron-core on CPU through a compatibility layer written for "
            f"megatron-core=={SUPPORTED_VERSION}, but {found} is installed. Install the pinned release "
            f"(pip install megatron-core=={SUPPORTED_VERSION}) or run on GPUs, where no layer is needed.")


def apply() -> bool:
    """Apply the layer once per process when no GPU is present; return whether it is active."""
    global _applied
    if not needs_cpu_layer():
        return False
    with _lock:
        if _applied:
            return True
        check_version()
        _install_import_hook()
        # import the parts of megatron-core the backend uses so they are patched now
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt.gpt_model  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
        import megatron.core.transformer.moe.moe_layer  # noqa: F401

        for name, module in list(sys.modules.items()):
            _patch_module(name, module)
        _patch_rng_tracker()
        _patch_type_checks()
        _patch_autocast_device()
        _mark_cuda_stream_advice_given()
        _applied = True
    return True


# ---------------------------------------------------------------------- 1. torch as seen by megatron-core
def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # an int device is a CUDA ordinal (``device=torch.cuda.current_device()`` on GPUs)
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_factory(fn: Any) -> Any:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA driver
        return fn(*args, **kwargs)

    return factory


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` / ``Event``: CPU work is ordered already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None  # wait_stream, record_event, synchronize, query ...

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` for megatron-core on CPU: the "current device" is the CPU, syncs are no-ops."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    Stream = _NullStream
    Event = _NullStream

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        return _NullStream()

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    @staticmethod
    def device_count() -> int:
        return 0


class _CpuTorch(types.ModuleType):
    """A transparent view of ``torch`` for megatron-core modules (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups are plain attribute reads
        return value


_CPU_TORCH: _CpuTorch | None = None


def _patch_module(name: str, module: Any) -> None:
    global _CPU_TORCH
    if not (name == "megatron.core" or name.startswith("megatron.core.")) or module is None:
        return
    if getattr(module, "__dict__", {}).get("torch") is torch:
        if _CPU_TORCH is None:
            _CPU_TORCH = _CpuTorch()
        module.torch = _CPU_TORCH


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _patch_module(module.__name__, module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Patches megatron-core modules imported after :func:`apply` (lazy imports inside megatron)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("megatron.core"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _install_import_hook() -> None:
    if not any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchingFinder())


# ---------------------------------------------------------------------- 2. RNG tracker
def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named CPU generator states, forked around model-parallel randomness (dropout, init)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Any:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    def initialize_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                               use_cudagraphable_rng: bool = False, force_reset: bool = False) -> None:
        if force_reset or not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    def model_parallel_cuda_manual_seed(seed: int, *args: Any, tp_rank: int | None = None,
                                        ep_rank: int | None = None, etp_rank: int | None = None,
                                        force_reset_rng: bool = False, **kwargs: Any) -> None:
        # same seeds as megatron-core's own function; the default (data-parallel) state is the CPU RNG
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
        etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
        initialize_rng_tracker(force_reset=True)
        tracker = mrandom._CUDA_RNG_STATE_TRACKER
        tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
        tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)

    # activation recompute saves and restores "the CUDA RNG state": on CPU that is the CPU generator
    mrandom._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    mrandom.initialize_rng_tracker = initialize_rng_tracker
    mrandom.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    import megatron.core.tensor_parallel as tp

    tp.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    initialize_rng_tracker(force_reset=True)


# ---------------------------------------------------------------------- 3./4. type checks, missing TE names
_CPU_TO_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                     "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cpu_tensors_look_like_cuda() -> Any:
    """While open, ``tensor.type()`` names CPU float tensors like their CUDA counterparts and
    ``tensor.cuda()`` returns the tensor itself.

    Used only around the few megatron-core functions that compare ``param.type()`` against
    ``"torch.cuda.FloatTensor"`` etc. to decide how to treat a parameter (the dtype is what matters),
    or move a freshly built weight with ``.cuda()`` before a collective.
    """
    original_type, original_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original_type(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original_type(self, dtype, non_blocking, **kwargs)

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.type = type_  # type: ignore[method-assign]
    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original_type  # type: ignore[method-assign]
        torch.Tensor.cuda = original_cuda  # type: ignore[method-assign]


def _scoped(fn: Any) -> Any:
    """``fn`` run inside :func:`_cpu_tensors_look_like_cuda`."""
    if getattr(fn, "_twinkle_cpu_scoped", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensors_look_like_cuda():
            return fn(*args, **kwargs)

    wrapper._twinkle_cpu_scoped = True  # type: ignore[attr-defined]
    return wrapper


def _patch_type_checks() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.transformer.moe import moe_utils

    # grad clipping asserts ``param.grad.type() == "torch.cuda.FloatTensor"``
    clip_grads.clip_grad_by_total_norm_fp32 = _scoped(clip_grads.clip_grad_by_total_norm_fp32)
    # both mixed-precision optimizers sort parameters by ``param.type()`` when they are built
    for cls in (distrib_optimizer.DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = _scoped(cls.__init__)
    # with PP and tied embeddings the last stage's copy is moved with ``.cuda()`` before its all-reduce
    LanguageModule.setup_embeddings_and_output_layer = _scoped(LanguageModule.setup_embeddings_and_output_layer)
    for module in (optimizer, distrib_optimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    # referenced unconditionally by the router's fp32 gemm, but only imported with Transformer Engine
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ---------------------------------------------------------------------- autocast device of the TP linear functions
def _mark_cuda_stream_advice_given() -> None:
    from megatron.core.tensor_parallel import layers

    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True


def _patch_autocast_device() -> None:
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithFrozenWeight, layers.LinearWithGradAccumulationAndAsyncCommunication):
        forward, backward = cls.forward, cls.backward
        if getattr(forward, "_twinkle_cpu_autocast", False):
            continue
        # functools.wraps inside torch.amp.custom_fwd / custom_bwd keeps the undecorated functions
        new_forward = torch.amp.custom_fwd(forward.__wrapped__, device_type="cpu")
        new_backward = torch.amp.custom_bwd(backward.__wrapped__, device_type="cpu")
        new_forward._twinkle_cpu_autocast = True
        cls.forward = staticmethod(new_forward)
        cls.backward = staticmethod(new_backward)
