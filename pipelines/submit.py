"""Submit compiled pipelines to a Kubeflow Pipelines API server, find the runs of earlier
submissions, and follow a run until it ends.

Install modes (``manifests/README.md``): standalone KFP runs the steps as the
ServiceAccount ``drmas-pipeline`` (``manifests/kfp-standalone``); multi-user Kubeflow runs
them in a Profile namespace as its ``default-editor`` (``service_account=""``, KFP's
default there), bound to the Role of ``manifests/pipelines/role.yaml``.

Authentication (``Credentials``). Multi-user Kubeflow's API server serves only requests
that carry a user's identity; kfp.Client (2.17.3, ``kfp/client/client.py``) takes it as
``existing_token`` (a bearer token, sent as ``Authorization``), ``cookies`` (the session
cookie of Kubeflow's login, e.g. ``authservice_session=...`` through the Istio gateway)
or ``credentials`` (``ServiceAccountTokenVolumeCredentials``: a token file, re-read before
every request, so a kubelet-projected token that rotates stays valid). Given a ``host``,
kfp.Client looks for none of them itself (it reads a service-account token only when it
finds the API server from inside the cluster, with no host), so ``connect`` passes them.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COOKIES_ENV",
    "FINISHED",
    "SERVICE_ACCOUNT",
    "SUCCEEDED",
    "TOKEN_ENV",
    "Credentials",
    "KfpRun",
    "connect",
    "find_run",
    "run_url",
    "submit",
    "wait_for_run",
]

SERVICE_ACCOUNT = "drmas-pipeline"
"""The steps' ServiceAccount in standalone KFP (``manifests/kfp-standalone``), bound to the
Role ``drmas-pipeline`` of ``manifests/pipelines/role.yaml``: reads the drmas-s3 secret
and the kfp-launcher ConfigMap. In a Profile namespace (``namespace`` given) submit with
``service_account=""``: the namespace's ``default-editor``."""
TOKEN_ENV = "DRMAS_KFP_TOKEN"
"""Environment variable holding a bearer token for the API server (kfp.Client's
``existing_token``): an environment variable, so the token is in no command line, shell
history or printed command."""
COOKIES_ENV = "DRMAS_KFP_COOKIES"
"""Environment variable holding the cookies to send (kfp.Client's ``cookies``), e.g.
``authservice_session=...`` copied from a browser logged in to Kubeflow."""
SA_TOKEN_PATH_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
"""kfp's own variable for a service-account token file (a Kubeflow notebook's PodDefault
sets it): ``Credentials.from_environment`` uses it when no token file is given."""
SUCCEEDED = "SUCCEEDED"
FINISHED = frozenset({"SUCCEEDED", "FAILED", "CANCELED", "SKIPPED"})
"""The states of a KFP run (kfp_server_api ``V2beta1RuntimeState``) after which it changes
no more; PENDING, RUNNING, CANCELING, PAUSED and an unset state are still going."""


@dataclass(frozen=True)
class Credentials:
    """The user's identity for the API server, as kfp.Client takes it (at most one is
    needed: a token file, a token, or cookies)."""

    token_file: str | None = None
    """A file holding a bearer token, re-read before every request (``kubectl create token``
    written to a file, or a projected service-account token)."""
    token: str | None = None
    """A bearer token (``existing_token``)."""
    cookies: str | None = None
    """Cookies (``cookies``), e.g. ``authservice_session=...``."""

    @classmethod
    def from_environment(cls, token_file: str | None = None) -> Credentials:
        """``token_file``, else ``$KF_PIPELINES_SA_TOKEN_PATH``; the token and cookies from
        ``TOKEN_ENV`` and ``COOKIES_ENV``. ValueError for a token file that cannot be read
        (the API server would only answer 401 later)."""
        token_file = token_file or os.environ.get(SA_TOKEN_PATH_ENV) or None
        if token_file is not None and not Path(token_file).is_file():
            raise ValueError(f"--token-file {token_file}: no such file (a bearer token for the KFP API server)")
        return cls(token_file, os.environ.get(TOKEN_ENV) or None, os.environ.get(COOKIES_ENV) or None)


