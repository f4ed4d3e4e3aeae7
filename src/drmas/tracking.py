"""MLflow tracking: one MLflow run per training run, ``step = iteration``.

Params are the resolved config (``section.field``); tags say where the run came from (git
sha, drmas version, config file, store root, drmas run id); every stage's output URI is
logged as lineage, so a run in MLflow leads to its Parquet files and checkpoints. A
resumed training run continues its MLflow run (found by the ``drmas.run_id`` tag).

Tracking never stops training: a failing call is logged as a warning and counted in
``gaps`` (reported at the end), and training goes on.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from drmas.config import DrmasConfig

__all__ = ["Tracker"]

log = logging.getLogger("drmas")


def _git_sha() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Tracker:
    """Logs a drmas run to MLflow; every method swallows and counts tracking failures."""

    def __init__(self, config: DrmasConfig, run_id: str, store_root: str, config_path: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow  # noqa: PLC0415

        self.mlflow = mlflow
        self.gaps = 0
        mlflow.set_tracking_uri(config.tracking.uri)
        experiment_name = config.tracking.experiment or config.experiment.name
        experiment = mlflow.get_experiment_by_name(experiment_name)
        self.experiment_id = experiment.experiment_id if experiment else mlflow.create_experiment(experiment_name)
        found = mlflow.search_runs(
            experiment_ids=[self.experiment_id], filter_string=f"tags.`drmas.run_id` = '{run_id}'", output_format="list"
        )
        if found:
            self.mlflow_run_id = found[0].info.run_id
        else:
            from drmas import __version__  # noqa: PLC0415

            created = mlflow.MlflowClient().create_run(
                self.experiment_id,
                run_name=run_id,
                tags={
                    "drmas.run_id": run_id,
                    "drmas.version": __version__,
                    "git.sha": _git_sha(),
                    "drmas.store_root": store_root,
                    "drmas.config_path": config_path or "",
                },
            )
            self.mlflow_run_id = created.info.run_id
            self._safely(self._log_params, config.flat_params())

    @property
    def url(self) -> str:
        return f"{self.mlflow.get_tracking_uri()} (experiment {self.experiment_id}, run {self.mlflow_run_id})"

    def _safely(self, function, *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - tracking must never stop training
            self.gaps += 1
            log.warning("tracking failed (training continues): %s", str(error).splitlines()[0][:200])

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param  # noqa: PLC0415

        items = [Param(key, value[:6000]) for key, value in sorted(params.items())]
        client = self.mlflow.MlflowClient()
        for start in range(0, len(items), 100):
            client.log_batch(self.mlflow_run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        def send() -> None:
            import math  # noqa: PLC0415
            import time  # noqa: PLC0415

            from mlflow.entities import Metric  # noqa: PLC0415

            now = int(time.time() * 1000)
            items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if math.isfinite(float(v))]
            client = self.mlflow.MlflowClient()
            for start in range(0, len(items), 500):
                client.log_batch(self.mlflow_run_id, metrics=items[start : start + 500])

        self._safely(send)

    def log_lineage(self, iteration: int, uris: dict[str, str]) -> None:
        """Stage name -> artifact URI, as a JSON artifact per iteration and as tags."""

        def send() -> None:
            client = self.mlflow.MlflowClient()
            client.log_dict(self.mlflow_run_id, uris, f"lineage/iter-{iteration:06d}.json")
            for stage, uri in uris.items():
                client.set_tag(self.mlflow_run_id, f"lineage.{stage}", uri)

        self._safely(send)

    def log_episodes(self, iteration: int, rows: dict[str, list[Any]]) -> None:
        """Sample agent calls of an iteration as an MLflow table (shown in the UI)."""
        self._safely(lambda: self.mlflow.MlflowClient().log_table(self.mlflow_run_id, rows, f"episodes/iter-{iteration:06d}.json"))

    def finish(self, status: str = "FINISHED") -> None:
        self._safely(lambda: self.mlflow.MlflowClient().set_terminated(self.mlflow_run_id, status))
