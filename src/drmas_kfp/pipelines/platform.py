"""Where each stage's pod runs on Kubernetes: resources, nodes, tolerations, credentials.

``place(task, placement)`` decorates a task through kfp-kubernetes; the pipelines apply it
to every task they create (importers aside: they start no pod). The S3 credentials reach
each step as environment variables from the Kubernetes secret ``drmas-s3`` (the one in
``manifests/base/secrets.yaml``), never as pipeline parameters.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import kfp.dsl.pipeline_task
from kfp import kubernetes
from kfp.dsl import PipelineTask

__all__ = ["CPU_NODES", "GPU_NODES", "Placement", "S3_SECRET", "S3_SECRET_KEYS", "placement_for", "place"]

S3_SECRET = "drmas-s3"
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
"""Keys of ``drmas-s3`` every step gets as environment variables of the same name."""
S3_OPTIONAL_KEYS = ("AWS_ENDPOINT_URL",)
"""Keys a step gets when the secret has them (the endpoint of an in-cluster S3 server)."""


@dataclass(frozen=True)
class Placement:
    """A pod's resources and the nodes it may run on."""

    cpu: str
    memory: str
    cpu_limit: str
    memory_limit: str
    accelerator_type: str | None = None
    accelerator_count: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, str], ...] = ()


CPU_NODES = Placement(
    cpu="1",
    memory="4Gi",
    cpu_limit="4",
    memory_limit="16Gi",
    # The images are built for linux/amd64; GPU nodes carry the nvidia.com/gpu taint, which
    # CPU steps do not tolerate, so they stay off them.
    node_selector={"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
)
GPU_NODES = Placement(
    cpu="8",
    memory="64Gi",
    cpu_limit="16",
    memory_limit="96Gi",
    accelerator_type="nvidia.com/gpu",
    accelerator_count=1,
    node_selector={"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", "nvidia.com/gpu.present": "true"},
    tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
)

GPU_STAGES = ("warmstart", "rollout", "update", "evaluate")
"""Stages whose component runs on the GPU image (components.images)."""


def placement_for(stage: str, config) -> Placement:
    """The placement of ``stage`` for this config.

    The warm start trains a model in the step's own process: GPU nodes, one GPU. Rollout,
    update and evaluate drive the run's pool: with ``ray.address`` (a KubeRay cluster) the
    generation and the data-parallel update run on the pool's workers on the cluster's
    GPUs and the step is only a Ray driver, so it runs on CPU nodes (still on the GPU
    image, which matches the cluster's Python and Ray): no GPU is requested outside the
    pool. Without it the step starts Ray in its own pod and needs the pool's
    ``ray.pool_size`` GPUs itself. Everything else runs on CPU nodes.
    """
    if stage in ("rollout", "update", "evaluate"):
        if config.ray.address:
            return CPU_NODES
        return Placement(**{**GPU_NODES.__dict__, "accelerator_count": config.ray.pool_size})
    if stage in GPU_STAGES:
        return GPU_NODES
    return CPU_NODES


class _CallerNameOnly:
    """``inspect`` for ``kfp.dsl.pipeline_task``, whose every resource setter (kfp 2.17)
    names its caller for an error message with ``inspect.stack()[1][3]``: that reads the
    source of every frame on the stack and scans ``sys.modules`` for each, 0.1-0.5 s per
    call in a process that imported torch (a 10-iteration pipeline has ~50 tasks, 4 setters
    each). Here ``stack()`` gives the caller's name alone; all else is ``inspect``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[Any]:
        # Frame 0 is this function, 1 kfp's check, 2 the setter it names.
        return [None, (None, None, None, sys._getframe(2).f_code.co_name)]


kfp.dsl.pipeline_task.inspect = _CallerNameOnly()  # type: ignore[assignment]


def place(task: PipelineTask, placement: Placement, secret: str = S3_SECRET) -> PipelineTask:
    """Requests, limits, accelerator, node selector, tolerations and the S3 secret as env."""
    task.set_cpu_request(placement.cpu).set_cpu_limit(placement.cpu_limit)
    task.set_memory_request(placement.memory).set_memory_limit(placement.memory_limit)
    if placement.accelerator_type and placement.accelerator_count:
        task.set_accelerator_type(placement.accelerator_type).set_accelerator_limit(placement.accelerator_count)
    for key, value in placement.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for toleration in placement.tolerations:
        kubernetes.add_toleration(task, **toleration)
    kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env={key: key for key in S3_SECRET_KEYS})
    kubernetes.use_secret_as_env(
        task, secret_name=secret, secret_key_to_env={key: key for key in S3_OPTIONAL_KEYS}, optional=True
    )
    return task
