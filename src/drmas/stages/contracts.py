"""One contract per stage: where its output goes, the artifacts it reads, the config fields
it reads and the plain values it depends on, stated once and used by the embedded runner
and by the stage's Kubeflow component alike; and the cache key made from it.

Why one place: the key's inputs used to be built twice (runner and component) and the
fields a stage reads were listed far from the stage, where they drifted (the update read
``rollout.sampling`` without it being in its key, so a changed temperature would have
reused an update computed at the old one). ``tests/test_contracts.py`` runs every stage
with each config read recorded and fails when a stage reads a field its contract does not
list. A field read through a config helper counts: ``config.worker_groups()`` reads the
agents, models, workers and the training defaults that agents may override.

The key follows Kubeflow's rule: a stage's output is reused when the stage, the content of
its input artifacts, the config fields it reads, its plain values and the code that computes
it are all the same (``reuses``); otherwise it is recomputed. The code is the fingerprint of
the stage's module and every drmas module it imports (``drmas.infra.code``): a change to
the rollout's code recomputes rollouts, and leaves the advantage's outputs valid unless the
advantage's code changed too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from drmas.config import WORKER_GROUP_FIELDS, DrmasConfig
from drmas.infra.caching import is_cached
from drmas.infra.code import module_fingerprint
from drmas.infra.layout import (
    FINAL_EVALUATION,
    METRICS_FILE,
    PolicyRef,
    current_update,
    evaluation_path,
    init_policy_path,
    optim_path,
    policy_path,
    stage_path,
    warmstart_path,
)
from drmas.infra.store import ArtifactNotFound, Store

__all__ = [
    "CONTRACTS",
    "PLACEMENT_FIELDS",
    "RETRIEVAL_SERVICE_FIELDS",
    "AdvantageContract",
    "CheckpointContract",
    "EvaluateContract",
    "PoliciesContract",
    "RolloutContract",
    "StageContract",
    "UpdateContract",
    "WarmstartContract",
    "cache_key",
    "reuses",
    "evaluation_config",
    "settings_label",
    "starting_point_reusable",
]

log = logging.getLogger(__name__)

RETRIEVAL_SERVICE_FIELDS = (
    "task.retrieval_url",
    "task.retrieval_timeout_s",
    "task.retrieval_retries",
    "task.retrieval_backoff_s",
    "task.retrieval_corpus_hash",
)
"""Where the search task's retrieval runs (a service, or in process) and how it is reached.
A served search returns what the in-process one does for the same corpus, and the client
refuses a service whose corpus hash is not the config's corpus (``data.corpus`` and the
generated world's settings, which stay in the keys): these change where passages come
from, never which."""

PLACEMENT_FIELDS = ("experiment.name", "store", "tracking", "ray", *RETRIEVAL_SERVICE_FIELDS)
"""Where a run's outputs are kept and tracked and where its stages run: they decide where
an output is, never what it holds, and ``store``/``tracking`` may change when a run is
resumed. Stages read them; no key holds them, not even inside a section a stage lists
(``task`` holds the retrieval service's settings)."""

WORKER_GROUPS = ("agents", "models", "workers", *(f"train.{name}" for name in WORKER_GROUP_FIELDS))
"""What ``config.worker_groups()`` reads: every stage that asks for the worker groups."""

POOL = (*WORKER_GROUPS, "rollout.engine", "rollout.max_prompt_tokens", "rollout.truncation")
"""What the pool hands each worker group's runtime (engine, dtype, prompt cut, chat
template variables, system prompt: all in ``models``): what a generating stage reads when it
starts the pool."""


def _fields(*names: str) -> tuple[str, ...]:
    """``names`` sorted, without those inside another of them (``train.lr`` in ``train``)."""
    return tuple(sorted({name for name in names if not any(name.startswith(f"{other}.") for other in names)}))


class StageContract(ABC):
    """What one call of a stage depends on. A subclass per stage holds the call's arguments
    (run, iteration, policies, ...) and says where the output goes and what it is made
    from; ``cache_key`` hashes that."""

    name: ClassVar[str]
    """The stage, as its key names it."""
    module: ClassVar[str]
    """The module whose code computes the stage (its key holds that code's fingerprint)."""
    fields: ClassVar[tuple[str, ...]]
    """The config the stage reads (dotted paths into the resolved config), placement aside:
    a change anywhere else leaves its output valid."""

    @abstractmethod
    def output(self, config: DrmasConfig) -> str:
        """Where the stage writes its output (a path under the store root)."""

    @abstractmethod
    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        """The artifacts the stage reads, name -> path under the store root (the key holds
        their content's fingerprint, not their path)."""

    storage_fields: ClassVar[tuple[str, ...]] = ()
    """Config the stage reads only to decide what it stores beside its output, never what it
    computes (the update's ``checkpoint.every``): not in its key; ``reusable`` checks what
    was stored."""
    held_inputs: ClassVar[tuple[str, ...]] = ()
    """Inputs (by name, or the part before its '/') that may exist only in the pool's
    memory, not in the store (optimizer states between ``checkpoint.every`` iterations):
    keyed by their path."""

    def values(self) -> dict[str, Any]:
        """Plain values the output depends on beyond its inputs and config (e.g. the
        iteration, which seeds the rollout's sampling)."""
        return {}

    def reusable(self, config: DrmasConfig, store: Store) -> bool:
        """Beyond a cached output with the same key, whether the stage may be skipped."""
        return True

    def stored_output(self, config: DrmasConfig, store: Store) -> str:
        """The output as readers take it from the store: ``output``, or for an update the
        newest version of it (``infra.layout.current_update``)."""
        return self.output(config)

    def stored_inputs(self, config: DrmasConfig, store: Store) -> dict[str, str]:
        """The inputs as the store holds them now (``inputs``, the newest version of each
        update the stage reads): what its key fingerprints."""
        return self.inputs(config)


def _policy_inputs(policies: Mapping[str, PolicyRef]) -> dict[str, str]:
    return {f"policy/{wg}": ref.artifact for wg, ref in policies.items()}


@dataclass(frozen=True)
class PoliciesContract(StageContract):
    """Worker group ``wg``'s initial policy: its model (pretrained, or built from its config
    with a tokenizer trained on the task's text), with its chat template."""

    run_id: str
    wg: str
    name: ClassVar[str] = "policies"
    module: ClassVar[str] = "drmas.stages.policies"
    fields: ClassVar[tuple[str, ...]] = _fields("experiment.seed", "task", "data", *WORKER_GROUPS)

    def output(self, config: DrmasConfig) -> str:
        return init_policy_path(config.experiment.name, self.run_id, self.wg)

    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        return {}

    def values(self) -> dict[str, Any]:
        return {"wg": self.wg}


@dataclass(frozen=True)
class WarmstartContract(StageContract):
    """Worker group ``wg``'s fine-tuning from ``policy`` (its initial policy) on the
    demonstrations of its agents' roles, which the task makes from its training questions."""

    run_id: str
    wg: str
    policy: PolicyRef
    name: ClassVar[str] = "warmstart"
    module: ClassVar[str] = "drmas.stages.warmstart"
    fields: ClassVar[tuple[str, ...]] = _fields(
        "experiment.seed",
        "task",
        "data",
        "warmstart",
        "rollout.max_prompt_tokens",
        "rollout.truncation",
        *WORKER_GROUPS,
    )

    def output(self, config: DrmasConfig) -> str:
        return warmstart_path(config.experiment.name, self.run_id, self.wg)

    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        return {"policy": self.policy.artifact}

    def values(self) -> dict[str, Any]:
        return {"wg": self.wg}


def starting_point_reusable(config: DrmasConfig, store: Store, contract: StageContract, run_id: str) -> bool:
    """Whether a starting policy (``policies``, ``warmstart``) stored at the contract's output
    is kept: when its key is the same, and also when it is not but the run has already
    trained from it (its rollout 0 exists). Recomputing it then would change the start, and
    the KL anchor, of iterations already trained: an older run resumed under newer code
    keeps the policies it started from, with a warning that names them."""
    path = contract.output(config)
    if not store.exists(path):
        return False
    if reuses(config, store, contract, cache_key(config, store, contract)):
        return True
    if store.open(path).meta.get("copied_from"):  # a start shared on purpose (drmas compare: one per seed set)
        return True
    if store.exists(stage_path(config.experiment.name, run_id, 0, "rollout")):
        log.warning(
            "%s: computed with another config or code than this run's (its cache key differs); kept, since the run "
            "has trained from it (drmas run --force %s on a new run rebuilds it)",
            store.uri(path),
            contract.name,
        )
        return True
    return False


@dataclass(frozen=True)
class RolloutContract(StageContract):
    """The team plays iteration ``iteration`` with ``policies`` (on a pool it starts)."""

    run_id: str
    iteration: int
    policies: Mapping[str, PolicyRef]
    name: ClassVar[str] = "rollout"
    module: ClassVar[str] = "drmas.stages.rollout"
    fields: ClassVar[tuple[str, ...]] = _fields("experiment.seed", "task", "data", "rollout", *POOL)

    def output(self, config: DrmasConfig) -> str:
        return stage_path(config.experiment.name, self.run_id, self.iteration, "rollout")

    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        return _policy_inputs(self.policies)

    def values(self) -> dict[str, Any]:
        return {"iteration": self.iteration}


@dataclass(frozen=True)
class AdvantageContract(StageContract):
    """Scores and advantages of the iteration's trajectories."""

    run_id: str
    iteration: int
    name: ClassVar[str] = "advantage"
    module: ClassVar[str] = "drmas.stages.advantage"
    fields: ClassVar[tuple[str, ...]] = _fields("algorithm")

    def output(self, config: DrmasConfig) -> str:
        return stage_path(config.experiment.name, self.run_id, self.iteration, "advantage")

    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        return {"rollout": stage_path(config.experiment.name, self.run_id, self.iteration, "rollout")}


@dataclass(frozen=True)
class UpdateContract(StageContract):
    """Worker group ``wg``'s step from ``policy`` (and ``optim``; None: a fresh optimizer)
    on its rows of the iteration's batch; ``reference`` is the KL anchor, an input only
    when the loss has a KL term. It reads ``rollout.sampling``: the trainer's log-probs are
    taken at each agent's sampling temperature."""

    run_id: str
    iteration: int
    wg: str
    policy: PolicyRef
    optim: PolicyRef | None
    reference: PolicyRef
    name: ClassVar[str] = "update"
    module: ClassVar[str] = "drmas.stages.update"
    fields: ClassVar[tuple[str, ...]] = _fields(
        "experiment.seed", "algorithm", "train", "diagnostics", "rollout.sampling", *WORKER_GROUPS
    )

    def output(self, config: DrmasConfig) -> str:
        """The new policy; its manifest carries the key (the optimizer state is beside it:
        ``optim_output``)."""
        return policy_path(config.experiment.name, self.run_id, self.iteration, self.wg)

    def optim_output(self, config: DrmasConfig) -> str:
        """The optimizer state the update writes with the policy."""
        return optim_path(config.experiment.name, self.run_id, self.iteration, self.wg)

    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        inputs = {
            "batch": stage_path(config.experiment.name, self.run_id, self.iteration, "advantage"),
            "policy": self.policy.artifact,
        }
        if self.optim is not None:
            inputs["optim"] = self.optim.artifact
        if config.algorithm.kl_coef:
            inputs["reference"] = self.reference.artifact
        return inputs

    storage_fields: ClassVar[tuple[str, ...]] = ("checkpoint.every", "experiment.iterations")
    held_inputs: ClassVar[tuple[str, ...]] = ("optim",)

    def values(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "wg": self.wg}

    def reusable(self, config: DrmasConfig, store: Store) -> bool:
        """Only with its optimizer state stored: skipped, the update leaves no state in the
        pool for the next update to continue from."""
        return store.exists(self.stored_optim_output(config, store))

    def stored_output(self, config: DrmasConfig, store: Store) -> str:
        return current_update(store, config.experiment.name, self.run_id, self.iteration, self.wg)[0]

    def stored_optim_output(self, config: DrmasConfig, store: Store) -> str:
        """The optimizer state of the newest version (stored or held by the pool)."""
        return current_update(store, config.experiment.name, self.run_id, self.iteration, self.wg)[1]


def evaluation_config(config: DrmasConfig, label: str) -> DrmasConfig:
    """The config an evaluation labelled ``label`` runs with: the final evaluation's
    settings (``eval.final``) for ``FINAL_EVALUATION``, else the run's own. Its cache key
    reads the run's ``eval`` (``eval.final`` included) and ``data`` either way."""
    return config.final_evaluation() if label == FINAL_EVALUATION else config


def settings_label(config: DrmasConfig) -> str:
    """``evaluate-{hash}``: an evaluation named after its eval set and settings, so that
    evaluations of one checkpoint on different eval sets do not overwrite each other."""
    settings = json.dumps({"data": config.data_spec("eval"), "eval": config.eval.model_dump()}, sort_keys=True)
    return f"evaluate-{hashlib.sha256(settings.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class EvaluateContract(StageContract):
    """The team with ``policies`` on the eval set, written to ``{home}/{label}`` (an empty
    label: ``settings_label``). It reads ``rollout.sampling`` because the team it plays
    with resolves every agent's rollout sampling before evaluation replaces it."""

    home: str
    policies: Mapping[str, PolicyRef]
    label: str = "evaluate"
    name: ClassVar[str] = "evaluate"
    module: ClassVar[str] = "drmas.stages.evaluate"
    fields: ClassVar[tuple[str, ...]] = _fields("experiment.seed", "task", "data", "eval", "rollout.sampling", *POOL)

    def output(self, config: DrmasConfig) -> str:
        return evaluation_path(self.home, self.label or settings_label(config))

    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        return _policy_inputs(self.policies)


@dataclass(frozen=True)
class CheckpointContract(StageContract):
    """The commit of the iteration: every worker group's new policy and optimizer state."""

    run_id: str
    iteration: int
    name: ClassVar[str] = "checkpoint"
    module: ClassVar[str] = "drmas.stages.checkpoint"
    fields: ClassVar[tuple[str, ...]] = _fields("checkpoint", *WORKER_GROUPS)
    held_inputs: ClassVar[tuple[str, ...]] = ("optim",)

    def output(self, config: DrmasConfig) -> str:
        return stage_path(config.experiment.name, self.run_id, self.iteration, "checkpoint")

    def inputs(self, config: DrmasConfig) -> dict[str, str]:
        experiment, groups = config.experiment.name, [group.name for group in config.worker_groups()]
        policies = {f"policy/{wg}": policy_path(experiment, self.run_id, self.iteration, wg) for wg in groups}
        return policies | {f"optim/{wg}": optim_path(experiment, self.run_id, self.iteration, wg) for wg in groups}

    def stored_inputs(self, config: DrmasConfig, store: Store) -> dict[str, str]:
        experiment, inputs = config.experiment.name, {}
        for group in config.worker_groups():
            policy, optim = current_update(store, experiment, self.run_id, self.iteration, group.name)
            inputs |= {f"policy/{group.name}": policy, f"optim/{group.name}": optim}
        return inputs

    def values(self) -> dict[str, Any]:
        return {"iteration": self.iteration}


CONTRACTS: dict[str, type[StageContract]] = {
    contract.name: contract
    for contract in (
        PoliciesContract,
        WarmstartContract,
        RolloutContract,
        AdvantageContract,
        UpdateContract,
        CheckpointContract,
        EvaluateContract,
    )
}
"""Stage name -> its contract, for every stage of ``drmas.stages.iteration.RUN_STAGES``."""


def reuses(config: DrmasConfig, store: Store, contract: StageContract, key: str) -> bool:
    """The reuse rule, written once for the runner and every component: a stage is skipped
    when the store holds its output with the same cache key and its contract allows it
    (``StageContract.reusable``)."""
    return is_cached(store, contract.stored_output(config, store), key) and contract.reusable(config, store)


def _select(resolved: dict[str, Any], dotted: str) -> Any:
    node: Any = resolved
    for part in dotted.split("."):
        node = node[part]
    return node


def _without_placement(resolved: dict[str, Any]) -> dict[str, Any]:
    """The resolved config without the placement fields nested in a section that a stage
    lists (``task.retrieval_url`` in ``task``); top-level ones no contract lists."""
    for dotted in PLACEMENT_FIELDS:
        *parents, leaf = dotted.split(".")
        if parents:
            _select(resolved, ".".join(parents)).pop(leaf, None)
    return resolved


def cache_key(config: DrmasConfig, store: Store, stage: StageContract) -> str:
    """The key of one call of a stage: its name, its input artifacts' content, the config
    fields it reads (placement aside), its plain values and its code's fingerprint."""
    resolved = _without_placement(json.loads(config.to_json()))
    payload = {
        "stage": stage.name,
        "config": {field: _select(resolved, field) for field in stage.fields},
        # metrics.json reports timings: it is not an input, and would make every key new.
        "inputs": {
            name: _fingerprint(store, stage, name, path)
            for name, path in sorted(stage.stored_inputs(config, store).items())
        },
        "values": stage.values(),
        "code": _code(stage.module),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@functools.cache
def _code(module: str) -> str:
    """The fingerprint of the installed code of ``module``: read once per process."""
    return module_fingerprint(module)


def _fingerprint(store: Store, stage: StageContract, name: str, path: str) -> str:
    """An input's content fingerprint; for an input the pool may hold unstored, its path."""
    try:
        return store.fingerprint(path, ignore=(METRICS_FILE,))
    except ArtifactNotFound:
        if name.split("/")[0] in stage.held_inputs:
            return f"held by the pool: {path}"
        raise
