"""MLflow tracking: one MLflow run per training run, ``step = iteration``.

Params are the resolved config (``section.field``); tags say where the run came from (git
sha, drmas version, config file, store root, drmas run id); every stage's output URI is
logged as lineage, so a run in MLflow leads to its Parquet files and checkpoints. A
resumed training run continues its MLflow run (found by the ``drmas.run_id`` tag).

Beyond metrics: the task's question sets and each iteration's trajectories are logged as
MLflow datasets (``log_input``: name, digest, source URI, no data copied), a report's
figures as artifacts, and each worker group's final policy as a version of the registered
model ``{experiment}-{wg}`` whose source is the policy's URI in the store.

Tracking never stops or stalls training; the store, not MLflow, holds the results:

- Bounded calls: drmas's MLflow calls retry once at most, time out after
  ``HTTP_LIMITS``'s seconds and ignore ``Retry-After`` (MLflow's own defaults, 7 retries
  with back-off and a 120 s timeout, can hold one call for many minutes), unless the user
  set those variables.
- A circuit breaker: after a failure the server is left alone for a cool-down (30 s,
  doubling up to 5 minutes while it stays down), so an outage costs training one bounded
  call per cool-down, not one per call.
- A buffer: every call waits in an ordered, bounded queue until it is delivered, with its
  original step and timestamp, so a temporary outage leaves no hole in the MLflow run
  (a replayed metric batch is deduplicated by MLflow: same key, step, timestamp, value).
  ``finish`` makes one last attempt; what could not be delivered is counted by kind
  (``undelivered``, ``gaps``) and described by ``gap_report``.

The run itself is opened when the tracker is made: a server that cannot be reached then
raises :class:`TrackingUnavailable` (in bounded time) before any training starts.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import subprocess
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas.config import DrmasConfig

__all__ = ["HTTP_LIMITS", "LOCAL_UI", "UI_MODE", "Tracker", "TrackingUnavailable", "tracking_uri", "ui_link"]

log = logging.getLogger("drmas")

HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER": "false",
}
"""MLflow's HTTP settings for drmas's calls, where the environment does not set them: one
immediate retry (a stale pooled connection, a dropped request; longer outages are the
buffer's job), 10 s to connect or to wait for a reply (a small logging call to a healthy
server takes milliseconds), and no sleeping for a ``Retry-After`` the server asks for (the
cool-down takes its place). A call to a refused port costs milliseconds, to a silent one
at most 2 x 10 s."""

FIRST_COOLDOWN_S = 30.0
MAX_COOLDOWN_S = 300.0
MAX_PENDING = 1000
"""Calls held while the server is down (about 200 iterations of the runner's calls)."""
EXPERIMENT_KIND, MODEL_DEVELOPMENT = "mlflow.experimentKind", "custom_model_development"
"""The experiment tag MLflow 3's UI reads to open an experiment on its training runs and
their charts (untagged, it opens drmas experiments in its GenAI mode, "Evaluation runs");
a kind a user set is kept."""


class TrackingUnavailable(RuntimeError):
    """The MLflow run could not be opened (server unreachable or refusing): nothing trained yet."""


@dataclass
class _Call:
    """One tracking call: what it logs (for the gap report) and how to send it."""

    kind: str
    send: Callable[[Any], None]
    """Takes the ``MlflowClient``; must be safe to repeat (a call may be sent again when
    its reply was lost)."""
    step: int | None = None
    held_back: bool = False
    """It could not be delivered when it was made."""


def _git_sha() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
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


def _redacted(text: str) -> str:
    """``text`` without the user and password of any URL in it (``http://user:pw@host``)."""
    return re.sub(r"(?<=://)[^/@\s]+@", "***@", text)


def error_reason(error: BaseException) -> str:
    """The first line of an error, short and without credentials, for a warning."""
    return _redacted(str(error).splitlines()[0][:200] if str(error) else type(error).__name__)


def _server_unavailable(error: Exception) -> bool:
    """Whether a failed call may go through later (server down, overloaded, slow or behind
    a failing proxy) rather than being refused for what it sent (a 4xx answer)."""
    from mlflow.exceptions import MlflowException  # noqa: PLC0415

    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
    else:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status is None:
            return isinstance(error, OSError)  # requests' connection errors are OSErrors
    return status >= 500 or status in (408, 429)


@contextmanager
def _bounded_http() -> Iterator[None]:
    """``HTTP_LIMITS`` for the calls made inside, for each setting the user has not set;
    the environment is as it was afterwards (other MLflow users in the process keep MLflow's
    defaults). MLflow reads these variables on every request."""
    added = {name: value for name, value in HTTP_LIMITS.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _never_raises(kind: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A logging method that cannot even prepare its call (a value that is not a number, an
    unreadable file) counts that call as lost instead of raising into training."""

    def decorate(method: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(method)
        def guarded(self: Tracker, *args: Any, **kwargs: Any) -> None:
            try:
                method(self, *args, **kwargs)
            except Exception as error:
                self._lose(kind, None, f"it could not be prepared: {error_reason(error)}")

        return guarded

    return decorate


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 8]`` -> ``"3-5, 8"``."""
    spans: list[list[int]] = []
    for step in sorted(set(steps)):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{first}-{last}" if last > first else f"{first}" for first, last in spans)


UI_MODE = "workflowType=machine_learning"
"""The MLflow UI (3.x) opens every experiment in its GenAI mode (traces, judges, evaluation
runs) unless a link chooses the model-training mode (runs, metrics, models): the mode is a
setting of the whole UI, read from this parameter of the page's route."""


LOCAL_UI = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` (and ``make ui``) serves a store by default."""


def ui_link(base: str, page: str) -> str:
    """A link to ``page`` (e.g. ``experiments/1/runs/abc``) of the MLflow UI at ``base``, in
    its model-training mode: every MLflow link drmas prints is made here. The UI is a
    single-page app routed after the ``#``; it reads the mode from the route's query."""
    return f"{base.rstrip('/')}/#/{page}?{UI_MODE}"


class Tracker:
    """Logs a drmas run to MLflow without ever stopping or stalling training (see the module
    docstring): calls are buffered while the server is down and sent when it is back."""

    def __init__(
        self,
        config: DrmasConfig,
        run_id: str,
        store_root: str,
        config_path: str | None = None,
        *,
        cooldown_s: float = FIRST_COOLDOWN_S,
        max_pending: int = MAX_PENDING,
        tags: dict[str, str] | None = None,
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow  # noqa: PLC0415

        self.uri = tracking_uri(config, store_root)
        self.max_pending = max_pending
        self.outages = 0
        """Times the server became unreachable."""
        self.outage_s = 0.0
        """Seconds from each outage's first failed call to its first delivered one."""
        self.delivered_late = 0
        """Calls held back during an outage and delivered after it."""
        self._pending: deque[_Call] = deque()
        self._lost: list[tuple[str, int | None]] = []
        """(kind, step) of each call that will never be sent: the queue was full or MLflow refused it."""
        self._first_cooldown_s = self._cooldown_s = cooldown_s
        self._retry_at = 0.0
        self._down_since: float | None = None
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(self.uri)
        self.client = mlflow.MlflowClient(self.uri)
        self.experiment_name = config.tracking.experiment or config.experiment.name
        try:
            with _bounded_http():
                created = self._open_run(run_id, store_root, config_path)
        except Exception as error:
            raise TrackingUnavailable(
                f"cannot open the MLflow run at {_redacted(self.uri)}: {error_reason(error)}"
            ) from error
        if created:
            self._log_params(config.flat_params())
        if tags:
            self._set_tags(tags)

    def _open_run(self, run_id: str, store_root: str, config_path: str | None) -> bool:
        """Find the run of ``run_id`` (a resumed run) or create it; True when created."""
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        self.experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(self.experiment_name, artifact_location=_artifact_location(self.uri))
        )
        if experiment is None or EXPERIMENT_KIND not in experiment.tags:
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_DEVELOPMENT)
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`drmas.run_id` = '{run_id}'", max_results=1
        )
        if found:
            self.mlflow_run_id = found[0].info.run_id
            return False
        from drmas import __version__  # noqa: PLC0415

        tags = {
            "drmas.run_id": run_id,
            "drmas.version": __version__,
            "git.sha": _git_sha(),
            "drmas.store_root": store_root,
            "drmas.config_path": config_path or "",
        }
        self.mlflow_run_id = self.client.create_run(self.experiment_id, run_name=run_id, tags=tags).info.run_id
        return True

    @property
    def url(self) -> str:
        return f"{_redacted(self.uri)} (experiment {self.experiment_id}, run {self.mlflow_run_id})"

    def link(self, ui: str | None = None) -> str:
        """The run's page in the MLflow UI at ``ui`` (default: the tracking server; for a
        store that no server serves, a sqlite file, ``mlflow ui`` over it: ``to_start``)."""
        base = ui or (LOCAL_UI if self.to_start() else self.uri)
        return ui_link(_redacted(base), f"experiments/{self.experiment_id}/runs/{self.mlflow_run_id}")

    def to_start(self, ui: str | None = None) -> str:
        """What to start before the run's link opens: the MLflow UI over a store that no
        server serves (a sqlite file), unless ``ui`` names the UI to open."""
        if ui or self.uri.startswith(("http://", "https://")):
            return ""
        return f"mlflow ui --backend-store-uri {_redacted(self.uri)}"

    def where(self, ui: str | None = None) -> str:
        """The run's link and, when needed, what to start first: for a person to read."""
        start = self.to_start(ui)
        return self.link(ui) + (f" (start the UI first: {start})" if start else "")

    # --- delivery: buffer, circuit breaker, accounting -------------------------------------

    def _submit(self, call: _Call, force: bool = False) -> None:
        """Queue ``call`` (or count it lost when the queue is full) and send what is queued."""
        if len(self._pending) >= self.max_pending:
            self._lose(call.kind, call.step, f"{self.max_pending} calls are already waiting for the server")
        else:
            self._pending.append(call)
        self._flush(force)
        if self._pending and self._pending[-1] is call:
            call.held_back = True

    def _flush(self, force: bool = False) -> None:
        """Send the queued calls in order; stop at the first one the server is unavailable
        for. During a cool-down nothing is sent, unless ``force`` (one last try)."""
        if not force and time.monotonic() < self._retry_at:
            return
        while self._pending:
            call = self._pending[0]
            try:
                with _bounded_http():
                    call.send(self.client)
            except Exception as error:
                if _server_unavailable(error):
                    self._server_down(error)
                    return
                self._pending.popleft()
                self._lose(call.kind, call.step, f"MLflow refused it: {error_reason(error)}")
                continue
            self._pending.popleft()
            if call.held_back:
                self.delivered_late += 1
        self._server_up()

    def _server_down(self, error: Exception) -> None:
        """Open the breaker for a cool-down (doubled for the next failure) and say so."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self.outages += 1
            log.warning(
                "tracking: MLflow at %s is unreachable (%s); training continues, "
                "calls are kept (up to %d) and sent when it is back",
                _redacted(self.uri),
                error_reason(error),
                self.max_pending,
            )
        else:
            log.warning(
                "tracking: MLflow still unreachable after %.0f s (%d calls waiting): %s",
                now - self._down_since,
                len(self._pending),
                error_reason(error),
            )
        self._retry_at = now + self._cooldown_s
        self._cooldown_s = min(2 * self._cooldown_s, MAX_COOLDOWN_S)

    def _server_up(self) -> None:
        """Close the breaker after an outage and say what was delivered late."""
        if self._down_since is None:
            return
        lasted = time.monotonic() - self._down_since
        self.outage_s += lasted
        self._down_since = None
        self._cooldown_s = self._first_cooldown_s
        log.warning(
            "tracking: MLflow is reachable again after %.0f s; %d held-back call(s) delivered in all",
            lasted,
            self.delivered_late,
        )

    def _lose(self, kind: str, step: int | None, why: str) -> None:
        self._lost.append((kind, step))
        log.warning("tracking: %s%s not logged to MLflow: %s", kind, "" if step is None else f" (step {step})", why)

    def _missing(self) -> list[tuple[str, int | None]]:
        """(kind, step) of every call not in MLflow: lost, or still waiting."""
        return [*self._lost, *((call.kind, call.step) for call in self._pending)]

    def undelivered(self) -> dict[str, int]:
        """Kind of call -> how many have not reached MLflow (waiting, or lost: the queue was
        full or MLflow refused them). After ``finish``: what the MLflow run lacks. Kinds:
        params, metrics, lineage, episodes, datasets, files, models, status (the run's end)."""
        return dict(sorted(Counter(kind for kind, _ in self._missing()).items()))

    @property
    def gaps(self) -> int:
        """Calls that have not reached MLflow (see ``undelivered``)."""
        return len(self._lost) + len(self._pending)

    def gap_report(self) -> str:
        """One paragraph on outages and what MLflow lacks; empty when tracking had no trouble."""
        if not self.outages and not self.gaps:
            return ""
        parts = []
        if self.outages:
            ongoing = time.monotonic() - self._down_since if self._down_since is not None else 0.0
            still = ", still unreachable at the last try" if self._down_since is not None else ""
            parts.append(
                f"MLflow at {_redacted(self.uri)} was unreachable {self.outages} time(s), "
                f"{self.outage_s + ongoing:.0f} s in all{still}"
            )
        if self.delivered_late:
            parts.append(
                f"{self.delivered_late} held-back call(s) were delivered late, with their original steps and times"
            )
        if self.gaps:
            missing = self.undelivered()
            steps = [step for kind, step in self._missing() if kind == "metrics" and step is not None]
            kinds = ", ".join(
                f"{kind} {count}" + (f" (steps {_ranges(steps)})" if kind == "metrics" and steps else "")
                for kind, count in missing.items()
            )
            unended = " (MLflow still shows the run as running)" if "status" in missing else ""
            parts.append(f"calls not in MLflow: {kinds}{unended}; the store holds every result")
        else:
            parts.append("nothing is missing from the MLflow run")
        return "; ".join(parts)

    # --- what the runner logs ------------------------------------------------------------------

    @_never_raises("tags")
    def _set_tags(self, tags: dict[str, str]) -> None:
        """Tags set on every opening (a Kubeflow run's id: each pipeline run that continues
        the drmas run names itself)."""
        from mlflow.entities import RunTag  # noqa: PLC0415

        items = [RunTag(key, value) for key, value in sorted(tags.items())]
        self._submit(_Call("tags", lambda client: client.log_batch(self.mlflow_run_id, tags=items)))

    @_never_raises("params")
    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param  # noqa: PLC0415

        items = [Param(key, value[:6000]) for key, value in sorted(params.items())]
        for start in range(0, len(items), 100):
            batch = items[start : start + 100]
            self._submit(
                _Call("params", lambda client, batch=batch: client.log_batch(self.mlflow_run_id, params=batch))
            )

    @_never_raises("metrics")
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Finite values only; timestamped now, whenever they reach MLflow."""
        from mlflow.entities import Metric  # noqa: PLC0415

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items()) if math.isfinite(float(v))]

        def send(client) -> None:
            for start in range(0, len(items), 500):
                client.log_batch(self.mlflow_run_id, metrics=items[start : start + 500])

        self._submit(_Call("metrics", send, step=step))

    @_never_raises("lineage")
    def log_lineage(self, iteration: int, uris: dict[str, str]) -> None:
        """Stage name -> artifact URI, as a JSON artifact per iteration and as tags."""
        from mlflow.entities import RunTag  # noqa: PLC0415

        def send(client) -> None:
            client.log_dict(self.mlflow_run_id, uris, f"lineage/iter-{iteration:06d}.json")
            client.log_batch(self.mlflow_run_id, tags=[RunTag(f"lineage.{stage}", uri) for stage, uri in uris.items()])

        self._submit(_Call("lineage", send, step=iteration + 1))

    @_never_raises("episodes")
    def log_episodes(self, iteration: int, rows: dict[str, list[Any]]) -> None:
        """Sample agent calls of an iteration as an MLflow table (shown in the UI)."""
        self._submit(
            _Call(
                "episodes",
                lambda client: client.log_table(self.mlflow_run_id, rows, f"episodes/iter-{iteration:06d}.json"),
                step=iteration + 1,
            )
        )

    @_never_raises("datasets")
    def log_dataset(self, name: str, source: str, digest: str, context: str, rows: int | None = None) -> None:
        """A dataset input of the run (MLflow's Datasets panel): where it is, not its data."""
        import json  # noqa: PLC0415

        from mlflow.entities import Dataset, DatasetInput, InputTag  # noqa: PLC0415
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT  # noqa: PLC0415

        source_type = "s3" if source.startswith("s3://") else "local" if source.startswith("/") else "drmas"
        profile = json.dumps({"num_rows": rows}) if rows is not None else None
        dataset = Dataset(name, digest[:36], source_type, json.dumps({"uri": source}), profile=profile)
        inputs = [DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, context)])]
        self._submit(_Call("datasets", lambda client: client.log_inputs(self.mlflow_run_id, inputs)))

    @_never_raises("files")
    def log_files(self, files: list[Path], folder: str) -> None:
        """Local files (a report's figures) as run artifacts under ``folder``; their bytes are
        read now, so the caller may delete them before they are delivered."""
        contents = {path.name: path.read_bytes() for path in files}

        def send(client) -> None:
            with tempfile.TemporaryDirectory() as scratch:
                for name, data in contents.items():
                    (Path(scratch) / name).write_bytes(data)
                client.log_artifacts(self.mlflow_run_id, scratch, folder)

        self._submit(_Call("files", send))

    @_never_raises("models")
    def register_policies(self, policies: dict[str, str], iteration: int) -> None:
        """Each worker group's final policy as a new version of ``{experiment}-{wg}``."""
        for wg, uri in policies.items():
            self._submit(_Call("models", lambda client, wg=wg, uri=uri: self._register(client, wg, uri, iteration)))

    def _register(self, client, wg: str, uri: str, iteration: int) -> None:
        """A version whose source is the policy's store URI. An MLflow server refuses a
        local path as a source (outside the run's artifacts), so a policy in a local store
        gets a pointer in the run's artifacts (``policies/{wg}/policy.json``) as its source
        instead; the tag ``drmas.store_uri`` names the policy either way."""
        from mlflow.exceptions import MlflowException  # noqa: PLC0415

        name = f"{self.experiment_name}-{wg}"
        try:
            client.create_registered_model(
                name, description=f"drmas worker group {wg} of experiment {self.experiment_name}"
            )
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = uri
        if uri.startswith(("/", "file:")) and self.uri.startswith(("http://", "https://")):
            pointer = {"store_uri": uri, "wg": wg, "iteration": iteration}
            client.log_dict(self.mlflow_run_id, pointer, f"policies/{wg}/policy.json")
            source = f"runs:/{self.mlflow_run_id}/policies/{wg}"
        tags = {"drmas.wg": wg, "drmas.iteration": str(iteration), "drmas.store_uri": uri}
        client.create_model_version(name, source=source, run_id=self.mlflow_run_id, tags=tags)

    def finish(self, status: str = "FINISHED") -> None:
        """End the MLflow run after one last try at everything waiting (whatever the
        cool-down; bounded like any call), and log the gap report if there is one."""
        self._submit(_Call("status", lambda client: client.set_terminated(self.mlflow_run_id, status)), force=True)
        self._report_gaps()

    def close(self) -> None:
        """One last try at everything waiting, leaving the MLflow run open: a Kubeflow
        step logs its part of a run that later steps continue."""
        self._flush(force=True)
        self._report_gaps()

    def _report_gaps(self) -> None:
        if report := self.gap_report():
            log.warning("tracking: %s", report)
