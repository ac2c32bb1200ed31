"""Fused kernels: device-conditional replacements that plugins register and the model applies once, when built.

A plugin yields :class:`~twinkle_core.records.KernelRecord` s from ``twinkle_register_kernels``. Each names the
kernel (``"npu_rms_norm"``), the accelerators it applies to (``("npu",)``), what it replaces and the replacement
(a lazy ``"package.module:object"``). ``replaces`` holds one or more targets:

``"module:<pkg.mod>:<Class>"``
    ``impl`` is a ``forward(self, ...)`` bound onto every instance of that class found in the network (matched by
    the class's module and name, so nothing is imported for families the model does not use). The class itself is
    untouched: another model in the same process keeps the original.
``"function:<pkg.mod>:<name>"``
    ``impl`` replaces a module-level function (``apply_rotary_pos_emb``) for this network only: the module global
    becomes a dispatcher that calls ``impl`` while a module of this network whose ``forward`` calls ``<name>`` runs
    (gradient-checkpointing recomputation included), and the original otherwise. Nothing happens unless the network
    holds a module of class defined in ``<pkg.mod>``.
``"model"``
    ``impl(network) -> int`` applies itself (e.g. registers an attention function and selects it for this network)
    and returns how many sites it changed; 0 means it does not apply to this network.
``"optimizer:<Name>"``
    ``impl`` is the ``torch.optim.Optimizer`` class that ``set_optimizer("<Name>")`` builds on these accelerators.

Every replacement must be numerically equivalent to what it replaces (forward and backward); each plugin proves it
with a parity test against the untouched module.

The model calls :func:`apply_kernels` right after building its network, with the accelerator it runs on and the
``kernels`` switch from the recipe (``model.options.kernels``): ``false`` turns every kernel off, a mapping
``{npu_rms_norm: false}`` turns single ones off; a name no plugin registered is an error. One INFO line lists what
was applied and on how many modules.

A CUDA kernel plugin (e.g. Liger) registers the same way, with ``accelerators=("cuda",)``::

    @hookimpl
    def twinkle_register_kernels():
        yield KernelRecord("liger_rms_norm", "my_liger_plugin.kernels:rms_norm_forward", accelerators=("cuda",),
                           replaces=("module:transformers.models.llama.modeling_llama:LlamaRMSNorm",))
        yield KernelRecord("liger_swiglu", "my_liger_plugin.kernels:swiglu_forward", accelerators=("cuda",),
                           replaces=("module:transformers.models.llama.modeling_llama:LlamaMLP",))
"""

from __future__ import annotations

import contextvars
import difflib
import logging
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.records import KernelRecord

logger = logging.getLogger("twinkle.kernels")

#: the kernel switch a model or recipe gives: ``None``/``True`` (all on), ``False`` (all off), or per-kernel flags
KernelSwitch = bool | Mapping[str, bool] | None

# kernel names whose "function:" replacements are active in the code running now (set by forward hooks)
_ACTIVE: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("twinkle_active_kernels",
                                                                         default=frozenset())


def registered_kernels() -> dict[str, KernelRecord]:
    """Every registered kernel by name, whatever its accelerator."""
    from twinkle_core.plugins import get_plugins

    return {name: entry.record for name, entry in get_plugins().records("kernel").items()}  # type: ignore[misc]


def check_switch(switch: KernelSwitch, *, where: str = "kernels") -> set[str]:
    """The kernel names ``switch`` turns off; a name no plugin registered is an error suggesting the closest one.

    ``where`` is the recipe key the switch came from (``model.options.kernels``), for the message.
    """
    known = registered_kernels()
    if switch is None or isinstance(switch, bool):
        return set() if switch in (None, True) else set(known)
    if not isinstance(switch, Mapping):
        raise ConfigError(f"{where}: expected true, false or a mapping {{kernel_name: false}}, got {switch!r}")
    for name, flag in switch.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), list(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}.{name}: no plugin registers a kernel named {name!r}; {hint}"
                              f"registered kernels: {', '.join(sorted(known)) or 'none'} (twinkle plugins lists them)")
        if not isinstance(flag, bool):
            raise ConfigError(f"{where}.{name}: expected true or false, got {flag!r}")
    return {name for name, flag in switch.items() if not flag}


def enabled_kernels(accelerator: str, switch: KernelSwitch = None) -> list[KernelRecord]:
    """The kernels for ``accelerator`` that ``switch`` leaves on, by name."""
    disabled = check_switch(switch)
    return [record for name, record in sorted(registered_kernels().items())
            if accelerator in record.accelerators and name not in disabled]


def optimizer_class(name: str, accelerator: str, switch: KernelSwitch = None) -> Any | None:
    """The optimizer class a kernel registers for ``set_optimizer(name)`` on ``accelerator``, or ``None``."""
    target = f"optimizer:{name}"
    for record in enabled_kernels(accelerator, switch):
        if target in record.replaces:
            return _load(record)
    return None


