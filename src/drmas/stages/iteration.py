"""The RL iteration, defined once, as data: its steps, what each reads, and the order the
run's pool imposes.

    rollout ──► advantage ──► update/wg1 ─► update/wg2 ─► … ──► checkpoint ──► evaluate (when due)
                                                                       └──► evaluate/final (last, eval.final)

Both ways of running a run follow this definition: the embedded runner
(``drmas.runner.run_iteration``) executes the steps in this order, and the Kubeflow pipeline
builder (``drmas_kfp.pipelines.build``) compiles each step to a task with one dependency
edge per input it reads and per pool edge (``pool_edges``). ``tests/test_iteration.py``
checks that both follow it.

Why the pool edges: rollout, update and evaluate all run on the run's one pool of devices,
and each keeps its own record of which engine is resident there. Argo starts every task
whose dependencies are done, so two pool users that no data edge orders (the evaluation
before training and rollout 0, which both read only the warm start; evaluation ``i`` and
rollout ``i+1``, which both read checkpoint ``i``; the worker groups' updates, which all
read the same batch) would run at once on one device. Every step that uses the pool
therefore runs after the pool user before it in the run's order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from drmas.config import DrmasConfig
from drmas.infra.layout import FINAL_EVALUATION, evaluation_path, iteration_path

__all__ = [
    "FINAL",
    "ITERATION_STAGES",
    "POOL_STAGES",
    "RUN_STAGES",
    "Step",
    "evaluation_outputs",
    "iteration_steps",
    "pool_edges",
    "run_steps",
]

RUN_STAGES = ("policies", "warmstart", "rollout", "advantage", "update", "checkpoint", "evaluate")
"""Every stage a run has, in the order a run meets them: the starting point (initial
policies, warm start), then the iteration's stages. The one list of stage names: the
contracts (``drmas.stages.contracts.CONTRACTS``), ``drmas rerun`` and ``--force`` name
stages from it."""

ITERATION_STAGES = RUN_STAGES[2:]
"""The stages of one RL iteration (what ``drmas rerun`` recomputes)."""

POOL_STAGES = frozenset({"rollout", "update", "evaluate"})
"""The stages that run on the run's pool: at most one of them at a time."""

FINAL = FINAL_EVALUATION
"""The variant of the evaluation that the last iteration ends with when ``eval.final`` is
set, and the name of its output (``iter-N/final``)."""

STARTING_POINT = "start"
"""What an iteration's first steps read: the policy set it starts from (the warm start, or
the checkpoint of the iteration before)."""

REFERENCE = "reference"
"""The KL anchor every update reads (the run's starting policies)."""


@dataclass(frozen=True)
class Step:
    """One task of a run: a stage, for one iteration (-1: before training) and, for an
    update, one worker group."""

    stage: str
    iteration: int
    wg: str | None = None
    reads: tuple[str, ...] = ()
    """The names of the steps (of this iteration; or ``STARTING_POINT``, ``REFERENCE``)
    whose outputs it reads."""
    variant: str | None = None
    """A second step of one stage in an iteration: ``FINAL`` for the final evaluation."""

    @property
    def name(self) -> str:
        """Unique within an iteration: ``rollout``, ``update/solver``, ``evaluate/final``, ..."""
        part = self.wg or self.variant
        return f"{self.stage}/{part}" if part else self.stage

    @property
    def title(self) -> str:
        """What a person reads in the pipeline's graph and the runner's progress:
        ``update solver 3``, ``evaluate before training``, ``evaluate final 39``."""
        when = "before training" if self.iteration < 0 else str(self.iteration)
        return " ".join(part for part in (self.stage, self.wg, self.variant, when) if part)

    @property
    def uses_pool(self) -> bool:
        return self.stage in POOL_STAGES


def iteration_steps(config: DrmasConfig, iteration: int) -> list[Step]:
    """The steps of iteration ``iteration``, in the order they run: rollout, advantage, each
    worker group's update (in the config's order), checkpoint, then the evaluation of the
    checkpoint when ``eval.every`` makes it due, and the final evaluation after the last
    iteration when ``eval.final`` is set. The checkpoint comes first so that an
    iteration is complete (resumable) before it is evaluated, and its metrics are the
    training's only, in every way of running it."""
    groups = [group.name for group in config.worker_groups()]
    updates = [Step("update", iteration, wg, ("advantage", STARTING_POINT, REFERENCE)) for wg in groups]
    steps = [
        Step("rollout", iteration, reads=(STARTING_POINT,)),
        Step("advantage", iteration, reads=("rollout",)),
        *updates,
        Step("checkpoint", iteration, reads=tuple(update.name for update in updates)),
    ]
    if config.evaluates(iteration):
        steps.append(Step("evaluate", iteration, reads=("checkpoint",)))
    if config.eval.final is not None and iteration == config.total_iterations - 1:
        steps.append(Step("evaluate", iteration, reads=("checkpoint",), variant=FINAL))
    return steps


def evaluation_outputs(config: DrmasConfig, run_id: str, iteration: int) -> list[str]:
    """Where the evaluations due in iteration ``iteration`` write: an iteration is done (a
    resume moves past it) only once each of them is stored."""
    home = iteration_path(config.experiment.name, run_id, iteration)
    return [
        evaluation_path(home, step.variant or "evaluate")
        for step in iteration_steps(config, iteration)
        if step.stage == "evaluate"
    ]


def run_steps(config: DrmasConfig, first: int, last: int, evaluate_before: bool) -> list[Step]:
    """The steps of iterations ``first`` .. ``last - 1`` in the order they run, after the
    evaluation of the starting policies when ``evaluate_before``."""
    before = [Step("evaluate", -1, reads=(STARTING_POINT,))] if evaluate_before else []
    return before + [step for i in range(first, last) for step in iteration_steps(config, i)]


def pool_edges(steps: Iterable[Step]) -> list[tuple[Step, Step]]:
    """(earlier, later) for every pool user and the pool user before it in ``steps``: the
    edges that keep the run's pool to one user at a time."""
    users: Sequence[Step] = [step for step in steps if step.uses_pool]
    return list(zip(users[:-1], users[1:], strict=True))
