"""The Tinker-compatible HTTP API: the unmodified ``tinker`` SDK (0.38), pointed at this server with ``base_url=``
(or ``TINKER_BASE_URL``) and an API key ``tml-...``, trains LoRA adapters on the hosted base models.

Every route authenticates ``X-API-Key`` to a tenant; another tenant's model, session, sampler or checkpoint id
answers 404 exactly like an unknown one. Long-running work (model creation, forward/backward, optimizer steps,
saves and loads, sampling) is queued on the base model's lane of the scheduler and answered with an
``UntypedAPIFuture`` (``{"request_id": ...}``); the SDK polls ``/api/v1/retrieve_future``, which long-polls the
scheduler and answers ``try_again`` while the work is queued or running. The wire details are in
:mod:`twinkle_server.tinker_wire`.

What the SDK can ask for and this server refuses (each with a 400 naming it, never a silent substitute): loss
``custom`` (server-side traced losses), non-Adam optimizers (Dimuon), image/audio model inputs, 2-D loss inputs,
top-k / target / alternative-token prompt logprobs, stability recording, cross-account access tokens, encrypted
exports, publishing checkpoints, copying weights, JWT auth exchange, billing/audit/admin endpoints.

The routes, by concern:

- :mod:`~twinkle_server.tinker_service`: health, client config, capabilities, sessions, heartbeats, telemetry
- :mod:`~twinkle_server.tinker_training`: create_model, get_info, forward_backward / forward, optim_step
- :mod:`~twinkle_server.tinker_checkpoints`: save_weights, save_weights_external, load_weights
- :mod:`~twinkle_server.tinker_sampler_weights`: save_weights_for_sampler (named, or ephemeral with a session)
- :mod:`~twinkle_server.tinker_listings`: training runs and checkpoints: listings, weights info, deletion, TTL
- :mod:`~twinkle_server.tinker_downloads`: signed download URLs of exported adapters
- :mod:`~twinkle_server.tinker_sampling`: sampling sessions and asample (also compute_logprobs)
- :mod:`~twinkle_server.tinker_futures`: retrieve_future(s) and the dedup of retried POSTs
- :mod:`~twinkle_server.tinker_refusals`: what is refused by name
"""

from __future__ import annotations

from fastapi import APIRouter

from twinkle_server import (
    tinker_checkpoints,
    tinker_downloads,
    tinker_futures,
    tinker_listings,
    tinker_refusals,
    tinker_sampler_weights,
    tinker_sampling,
    tinker_service,
    tinker_training,
)
from twinkle_server.tinker_service import CLIENT_CONFIG

ROUTE_MODULES = (tinker_service, tinker_training, tinker_checkpoints, tinker_sampler_weights, tinker_listings,
                 tinker_downloads, tinker_sampling, tinker_futures, tinker_refusals)


def build_router() -> APIRouter:
    """One router with every Tinker route (the refusals last)."""
    router = APIRouter()
    for module in ROUTE_MODULES:
        router.include_router(module.router)
    return router


router = build_router()

__all__ = ["CLIENT_CONFIG", "ROUTE_MODULES", "build_router", "router"]
