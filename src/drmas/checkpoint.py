"""The checkpoint stage and resume.

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

from dataclasses import dataclass

from drmas.config import DrmasConfig
from drmas.layout import StageResult, init_policy_path, optim_path, policy_path, run_path, stage_path
from drmas.store import MANIFEST, ArtifactNotFound, CorruptArtifact, Store
from drmas.workers import PolicyRef

__all__ = ["ResumePoint", "checkpoint", "resume_point"]


@dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: the next iteration and the state it starts from."""

    next_iteration: int
    policies: dict[str, PolicyRef]
    optims: dict[str, PolicyRef | None]


def checkpoint(config: DrmasConfig, store: Store, run_id: str, iteration: int, metrics: dict[str, float], overwrite: bool = False, cache_key: str = "") -> StageResult:
    """Commit the iteration: every worker group's policy and optimizer state, verified."""
    experiment = config.experiment.name
    groups = {}
    for group in config.worker_groups():
        policy = policy_path(experiment, run_id, iteration, group.name)
        optim = optim_path(experiment, run_id, iteration, group.name)
        groups[group.name] = {
            "policy": policy,
            "policy_manifest": store.fingerprint(policy),
            "optim": optim,
            "optim_manifest": store.fingerprint(optim),
        }
    path = stage_path(experiment, run_id, iteration, "checkpoint")
    with store.writer(path, overwrite=overwrite, meta={"stage": "checkpoint", "iteration": iteration, "cache_key": cache_key}) as out:
        out.write_json("checkpoint.json", {"iteration": iteration, "worker_groups": groups})
        out.write_json("metrics.json", metrics)
    return StageResult(path, metrics)


def resume_point(config: DrmasConfig, store: Store, run_id: str) -> ResumePoint:
    """The state after the last complete iteration, or the initial policies.

    A checkpoint whose policies or optimizer states changed or vanished since it was
    written is refused with the path and the reason (CorruptArtifact), never skipped.
    """
    experiment = config.experiment.name
    done = [
        int(path.split("/")[-2].removeprefix("iter-"))
        for path in store.list(run_path(experiment, run_id))
        if path.endswith("/checkpoint")
    ]
    groups = [group.name for group in config.worker_groups()]
    if not done:
        policies = {wg: PolicyRef(init_policy_path(experiment, run_id, wg)) for wg in groups}
        return ResumePoint(0, policies, {wg: None for wg in groups})
    last = max(done)
    record = store.open(stage_path(experiment, run_id, last, "checkpoint")).read_json("checkpoint.json")
    policies, optims = {}, {}
    for wg in groups:
        entry = record["worker_groups"].get(wg)
        if entry is None:
            raise CorruptArtifact(f"checkpoint of iteration {last} has no worker group {wg!r} (config changed?)")
        for kind in ("policy", "optim"):
            try:
                found = store.fingerprint(entry[kind])
            except ArtifactNotFound:
                raise CorruptArtifact(f"{store.uri(entry[kind])}: named by the checkpoint of iteration {last} but missing") from None
            if found != entry[f"{kind}_manifest"]:
                raise CorruptArtifact(f"{store.uri(entry[kind], MANIFEST)}: differs from what the checkpoint of iteration {last} recorded")
        policies[wg], optims[wg] = PolicyRef(entry["policy"]), PolicyRef(entry["optim"])
    return ResumePoint(last + 1, policies, optims)
