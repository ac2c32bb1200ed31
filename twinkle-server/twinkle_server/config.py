"""The server's configuration: ``twinkle serve CONFIG.yaml``.

::

    host: 127.0.0.1            # loopback by default: exposing the server is a deliberate choice
    port: 8000
    state_dir: ./twinkle-state # sessions, runs, adapters, optimizer states and checkpoints live here
    base_models:
      - name: Qwen/Qwen2.5-0.5B-Instruct     # what clients pass as base_model
        model: {path: /models/qwen2.5-0.5b}  # a recipe's model section
        max_lora_rank: 64
        max_adapters: 32
        ray: {workers: 2, cpus_per_worker: 1, gpus_per_worker: 0, placement: PACK, address: null}  # optional
      - name: team/full-qwen                 # or: one tenant's full-parameter training (no LoRA options, no ray)
        model: {path: /models/qwen2.5-0.5b}
        full_parameter: {owner: alice}
    tenants:
      - {name: alice, api_key_sha256: 9f86d0...}   # or api_key: tml-... (development), or api_key_env: ALICE_KEY
    limits:
      max_tenants: 64
      max_body_mb: 64
      max_tokens_per_request: 262144
      max_queued_per_tenant: 64
    admins: [alice]            # tenants who see every tenant's runs in the console (/console)

Unknown keys are errors naming the known ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Limits:
    max_tenants: int = 64
    max_body_mb: float = 64.0
    max_tokens_per_request: int = 262_144
    max_queued_per_tenant: int = 64
    max_samples_per_request: int = 64

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * (1 << 20))


@dataclass(frozen=True)
class FullParameterConfig:
    """``full_parameter: {owner: alice}``: the base model is hosted for full-parameter training by ``owner`` alone
    (:mod:`twinkle_server.full_host`); no other tenant sees it."""

    owner: str


@dataclass(frozen=True)
class RayConfig:
    """``ray: {workers: 2, ...}``: the base model runs in a worker group of ``workers`` Ray actors, one
    data-parallel rank each (:mod:`twinkle_server.ray_host`), each reserving ``cpus_per_worker`` /
    ``gpus_per_worker`` in its own placement group (``placement``: Ray's strategy). ``address``: the Ray cluster
    (``HOST:PORT`` or ``auto``); ``null`` joins ``RAY_ADDRESS`` when set, else starts a local cluster."""

    workers: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement: str = "PACK"
    address: str | None = None


@dataclass(frozen=True)
class BaseModelConfig:
    name: str
    model: dict[str, Any]
    max_lora_rank: int = 64
    max_adapters: int | None = None
    full_parameter: FullParameterConfig | None = None
    #: ``None``: the model lives in the server's process (no Ray)
    ray: RayConfig | None = None


@dataclass(frozen=True)
class TenantConfig:
    name: str
    api_key_sha256: str


@dataclass(frozen=True)
class ServerConfig:
    base_models: tuple[BaseModelConfig, ...]
    tenants: tuple[TenantConfig, ...]
    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    limits: Limits = field(default_factory=Limits)
    #: tenants whose key also shows every tenant's runs in the console (read-only)
    admins: tuple[str, ...] = ()

    def base_model(self, name: str) -> BaseModelConfig | None:
        return next((m for m in self.base_models if m.name == name), None)


def _known(section: str, given: dict[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; known: {sorted(known)}")


def _tenant(entry: Any, index: int) -> TenantConfig:
    import hashlib

    if not isinstance(entry, dict):
        raise ConfigError(f"tenants[{index}] must be a mapping with name and one of api_key / api_key_sha256 / "
                          f"api_key_env")
    entry = dict(entry)
    name = entry.pop("name", None)
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        raise ConfigError(f"tenants[{index}].name {name!r} must be 1-64 letters, digits, '_', '.' or '-' (it names "
                          f"the tenant's directory under state_dir)")
    sources = {k: entry.pop(k) for k in ("api_key", "api_key_sha256", "api_key_env") if k in entry}
    if entry:
        raise ConfigError(f"tenants[{index}] ({name}): unknown key(s) {sorted(entry)}; known: name, api_key, "
                          f"api_key_sha256, api_key_env")
    if len(sources) != 1:
        raise ConfigError(f"tenants[{index}] ({name}) needs exactly one of api_key, api_key_sha256, api_key_env")
    (kind, value), = sources.items()
    if kind == "api_key_sha256":
        if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
            raise ConfigError(f"tenants[{index}] ({name}).api_key_sha256 must be 64 lowercase hex digits")
        return TenantConfig(name, value)
    if kind == "api_key_env":
        key = os.environ.get(str(value))
        if not key:
            raise ConfigError(f"tenants[{index}] ({name}).api_key_env: the environment variable {value} is not set")
        value = key
    if not (isinstance(value, str) and value.startswith("tml-") and len(value) >= 12):
        raise ConfigError(f"tenants[{index}] ({name}): an API key must start with 'tml-' (the Tinker SDK refuses "
                          f"others) and be at least 12 characters")
    return TenantConfig(name, hashlib.sha256(value.encode()).hexdigest())


def _local_paths(model: dict[str, Any], base_dir: Path | None) -> dict[str, Any]:
    """``path`` / ``tokenizer`` given relative to the config file, as a recipe's are (URIs like hf://... stay)."""
    model = dict(model)
    for key in ("path", "tokenizer"):
        value = model.get(key)
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute() and base_dir is not None:
            candidate = base_dir / value
            if candidate.exists():
                model[key] = str(candidate.resolve())
    return model


def _base_model(entry: Any, index: int, base_dir: Path | None = None) -> BaseModelConfig:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("model"),
                                                                                                 dict):
        raise ConfigError(f"base_models[{index}] must be a mapping with name (what clients ask for) and model (a "
                          f"recipe's model section, e.g. {{path: /models/qwen}})")
    _known(f"base_models[{index}]", entry, BaseModelConfig)
    rank = entry.get("max_lora_rank", 64)
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"base_models[{index}].max_lora_rank must be a positive integer, got {rank!r}")
    return BaseModelConfig(name=entry["name"], model=_local_paths(entry["model"], base_dir), max_lora_rank=rank,
                           max_adapters=entry.get("max_adapters"), full_parameter=_full_parameter(entry, index),
                           ray=_ray(entry, index))


