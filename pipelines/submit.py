"""Submit a compiled pipeline to a Kubeflow Pipelines API server.

Install modes (``manifests/README.md``): standalone KFP runs the steps as the
ServiceAccount ``drmas-pipeline`` (``manifests/kfp-standalone``); multi-user Kubeflow runs
them in a Profile namespace as its ``default-editor`` (``service_account=""``, KFP's
default there), bound to the Role of ``manifests/pipelines/role.yaml``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SERVICE_ACCOUNT", "submit"]

SERVICE_ACCOUNT = "drmas-pipeline"
"""The steps' ServiceAccount in standalone KFP (``manifests/kfp-standalone``), bound to the
Role ``drmas-pipeline`` of ``manifests/pipelines/role.yaml``: reads the drmas-s3 secret
and the kfp-launcher ConfigMap. In a Profile namespace (``namespace`` given) submit with
``service_account=""``: the namespace's ``default-editor``."""


def submit(
    package: str | Path,
    host: str,
    arguments: dict,
    experiment: str,
    run_name: str,
    namespace: str | None = None,
    service_account: str | None = None,
) -> tuple[str, str]:
    """Create a run of the compiled ``package``; returns (KFP run id, its URL).

    ``service_account``: None for the install mode's default (``SERVICE_ACCOUNT``, or with
    a ``namespace`` the namespace's default account), '' for KFP's default.

    Caching is left to the compiled pipeline (``enable_caching`` is not overridden at
    submission), so the tasks compiled with ``--force`` recompute and the others may be
    cache hits.
    """
    import warnings  # noqa: PLC0415

    import kfp  # noqa: PLC0415

    if service_account is None:
        service_account = SERVICE_ACCOUNT if namespace is None else ""
    with warnings.catch_warnings():  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2 and later"
        warnings.filterwarnings("ignore", category=FutureWarning, module="kfp")
        client = kfp.Client(host=host, namespace=namespace or "kubeflow")
    result = client.create_run_from_pipeline_package(
        str(package),
        arguments=arguments,
        run_name=run_name,
        experiment_name=experiment,
        namespace=namespace,
        service_account=service_account or None,
    )
    return result.run_id, f"{host.rstrip('/')}/#/runs/details/{result.run_id}"
