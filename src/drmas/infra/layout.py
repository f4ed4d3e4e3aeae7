"""Where each stage's artifact lives in the store (docs/architecture.md §4).

    {experiment}/{run_id}/init/policy/{wg}/            initial policies (HF layout)
    {experiment}/{run_id}/iter-{i:06d}/rollout/        trajectories.parquet, metrics.json
    {experiment}/{run_id}/iter-{i:06d}/advantage/      batch.parquet, metrics.json
    {experiment}/{run_id}/iter-{i:06d}/policy/{wg}/    the updated policy (HF layout)
    {experiment}/{run_id}/iter-{i:06d}/optim/{wg}/     optimizer, scheduler and RNG state
    {experiment}/{run_id}/iter-{i:06d}/checkpoint/     the commit: which policies, metrics
    {experiment}/{run_id}/iter-{i:06d}/evaluate/       eval.parquet, metrics.json

Each is one artifact with its own manifest, so each stage's output appears whole or not at
all; the checkpoint artifact, written after every worker group's policy and optimizer
state, is what makes an iteration complete.
"""

from __future__ import annotations

from dataclasses import dataclass

from drmas.infra.store import iteration_path

__all__ = ["PolicyRef", "StageResult", "init_policy_path", "optim_path", "policy_path", "run_path", "stage_path"]


@dataclass(frozen=True)
class PolicyRef:
    """Where a worker group's weights are: an artifact in HF layout (or a folder in one)."""

    artifact: str
    """Artifact path relative to the store root (e.g. exp/run/iter-000003/policy/solver)."""
    prefix: str = ""
    """Folder inside the artifact holding the HF layout; empty: the artifact itself."""


@dataclass(frozen=True)
class StageResult:
    """A stage's output artifact (path under the store root) and its metrics."""

    artifact: str
    metrics: dict[str, float]


def run_path(experiment: str, run_id: str) -> str:
    return f"{experiment}/{run_id}"


def stage_path(experiment: str, run_id: str, iteration: int, stage: str) -> str:
    return f"{iteration_path(experiment, run_id, iteration)}/{stage}"


def policy_path(experiment: str, run_id: str, iteration: int, wg: str) -> str:
    return f"{iteration_path(experiment, run_id, iteration)}/policy/{wg}"


def optim_path(experiment: str, run_id: str, iteration: int, wg: str) -> str:
    return f"{iteration_path(experiment, run_id, iteration)}/optim/{wg}"


def init_policy_path(experiment: str, run_id: str, wg: str) -> str:
    return f"{run_path(experiment, run_id)}/init/policy/{wg}"
