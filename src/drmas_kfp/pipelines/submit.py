"""Submit a compiled pipeline to a Kubeflow Pipelines API server."""

from __future__ import annotations

from pathlib import Path

__all__ = ["SERVICE_ACCOUNT", "submit"]

SERVICE_ACCOUNT = "drmas-pipeline"
"""The steps' ServiceAccount (manifests/base/rbac.yaml): reads the drmas-s3 secret."""


def submit(
    package: str | Path,
    host: str,
    arguments: dict,
    experiment: str,
    run_name: str,
    namespace: str | None = None,
    service_account: str | None = SERVICE_ACCOUNT,
) -> tuple[str, str]:
    """Create a run of the compiled ``package``; returns (KFP run id, its URL).

    Caching is left to the compiled pipeline (``enable_caching`` is not overridden at
    submission), so the tasks compiled with ``--force`` recompute and the others may be
    cache hits.
    """
    import warnings  # noqa: PLC0415

    import kfp  # noqa: PLC0415

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
