"""The iteration is defined once (``drmas.stages.iteration``): the embedded runner executes
that definition in its order, and the compiled Kubeflow pipeline carries an edge for every
input a step reads and for every pair of pool users in a row."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ROOT, TINY_OVERRIDES

import drmas.stages.checkpoint as checkpoint_module
from drmas import runner
from drmas.config import DrmasConfig, load_config
from drmas.infra.layout import METRICS_FILE, PolicyRef, StageResult, optim_path, policy_path, stage_path
from drmas.infra.store import Store
from drmas.stages.contracts import CONTRACTS
from drmas.stages.iteration import (
    ITERATION_STAGES,
    RUN_STAGES,
    evaluation_outputs,
    iteration_steps,
    pool_edges,
    run_steps,
)
from drmas.stages.track import summary_line

RUN = "iteration"


def two_groups(folder: Path, *overrides: str) -> DrmasConfig:
    """The tiny math team (a worker group per agent: solver, verifier), evaluated every
    second iteration."""
    return load_config(
        ROOT / "configs" / "math_tiny.yaml",
        [*TINY_OVERRIDES, "eval.every=2", f"store.root={folder / 'runs'}", *overrides],
    )


@pytest.fixture
def config(tmp_path: Path) -> DrmasConfig:
    return two_groups(tmp_path)


def test_an_iteration_checkpoints_before_it_evaluates(config):
    groups = [group.name for group in config.worker_groups()]
    assert len(groups) == 2
    due = next(i for i in range(4) if config.evaluates(i))
    names = [step.name for step in iteration_steps(config, due)]
    assert names == ["rollout", "advantage", *(f"update/{wg}" for wg in groups), "checkpoint", "evaluate"]
    not_due = next(i for i in range(4) if not config.evaluates(i))
    assert "evaluate" not in [step.name for step in iteration_steps(config, not_due)]


def test_every_step_reads_only_steps_before_it_or_the_iteration_inputs(config):
    steps = iteration_steps(config, 1)
    for position, step in enumerate(steps):
        earlier = {before.name for before in steps[:position]}
        assert set(step.reads) <= earlier | {"start", "reference"}, step.name


def test_the_pool_edges_chain_every_pool_user_of_the_run_in_order(config):
    """Evaluation before training, then per iteration: rollout, each update, evaluation
    when due; each after the one before it, across iterations too."""
    steps = run_steps(config, 0, 2, evaluate_before=True)
    assert [config.evaluates(i) for i in range(2)] == [False, True]
    chain = [(a.title, b.title) for a, b in pool_edges(steps)]
    users = ["evaluate before training", "rollout 0", "update solver 0", "update verifier 0", "rollout 1"]
    users += ["update solver 1", "update verifier 1", "evaluate 1"]
    assert chain == list(zip(users[:-1], users[1:], strict=True))


def test_the_stage_names_are_one_list():
    assert set(CONTRACTS) == set(RUN_STAGES)
    assert ITERATION_STAGES == RUN_STAGES[2:]
    assert all(CONTRACTS[name].module == f"drmas.stages.{name}" for name in RUN_STAGES)


class StandInStages:
    """The stage functions the runner calls, replaced by ones that write a small output (with
    the cache key, as the real ones do) and record the order they were called in: the test
    is about the runner's order and its reuse rule, not about what the stages compute."""

    def __init__(self, config: DrmasConfig, store: Store) -> None:
        self.config, self.store, self.calls = config, store, []

    def _write(self, name: str, path: str, key: str, timing: str = "", value: float = 1.0) -> StageResult:
        self.calls.append(name)
        metrics = {timing or f"time/{name}": value}
        with self.store.writer(path, overwrite=True, meta={"cache_key": key}) as out:
            out.write_bytes("out.txt", name.encode())
            out.write_json(METRICS_FILE, metrics)
        return StageResult(path, metrics)

    def install(self, patch: pytest.MonkeyPatch) -> None:
        experiment = self.config.experiment.name

        def update(config, store, run_id, i, wg, policy, optim, reference, overwrite, cache_key, pool):
            self._write("optim", optim_path(experiment, run_id, i, wg), "")
            self.calls.pop()
            return self._write(f"update/{wg}", policy_path(experiment, run_id, i, wg), cache_key, f"wg/{wg}/time")

        patch.setattr(
            runner,
            "rollout",
            lambda c, s, r, i, p, pool, overwrite, cache_key: self._write(
                "rollout", stage_path(experiment, r, i, "rollout"), cache_key
            ),
        )
        patch.setattr(
            runner,
            "advantage",
            lambda c, s, r, i, overwrite, cache_key: self._write(
                "advantage", stage_path(experiment, r, i, "advantage"), cache_key
            ),
        )
        patch.setattr(runner, "update", update)

        def evaluate(config, store, path, policies, pool, overwrite, cache_key):
            """Records the samples per question of the config it was given, as eval/k."""
            name = "evaluate/final" if path.endswith("/final") else "evaluate"
            return self._write(name, path, cache_key, "eval/k", float(config.eval.k))

        patch.setattr(runner, "evaluate", evaluate)
        real_checkpoint = runner.checkpoint

        def checkpoint(*args, **kwargs):
            self.calls.append("checkpoint")
            return real_checkpoint(*args, **kwargs)

        patch.setattr(runner, "checkpoint", checkpoint)


