"""The checkpoint stage and resume.

    training_metrics(config, store, run_id, iteration) -> dict   what the checkpoint records
    checkpoint(config, store, run_id, iteration, metrics) -> StageResult
    resume_point(config, store, run_id) -> ResumePoint

The update stage writes each worker group's policy (HF layout) and optimizer state as
artifacts; the checkpoint stage checks that all of them are complete and intact, then
writes ``iter-{i}/checkpoint`` naming them (with the hashes of their manifests) and the
iteration's metrics. That artifact, written last, is what makes an iteration complete: a
run killed at any point resumes after the last iteration that has one, and since every
stage is deterministic given its inputs, the resumed run is the run that was never killed.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from drmas.config import DrmasConfig, PolicyError, WorkerGroup, weights_problem
from drmas.generation.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_POLICY, lora_base
from drmas.infra.layout import (
    METRICS_FILE,
    PolicyRef,
    StageResult,
    current_update,
    init_policy_path,
    optim_path,
    policy_path,
    run_path,
    split_iteration_path,
    stage_path,
    stored_versions,
    versioned,
)
from drmas.infra.store import MANIFEST, ArtifactNotFound, CorruptArtifact, Store
from drmas.stages.iteration import evaluation_outputs

log = logging.getLogger(__name__)

__all__ = ["ResumePoint", "check_policy", "checkpoint", "read_checkpoint", "resume_point", "training_metrics"]


@dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: the next iteration and the state it starts from."""

    next_iteration: int
    policies: dict[str, PolicyRef]
    optims: dict[str, PolicyRef | None]


def training_metrics(config: DrmasConfig, store: Store, run_id: str, iteration: int) -> dict[str, float]:
    """The iteration's metrics as its checkpoint records them, from its stored stage outputs:
    the rollout's, the advantage's and every worker group's update's, and ``time/iteration``,
    the sum of their stage times. The same in every way of running the iteration (the
    embedded runner, a Kubeflow task): the evaluation comes after the checkpoint and is not
    in it, nor are a pod's start-up and waits."""
    experiment = config.experiment.name
    sources = [stage_path(experiment, run_id, iteration, stage) for stage in ("rollout", "advantage")]
    sources += [current_update(store, experiment, run_id, iteration, g.name)[0] for g in config.worker_groups()]
    values: dict[str, float] = {}
    for source in sources:
        values |= store.open(source).read_json(METRICS_FILE)
    values["time/iteration"] = sum(
        value for name, value in values.items() if name.startswith("time/") or re.fullmatch(r"wg/[^/]+/time", name)
    )
    return values


def checkpoint(
    config: DrmasConfig,
    store: Store,
    run_id: str,
    iteration: int,
    metrics: dict[str, float],
    overwrite: bool = False,
    cache_key: str = "",
) -> StageResult:
    """Commit the iteration: every worker group's policy and optimizer state, verified. An
    iteration whose optimizer state is only held by the pool (``checkpoint.every``)
    records it with no manifest: a resume goes back to the last one stored."""
    experiment = config.experiment.name
    groups = {}
    for group in config.worker_groups():
        policy, optim = current_update(store, experiment, run_id, iteration, group.name)
        groups[group.name] = {
            "policy": policy,
            "policy_manifest": store.fingerprint(policy),
            "optim": optim,
            "optim_manifest": store.fingerprint(optim) if store.exists(optim) else None,
        }
    path = stage_path(experiment, run_id, iteration, "checkpoint")
    with store.writer(
        path, overwrite=overwrite, meta={"stage": "checkpoint", "iteration": iteration, "cache_key": cache_key}
    ) as out:
        out.write_json("checkpoint.json", {"iteration": iteration, "worker_groups": groups})
        out.write_json("metrics.json", metrics)
    prune_optimizer_states(config, store, run_id, iteration)
    prune_policies(config, store, run_id, iteration)
    return StageResult(path, metrics)


