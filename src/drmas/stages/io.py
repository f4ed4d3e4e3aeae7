"""The glue every Kubeflow component runs around its stage: open the config and store,
check the input pointers, reuse or compute the output under drmas' cache key, and publish
the output pointer and the metrics.

Why a library module: a lightweight KFP component ships only its function's source, so
whatever the components share has to come from the installed drmas, not from a helper
beside them in ``components/``. Keeping it here means the pointer format (the metadata
documented in ``components/__init__.py``) and the cache rule are written once, and the
components stay thin.

Why no kfp: the library never imports kfp (docs/architecture.md §3). The functions take the artifact
objects duck-typed: anything with ``.metadata`` (a dict), ``.path`` (a local file the
executor uploads) and ``.uri``; a metrics artifact also has ``log_metric(name, value)``.
That is what KFP's ``dsl.Artifact``/``dsl.Metrics`` are, and what the tests fake.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from drmas.config import DrmasConfig
from drmas.infra.layout import METRICS_FILE, split_iteration_path
from drmas.infra.lease import stage_lease
from drmas.infra.store import Store, StoreError
from drmas.stages.contracts import StageContract, reuses

__all__ = [
    "InputNotStored",
    "announce",
    "check_inputs",
    "expect_input",
    "open_stage",
    "policy_set",
    "publish",
    "publish_metrics",
    "reuse_or_compute",
]


class ArtifactLike(Protocol):
    """What the components get from KFP for an input or output artifact."""

    metadata: dict[str, Any]
    path: str
    uri: str


class MetricsLike(Protocol):
    """What the components get from KFP for a ``Metrics`` output."""

    path: str

    def log_metric(self, metric: str, value: float) -> None: ...


def open_stage(config_json: str) -> tuple[DrmasConfig, Store]:
    """The resolved config (the component's explicit ``config_json`` parameter) and the
    store it names; S3 credentials come from the environment, never from a parameter."""
    config = DrmasConfig.from_json(config_json)
    return config, Store.from_config(config.store)


def expect_input(artifact: ArtifactLike, expected_path: str, store: Store, what: str) -> None:
    """Refuse an input pointer that does not name ``expected_path`` in the store.

    A stage reads its input from where the store layout says, not from the artifact (the
    artifact is only a pointer), so wiring the wrong task into it would silently read
    something else: this makes the mismatch an error that names both sides.
    ``what`` starts the message, e.g. "the advantage of iteration 3".
    """
    if artifact.metadata.get("artifact") != expected_path:
        given = artifact.metadata.get("store_uri") or artifact.uri
        raise ValueError(f"{what} reads {store.uri(expected_path)}, but was given {given}")


class InputNotStored(StoreError):
    """An input pointer names a store artifact that is gone, or that was rewritten since
    the task that wrote it ran."""


def check_inputs(store: Store, run_id: str, what: str, *inputs: ArtifactLike) -> None:
    """Refuse inputs whose store artifacts are not what the tasks that wrote them left.

    KFP reuses a task from its cache by its inputs alone, never asking the store: after the
    store is cleared (or a new bucket takes the run id) a cached task's output pointer names
    an artifact that is gone, and a rewritten artifact is not the content the pointer
    recorded (``fingerprint``, ``fingerprints``). Either is refused here, naming the artifact
    and the command that recomputes it, before the stage reads anything. ``what`` starts the
    message, e.g. "the advantage of iteration 3"."""
    for pointer in inputs:
        meta = pointer.metadata
        if meta.get("policies"):
            # A policy set: consumers read its policies, whose own fingerprints it records;
            # the set's path may be no artifact (the warm start's is the run's folder).
            paths = [ref["artifact"] for ref in meta["policies"].values()]
            recorded = dict(meta.get("fingerprints") or {})
        else:
            paths = [meta["artifact"]] if "artifact" in meta else []
            recorded = {meta.get("artifact"): meta.get("fingerprint")}
        for path in paths:
            again = f"drmas submit CONFIG --run-id {run_id or 'RUN_ID'} --force {_force_of(path)}"
            if not store.exists(path):
                raise InputNotStored(
                    f"{what}: its input {store.uri(path)} is not in the store, though the task that wrote it is "
                    f"done (KFP reused it from its cache: the store was cleared, or this is another bucket); "
                    f"recompute it with: {again}"
                )
            expected = recorded.get(path)
            if expected and store.fingerprint(path, ignore=(METRICS_FILE,)) != expected:
                raise InputNotStored(
                    f"{what}: its input {store.uri(path)} was rewritten since the task that wrote it ran (its "
                    f"files are not the ones KFP recorded); recompute from there with: {again}"
                )


def _force_of(path: str) -> str:
    """The ``--force`` of the stage that writes ``path``: ``update/WG@I`` for an iteration's
    policy, ``STAGE@I`` for its other outputs, ``warmstart`` for the run's starting policies."""
    found = split_iteration_path(path)
    if found is None:
        return "warmstart"
    _, iteration, rest = found
    kind, _, wg = rest.partition("/")
    return f"update/{wg}@{iteration}" if kind in ("policy", "optim") else f"{kind}@{iteration}"


def announce(label: str, reused: bool, uri: str) -> None:
    """One line per stage, ``drmas: LABEL reused|computed URI``: the logs (and the tests)
    tell from it whether a task that KFP executed did any work."""
    print(f"drmas: {label} {'reused' if reused else 'computed'} {uri}", flush=True)


def reuse_or_compute(
    config: DrmasConfig,
    store: Store,
    contract: StageContract,
    key: str,
    force: bool,
    compute: Callable[[], object],
    *,
    label: str | None = None,
) -> bool:
    """Call ``compute`` (which writes the contract's output with ``key``) unless the stage
    may be skipped (``drmas.stages.contracts.reuses``: the store holds that output with the
    same cache key, and the contract allows it); ``force`` recomputes regardless.

    This is drmas' own cache, under KFP's: a task that KFP re-executes (its input is a new
    artifact) does no work when its inputs' content did not change, and KFP runs,
    ``drmas run`` and ``drmas rerun`` share outputs. Returns whether the output was reused;
    with a ``label``, also says so (``announce``).

    The check and the work run holding the lease of the output (``drmas.infra.lease.stage_lease``):
    a retry of this task while an earlier attempt still writes waits for it (and then reuses
    its output), takes over from one that died, and is refused (RunBusy) when it waited for
    twice ``store.lease_timeout_s`` in vain; parallel tasks writing other outputs of the run
    do not wait for each other.
    """
    path = contract.output(config)
    with stage_lease(store, path):
        reused = not force and reuses(config, store, contract, key)
        if not reused:
            compute()
    if label is not None:
        announce(label, reused, store.uri(contract.stored_output(config, store)))
    return reused


def policy_set(
    store: Store,
    home: str,
    policies: Mapping[str, tuple[str, str]],
    optims: Mapping[str, str | None],
) -> dict[str, Any]:
    """The extra metadata of a policy-set pointer (warm start, checkpoint, load_checkpoint).

    ``policies`` maps each worker group to its policy ``(artifact, prefix)``, ``optims`` to
    its optimizer state's artifact (None: a fresh optimizer). Consumers (rollout, update,
    evaluate) build their ``PolicyRef`` from these entries, and evaluations go to ``home``;
    ``policy_uris`` is for people browsing the run.
    """
    return {
        "home": home,
        "policies": {wg: {"artifact": artifact, "prefix": prefix} for wg, (artifact, prefix) in policies.items()},
        "optims": {wg: {"artifact": optim, "prefix": ""} if optim else None for wg, optim in optims.items()},
        "policy_uris": {wg: store.uri(artifact) for wg, (artifact, _) in policies.items()},
        "fingerprints": {
            artifact: store.fingerprint(artifact, ignore=(METRICS_FILE,)) for artifact, _ in policies.values()
        },
    }


def publish(
    store: Store,
    path: str,
    artifact: ArtifactLike,
    iteration: int,
    *,
    fingerprint: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Point the output ``artifact`` at the stage output ``path`` in the store.

    Its metadata gets ``store_uri``, ``artifact`` (``path``), ``fingerprint`` (of the
    output's files, metrics aside; pass one for an output that is not a single artifact)
    and ``iteration``, then ``extra``; the same JSON goes to ``artifact.path``, because KFP
    uploads that file as the artifact and a consumer outside KFP's metadata sees only it.
    Returns the metadata.
    """
    artifact.metadata.update(
        {
            "store_uri": store.uri(path),
            "artifact": path,
            "fingerprint": fingerprint if fingerprint is not None else store.fingerprint(path, ignore=(METRICS_FILE,)),
            "iteration": iteration,
            **extra,
        }
    )
    with open(artifact.path, "w") as handle:
        json.dump(artifact.metadata, handle, indent=2)
    return artifact.metadata


def publish_metrics(values: Mapping[str, float], metrics: MetricsLike) -> None:
    """Log ``values`` to the ``Metrics`` output and write them to ``metrics.path``.

    KFP metadata cannot hold NaN or infinity (e.g. a statistic of a one-row group), so only
    finite values are logged; the file keeps every value (the others as strings, which JSON
    can hold). The file matters on its own: without it kfp.local never caches the task.
    """
    for name, value in values.items():
        if math.isfinite(value):
            metrics.log_metric(name, float(value))
    with open(metrics.path, "w") as handle:
        json.dump(
            {name: value if math.isfinite(value) else str(value) for name, value in values.items()}, handle, indent=2
        )