def _sub_mapping(raw: Any, where: str, cls: type, example: str) -> dict[str, Any] | None:
    """An optional section of a base-model entry: ``None`` when absent, else a mapping of ``cls``'s known keys."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping such as {example}")
    _known(where, raw, cls)
    return raw


def _ray(entry: dict[str, Any], index: int) -> RayConfig | None:
    """``ray: {workers, cpus_per_worker, gpus_per_worker, placement, address}``, checked before anything starts."""
    where = f"base_models[{index}].ray"
    raw = _sub_mapping(entry.get("ray"), where, RayConfig, "{workers: 2, cpus_per_worker: 1}")
    if raw is None:
        return None
    if entry.get("full_parameter") is not None:
        raise ConfigError(f"base_models[{index}] ({entry['name']}): full_parameter runs in the server's process; "
                          f"remove ray, or remove full_parameter to host LoRA adapters on a worker group")
    try:
        from twinkle_ray.worker_group import PLACEMENT_STRATEGIES
    except ImportError as exc:
        raise ConfigError(f"{where} needs the Ray runtime: pip install 'twinkle-server[ray]' ({exc})") from None
    config = RayConfig(**raw)
    workers, placement = config.workers, str(config.placement).upper()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"{where}.workers must be a positive integer, got {workers!r}")
    for key in ("cpus_per_worker", "gpus_per_worker"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"{where}.{key} must be a number >= 0, got {value!r}")
    if placement not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"{where}.placement {config.placement!r} is not one of {', '.join(PLACEMENT_STRATEGIES)}")
    if config.address is not None and not isinstance(config.address, str):
        raise ConfigError(f"{where}.address must be HOST:PORT, 'auto' or null, got {config.address!r}")
    return RayConfig(workers=workers, cpus_per_worker=float(config.cpus_per_worker),
                     gpus_per_worker=float(config.gpus_per_worker), placement=placement, address=config.address)


def _full_parameter(entry: dict[str, Any], index: int) -> FullParameterConfig | None:
    """``full_parameter: {owner: <tenant>}`` (the owner is checked against the tenants by :func:`server_config`)."""
    where = f"base_models[{index}].full_parameter"
    raw = _sub_mapping(entry.get("full_parameter"), where, FullParameterConfig,
                       "{owner: alice} (the one tenant who trains it)")
    if raw is None:
        return None
    lora_only = sorted({"max_lora_rank", "max_adapters"} & set(entry))
    if lora_only:
        raise ConfigError(f"base_models[{index}] ({entry['name']}): full_parameter hosts the model for one tenant's "
                          f"full-parameter training, which has no LoRA adapters; {lora_only} configure LoRA "
                          f"hosting: remove them, or remove full_parameter to share the base through LoRA adapters")
    if not isinstance(raw.get("owner"), str):
        raise ConfigError(f"{where}.owner must name the tenant who trains the model, got {raw.get('owner')!r}")
    return FullParameterConfig(owner=raw["owner"])


def server_config(raw: dict[str, Any], *, base_dir: Path | None = None) -> ServerConfig:
    """Validate a parsed YAML mapping; relative ``state_dir`` is taken from ``base_dir`` (the file's folder)."""
    if not isinstance(raw, dict):
        raise ConfigError("the server config must be a YAML mapping")
    _known("server config", raw, ServerConfig)
    models = raw.get("base_models") or []
    if not models:
        raise ConfigError("base_models: list at least one base model to host")
    base_models = tuple(_base_model(m, i, base_dir) for i, m in enumerate(models))
    names = [m.name for m in base_models]
    if len(set(names)) != len(names):
        raise ConfigError(f"base_models: names must be unique, got {names}")
    tenants = tuple(_tenant(t, i) for i, t in enumerate(raw.get("tenants") or []))
    if not tenants:
        raise ConfigError("tenants: list at least one tenant with an API key (no anonymous access)")
    if len({t.name for t in tenants}) != len(tenants) or len({t.api_key_sha256 for t in tenants}) != len(tenants):
        raise ConfigError("tenants: names and API keys must be unique")
    for index, model in enumerate(base_models):
        owner = model.full_parameter.owner if model.full_parameter is not None else None
        if owner is not None and owner not in {t.name for t in tenants}:
            raise ConfigError(f"base_models[{index}] ({model.name}).full_parameter.owner {owner!r} is not a "
                              f"configured tenant; configured: {[t.name for t in tenants]}")
    addresses = {m.ray.address for m in base_models if m.ray is not None}
    if len(addresses) > 1:
        raise ConfigError(f"base_models: the ray sections name different clusters {sorted(map(str, addresses))}; the "
                          f"server joins one Ray cluster: give every ray section the same address")
    limits_raw = raw.get("limits") or {}
    _known("limits", limits_raw, Limits)
    limits = Limits(**limits_raw)
    if len(tenants) > limits.max_tenants:
        raise ConfigError(f"tenants: {len(tenants)} configured, above limits.max_tenants={limits.max_tenants}")
    state_dir = Path(raw.get("state_dir") or "twinkle-state")
    if not state_dir.is_absolute():
        state_dir = (base_dir or Path.cwd()) / state_dir
    port = raw.get("port", 8000)
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"port must be an integer in 0..65535, got {port!r}")
    admins = tuple(raw.get("admins") or ())
    unknown_admins = sorted(set(admins) - {t.name for t in tenants})
    if unknown_admins:
        raise ConfigError(f"admins: {unknown_admins} are not configured tenants")
    return ServerConfig(base_models=base_models, tenants=tenants, state_dir=state_dir.resolve(), admins=admins,
                        host=str(raw.get("host", "127.0.0.1")), port=port, limits=limits)


def load_server_config(path: str | Path) -> ServerConfig:
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"server config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"server config {path} is not valid YAML: {exc}") from None
    return server_config(raw, base_dir=path.resolve().parent)
