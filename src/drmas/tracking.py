"""MLflow tracking: one MLflow run per training run, ``step = iteration``.

Params are the resolved config (``section.field``); tags say where the run came from (git
sha, drmas version, config file, store root, drmas run id); every stage's output URI is
logged as lineage, so a run in MLflow leads to its Parquet files and checkpoints. A
resumed training run continues its MLflow run (found by the ``drmas.run_id`` tag).

Beyond metrics: the task's question sets and each iteration's trajectories are logged as
MLflow datasets (``log_input``: name, digest, source URI, no data copied), a report's
figures as artifacts, and each worker group's final policy as a version of the registered
model ``{experiment}-{wg}`` whose source is the policy's URI in the store.

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

__all__ = ["Tracker", "tracking_uri"]

log = logging.getLogger("drmas")


def _git_sha() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def tracking_uri(config: DrmasConfig, store_root: str) -> str:
    """The configured tracking URI, or sqlite in the store's folder (``./`` for S3 stores)."""
    if config.tracking.uri:
        return config.tracking.uri
    folder = Path(".") if store_root.startswith("s3://") else Path(store_root)
    return f"sqlite:///{(folder / 'mlflow.db').resolve()}"


def _artifact_location(uri: str) -> str | None:
    """For a sqlite store, artifacts go beside the database (not into the working folder)."""
    if not uri.startswith("sqlite:///"):
        return None
    return str(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts")


class Tracker:
    """Logs a drmas run to MLflow; every method swallows and counts tracking failures."""

    def __init__(self, config: DrmasConfig, run_id: str, store_root: str, config_path: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow  # noqa: PLC0415

        self.mlflow = mlflow
        self.gaps = 0
        uri = tracking_uri(config, store_root)
        if uri.startswith("sqlite:///"):
            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(uri)
        self.experiment_name = config.tracking.experiment or config.experiment.name
        experiment = mlflow.get_experiment_by_name(self.experiment_name)
        self.experiment_id = (
            experiment.experiment_id if experiment else mlflow.create_experiment(self.experiment_name, artifact_location=_artifact_location(uri))
        )
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

    def log_dataset(self, name: str, source: str, digest: str, context: str, rows: int | None = None) -> None:
        """A dataset input of the run (MLflow's Datasets panel): where it is, not its data."""

        def send() -> None:
            import json  # noqa: PLC0415

            from mlflow.entities import Dataset, DatasetInput, InputTag  # noqa: PLC0415
            from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT  # noqa: PLC0415

            source_type = "s3" if source.startswith("s3://") else "local" if source.startswith("/") else "drmas"
            profile = json.dumps({"num_rows": rows}) if rows is not None else None
            dataset = Dataset(name, digest[:36], source_type, json.dumps({"uri": source}), profile=profile)
            self.mlflow.MlflowClient().log_inputs(self.mlflow_run_id, [DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)])])

        self._safely(send)

    def log_files(self, files: list[Path], folder: str) -> None:
        """Local files (a report's figures) as run artifacts under ``folder``."""

        def send() -> None:
            client = self.mlflow.MlflowClient()
            for path in files:
                client.log_artifact(self.mlflow_run_id, str(path), folder)

        self._safely(send)

    def register_policies(self, policies: dict[str, str], iteration: int) -> None:
        """Each worker group's final policy as a new version of ``{experiment}-{wg}``."""

        def send() -> None:
            from mlflow.exceptions import MlflowException  # noqa: PLC0415

            client = self.mlflow.MlflowClient()
            for wg, uri in policies.items():
                name = f"{self.experiment_name}-{wg}"
                try:
                    client.create_registered_model(name, description=f"drmas worker group {wg} of experiment {self.experiment_name}")
                except MlflowException as error:
                    if error.error_code != "RESOURCE_ALREADY_EXISTS":
                        raise
                client.create_model_version(name, source=uri, run_id=self.mlflow_run_id, tags={"drmas.wg": wg, "drmas.iteration": str(iteration)})

        self._safely(send)

    def finish(self, status: str = "FINISHED") -> None:
        self._safely(lambda: self.mlflow.MlflowClient().set_terminated(self.mlflow_run_id, status))
