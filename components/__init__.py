"""Kubeflow components: one thin shim per stage over the installed drmas library.

    warmstart        -> policies (Model: the policy set iteration 0 starts from), metrics
    rollout          policies -> trajectories (Dataset), metrics
    advantage        trajectories -> batch (Dataset), metrics
    update (per wg)  batch, policies, reference -> policy (Model), metrics
    checkpoint       update_0..update_7 -> checkpoint (Model: the next policy set), metrics
    evaluate         policies -> results (Dataset), metrics
    load_checkpoint  checkpoint (imported by URI) -> policies (Model)
    track_start      -> mlflow (Markdown)        the run's MLflow run opened, and linked
    track            checkpoint, evaluation ->   one iteration logged to MLflow
    track_end        checkpoint -> mlflow (Markdown)  report, registered policies, figures

Each is a lightweight component on the drmas image of this version (``images.py``) with
``install_kfp_package=False``: its module imports only the standard library and kfp, and
its body imports drmas (absolute imports, since KFP ships the function's source alone).
The resolved config is the explicit JSON parameter ``config_json``; S3 credentials come
from the environment (the ``drmas-s3`` secret on a cluster), never from a parameter.

The artifacts are pointers into the drmas store. A stage writes its output where the
store layout says (``drmas.infra.layout``); the KFP artifact keeps the URI that KFP gave it (in
the pipeline root) and holds a small JSON file, and its metadata names the store output:

    store_uri    full address of the stage output, e.g. s3://drmas/runs/exp/run/iter-000003/advantage
    artifact     the same path relative to the store root (what the library reads)
    fingerprint  hash of the output's files (metrics.json aside), from its manifest
    iteration    the iteration (-1: the starting policies)
  policy sets (warmstart, checkpoint, load_checkpoint) also:
    policies     {wg: {artifact, prefix}}, optims {wg: {artifact, prefix} | null}
    home         the folder their evaluations go to (init/ or iter-{i}/)

Consumers read the store through this metadata. (Setting ``.uri`` to the store URI is
honoured by kfp.local and recorded by the KFP backend, but the backend's launcher then
uploads the local file to that URI with the pipeline root's bucket settings and downloads
every input artifact's URI before a step starts: a store outside the pipeline root's
bucket would fail, and inside it whole checkpoints would be copied into every pod.)

Every stage also keeps drmas' own content-addressed cache: its output is reused when the
store holds it with the same cache key (stage, input content, the config it reads, drmas
version: the stage's contract in ``drmas.stages.contracts``, which ``drmas run`` uses too), so a
task that KFP re-executes does no work unless its inputs changed, and KFP runs,
``drmas run`` and ``drmas rerun`` share outputs in one store. ``force=True`` recomputes
regardless (the pipelines set it with ``--force``).

What every body does around its stage (open the config and store, check the input
pointers, reuse or compute under the cache key, publish the pointer and the metrics) is
written once in ``drmas.stages.io``, in the library, since a body ships without this package.
"""

from drmas_kfp.components.advantage import advantage
from drmas_kfp.components.checkpoint import MAX_WORKER_GROUPS, checkpoint
from drmas_kfp.components.evaluate import evaluate
from drmas_kfp.components.images import CPU_IMAGE, GPU_IMAGE, IMAGES
from drmas_kfp.components.load_checkpoint import load_checkpoint
from drmas_kfp.components.rollout import rollout
from drmas_kfp.components.track import track, track_end, track_start
from drmas_kfp.components.update import update
from drmas_kfp.components.warmstart import warmstart

__all__ = [
    "CPU_IMAGE",
    "GPU_IMAGE",
    "IMAGES",
    "MAX_WORKER_GROUPS",
    "advantage",
    "checkpoint",
    "evaluate",
    "load_checkpoint",
    "rollout",
    "track",
    "track_end",
    "track_start",
    "update",
    "warmstart",
]
