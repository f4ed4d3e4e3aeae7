"""Where each stage's pod runs on Kubernetes: resources, nodes, tolerations, credentials.

``place(task, placement)`` decorates a task through kfp-kubernetes; the pipelines apply it
to every task they create (importers aside: they start no pod). The S3 credentials reach
each step as environment variables from the Kubernetes secret ``drmas-s3`` (in the
pipeline namespace, created by the operator), never as pipeline parameters.
The steps that drive the run's pool on a Ray cluster (rollout, update, evaluate with
``ray.address``) also get ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` from the secret
``drmas-ray-token`` (key ``auth_token``); the RayCluster refuses clients without it. The
tracking steps get MLflow's client credentials (``MLFLOW_TRACKING_USERNAME``/``PASSWORD``)
from the secret ``drmas-mlflow-auth``: the manifests' MLflow runs its basic-auth app. The
operator creates these secrets (``manifests/README.md``, "Secrets"); no step starts while
one it names is missing. Every step's pod carries the label ``POD_LABEL``
(``drmas.io/pipeline-step: "true"``), which the NetworkPolicies of ``manifests/`` admit to
Ray, MLflow and the retrieval service; KFP's own label, which every v2 pipeline's pods
carry, admits nothing (KFP applies pod labels since 2.1, kubeflow/pipelines#10393).

Versions. The spec is compiled by kfp 2.17.3 with kfp-kubernetes 2.17.3 (both pinned).
KFP's backend reads the Kubernetes part of it with its own copy of kfp-kubernetes'
protobuf, so an older backend does not know the newer fields (read in KFP's source,
``backend/src/v2/cmd/driver/main.go``, ``backend/src/common/util/json.go``,
``backend/src/apiserver/template/v2_template.go``, ``kubernetes_platform/proto/
kubernetes_executor_config.proto``, at each release tag):

- ``SecretAsEnv.optional`` arrived in KFP 2.15.0: the compiled spec as it is runs on
  **KFP 2.15 or later**. KFP 2.4.1-2.14 skip the unknown field (their driver allows
  unknown fields), so the endpoint key becomes required there; 2.2.0-2.4.0 refuse the
  whole task ("failed to unmarshal Kubernetes config").
- ``SecretAsEnv.secret_name_parameter`` arrived in 2.5.0 (older drivers read the
  deprecated ``secret_name``, which kfp-kubernetes writes too); ``for_backend`` treats
  ``ImagePullSecret.secret_name_parameter`` (``kubeflow.image_pull_secrets``) the same way.
- The ``resource*`` fields of a container's resources (``resourceCpuRequest``, ...)
  arrived in KFP's pipeline-spec API with 2.4.0; the API server of 2.2/2.3 refuses an
  unknown field when a run is created (kfp writes the older ``cpuRequest``, ... too).
- The scratch volume of the update pods (an ``emptyDir``) needs 2.3.0.

``for_backend(path, "2.3")`` rewrites a compiled spec for such a backend: it drops those
fields (``drmas compile|submit --kfp-backend 2.3``), so the spec runs on **KFP 2.3 or
later** (Argo 3.4, which the pipeline Role's ``workflowtaskresults`` grant is for). The
optional secret key ``AWS_ENDPOINT_URL`` then becomes a required one: the pipeline
namespace's ``drmas-s3`` must hold it (for AWS: ``https://s3.<region>.amazonaws.com``).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import kfp.dsl.pipeline_task
from kfp import kubernetes
from kfp.dsl import PipelineTask

__all__ = [
    "BACKENDS",
    "CPU_NODES",
    "DEFAULT_BACKEND",
    "GPU_NODES",
    "GPU_TAINT",
    "MLFLOW_AUTH_KEYS",
    "MLFLOW_AUTH_SECRET",
    "POD_LABEL",
    "RAY_TOKEN_KEY",
    "RAY_TOKEN_SECRET",
    "SCRATCH",
    "Placement",
    "S3_SECRET",
    "S3_SECRET_KEYS",
    "cheap_setter_checks",
    "check_backend",
    "for_backend",
    "image_flavor",
    "placement_for",
    "place",
    "update_scratch_size",
    "warmstart_memory",
]

S3_SECRET = "drmas-s3"
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
"""Keys of ``drmas-s3`` every step gets as environment variables of the same name."""
S3_OPTIONAL_KEYS = ("AWS_ENDPOINT_URL",)
"""Keys a step gets when the secret has them (the endpoint of an in-cluster S3 server)."""
RAY_TOKEN_SECRET = "drmas-ray-token"
RAY_TOKEN_KEY = "auth_token"
"""The Secret and key of the Ray cluster's token (``manifests/README.md``, "Secrets")."""
MLFLOW_AUTH_SECRET = "drmas-mlflow-auth"
MLFLOW_AUTH_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
"""The Secret and keys of MLflow's client credentials (the tracking steps get them as
environment variables of the same name, which MLflow's client reads)."""
TRACKING_STAGES = ("track_start", "track", "track_end")
"""The steps that log to MLflow."""
POD_LABEL = ("drmas.io/pipeline-step", "true")
"""The label of every drmas step's pod: what the NetworkPolicies admit (``manifests/``)."""
SCRATCH = "/tmp"
"""Where the update pods' scratch volume is mounted: the default temporary folder of Python
(``tempfile``) and of Ray (its session folder, object spilling), so no environment
variable has to point there (kfp.local would apply one to the local process too)."""


