"""The ``mlflow`` tracker: MLflow (``pip install mlflow``).

Options (``train.tracker_options.mlflow``): ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI``, else mlflow's
default), ``experiment_name`` (default: ``MLFLOW_EXPERIMENT_NAME`` or ``twinkle``), ``run_name`` (default: the output
directory's name), ``tags`` and ``artifact_location`` (for an experiment this run creates; MLflow's default with a
local database is ``./mlruns`` in the working directory). The recipe is logged as flat params (``optimizer.lr``) and as the artifact
``recipe.json``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from twinkle_core.trackers import Tracker, flatten

_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
_MAX_PARAM = 500  # the value length every MLflow store accepts
_BATCH = 100  # params per log_batch call


class MLflowTracker(Tracker):
    requires = {"mlflow": "pip install mlflow"}

    def __init__(self, tracking_uri: str | None = None, experiment_name: str | None = None,
                 run_name: str | None = None, tags: dict[str, str] | None = None,
                 artifact_location: str | None = None) -> None:
        super().__init__(tracking_uri=tracking_uri, experiment_name=experiment_name, run_name=run_name, tags=tags,
                         artifact_location=artifact_location)
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, run_config: dict[str, Any], output_dir: str | os.PathLike[str], run_name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        o = self.options
        self.client = MlflowClient(tracking_uri=o["tracking_uri"] or None)
        name = o["experiment_name"] or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "twinkle"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(name, artifact_location=o["artifact_location"]))
        run = self.client.create_run(experiment_id, run_name=o["run_name"] or run_name,
                                     tags={str(k): str(v) for k, v in (o["tags"] or {}).items()})
        self.run_id = run.info.run_id
        params = [Param(key, str(value)[:_MAX_PARAM]) for key, value in flatten(run_config).items()]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _BATCH])
        self.client.log_text(self.run_id, json.dumps(run_config, indent=2, default=str), "recipe.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step)
                                                    for key, value in metrics.items()])

    def finish(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=_STATUS.get(status, "FAILED"))
            self.run_id = None
