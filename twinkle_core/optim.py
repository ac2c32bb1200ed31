"""Optimizers and learning-rate schedulers by registered name, class or instance."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import TYPE_CHECKING, Any

from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    import torch


#: ``implementation=`` values for torch optimizers that have fused / foreach kernels (AdamW, Adam, SGD, ...)
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")


def build_optimizer(spec: Any, parameters: list[torch.nn.Parameter], *, implementation: str = "auto",
                    accelerator: str | None = None, kernels: Any = None, **kwargs: Any) -> torch.optim.Optimizer:
    """``spec``: a registered name (``"AdamW"``), an ``Optimizer`` subclass, or an instance (returned as is).

    A name that a kernel plugin replaces on ``accelerator`` (``"optimizer:AdamW"`` in a
    :class:`~twinkle_core.records.KernelRecord`, e.g. ``NpuFusedAdamW`` on ``npu``) builds that class, unless the
    ``kernels`` switch turns the kernel off (:mod:`twinkle_core.kernels`).

    ``implementation`` picks the kernel of a torch optimizer that has several: ``auto`` (the default) takes the
    fused kernel where torch has one for every parameter's device and dtype, else the foreach one where the
    devices support it, else the per-parameter loop; ``fused`` / ``foreach`` / ``for_loop`` insist. All give
    the same update within floating-point rounding (``transformers.Trainer`` defaults to the fused AdamW too).
    """
    import torch

    if isinstance(spec, torch.optim.Optimizer):
        if kwargs or implementation != "auto":
            given = sorted(kwargs) + ([] if implementation == "auto" else ["implementation"])
            raise ConfigError(f"set_optimizer got an optimizer instance and also options {given}; "
                              f"pass one or the other")
        return spec
    if isinstance(spec, str):
        from twinkle_core.kernels import optimizer_class
        from twinkle_core.plugins import get_plugins

        replacement = optimizer_class(spec, accelerator, kernels) if accelerator else None
        spec = replacement or get_plugins().load("optimizer", spec)
    if inspect.isclass(spec) and issubclass(spec, torch.optim.Optimizer):
        if not parameters:
            raise ConfigError("the optimizer has no trainable parameters: add an adapter or unfreeze the model")
        check_hyperparameters(spec.__name__, kwargs)
        return spec(parameters, **kwargs, **implementation_options(spec, parameters, implementation, kwargs))
    raise ConfigError(f"cannot build an optimizer from {spec!r}; pass a registered name, an Optimizer class "
                      f"or an Optimizer instance")


#: the options :func:`check_hyperparameters` checks, and what each must be
_HYPERPARAMETERS = {"lr": "a finite number >= 0 (the learning rate, e.g. 1e-4)",
                    "weight_decay": "a finite number >= 0 (e.g. 0.01, or 0 for none)"}


def check_hyperparameters(optimizer_name: str, options: dict[str, Any]) -> None:
    """Refuse an ``lr`` or ``weight_decay`` that is negative, NaN, infinite or not a number, as ``set_optimizer``
    gets them (the recipe's ``optimizer.lr`` / ``optimizer.weight_decay`` are checked earlier, by the recipe
    checker): one ConfigError naming the option, instead of the optimizer's ValueError or a silently NaN run."""
    import torch

    for key, wanted in _HYPERPARAMETERS.items():
        if key not in options:
            continue
        value = options[key]
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number) or number < 0:
            raise ConfigError(f"set_optimizer({optimizer_name!r}): {key}={value!r} is refused; {key} must be {wanted}")