def prune_optimizer_states(config: DrmasConfig, store: Store, run_id: str, iteration: int) -> list[int]:
    """Delete the optimizer states of the iterations before ``iteration`` that
    ``checkpoint.every`` and ``checkpoint.keep`` do not keep (after ``iteration`` is
    checkpointed: the last ``keep`` every-N-th states, ``iteration``'s among them when it
    is one), never the latest stored one (where a resume starts); returns their
    iterations. Each goes manifest first, so a kill leaves no half-deleted state that
    a reader could take for a whole one."""
    every, keep = config.checkpoint.every, config.checkpoint.keep
    if every == 1 and keep is None:
        return []
    experiment = config.experiment.name
    stored = sorted(
        {
            found[1]
            for found in map(split_iteration_path, store.list(run_path(experiment, run_id)))
            if found is not None and found[2].startswith("optim/")
        }
    )
    older = [i for i in stored if i < iteration]
    milestones = [i for i in stored if i <= iteration and (i + 1) % every == 0]  # the latest counts if it is one
    kept = set(milestones[-keep:] if keep else milestones) | set(stored[-1:])  # the latest: where a resume starts
    doomed = [i for i in older if i not in kept]
    for i in doomed:
        for group in config.worker_groups():
            state = optim_path(experiment, run_id, i, group.name)
            for number in stored_versions(store, state):
                store.delete(versioned(state, number))
    return doomed


def prune_policies(config: DrmasConfig, store: Store, run_id: str, iteration: int) -> list[int]:
    """With ``checkpoint.prune_policies``, delete the policies of the iterations before the
    latest stored optimizer state (up to ``iteration``) whose optimizer state is not kept
    (after ``prune_optimizer_states``); returns their iterations. Nothing reads them again:
    a resume starts from the latest stored state, a rerun of one of their stages is refused
    for want of the optimizer state before it, and each later stage reads the policies
    from the latest stored state on. Manifest first, as for the optimizer states."""
    if not config.checkpoint.prune_policies:
        return []
    experiment = config.experiment.name
    found = [f for f in map(split_iteration_path, store.list(run_path(experiment, run_id))) if f is not None]
    states = {i for _, i, what in found if what.startswith("optim/") and i <= iteration}
    if not states:
        return []
    latest = max(states)
    policies = sorted({i for _, i, what in found if what.startswith("policy/")})
    doomed = [i for i in policies if i < latest and i not in states]
    for i in doomed:
        for group in config.worker_groups():
            policy = policy_path(experiment, run_id, i, group.name)
            for number in stored_versions(store, policy):
                store.delete(versioned(policy, number))
    return doomed


def resume_point(config: DrmasConfig, store: Store, run_id: str) -> ResumePoint:
    """The state after the last complete iteration whose optimizer states were stored, or
    the initial policies. The iterations after it (their optimizer states were held only by
    a pool, ``checkpoint.every``) run again: their rollouts are reused, their updates
    recomputed (bit-exact on CPU).

    A checkpoint whose policies or optimizer states changed or vanished since it was
    written is refused with the path and the reason (CorruptArtifact), never skipped; so
    is a policy that is not the worker group's model (PolicyError, see ``check_policy``).
    """
    experiment = config.experiment.name
    checkpointed = sorted(
        found[1]
        for found in map(split_iteration_path, store.list(run_path(experiment, run_id)))
        if found is not None and found[2] == "checkpoint"
    )
    # An iteration evaluates after its checkpoint: one killed in between is done up to its
    # evaluations, which the resumed run computes (its other stages are reused).
    done = list(
        itertools.takewhile(
            lambda i: all(store.exists(path) for path in evaluation_outputs(config, run_id, i)), checkpointed
        )
    )
    stored = next(
        (i for i in reversed(done) if _stores_optimizer_states(store, stage_path(experiment, run_id, i, "checkpoint"))),
        None,
    )
    if done and stored != done[-1]:
        log.info(
            "run %s: iterations %d-%d are checkpointed, but their optimizer states were held only by the pool "
            "(checkpoint.every %d): their updates run again, from %s",
            run_id,
            0 if stored is None else stored + 1,
            done[-1],
            config.checkpoint.every,
            "the start" if stored is None else f"iteration {stored}'s state",
        )
    if stored is not None:
        return read_checkpoint(config, store, stage_path(experiment, run_id, stored, "checkpoint"))
    groups = [group.name for group in config.worker_groups()]
    policies = {wg: PolicyRef(init_policy_path(experiment, run_id, wg)) for wg in groups}
    return ResumePoint(0, policies, {wg: None for wg in groups})


