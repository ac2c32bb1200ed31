"""The ``wandb`` tracker: Weights & Biases (``pip install wandb``).

Options (``train.tracker_options.wandb``): ``project``, ``entity``, ``name`` (default: the output directory's
name), ``group``, ``tags``, ``mode`` (``online``, ``offline``, ``disabled``; default: wandb's own, ``WANDB_MODE``),
``dir`` (default: ``WANDB_DIR`` or the output directory) and ``init_kwargs`` (anything else ``wandb.init`` takes).
"""

from __future__ import annotations

import os
from typing import Any

from twinkle_core.trackers import Tracker


class WandbTracker(Tracker):
    requires = {"wandb": "pip install wandb"}

    def __init__(self, project: str | None = None, entity: str | None = None, name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, mode: str | None = None,
                 dir: str | None = None, init_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(project=project, entity=entity, name=name, group=group, tags=tags, mode=mode, dir=dir)
        self.init_kwargs = dict(init_kwargs or {})
        self.run: Any = None

    def start(self, run_config: dict[str, Any], output_dir: str | os.PathLike[str], run_name: str) -> None:
        import wandb

        kwargs = self.init_options(run_name, project_env="WANDB_PROJECT", dir_key="dir", dir_env="WANDB_DIR",
                                   default_dir=str(output_dir))
        self.run = wandb.init(config=run_config, **{**kwargs, **self.init_kwargs})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "success" else 1)
            self.run = None
