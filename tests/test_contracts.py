"""Every stage's contract (``drmas.stages.contracts``) lists the config it reads.

A stage's cache key hashes only the config fields its contract lists, so a field the stage
reads but the contract leaves out is a stale cache waiting to happen: change it, and the
old output is reused. This runs one real iteration of the tiny math team, stage function
by stage function, with every read of a config field recorded, and compares.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import ROOT, TINY_OVERRIDES

from drmas.config import DrmasConfig, Section, load_config
from drmas.generation import pool as pool_module
from drmas.generation.pool import RayPool
from drmas.infra import progress as progress_module
from drmas.infra.code import PACKAGE_ROOT, module_fingerprint
from drmas.infra.layout import PolicyRef, iteration_path, stage_path
from drmas.infra.store import Store
from drmas.stages import contracts as contracts_module
from drmas.stages import policies as policies_module
from drmas.stages import warmstart as warmstart_module
from drmas.stages.advantage import advantage
from drmas.stages.checkpoint import checkpoint
from drmas.stages.contracts import (
    CONTRACTS,
    PLACEMENT_FIELDS,
    AdvantageContract,
    CheckpointContract,
    EvaluateContract,
    PoliciesContract,
    RolloutContract,
    StageContract,
    UpdateContract,
    WarmstartContract,
    cache_key,
    settings_label,
)
from drmas.stages.evaluate import evaluate
from drmas.stages.iteration import RUN_STAGES
from drmas.stages.policies import init_policies
from drmas.stages.rollout import rollout
from drmas.stages.update import update
from drmas.stages.warmstart import warmstart

# --------------------------------------------------------------------------------------
# recording what a call reads
# --------------------------------------------------------------------------------------


def _section_paths(node: Any, path: str, paths: dict[int, str]) -> dict[int, str]:
    """id of every config section inside ``node`` -> its dotted path (list items and
    dict entries by index and key: ``agents.0``, ``models.tiny``)."""
    if isinstance(node, Section):
        paths[id(node)] = path
        children = ((name, getattr(node, name)) for name in type(node).model_fields)
    elif isinstance(node, dict):
        children = node.items()
    elif isinstance(node, list | tuple):
        children = enumerate(node)
    else:
        return paths
    for name, child in children:
        _section_paths(child, f"{path}.{name}" if path else str(name), paths)
    return paths


def _holds_sections(value: Any) -> bool:
    """Whether reading ``value`` is only a step towards the fields inside it (which are
    recorded when read) rather than a read of a value."""
    if isinstance(value, Section):
        return True
    items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list | tuple) else []
    return bool(items) and all(isinstance(item, Section) for item in items)


@contextmanager
def recording(config: DrmasConfig) -> Iterator[set[str]]:
    """Record the dotted path of every config field read inside the block, on the config
    itself or through any helper of it (``config.worker_groups()`` reads ``agents``, ...).
    A whole section dumped (``model_dump``) counts as reading all of it."""
    paths = _section_paths(config, "", {})
    reads: set[str] = set()
    dumps = {"model_dump", "model_dump_json"}

    def recording_getattribute(section: Section, name: str) -> Any:
        value = object.__getattribute__(section, name)
        path = paths.get(id(section))
        if path is None or KEYING:
            return value
        if name in dumps:
            reads.add(path)
        elif name in type(section).model_fields and not _holds_sections(value):
            reads.add(f"{path}.{name}" if path else name)
        return value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Section, "__getattribute__", recording_getattribute)
        yield reads


KEYING: list[bool] = []
"""Non-empty while a stage makes a cache key: the key reads the whole resolved config by
design (and keeps only the contract's fields), which is not the stage reading it."""


def unrecorded(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        KEYING.append(True)
        try:
            return function(*args, **kwargs)
        finally:
            KEYING.pop()

    return call


def covered(read: str, fields: tuple[str, ...]) -> bool:
    """Whether ``read`` is one of ``fields`` or inside one of them."""
    return any(read == listed or read.startswith(f"{listed}.") for listed in fields)


# --------------------------------------------------------------------------------------
# the pool without Ray
# --------------------------------------------------------------------------------------


class _ActorInProcess:
    """A Ray actor handle whose methods run in this process: ``actor.method.remote(...)``
    returns the result itself, which ``ray.get`` passes through."""

    def __init__(self, instance: object) -> None:
        self._instance = instance

    def __getattr__(self, method: str) -> SimpleNamespace:
        return SimpleNamespace(remote=getattr(self._instance, method))


def _in_process_ray() -> dict[str, Any]:
    """The part of Ray that ``RayPool`` uses, in-process, by the names the pool module
    imported it under: the pool's own code (its config reads included) runs unchanged, and
    so do the worker groups' runtimes, whose reads would otherwise happen in actor processes
    that no recording sees."""

    def remote(cls: type | None = None, **_options: object) -> Any:
        """``ray.remote(cls)`` or ``ray.remote(**options)(cls)``: the options do nothing in process."""
        if cls is None:
            return remote
        return SimpleNamespace(
            options=lambda **_: SimpleNamespace(remote=lambda *args, **kwargs: _ActorInProcess(cls(*args, **kwargs)))
        )

    ray = SimpleNamespace(
        remote=remote,
        get=lambda value, timeout=None: value,
        wait=lambda refs, timeout=None, num_returns=1: (refs, []),  # the placement group is ready at once
        kill=lambda actor, no_restart=True: None,
        exceptions=SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {})),
    )
    return {
        "ray": ray,
        "placement_group": lambda bundles, strategy, **_: SimpleNamespace(ready=lambda: None),
        "remove_placement_group": lambda group: None,
        "PlacementGroupSchedulingStrategy": lambda *args, **kwargs: None,
    }