@dataclass(frozen=True)
class Retry:
    """KFP's retry policy of a step (``PipelineTask.set_retry``; the Argo backend honours
    it from KFP 2.5, kubeflow/pipelines#11673): a failed attempt runs again after a back-off
    that grows by ``factor``, within ``max_duration`` (KFP's own cap is an hour)."""

    count: int
    first_backoff: str
    factor: float
    max_duration: str


POOL_RETRY = Retry(count=3, first_backoff="90s", factor=2.0, max_duration="3600s")
"""The pool's steps, which wait for GPUs (``PoolNotReady`` past ``ray.placement_timeout_s``)
and lose pods with nodes: three more attempts, after 1.5, 3 and 6 minutes. The first
back-off outlasts a killed attempt's leases (run and pool: 60 s after its last heartbeat),
so the retry is not refused as a second writer; a retried stage recomputes from the store,
its output written manifest last, so it gives what a first attempt would."""


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
    ray_token: bool = False
    """Joins the run's Ray cluster: gets the cluster's token (``RAY_AUTH_MODE=token``)."""
    mlflow_auth: bool = False
    """Logs to MLflow: gets its client credentials (``MLFLOW_AUTH_SECRET``)."""
    scratch: str | None = None
    """Size limit of an ``emptyDir`` scratch volume at ``SCRATCH`` (``/tmp``), or none."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets the pod pulls its image with (``kubeflow.image_pull_secrets``)."""
    retry: Retry | None = None
    """Attempts after a failure (``POOL_RETRY`` for the pool's steps), or none."""