def stand_in_policies(config: DrmasConfig, store: Store) -> dict[str, PolicyRef]:
    """Each worker group's starting policy, a stored artifact the stand-in stages only name."""
    starting = {}
    for group in config.worker_groups():
        path = f"{config.experiment.name}/{RUN}/init/policy/{group.name}"
        with store.writer(path) as out:
            out.write_bytes("weights.txt", group.name.encode())
        starting[group.name] = PolicyRef(path)
    return starting


def test_the_runner_runs_the_definition_and_reuses_what_it_may(config, monkeypatch):
    """``run_iteration`` calls the steps in the definition's order; a second call reuses
    them all; ``force`` names a stage (every worker group's update) or one step."""
    store = Store.from_config(config.store)
    groups = [group.name for group in config.worker_groups()]
    starting = stand_in_policies(config, store)
    stages = StandInStages(config, store)
    stages.install(monkeypatch)
    due = next(i for i in range(4) if config.evaluates(i))
    expected = [step.name for step in iteration_steps(config, due)]

    def iterate(force: frozenset[str] = frozenset()) -> runner.IterationResult:
        stages.calls.clear()
        return runner.run_iteration(
            config, store, RUN, due, starting, dict.fromkeys(groups), starting, lambda: None, force=force
        )

    first = iterate()
    assert stages.calls == expected and first.ran == expected and first.recomputed == expected
    # The stages' own times (rollout, advantage, each update), the evaluation's aside.
    assert first.metrics["time/iteration"] == 2.0 + len(groups)
    again = iterate()
    assert again.ran == expected and again.recomputed == [] and stages.calls == []
    assert iterate(frozenset({"update"})).recomputed == [f"update/{wg}" for wg in groups]
    assert iterate(frozenset({f"update/{groups[1]}"})).recomputed == [f"update/{groups[1]}"]


