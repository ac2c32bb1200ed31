"""The ``swanlab`` tracker: SwanLab (``pip install swanlab``).

Options (``train.tracker_options.swanlab``): ``project`` (default ``twinkle``), ``workspace``, ``name`` (default:
the output directory's name), ``mode`` (``online``, ``local``, ``offline``, ``disabled``; default: SwanLab's own,
``SWANLAB_MODE``), ``log_dir`` (default: ``SWANLAB_LOG_DIR`` or ``output_dir/swanlog``), ``group``, ``tags`` and
``init_kwargs`` (anything else ``swanlab.init`` takes). ``offline``/``local`` runs can be uploaded later with
``swanlab sync``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from twinkle_core.trackers import Tracker

_STATE = {"success": "success", "failed": "crashed", "interrupted": "aborted"}


class SwanLabTracker(Tracker):
    requires = {"swanlab": "pip install swanlab"}

    def __init__(self, project: str | None = None, workspace: str | None = None, name: str | None = None,
                 mode: str | None = None, log_dir: str | None = None, group: str | None = None,
                 tags: list[str] | None = None, init_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(project=project, workspace=workspace, name=name, mode=mode, log_dir=log_dir, group=group,
                         tags=tags)
        self.init_kwargs = dict(init_kwargs or {})
        self.run: Any = None

    def start(self, run_config: dict[str, Any], output_dir: str | os.PathLike[str], run_name: str) -> None:
        import swanlab

        kwargs = self.init_options(run_name, project_env="SWANLAB_PROJ_NAME", dir_key="log_dir",
                                   dir_env="SWANLAB_LOG_DIR", default_dir=str(Path(output_dir) / "swanlog"))
        self.run = swanlab.init(config=run_config, **{**kwargs, **self.init_kwargs})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(state=_STATE.get(status, "crashed"))
            self.run = None