CPU_NODES = Placement(
    cpu="1",
    memory="4Gi",
    cpu_limit="4",
    memory_limit="16Gi",
    # The images are built for linux/amd64; GPU nodes carry the nvidia.com/gpu taint, which
    # CPU steps do not tolerate, so they stay off them.
    node_selector={"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
)
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
"""The taint GPU node pools carry (GKE and AKS add it to GPU nodes, EKS and operators by
convention), which only steps that ask for a GPU tolerate."""
GPU_NODES = Placement(
    cpu="8",
    memory="64Gi",
    cpu_limit="16",
    memory_limit="96Gi",
    # The GPU itself places the pod: the scheduler puts a request for the nvidia.com/gpu
    # resource only on nodes whose device plugin advertises it. No label is required
    # (nvidia.com/gpu.present is written by the GPU Operator alone, which many clusters do
    # not run); kubeflow.gpu_node_selector adds labels where a cluster has several GPU kinds.
    accelerator_type="nvidia.com/gpu",
    accelerator_count=1,
    node_selector={"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"},
    tolerations=(GPU_TAINT,),
)

POOL_STAGES = ("rollout", "update", "evaluate")
"""The stages that drive the run's pool (``ray``)."""


def placement_for(stage: str, config) -> Placement:
    """The placement of ``stage`` for this config.

    The warm start with ``warmstart.steps`` > 0 trains a model in the step's own process
    (it never joins the Ray cluster): GPU nodes, one GPU. With 0 steps it only fetches
    each worker group's initial weights and saves them to the store: CPU nodes, with the
    memory ``warmstart_memory`` sizes. Rollout, update and evaluate drive the run's pool:
    with ``ray.address`` (a KubeRay cluster) the generation and the data-parallel update
    run on the pool's workers on the cluster's GPUs and the step is only a Ray client, so
    it runs on CPU nodes with the cluster's token: no GPU is requested outside the pool.
    Without it the step starts Ray in its own pod and needs the pool's ``ray.pool_size``
    GPUs itself. Everything else runs on CPU nodes. Update pods get a scratch volume sized
    by ``update_scratch_size``. A step that asks for GPUs also requires the nodes labelled
    ``kubeflow.gpu_node_selector``; every step pulls with ``kubeflow.image_pull_secrets``.
    """
    gpu_nodes = replace(GPU_NODES, node_selector={**GPU_NODES.node_selector, **config.kubeflow.gpu_node_selector})
    if stage in POOL_STAGES:
        scratch = update_scratch_size(config) if stage == "update" else None
        if config.ray.address:
            placement = replace(CPU_NODES, ray_token=True, scratch=scratch, retry=POOL_RETRY)
        else:
            placement = replace(gpu_nodes, accelerator_count=config.ray.pool_size, scratch=scratch, retry=POOL_RETRY)
    elif stage == "warmstart":
        placement = gpu_nodes if config.warmstart.steps else replace(CPU_NODES, **warmstart_memory(config))
    elif stage in TRACKING_STAGES:
        placement = replace(CPU_NODES, mlflow_auth=True)
    else:
        placement = CPU_NODES
    return replace(placement, image_pull_secrets=tuple(config.kubeflow.image_pull_secrets))


def image_flavor(placement: Placement) -> str:
    """The image a step runs: the GPU image (CUDA, SGLang) where its pod asks for GPUs,
    else the CPU image, which has the same Python, Ray and drmas (images/): a Ray client of
    the pool runs there, and CPU nodes never pull the 15-20 GB GPU image."""
    return "gpu" if placement.accelerator_type and placement.accelerator_count else "cpu"


WARMSTART_MEMORY_GIB_UNKNOWN_MODEL = 32
"""The memory limit of a warm start without steps for a model ``drmas plan`` cannot size."""


def warmstart_memory(config) -> dict[str, str]:
    """``memory`` and ``memory_limit`` of a warm start with no steps, which loads each
    worker group's model on the CPU and saves it (one group at a time): the largest group's
    weights twice (the model, and a shard's bytes while safetensors writes it), plus 4 GiB
    for the process; at least ``CPU_NODES``' limit. The request is the limit: the step
    needs all of it at its peak."""
    from drmas.planning import PlanError, architecture_of  # noqa: PLC0415

    largest = 0
    for group in config.worker_groups():
        try:
            architecture, _ = architecture_of(group.model, group.spec)
        except PlanError:
            largest = WARMSTART_MEMORY_GIB_UNKNOWN_MODEL << 30
            break
        dtype_bytes = 2 if group.spec is not None and group.spec.dtype == "bfloat16" else 4
        largest = max(largest, 2 * architecture.params * dtype_bytes + (4 << 30))
    gib = max(-(-largest // (1 << 30)), int(CPU_NODES.memory_limit.removesuffix("Gi")))
    return {"memory": f"{gib}Gi", "memory_limit": f"{gib}Gi"}


DRIVER_SCRATCH_GIB = 2
"""An update pod that only drives the pool on a Ray cluster writes Ray client logs and the
stage's small pointer files: 2 GiB."""
SCRATCH_GIB_UNKNOWN_MODEL = 64
"""The scratch of an update pod that trains in the pod, for a model ``drmas plan`` cannot
size (a 4B-parameter model in bf16 writes about 60 GiB, see ``update_scratch_size``)."""


def update_scratch_size(config) -> str:
    """The scratch an update pod writes, as a Kubernetes quantity (``"NGi"``).

    With ``ray.address`` the update runs on the pool's workers in the Ray cluster and the
    pod is a client: ``DRIVER_SCRATCH_GIB``. Otherwise the pool runs in the pod, and one
    worker group's update writes to its temporary folder (``drmas.stages.update``): the
    policy it starts from, downloaded (Ψ parameters x dtype bytes), the new policy saved
    before upload (the same), and, when the iteration stores it, the optimizer state
    saved before upload (12 bytes per parameter under DeepSpeed's bf16 mixed precision:
    fp32 master weights and two Adam moments; 2 x dtype bytes otherwise, as
    ``drmas.planning`` counts it); Ray's session folder and object spilling go there too
    (all in ``/tmp``). The largest worker group's sum, plus a quarter and 2 GiB, rounded up
    to GiB; ``SCRATCH_GIB_UNKNOWN_MODEL`` for a model whose size the plan cannot read.
    Not in it: the pool workers' policy cache (``~/.cache/drmas/policies``, the
    container's writable layer). KFP sets no ephemeral-storage request (it has none), so
    the scheduler does not reserve this: a LimitRange of the pipeline namespace can.
    """
    if config.ray.address:
        return f"{DRIVER_SCRATCH_GIB}Gi"
    from drmas.planning import PlanError, architecture_of  # noqa: PLC0415

    largest = 0
    for group in config.worker_groups():
        try:
            architecture, _ = architecture_of(group.model, group.spec)
        except PlanError:
            return f"{SCRATCH_GIB_UNKNOWN_MODEL}Gi"
        dtype_bytes = 2 if group.spec is not None and group.spec.dtype == "bfloat16" else 4
        mixed = config.train.backend == "deepspeed" and dtype_bytes == 2
        optimizer = 12 if mixed else 2 * dtype_bytes
        largest = max(largest, architecture.params * (2 * dtype_bytes + optimizer))
    gib = -(-(largest * 5 // 4 + (2 << 30)) // (1 << 30))
    return f"{gib}Gi"


class _CallerNameOnly:
    """``inspect`` for ``kfp.dsl.pipeline_task``, whose container setters (kfp 2.17: the
    image, resources, accelerator, environment) name their caller for an error message
    with ``inspect.stack()[1][3]``: that reads the source of every frame on the stack and
    scans ``sys.modules`` for each, 0.1-0.5 s per call in a process that imported torch (a
    10-iteration pipeline has ~50 tasks, five or more such setters each). Here ``stack()`` gives the
    caller's name alone; all else is ``inspect``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[Any]:
        # Frame 0 is this function, 1 kfp's check, 2 the setter it names.
        return [None, (None, None, None, sys._getframe(2).f_code.co_name)]


@contextmanager
def cheap_setter_checks() -> Iterator[None]:
    """Within it, kfp's container setters name themselves in their errors without walking
    the stack (``_CallerNameOnly``); outside it kfp is as installed, so the patch reaches
    no one else's use of kfp in the process. The pipelines set every task's container
    inside it."""
    module = kfp.dsl.pipeline_task
    previous = module.inspect
    module.inspect = _CallerNameOnly()  # type: ignore[assignment]
    try:
        yield
    finally:
        module.inspect = previous


def place(task: PipelineTask, placement: Placement, secret: str = S3_SECRET) -> PipelineTask:
    """Requests, limits, accelerator, node selector, tolerations, image pull secrets, retries, the S3 secret as env, the
    Ray token where the step joins the cluster, MLflow's credentials where it logs, the
    scratch volume where it has one, and the pod label the NetworkPolicies admit."""
    kubernetes.add_pod_label(task, label_key=POD_LABEL[0], label_value=POD_LABEL[1])
    task.set_cpu_request(placement.cpu).set_cpu_limit(placement.cpu_limit)
    task.set_memory_request(placement.memory).set_memory_limit(placement.memory_limit)
    if placement.accelerator_type and placement.accelerator_count:
        task.set_accelerator_type(placement.accelerator_type).set_accelerator_limit(placement.accelerator_count)
    for key, value in placement.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for toleration in placement.tolerations:
        kubernetes.add_toleration(task, **toleration)
    if placement.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(placement.image_pull_secrets))
    if placement.retry is not None:
        retry = placement.retry
        task.set_retry(retry.count, retry.first_backoff, retry.factor, retry.max_duration)
    kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env={key: key for key in S3_SECRET_KEYS})
    kubernetes.use_secret_as_env(
        task, secret_name=secret, secret_key_to_env={key: key for key in S3_OPTIONAL_KEYS}, optional=True
    )
    if placement.ray_token:  # (kfp.local applies RAY_AUTH_MODE to the local process too)
        task.set_env_variable("RAY_AUTH_MODE", "token")
        kubernetes.use_secret_as_env(
            task, secret_name=RAY_TOKEN_SECRET, secret_key_to_env={RAY_TOKEN_KEY: "RAY_AUTH_TOKEN"}
        )
    if placement.mlflow_auth:
        kubernetes.use_secret_as_env(
            task, secret_name=MLFLOW_AUTH_SECRET, secret_key_to_env={key: key for key in MLFLOW_AUTH_KEYS}
        )
    if placement.scratch:
        # KFP has no ephemeral-storage request (kfp.dsl.structures.ResourceSpec: cpu,
        # memory, accelerator; kfp-kubernetes: volumes, no container resources): an emptyDir
        # with a size limit at /tmp bounds what the pod writes there (the kubelet evicts
        # the pod beyond it).
        kubernetes.empty_dir_mount(task, volume_name="scratch", mount_path=SCRATCH, size_limit=placement.scratch)
    return task


BACKENDS = ("2.3", "2.5", "2.15")
"""The KFP backends ``for_backend`` writes a spec for: each the oldest release that reads
the fields it keeps (see the module's docstring)."""
DEFAULT_BACKEND = "2.15"
_RESOURCE_FIELDS = (
    "resourceCpuRequest",
    "resourceCpuLimit",
    "resourceMemoryRequest",
    "resourceMemoryLimit",
    "resourceType",
    "resourceCount",
)


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.removeprefix("v").split("."))
    except ValueError:
        raise ValueError(f"KFP backend {text!r} is not a version such as 2.15") from None


def check_backend(backend: str) -> tuple[int, ...]:
    """The version ``backend`` names, if the pipelines run on it; ValueError otherwise."""
    version = _version(backend)
    if version < (2, 3):
        raise ValueError(
            f"KFP {backend} is not supported: the pipelines need KFP 2.3 or later (Argo 3.4; the update pods' "
            "emptyDir scratch volume)"
        )
    return version


def for_backend(path, backend: str = DEFAULT_BACKEND) -> list[str]:
    """Rewrite the compiled pipeline at ``path`` so that KFP ``backend`` (a version, at
    least 2.3) runs it: below 2.15 no ``optional`` in a secret's environment variables
    (the optional keys become required), below 2.5 no ``secretNameParameter`` (the
    constant ``secretName`` stays), below 2.4 no ``resource*`` container resources (the
    older fields stay). Returns what it changed, one line each (nothing for 2.15+)."""
    from pathlib import Path  # noqa: PLC0415

    import yaml  # noqa: PLC0415

    version = check_backend(backend)
    if version >= (2, 15):
        return []
    path = Path(path)
    spec, platform = yaml.safe_load_all(path.read_text())
    changes: list[str] = []
    optional = set()
    for executor in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        for item in executor.get("secretAsEnv", []):
            if item.pop("optional", False):
                optional.update(f"{item['secretName']}/{key['secretKey']}" for key in item["keyToEnv"])
            if version < (2, 5) and item.pop("secretNameParameter", None) is not None and not item.get("secretName"):
                raise ValueError("a secret named by a pipeline parameter needs KFP 2.5 or later")
        for item in executor.get("imagePullSecret", []) if version < (2, 5) else ():
            if item.pop("secretNameParameter", None) is not None and not item.get("secretName"):
                raise ValueError("an image pull secret named by a pipeline parameter needs KFP 2.5 or later")
    if optional:
        changes.append(f"secret keys required (KFP {backend} has no optional ones): {', '.join(sorted(optional))}")
    if version < (2, 5):
        changes.append("secrets named by secretName only")
    if version < (2, 4):
        for executor in spec["deploymentSpec"]["executors"].values():
            resources = executor.get("container", {}).get("resources", {})
            for key in _RESOURCE_FIELDS:
                resources.pop(key, None)
            for key in _RESOURCE_FIELDS:
                resources.get("accelerator", {}).pop(key, None)
        changes.append("container resources in the pre-2.4 fields only")
    path.write_text(yaml.safe_dump_all([spec, platform], sort_keys=True))
    return changes
