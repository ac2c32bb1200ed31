"""Registrations of the training service (entry point ``twinkle: server``)."""

from __future__ import annotations

from twinkle_core import hookimpl
from twinkle_core.records import CommandRecord, SamplerRecord


@hookimpl
def twinkle_register_commands():
    yield CommandRecord("serve", "twinkle_server.serve:ServeCommand",
                        "host base models for many tenants over HTTP (Tinker-compatible API, native client)")


@hookimpl
def twinkle_register_samplers():
    # no options: it samples through the RemoteModel it is bound to, so an RL task training a RemoteModel picks it
    # by name (task_options.sampler: {name: twinkle_remote}) where hf_generate would read parameters it cannot reach
    yield SamplerRecord("twinkle_remote", "twinkle_server.client:RemoteSampler",
                        "completions from a twinkle serve adapter's current weights, through the RemoteModel it is "
                        "bound to (the native client)")