# --------------------------------------------------------------------------------------
# one iteration, stage by stage
# --------------------------------------------------------------------------------------


RUN = "contracts"
SETTINGS = [
    *TINY_OVERRIDES,
    "warmstart.steps=1",
    "eval.every=1",
    "eval.k=2",
    "eval.max_questions=2",
    "algorithm.kl_coef=0.01",
]
"""The tiny math team, one iteration with an evaluation; a KL term so that the update
reads its reference policy too; a one-step warm start (its reads in the process that
fine-tunes are not recorded: it reads its config from JSON there)."""


@dataclass
class TinyIteration:
    """Iteration 0 of a tiny run, made stage function by stage function."""

    config: DrmasConfig
    store: Store
    initial: dict[str, PolicyRef]
    updated: dict[str, PolicyRef]
    reads: dict[str, set[str]] = field(default_factory=dict)
    """Stage -> the config fields its function read."""

    def record(self, stage: str, call: Callable[[], Any]) -> Any:
        with recording(self.config) as reads:
            result = call()
        self.reads[stage] = self.reads.get(stage, set()) | reads
        return result


def tiny_config(folder: Path, *overrides: str) -> DrmasConfig:
    return load_config(ROOT / "configs" / "math_tiny.yaml", [*SETTINGS, f"store.root={folder / 'runs'}", *overrides])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyIteration:
    """Every stage of iteration 0 with its config reads recorded. The rollout and the
    evaluation each start their pool inside the call, as their components do (and as the
    runner's rollout does), so what the pool reads counts for them."""
    folder = tmp_path_factory.mktemp("contracts")
    config = tiny_config(folder)
    store = Store.from_config(config.store)
    run = TinyIteration(config, store, {}, {})
    threads = torch.get_num_threads()

    def on_a_pool(stage: Callable[[RayPool], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with RayPool(config, store, cache_dir=folder / "policies", threads=1) as pool:
                return stage(pool)

        return call

    with pytest.MonkeyPatch.context() as patch:
        for name, value in _in_process_ray().items():
            patch.setattr(pool_module, name, value)
        # The in-process workers are made as a pool's actors are (relay=True), which puts
        # this process's progress into relay mode: undone with the patches, so that the
        # next test file in this process shows its progress again.
        patch.setattr(progress_module, "_relay", progress_module._relay)
        for module in (contracts_module, policies_module, warmstart_module):  # the stages that key themselves
            patch.setattr(module, "cache_key", unrecorded(cache_key))
        try:
            run.initial = run.record("policies", lambda: init_policies(config, store, RUN))
            run.record("warmstart", lambda: warmstart(config, store, RUN, run.initial))
            run.record("rollout", on_a_pool(lambda pool: rollout(config, store, RUN, 0, run.initial, pool)))
            run.record("advantage", lambda: advantage(config, store, RUN, 0))
            for wg, policy in run.initial.items():
                result = run.record(
                    "update", lambda wg=wg, policy=policy: update(config, store, RUN, 0, wg, policy, None, policy)
                )
                run.updated[wg] = PolicyRef(result.artifact)
            path = stage_path(config.experiment.name, RUN, 0, "evaluate")
            run.record("evaluate", on_a_pool(lambda pool: evaluate(config, store, path, run.updated, pool)))
            run.record("checkpoint", lambda: checkpoint(config, store, RUN, 0, {}))
        finally:
            torch.set_num_threads(threads)
    return run


def contracts_of(run: TinyIteration) -> list[StageContract]:
    """The contract of each stage of the tiny iteration, with its arguments."""
    wg, policy = next(iter(run.initial.items()))
    return [
        PoliciesContract(RUN, wg),
        WarmstartContract(RUN, wg, policy),
        RolloutContract(RUN, 0, run.initial),
        AdvantageContract(RUN, 0),
        UpdateContract(RUN, 0, wg, policy, None, policy),
        EvaluateContract(iteration_path(run.config.experiment.name, RUN, 0), run.updated),
        CheckpointContract(RUN, 0),
    ]


# --------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", sorted(CONTRACTS))
def test_a_stage_reads_only_the_config_its_contract_lists(tiny, stage):
    """Whatever a stage reads is in its cache key: a read the contract does not list would
    let a changed config reuse an output computed under the old one. Where the run is
    stored, tracked and scheduled (placement) never changes what a stage writes. The warm
    start hands its whole config (JSON) to the process that fine-tunes: that hand-off is
    not a read, and what it reads there is not recorded."""
    fields = CONTRACTS[stage].fields
    assert tiny.reads[stage], f"{stage}: no config read was recorded (is the recording broken?)"
    allowed = (*fields, *CONTRACTS[stage].storage_fields, *PLACEMENT_FIELDS)
    handed_over = {""} if stage == "warmstart" else set()
    unlisted = sorted(read for read in tiny.reads[stage] - handed_over if not covered(read, allowed))
    assert not unlisted, f"the {stage} stage reads {unlisted}, which its contract does not list ({fields})"


def test_every_contract_names_where_its_stage_wrote(tiny):
    """The output path of each contract is where its stage function wrote, and the inputs
    it names exist: the key is made from what the stage really reads."""
    for contract in contracts_of(tiny):
        assert tiny.store.exists(contract.output(tiny.config)), contract.name
        assert all(tiny.store.exists(path) for path in contract.inputs(tiny.config).values()), contract.name


def test_the_update_key_follows_the_sampling_temperature(tiny, tmp_path):
    """The drift this module exists for: the update takes its log-probs at the sampling
    temperature, so a new temperature must not reuse the old update; the advantage, which
    does not read it, stays cached."""
    hotter = tiny_config(tmp_path, "rollout.sampling.temperature=0.5")
    unchanged = {
        contract.name
        for contract in contracts_of(tiny)
        if cache_key(hotter, tiny.store, contract) == cache_key(tiny.config, tiny.store, contract)
    }
    assert unchanged == {"policies", "warmstart", "advantage", "checkpoint"}


def test_no_key_follows_placement(tiny, tmp_path):
    """A run resumed from a moved store, tracked elsewhere, on another Ray pool or extended
    by more iterations keeps every cached output (open_run allows exactly these changes)."""
    moved = tiny_config(
        tmp_path,
        "store.region=eu-west-1",
        "tracking.uri=sqlite:///elsewhere.db",
        "ray.pool_size=4",
        "ray.max_resident=1",
        "experiment.iterations=99",
    )
    assert moved.store.root != tiny.config.store.root
    for contract in contracts_of(tiny):
        assert cache_key(moved, tiny.store, contract) == cache_key(tiny.config, tiny.store, contract), contract.name


def test_the_update_reads_its_optimizer_and_reference_only_when_it_uses_them(tiny, tmp_path):
    """No optimizer state: a fresh optimizer, nothing to fingerprint. No KL term: the
    reference policy does not change the update, so it is not an input."""
    policy, reference, optim = PolicyRef("p"), PolicyRef("ref"), PolicyRef("o")
    without_kl = tiny_config(tmp_path, "algorithm.kl_coef=0.0")
    assert set(UpdateContract(RUN, 0, "solver", policy, None, reference).inputs(without_kl)) == {"batch", "policy"}
    assert set(UpdateContract(RUN, 0, "solver", policy, optim, reference).inputs(tiny.config)) == {
        "batch",
        "policy",
        "optim",
        "reference",
    }


def test_an_unlabelled_evaluation_is_named_after_its_settings(tmp_path):
    """``drmas eval`` and the evaluate component without a label write to
    ``evaluate-{hash}``: a second eval set gets a folder of its own."""
    first, second = tiny_config(tmp_path), tiny_config(tmp_path, "eval.k=3")
    unlabelled = EvaluateContract("exp/run/iter-000002", {}, label="")
    assert unlabelled.output(first) == f"exp/run/iter-000002/{settings_label(first)}"
    assert unlabelled.output(first) != unlabelled.output(second)
    assert EvaluateContract("exp/run/init", {}).output(first) == "exp/run/init/evaluate"


def test_what_decides_only_what_is_stored_leaves_the_key_alone(tiny):
    """``checkpoint.every`` and ``experiment.iterations`` decide only whether the update
    stores its optimizer state: a run stored otherwise, or extended, reuses its updates."""
    wg, policy = next(iter(tiny.initial.items()))
    contract = UpdateContract(RUN, 0, wg, policy, None, policy)
    changed = tiny.config.model_copy(
        update={
            "checkpoint": tiny.config.checkpoint.model_copy(update={"every": 3}),
            "experiment": tiny.config.experiment.model_copy(update={"iterations": 9}),
        }
    )
    assert cache_key(tiny.config, tiny.store, contract) == cache_key(changed, tiny.store, contract)


def test_a_stage_key_follows_the_code_that_computes_it(tmp_path):
    """The code fingerprint covers a stage's module and what it imports: editing the
    advantage's module changes the advantage's fingerprint and not the checkpoint's;
    editing the math it imports changes the advantage's and the update's; an untouched
    copy of the package has the installed one's fingerprints."""
    package = tmp_path / "drmas"
    shutil.copytree(PACKAGE_ROOT, package, ignore=shutil.ignore_patterns("__pycache__"))
    modules = [f"drmas.stages.{stage}" for stage in RUN_STAGES]
    installed = {module: module_fingerprint(module) for module in modules}
    assert {module: module_fingerprint(module, package) for module in modules} == installed

    def changed_after_editing(relative: str) -> set[str]:
        with (package / relative).open("a") as source:
            source.write("\n# edited\n")
        now = {module: module_fingerprint(module, package) for module in modules}
        return {module.rsplit(".", 1)[1] for module in modules if now[module] != installed[module]}

    edited_stage = changed_after_editing("stages/advantage.py")
    assert "advantage" in edited_stage and "checkpoint" not in edited_stage
    assert {"advantage", "update"} <= changed_after_editing("algos.py")


def test_the_cache_key_holds_the_code_fingerprint(tiny, monkeypatch):
    contract = AdvantageContract(RUN, 0)
    before = cache_key(tiny.config, tiny.store, contract)
    monkeypatch.setattr(contracts_module, "_code", lambda module: "other code")
    assert cache_key(tiny.config, tiny.store, contract) != before