def check_implementation(optimizer_cls: type, implementation: str, options: dict[str, Any]) -> set[str]:
    """Refuse an unknown ``implementation`` or one the class cannot take; return the kernels it selects among."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"optimizer implementation {implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    kernels = {name for name in ("fused", "foreach") if name in inspect.signature(optimizer_cls).parameters}
    if implementation == "auto":
        return kernels
    explicit = sorted(name for name in ("fused", "foreach") if options.get(name) is not None)
    if explicit:
        raise ConfigError(f"optimizer: pass implementation={implementation!r} or {'/'.join(explicit)}=, not both")
    if implementation != "for_loop" and implementation not in kernels:
        raise ConfigError(f"{optimizer_cls.__name__} has no {implementation} kernel (it has: "
                          f"{', '.join(sorted(kernels | {'for_loop'}))}); use implementation='auto'")
    return kernels


def check_optimizer_options(optimizer_cls: type, options: dict[str, Any]) -> None:
    """A recipe's ``optimizer.options`` bound to the optimizer's signature, plus ``implementation``."""
    from twinkle_core.options import check_options

    options = dict(options)
    implementation = options.pop("implementation", "auto")
    try:
        check_implementation(optimizer_cls, implementation, options)
    except ConfigError as exc:
        raise ConfigError(f"optimizer.options.implementation: {exc}") from None
    check_options(optimizer_cls, options, where="optimizer.options", positional=1,  # the parameters
                  provided={"lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay"})


def _dtensor_has_fused(optimizer_cls: type, parameters: list[Any]) -> bool:
    """Sharded (DTensor) parameters, as FSDP2 makes them, have fused kernels for Adam and AdamW only."""
    import torch
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in parameters):
        return True
    return issubclass(optimizer_cls, (torch.optim.Adam, torch.optim.AdamW))


def implementation_options(optimizer_cls: type, parameters: list[Any], implementation: str,
                           options: dict[str, Any]) -> dict[str, Any]:
    """The ``fused`` / ``foreach`` keyword arguments that select ``implementation`` for these parameters."""
    from torch.optim.optimizer import (
        _get_foreach_kernels_supported_devices,
        _get_fused_kernels_supported_devices,
    )

    kernels = check_implementation(optimizer_cls, implementation, options)
    if not kernels or any(options.get(name) is not None for name in ("fused", "foreach")):
        return {}  # the user chose through the class's own keywords, or there is nothing to choose

    def runs_on(devices: list[str]) -> bool:
        return all(p.device.type in devices and p.is_floating_point() for p in parameters)

    fused_ok = ("fused" in kernels and not options.get("differentiable")  # torch refuses fused + differentiable
                and runs_on(_get_fused_kernels_supported_devices()) and _dtensor_has_fused(optimizer_cls, parameters))
    foreach_ok = "foreach" in kernels and runs_on(_get_foreach_kernels_supported_devices())
    if implementation == "auto":
        implementation = "fused" if fused_ok else "foreach" if foreach_ok else "for_loop"
    elif implementation == "fused" and not fused_ok:
        devices = sorted({f"{p.device.type}/{p.dtype}" for p in parameters})
        raise ConfigError(f"{optimizer_cls.__name__}: torch has no fused kernel for parameters on {devices}; "
                          f"use implementation='auto'")
    chosen = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]
    return {k: v for k, v in chosen.items() if k in kernels}


def build_scheduler(spec: Any, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
    """``spec``: a registered name (``"cosine"``), an ``LRScheduler`` class, or an instance."""
    import torch

    base = torch.optim.lr_scheduler.LRScheduler
    if isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        from twinkle_core.plugins import get_plugins

        spec = get_plugins().load("scheduler", spec)
    if inspect.isclass(spec) and issubclass(spec, base):
        return spec(optimizer, **kwargs)
    if callable(spec):
        return spec(optimizer, **kwargs)
    raise ConfigError(f"cannot build a learning-rate scheduler from {spec!r}")


# ---------------------------------------------------------------------- built-in schedules
def _lambda(optimizer: Any, fn: Any) -> Any:
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def constant(optimizer: Any, num_warmup_steps: int = 0, **_: Any) -> Any:
    """Linear warm-up, then constant."""
    return _lambda(optimizer, lambda step: min(1.0, (step + 1) / (num_warmup_steps + 1)) if num_warmup_steps else 1.0)


def linear(optimizer: Any, num_training_steps: int, num_warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> Any:
    """Linear warm-up, then linear decay to ``min_lr_ratio`` at ``num_training_steps``."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)

    return _lambda(optimizer, factor)


def cosine(optimizer: Any, num_training_steps: int, num_warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> Any:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at ``num_training_steps``."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / (num_warmup_steps + 1)
        progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return _lambda(optimizer, factor)
