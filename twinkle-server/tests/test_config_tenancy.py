"""The server config, API keys and the durable registry."""

from __future__ import annotations

import hashlib

import pytest
from twinkle_server.config import server_config
from twinkle_server.errors import NotFound, Unauthorized
from twinkle_server.registry import Registry
from twinkle_server.tenancy import Tenants

from twinkle_core.errors import ConfigError

MODEL = {"name": "tiny", "model": {"path": "/nowhere"}}


def config(**overrides):
    raw = {"base_models": [MODEL], "tenants": [{"name": "alice", "api_key": "tml-alice-0001"}],
           "state_dir": "state", **overrides}
    return raw


def test_keys_map_to_tenants_and_are_kept_as_digests(tmp_path):
    cfg = server_config(config(tenants=[{"name": "alice", "api_key": "tml-alice-0001"},
                                        {"name": "bob", "api_key_sha256": hashlib.sha256(b"tml-bob-00001").hexdigest()}]),
                        base_dir=tmp_path)
    assert "tml-alice-0001" not in repr(cfg)
    tenants = Tenants(cfg.tenants)
    assert tenants.authenticate("tml-alice-0001").name == "alice"
    assert tenants.authenticate("tml-bob-00001").name == "bob"
    with pytest.raises(Unauthorized, match="X-API-Key"):
        tenants.authenticate(None)
    with pytest.raises(Unauthorized, match="unknown"):
        tenants.authenticate("tml-alice-0002")
    assert cfg.state_dir == (tmp_path / "state").resolve()


@pytest.mark.parametrize("raw, message", [
    (config(limits={"max_body": 3}), "unknown key"),
    (config(tenants=[{"name": "alice", "api_key": "sk-1234567890"}]), "tml-"),
    (config(tenants=[]), "at least one tenant"),
    (config(tenants=[{"name": "../x", "api_key": "tml-alice-0001"}]), "letters, digits"),
    (config(tenants=[{"name": "a", "api_key": "tml-same-00001"}, {"name": "b", "api_key": "tml-same-00001"}]), "unique"),
    (config(base_models=[]), "at least one base model"),
    (config(tenants=[{"name": "a", "api_key_env": "TWINKLE_TEST_UNSET_KEY"}]), "is not set"),
    (config(limits={"max_tenants": 0}), "max_tenants"),
])
def test_config_errors_name_the_fix(raw, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        server_config(raw, base_dir=tmp_path)


def test_registry_survives_a_restart_and_hides_other_tenants(tmp_path):
    registry = Registry(tmp_path)
    session = registry.new_session("alice")
    run = registry.new_run("alice", base_model="tiny", lora_rank=8, lora={"seed": 3}, session_id=session)
    directory = registry.checkpoint_dir(run, "state", "step-1")
    directory.mkdir(parents=True)
    checkpoint = registry.add_checkpoint(run, kind="state", name="step-1")
    assert checkpoint.tinker_path == f"tinker://{run.model_id}/weights/step-1"

    reopened = Registry(tmp_path)
    assert reopened.run("alice", run.model_id).lora == {"seed": 3}
    assert reopened.checkpoint("alice", checkpoint.tinker_path).directory == directory
    assert [c.name for c in reopened.checkpoints("alice", run.model_id)] == ["step-1"]
    for lookup in (lambda: reopened.run("bob", run.model_id), lambda: reopened.checkpoint("bob", checkpoint.tinker_path),
                   lambda: reopened.session("bob", session), lambda: reopened.checkpoints("bob", run.model_id)):
        with pytest.raises(NotFound):
            lookup()
    assert not list(tmp_path.glob(".registry.json.*"))  # no temporary file left behind


def test_a_checkpoint_is_registered_only_once_written(tmp_path):
    registry = Registry(tmp_path)
    run = registry.new_run("alice", base_model="tiny", lora_rank=8)
    with pytest.raises(NotFound, match="was not written"):
        registry.add_checkpoint(run, kind="state", name="missing")
    with pytest.raises(Exception, match="letters, digits"):
        registry.checkpoint_dir(run, "state", "../../escape")
