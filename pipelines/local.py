"""Run a pipeline on this machine with kfp.local: each task in a subprocess of this Python
(the image is not used), with KFP's local cache on, under a project cache folder."""

from __future__ import annotations

import warnings
from pathlib import Path

__all__ = ["DEFAULT_ROOT", "run_local"]

DEFAULT_ROOT = Path(".cache") / "kfp-local"
"""kfp.local's pipeline root (task outputs) and, below it, its cache (``.kfp_cache``)."""


def run_local(pipeline_func, arguments: dict, pipeline_root: str | Path = DEFAULT_ROOT):
    """Run ``pipeline_func`` with ``arguments``; returns its output artifact.

    Raises RuntimeError naming the task when one fails. Tasks whose caching is off (the
    forced ones) always execute; the others are skipped when kfp.local's cache holds a
    run of the same component with the same inputs.
    """
    from kfp import local  # noqa: PLC0415

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root), enable_caching=True)
    with warnings.catch_warnings():
        # The subprocess runner does not use the drmas image, and resource requests apply on
        # Kubernetes only: kfp.local would say so for every task.
        warnings.filterwarnings("ignore", message=".*non-Python base image.*")
        warnings.filterwarnings("ignore", message=".*no effect in the current local runner.*")
        task = pipeline_func(**arguments)
    return task.output