def _load(record: KernelRecord) -> Any:
    from twinkle_core.plugins import get_plugins

    return get_plugins().load_record("kernel", record)


@dataclass
class AppliedKernels:
    """What :func:`apply_kernels` changed in one network: kernel name -> sites, and how to undo it."""

    accelerator: str
    counts: dict[str, int] = field(default_factory=dict)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def summary(self) -> str:
        if not self.counts:
            return f"no fused kernels applied for accelerator {self.accelerator!r}"
        listed = ", ".join(f"{name} ({count} {'site' if count == 1 else 'sites'})"
                           for name, count in self.counts.items())
        return f"fused kernels applied for accelerator {self.accelerator!r}: {listed}"

    def remove(self) -> None:
        """Restore every module ``forward`` and module function this application replaced ("model" ones stay)."""
        while self._undo:
            self._undo.pop()()
        self.counts.clear()


def apply_kernels(network: Any, accelerator: str, switch: KernelSwitch = None) -> AppliedKernels:
    """Apply every enabled kernel for ``accelerator`` to ``network`` (a ``torch.nn.Module``) and log what was done."""
    applied = AppliedKernels(accelerator)
    for record in enabled_kernels(accelerator, switch):
        targets = [t for t in record.replaces if not t.startswith("optimizer:")]
        if not targets:
            continue
        impl = _load(record)
        count = 0
        for target in targets:
            count += _apply_target(network, record.name, target, impl, applied._undo)
        if count:
            applied.counts[record.name] = count
    logger.info("%s", applied.summary())
    return applied


def _class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _apply_target(network: Any, name: str, target: str, impl: Any, undo: list[Callable[[], None]]) -> int:
    form, _, where = target.partition(":")
    if form == "module":
        return _swap_forwards(network, where, impl, undo)
    if form == "function":
        return _swap_function(network, name, where, impl, undo)
    if form == "model" and not where:
        return int(impl(network))
    raise ConfigError(f"kernel {name!r}: cannot apply target {target!r}; expected 'module:<pkg.mod>:<Class>', "
                      f"'function:<pkg.mod>:<name>', 'model' or 'optimizer:<Name>'")


def _swap_forwards(network: Any, class_key: str, forward: Callable[..., Any], undo: list[Callable[[], None]]) -> int:
    count = 0
    for module in network.modules():
        if _class_key(type(module)) != class_key:
            continue
        module.forward = types.MethodType(forward, module)
        undo.append(lambda m=module: m.__dict__.pop("forward", None))
        count += 1
    return count


class _Dispatcher:
    """Stands in for a module-level function: a registered kernel's replacement while it is active, else the original."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.replacements: dict[str, Callable[..., Any]] = {}
        self.__wrapped__ = original
        self.__name__ = getattr(original, "__name__", "dispatcher")
        self.users: dict[str, int] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.get()
        for name, replacement in self.replacements.items():
            if name in active:
                return replacement(*args, **kwargs)
        return self.original(*args, **kwargs)


def _callers(network: Any, module_name: str, function: str) -> Iterator[Any]:
    """Modules of ``network`` defined in ``module_name`` whose own ``forward`` calls ``function`` by its global name."""
    import inspect

    for module in network.modules():
        cls = type(module)
        if cls.__module__ != module_name:
            continue
        code = getattr(inspect.unwrap(cls.forward), "__code__", None)  # under decorators such as deprecate_kwarg
        if code is not None and function in code.co_names:
            yield module


def _swap_function(network: Any, name: str, where: str, impl: Callable[..., Any],
                   undo: list[Callable[[], None]]) -> int:
    module_name, _, function = where.partition(":")
    callers = list(_callers(network, module_name, function))
    if not callers:
        return 0
    home = sys.modules[module_name]  # imported: the network holds instances of its classes
    dispatcher = getattr(home, function)
    if not isinstance(dispatcher, _Dispatcher):
        dispatcher = _Dispatcher(dispatcher)
        setattr(home, function, dispatcher)
    dispatcher.replacements[name] = impl
    dispatcher.users[name] = dispatcher.users.get(name, 0) + 1
    handles = []
    for module in callers:
        tokens: list[contextvars.Token[frozenset[str]]] = []
        handles.append(module.register_forward_pre_hook(
            lambda _m, _a, tokens=tokens: tokens.append(_ACTIVE.set(_ACTIVE.get() | {name}))))
        handles.append(module.register_forward_hook(
            lambda _m, _a, _o, tokens=tokens: _ACTIVE.reset(tokens.pop()), always_call=True))

    def restore() -> None:
        for handle in handles:
            handle.remove()
        dispatcher.users[name] -= 1
        if dispatcher.users[name] == 0:  # the last network using this kernel here
            del dispatcher.users[name], dispatcher.replacements[name]
        if not dispatcher.replacements:
            setattr(home, function, dispatcher.original)

    # a network dropped without remove() must not leave the module function dispatching for it forever;
    # a finalizer runs at most once, whichever of remove() and garbage collection comes first
    undo.append(weakref.finalize(network, restore))
    return len(callers)
