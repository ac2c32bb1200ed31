"""A real ``twinkle serve`` process for tests, benchmarks and examples: started on loopback with a free port,
stopped (SIGTERM, then SIGKILL) when the ``with`` block ends, also when it fails.

::

    with ServerProcess(tiny_server_config(tmp_path, tenants={"alice": "tml-alice-key-1"})) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-alice-key-1")
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

#: a 2-layer qwen2 with the byte-level tokenizer of examples/quickstart (vocab 262): seconds to build on a CPU
TINY_QWEN: dict[str, Any] = {
    "model_type": "qwen2", "vocab_size": 262, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}
TINY_BASE = "twinkle/tiny-qwen2"


#: short chats of the quickstart's kind, as the tests' training texts
BYTE_TEXTS = ("upper: abc -> ABC", "reverse: abcd -> dcba", "upper: xyz -> XYZ", "lower: QRS -> qrs")


def byte_batch(step: int) -> dict[str, Any]:
    """Two rows of :data:`BYTE_TEXTS` (from ``step`` on) as byte-level tokens (the tiny model's tokenizer is bytes),
    right-padded, every token a label: a native-API training batch."""
    import torch

    rows = [list(BYTE_TEXTS[(step + i) % len(BYTE_TEXTS)].encode()) for i in range(2)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def quickstart_tokenizer() -> str:
    return str(Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "tokenizer")


def tiny_model_section(seed: int = 0) -> dict[str, Any]:
    return {"class_name": "TransformersModel", "config": dict(TINY_QWEN), "tokenizer": quickstart_tokenizer(),
            "precision": "no", "seed": seed}


def tiny_server_config(directory: Path, *, tenants: dict[str, str], admins: tuple[str, ...] = (),
                       **overrides: Any) -> Path:
    """Write a server config hosting :data:`TINY_BASE` for ``tenants`` (name -> API key) and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = {"host": "127.0.0.1", "port": 0, "state_dir": str(directory / "state"),
           "base_models": [{"name": TINY_BASE, "model": tiny_model_section(), "max_lora_rank": 32}],
           "tenants": [{"name": name, "api_key": key} for name, key in tenants.items()],
           "admins": list(admins), **overrides}
    path = directory / "server.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class ServerProcess:
    """``twinkle serve CONFIG`` in a child process (its own process group), its output in ``log``."""

    def __init__(self, config: Path, *, env: dict[str, str] | None = None, start_timeout_s: float = 120.0) -> None:
        self.config = Path(config)
        self.log = self.config.parent / "server.log"
        self.env = env
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    def start(self) -> ServerProcess:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
               **(self.env or {})}
        env.setdefault("OMP_NUM_THREADS", os.environ.get("TWINKLE_TEST_THREADS", "1"))
        handle = open(self.log, "ab")
        offset = handle.tell()  # a restart appends to the same log: read only this start's lines
        self.process = subprocess.Popen([sys.executable, "-m", "twinkle_core.cli", "serve", str(self.config)],
                                        stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        handle.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            with open(self.log, "rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
            found = re.findall(r"listening on (http://\S+)", text)
            if found and "Application startup complete" in text:
                self.base_url = found[-1]
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"twinkle serve exited with {self.process.returncode}:\n{text[-4000:]}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"twinkle serve did not start within {self.start_timeout_s:.0f} s:\n"
                           f"{self.log.read_text(errors='replace')[-4000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing gets to clean up."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (graceful: in-flight work finishes), then SIGKILL after ``timeout_s``."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