@dataclass(frozen=True)
class KfpRun:
    """A KFP run as ``find_run`` and ``wait_for_run`` report it."""

    run_id: str
    state: str
    """Its ``V2beta1RuntimeState`` (``PENDING`` while the server has set none)."""


def connect(host: str, namespace: str | None = None, credentials: Credentials = Credentials()) -> Any:
    """A kfp.Client of ``host`` (the API server's address: a port-forward, an Ingress, or
    Kubeflow's gateway ``https://kubeflow.example.com/pipeline``) for ``namespace`` (a
    Profile's, in multi-user Kubeflow; None: standalone), authenticated by ``credentials``."""
    import kfp  # noqa: PLC0415
    from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials  # noqa: PLC0415

    token_file = ServiceAccountTokenVolumeCredentials(credentials.token_file) if credentials.token_file else None
    with warnings.catch_warnings():  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2 and later"
        warnings.filterwarnings("ignore", category=FutureWarning, module="kfp")
        return kfp.Client(
            host=host,
            namespace=namespace or "kubeflow",
            existing_token=credentials.token,
            cookies=credentials.cookies,
            credentials=token_file,
        )


def submit(
    client: Any,
    package: str | Path,
    arguments: dict,
    experiment: str,
    run_name: str,
    namespace: str | None = None,
    service_account: str | None = None,
) -> str:
    """Create a run of the compiled ``package``; returns its KFP run id.

    ``service_account``: None for the install mode's default (``SERVICE_ACCOUNT``, or with
    a ``namespace`` the namespace's default account), '' for KFP's default.

    Caching is left to the compiled pipeline (``enable_caching`` is not overridden at
    submission), so the tasks compiled with ``--force`` recompute and the others may be
    cache hits.
    """
    if service_account is None:
        service_account = SERVICE_ACCOUNT if namespace is None else ""
    result = client.create_run_from_pipeline_package(
        str(package),
        arguments=arguments,
        run_name=run_name,
        experiment_name=experiment,
        namespace=namespace,
        service_account=service_account or None,
    )
    return result.run_id


def run_url(host: str, run_id: str) -> str:
    """Where the KFP UI shows the run."""
    return f"{host.rstrip('/')}/#/runs/details/{run_id}"


def find_run(client: Any, experiment: str, run_name: str, namespace: str | None = None) -> KfpRun | None:
    """The run named ``run_name`` in ``experiment`` that a resubmission must not repeat: one
    that succeeded, else the newest one still going; None when every such run ended
    otherwise (or there is none, or no such experiment). ``drmas submit`` names each part
    of a run after its drmas run id and iterations, so the name finds an earlier
    submission of the same part."""
    try:
        found = client.get_experiment(experiment_name=experiment, namespace=namespace)
    except ValueError:  # kfp.Client: "No experiment is found with name ..."
        return None
    by_name = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": run_name}]})
    runs, page = [], ""
    while True:
        response = client.list_runs(
            page_token=page,
            page_size=100,
            sort_by="created_at desc",
            experiment_id=found.experiment_id,
            namespace=namespace,
            filter=by_name,
        )
        runs += [run for run in response.runs or () if run.display_name == run_name]
        page = response.next_page_token or ""
        if not page:
            break
    states = [KfpRun(run.run_id, run.state or "PENDING") for run in runs]
    succeeded = [run for run in states if run.state == SUCCEEDED]
    going = [run for run in states if run.state not in FINISHED]
    return (succeeded or going or [None])[0]


def wait_for_run(client: Any, run_id: str, poll_s: float, report: Callable[[str], None]) -> KfpRun:
    """Ask the API server for the run's state every ``poll_s`` seconds until it is one of
    ``FINISHED``; ``report`` gets a line whenever the state changes. (kfp.Client's own
    ``wait_for_run_completion`` needs a timeout and prints nothing while it waits.)"""
    seen = None
    while True:
        state = client.get_run(run_id).state or "PENDING"
        if state != seen:
            report(f"KFP run {run_id}: {state.lower()}")
            seen = state
        if state in FINISHED:
            return KfpRun(run_id, state)
        time.sleep(poll_s)
