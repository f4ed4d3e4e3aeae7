"""Where each stage's artifact lives in the store (docs/architecture.md §4): every store path
drmas writes or reads is built here, and read back here (``split_iteration_path``).

    {experiment}/{run_id}/run/                         the run's resolved config
    {experiment}/{run_id}/init/policy/{wg}/            initial policies (HF layout)
    {experiment}/{run_id}/warmstart/policy/{wg}/       warm-started policies
    {experiment}/{run_id}/init/evaluate/               the evaluation before training
    {experiment}/{run_id}/report/                      the run's report and figures
    {experiment}/{run_id}/iter-{i:06d}/rollout/        trajectories.parquet, metrics.json
    {experiment}/{run_id}/iter-{i:06d}/advantage/      batch.parquet, metrics.json
    {experiment}/{run_id}/iter-{i:06d}/policy/{wg}/    the updated policy (HF layout)
    {experiment}/{run_id}/iter-{i:06d}/optim/{wg}/     optimizer, scheduler and RNG state
    {experiment}/{run_id}/iter-{i:06d}/policy/{wg}@v2/ a recomputed update: version 2 (and on)
    {experiment}/{run_id}/iter-{i:06d}/checkpoint/     the commit: which policies, metrics
    {experiment}/{run_id}/iter-{i:06d}/evaluate/       eval.parquet, metrics.json

Each is one artifact with its own manifest, so each stage's output appears whole or not at
all; the checkpoint artifact, written after every worker group's policy and optimizer
state, is what makes an iteration complete.

An update's policy, once written, is never rewritten: a recomputation (a resubmitted part
runs the updates since the last stored optimizer state again) writes the next version
beside it, ``{wg}@v{n}`` with its optimizer state ``optim/{wg}@v{n}``, so that what a
cached task or a logged metric came from stays in the store. Readers take the newest
(``current_update``); a name never holds ``@`` (``NAME_PATTERN``).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "FINAL_EVALUATION",
    "METRICS_FILE",
    "PolicyRef",
    "StageResult",
    "current_update",
    "evaluation_path",
    "init_home",
    "init_policy_path",
    "iteration_path",
    "optim_path",
    "policy_path",
    "report_path",
    "run_path",
    "run_record_path",
    "split_iteration_path",
    "stage_path",
    "stored_versions",
    "version_number",
    "versioned",
    "warmstart_path",
]

METRICS_FILE = "metrics.json"
"""A stage output's metrics: reports timings, so it is left out of the fingerprint."""
FINAL_EVALUATION = "final"
"""The label (``evaluation_path``) of a run's final evaluation, ``iter-N/final``
(``eval.final``), and the prefix of its metrics (``final/eval/...``)."""


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


def run_record_path(experiment: str, run_id: str) -> str:
    """The run's record (its resolved config): what makes a run exist."""
    return f"{run_path(experiment, run_id)}/run"


def report_path(experiment: str, run_id: str) -> str:
    return f"{run_path(experiment, run_id)}/report"


def init_home(experiment: str, run_id: str) -> str:
    """Where the starting policies' evaluations go (``init/evaluate``)."""
    return f"{run_path(experiment, run_id)}/init"


def evaluation_path(home: str, label: str = "evaluate") -> str:
    """An evaluation of the policy set whose home is ``home`` (``init_home`` or an
    ``iteration_path``), named ``label`` (``evaluate``, or after its settings)."""
    return f"{home}/{label}"


def iteration_path(experiment: str, run_id: str, iteration: int) -> str:
    """The folder of one iteration of a run, relative to the store root."""
    return f"{run_path(experiment, run_id)}/iter-{iteration:06d}"


def stage_path(experiment: str, run_id: str, iteration: int, stage: str) -> str:
    return f"{iteration_path(experiment, run_id, iteration)}/{stage}"


def policy_path(experiment: str, run_id: str, iteration: int, wg: str) -> str:
    return f"{iteration_path(experiment, run_id, iteration)}/policy/{wg}"


def optim_path(experiment: str, run_id: str, iteration: int, wg: str) -> str:
    return f"{iteration_path(experiment, run_id, iteration)}/optim/{wg}"


def init_policy_path(experiment: str, run_id: str, wg: str) -> str:
    return f"{init_home(experiment, run_id)}/policy/{wg}"


def warmstart_path(experiment: str, run_id: str, wg: str) -> str:
    return f"{run_path(experiment, run_id)}/warmstart/policy/{wg}"


_ITERATION = re.compile(r"(?P<run>.+)/iter-(?P<iteration>\d{6,})(?:/(?P<rest>.*))?")


def split_iteration_path(path: str) -> tuple[str, int, str] | None:
    """``(run folder, iteration, what in it)`` of a path under an iteration
    (``exp/run/iter-000003/optim/solver`` -> ``("exp/run", 3, "optim/solver")``); None for
    a path outside every iteration. The inverse of the builders above."""
    found = _ITERATION.fullmatch(path)
    return (found["run"], int(found["iteration"]), found["rest"] or "") if found else None


_VERSION = re.compile(r"(?P<base>[^@]+)@v(?P<number>[2-9]|[1-9]\d+)")


class Listing(Protocol):
    """What version lookups need of a store: its complete artifacts under a prefix."""

    def list(self, prefix: str = "") -> list[str]: ...


def versioned(path: str, number: int) -> str:
    """Version ``number`` of the artifact at ``path`` (1: ``path`` itself)."""
    return path if number == 1 else f"{path}@v{number}"


def version_number(path: str) -> int:
    """Which version of its artifact ``path`` is (1 without ``@v``)."""
    found = _VERSION.fullmatch(path)
    return int(found["number"]) if found else 1


def stored_versions(store: Listing, path: str) -> list[int]:
    """The versions of the artifact at ``path`` that ``store`` holds complete, ascending."""
    parent, name = posixpath.split(path)
    found = []
    for listed in store.list(parent):
        rest = listed[len(parent) + 1 :] if parent else listed
        version = _VERSION.fullmatch(rest)
        if rest == name:
            found.append(1)
        elif version is not None and version["base"] == name:
            found.append(int(version["number"]))
    return sorted(found)


def current_update(store: Listing, experiment: str, run_id: str, iteration: int, wg: str) -> tuple[str, str]:
    """The policy and optimizer-state paths of the newest version of the update of ``wg``
    in ``iteration`` (the first when none is stored; the state may be unstored, held by
    the pool)."""
    policy = policy_path(experiment, run_id, iteration, wg)
    number = max(stored_versions(store, policy), default=1)
    return versioned(policy, number), versioned(optim_path(experiment, run_id, iteration, wg), number)