def test_the_last_iteration_ends_with_the_final_evaluation_of_its_own_settings(tmp_path, monkeypatch):
    """``eval.final`` (issue 31 §1): the last iteration's checkpoint is evaluated a second
    time with the final settings, stored as ``iter-N/final``, its metrics under ``final/``;
    an iteration counts as done for a resume only with it."""
    config = two_groups(tmp_path, "experiment.iterations=2", "eval.final.k=16", "eval.final.max_questions=3")
    assert "evaluate/final" not in [step.name for step in iteration_steps(config, 0)]
    names = [step.name for step in iteration_steps(config, 1)]
    assert names[-3:] == ["checkpoint", "evaluate", "evaluate/final"]
    home = f"{config.experiment.name}/{RUN}/iter-000001"
    assert evaluation_outputs(config, RUN, 1) == [f"{home}/evaluate", f"{home}/final"]
    final = config.final_evaluation()
    assert (final.eval.k, final.eval.max_questions, final.eval.final) == (16, 3, None)
    assert (final.data.eval, final.eval.sampling) == (config.data.eval, config.eval.sampling)

    store = Store.from_config(config.store)
    groups = [group.name for group in config.worker_groups()]
    starting = stand_in_policies(config, store)
    StandInStages(config, store).install(monkeypatch)
    result = None
    for i in range(2):
        result = runner.run_iteration(config, store, RUN, i, starting, dict.fromkeys(groups), starting, lambda: None)
    assert result.ran == names and result.stages["evaluate/final"] == f"{home}/final"
    assert (result.metrics["eval/k"], result.metrics["final/eval/k"]) == (config.eval.k, 16.0)
    # The stand-ins' checkpoints hold no weights: what a resume reads of one is its iteration.
    monkeypatch.setattr(
        checkpoint_module,
        "read_checkpoint",
        lambda c, s, path: checkpoint_module.ResumePoint(int(path.split("iter-")[1][:6]) + 1, {}, {}),
    )
    assert checkpoint_module.resume_point(config, store, RUN).next_iteration == 2
    store.delete(f"{home}/final")  # killed during the final evaluation: the resume computes it
    assert checkpoint_module.resume_point(config, store, RUN).next_iteration == 1
    line = summary_line(1, {"final/eval/avg_at_16": 0.25, "final/eval/pass_at_16": 0.5}, config.eval.k)
    assert line.endswith("| final eval avg@16 0.250 pass@16 0.500")


def compiled_dependencies(config: DrmasConfig, folder: Path, start: int = 0) -> dict[str, set[str]]:
    """Task display name -> the display names of the tasks it depends on, in the compiled
    training pipeline (the IR YAML a KFP backend reads)."""
    yaml = pytest.importorskip("yaml")
    from drmas_kfp.pipelines.build import build_pipeline, compile_pipeline

    func, _ = build_pipeline("train", config, RUN, start)
    spec = next(yaml.safe_load_all(compile_pipeline(func, folder / "pipeline.yaml").read_text()))
    tasks = spec["root"]["dag"]["tasks"]
    names = {key: task["taskInfo"]["name"] for key, task in tasks.items()}
    return {names[key]: {names[other] for other in task.get("dependentTasks", [])} for key, task in tasks.items()}


def reachable(dependencies: dict[str, set[str]], name: str) -> set[str]:
    """Every task ``name`` waits for, directly or not."""
    seen, todo = set(), list(dependencies[name])
    while todo:
        other = todo.pop()
        if other not in seen:
            seen.add(other)
            todo.extend(dependencies[other])
    return seen


@pytest.mark.parametrize(("start", "final"), [(0, False), (1, False), (0, True)])
def test_the_compiled_pipeline_carries_every_edge_of_the_definition(tmp_path, start, final):
    """Every step of the definition is a task; a task waits for every step whose output it
    reads and for the pool user before it; so no two pool users can run at once (Argo
    starts every task whose dependencies are done). With ``eval.final`` the final
    evaluation is a task of its own."""
    config = two_groups(tmp_path, "experiment.iterations=3", *(["eval.final.k=16"] if final else []))
    dependencies = compiled_dependencies(config, tmp_path, start)
    steps = run_steps(config, start, 3, evaluate_before=start == 0)
    by_iteration = {(step.iteration, step.name): step.title for step in steps}
    for step in steps:
        assert step.title in dependencies, f"{step.title} is not in the compiled pipeline"
        for read in step.reads:
            if (step.iteration, read) in by_iteration:
                assert by_iteration[(step.iteration, read)] in dependencies[step.title], (step.title, read)
    for earlier, later in pool_edges(steps):
        assert earlier.title in dependencies[later.title], (earlier.title, later.title)
    users = [step.title for step in steps if step.uses_pool]
    for position, later in enumerate(users):
        assert set(users[:position]) <= reachable(dependencies, later), f"{later} may overlap a pool user before it"
    assert ("evaluate final 2" in dependencies) == final
    rollouts = [step for step in steps if step.stage == "rollout"][1:]
    assert all(f"checkpoint {step.iteration - 1}" in dependencies[step.title] for step in rollouts)