def _stores_optimizer_states(store: Store, checkpoint_path: str) -> bool:
    """Whether the checkpoint at ``checkpoint_path`` has every optimizer state stored."""
    record = store.open(checkpoint_path).read_json("checkpoint.json")
    return all(entry.get("optim_manifest") for entry in record["worker_groups"].values())


def read_checkpoint(config: DrmasConfig, store: Store, path: str) -> ResumePoint:
    """What the checkpoint artifact at ``path`` names, each part checked: every worker
    group's policy and stored optimizer state present and unchanged since the checkpoint was
    written, their files all there at their sizes (CorruptArtifact otherwise: a resume stops
    before it starts Ray or a rollout), and each policy the group's model (``check_policy``).
    An optimizer state that was not stored (held by the pool) is named, unchecked: the
    update that continues from it finds it in the pool or fails with OptimizerStateLost."""
    where = store.uri(path)
    record = store.open(path).read_json("checkpoint.json")
    policies, optims = {}, {}
    for group in config.worker_groups():
        entry = record["worker_groups"].get(group.name)
        if entry is None:
            raise CorruptArtifact(f"{where} has no worker group {group.name!r} (config changed?)")
        for kind in ("policy", "optim"):
            if kind == "optim" and entry.get("optim_manifest") is None:
                continue
            try:
                artifact = store.open(entry[kind])
            except ArtifactNotFound:
                raise CorruptArtifact(f"{store.uri(entry[kind])}: named by {where} but missing") from None
            if artifact.fingerprint() != entry[f"{kind}_manifest"]:
                raise CorruptArtifact(f"{store.uri(entry[kind], MANIFEST)}: differs from what {where} recorded")
            artifact.check_sizes()
        policies[group.name], optims[group.name] = PolicyRef(entry["policy"]), PolicyRef(entry["optim"])
        check_policy(group, store, policies[group.name])
    return ResumePoint(record["iteration"] + 1, policies, optims)


ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)
"""The fields of a policy's config.json that say which model it is."""


def check_policy(group: WorkerGroup, store: Store, policy: PolicyRef) -> None:
    """Refuse, from its manifest and config.json alone (before any weights are read), a
    policy that the worker group must not load: weights that are not safetensors (a LoRA
    policy: an adapter that is not, or a base that is gone, changed or refused), or the
    checkpoint of another model (an architecture other than the group's model spec, or
    than the config.json of the local folder it names). Hub models are not compared: what
    they are is known only once downloaded."""
    artifact = store.open(policy.artifact)
    prefix = policy.prefix.rstrip("/") + "/" if policy.prefix else ""
    names = [
        name[len(prefix) :] for name in artifact.files if name.startswith(prefix) and "/" not in name[len(prefix) :]
    ]
    where = store.uri(policy.artifact, policy.prefix or None)
    if ADAPTER_CONFIG in names:  # a LoRA policy: its adapter, then the base it names
        base = lora_base(store, policy)
        if ADAPTER_WEIGHTS not in names or base is None:
            raise PolicyError(f"{where}: a LoRA policy needs {ADAPTER_WEIGHTS} and {BASE_POLICY} (PEFT layout)")
        check_policy(group, store, base)
        return
    if problem := weights_problem(names):
        raise PolicyError(f"{where}: {problem}")
    expected = _expected_architecture(group)
    if expected is None:
        return
    found = artifact.read_json(f"{prefix}config.json")
    differences = [
        f"{key} {found.get(key)!r} (expected {value!r})" for key, value in expected.items() if found.get(key) != value
    ]
    if differences:
        raise PolicyError(
            f"{where}: the checkpoint of another model: {', '.join(differences)} "
            f"(worker group {group.name!r} has model {group.model!r})"
        )


def _expected_architecture(group: WorkerGroup) -> dict[str, object] | None:
    """The architecture fields a policy of this worker group has, where the config says."""
    spec = group.spec
    if spec is not None and spec.source == "scratch":
        values = (
            spec.architecture,
            spec.hidden_size,
            spec.num_layers,
            spec.num_heads,
            spec.num_kv_heads,
            spec.intermediate_size,
        )
        return dict(zip(ARCHITECTURE_KEYS, values, strict=True))
    source = Path(spec.source if spec is not None else group.model).expanduser()
    if not (source / "config.json").is_file():
        return None
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    return {key: config[key] for key in ARCHITECTURE_KEYS if key in config}
