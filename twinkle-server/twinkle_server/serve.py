"""``twinkle serve CONFIG.yaml [--host H] [--port P] [--state-dir DIR]``: host base models for many tenants."""

from __future__ import annotations

import argparse

from twinkle_core.commands import Command


class ServeCommand(Command):
    description = ("Serve base models for many tenants over HTTP: the Tinker SDK (base_url=...) and Twinkle's native "
                   "client train LoRA adapters through it.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("config", help="the server's YAML config (base_models, tenants, limits, state_dir)")
        parser.add_argument("--host", default=None, help="address to listen on (default: the config's, else 127.0.0.1)")
        parser.add_argument("--port", type=int, default=None, help="port (default: the config's, else 8000; 0 picks "
                                                                   "a free one and prints it)")
        parser.add_argument("--state-dir", default=None, help="where sessions, runs and checkpoints live (overrides "
                                                              "the config's state_dir)")
        parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))

    def run(self, args: argparse.Namespace) -> int:
        import dataclasses
        from pathlib import Path

        from twinkle_server.config import load_server_config

        config = load_server_config(args.config)
        changes = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        if args.state_dir is not None:
            changes["state_dir"] = Path(args.state_dir).resolve()
        config = dataclasses.replace(config, **changes)
        serve(config, log_level=args.log_level)
        return 0


def serve(config, *, log_level: str = "info") -> None:
    """Run the server in this process until SIGINT/SIGTERM (uvicorn's graceful shutdown: in-flight requests
    finish, queued work drains, then the process exits)."""
    import logging
    import socket

    import uvicorn

    from twinkle_server.app import build_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = build_app(config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    host, port = sock.getsockname()[:2]
    print(f"twinkle serve: listening on http://{host}:{port} (state in {config.state_dir})", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=60))
    server.run(sockets=[sock])
