"""Pipelines built from a config: the worker groups, the number of iterations and when to
evaluate come from the config, so each pipeline is made by a function of it.

    training_pipeline(config, run_id)       warm start, then iterations 0..N-1 chained
    training_pipeline(config, run_id, start_iteration=K, iterations=M)
                                            the checkpoint of iteration K-1 (imported by
                                            its URI, a pipeline parameter), then K..N-1
                                            (or the M iterations from K)
    iteration_pipeline(config, run_id, iteration=K)
                                            one RL iteration: rollout -> advantage ->
                                            update (one task per worker group) ->
                                            checkpoint -> evaluate (when due)
    evaluation_pipeline(config, checkpoint)  a checkpoint (by URI) on the config's eval set

Every pipeline takes the resolved config as the JSON parameter ``config_json`` (changing
it changes every task's cache key) and the drmas run id as ``run_id``; the structure (the
worker groups, the iterations) is the compiled config's. The stage outputs
go to ``{store.root}/{experiment}/{run_id}/...`` as with ``drmas run``. ``force`` names
stages to recompute in this run: their tasks get caching off and ``force=True`` (see
``parse_force``). Every task is placed by ``pipelines.platform`` (``placement_for``) and
runs the image of its placement's flavor (``image_flavor``: the GPU image where the pod asks
for GPUs, else the CPU image; ``images``: {"cpu": ..., "gpu": ...}, default the
components' ``base_image``), set per task with ``PipelineTask.set_container_image``.

The train and rl_iteration pipelines log to MLflow as ``drmas run`` does, from small CPU
steps beside the stages (``components.track``): ``mlflow: start`` (opens the run, links
to it), ``mlflow: iteration i`` after each checkpoint (and evaluation), ``mlflow: end``
(report, registered policies, link and figures).
"""

import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kfp import compiler, dsl
from kfp.dsl import Dataset, Model, PipelineTask

from drmas.config import DrmasConfig
from drmas.infra.layout import stage_path
from drmas.stages.iteration import RUN_STAGES, Step, run_steps
from drmas_kfp import components
from drmas_kfp.pipelines.platform import Placement, cheap_setter_checks, image_flavor, place, placement_for

__all__ = [
    "PIPELINES",
    "STAGES",
    "Force",
    "build_pipeline",
    "default_checkpoint",
    "compile_pipeline",
    "evaluation_pipeline",
    "iteration_pipeline",
    "parse_force",
    "training_pipeline",
]

PIPELINES = ("train", "rl_iteration", "evaluate")
STAGES = tuple(stage for stage in RUN_STAGES if stage != "policies")
"""The stages ``--force`` names (the initial policies are rebuilt with the warm start)."""

PlacementRule = Callable[[str, DrmasConfig], Placement]


@dataclass(frozen=True)
class Force:
    """The tasks to recompute: (stage, worker group or None, iteration or None) entries."""

    entries: frozenset[tuple[str, str | None, int | None]] = frozenset()

    def __call__(self, stage: str, iteration: int | None = None, wg: str | None = None) -> bool:
        return any(s == stage and w in (None, wg) and i in (None, iteration) for s, w, i in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


def parse_force(items: Iterable[str], config: DrmasConfig) -> Force:
    """``STAGE[@ITERATION]``: warmstart, rollout, advantage, update (every worker group),
    update/WG or policy/WG (one), checkpoint, evaluate. Without ``@ITERATION`` the stage
    recomputes in every iteration of the pipeline."""
    groups = [group.name for group in config.worker_groups()]
    entries = set()
    for item in items:
        text, _, at = item.partition("@")
        stage, _, wg = text.partition("/")
        if stage == "policy":
            stage = "update"
        problems = []
        if stage not in STAGES:
            problems.append(f"unknown stage {text!r}; stages: {', '.join(STAGES)}, update/WG")
        elif wg and stage != "update":
            problems.append(f"only update takes a worker group (update/WG), not {stage}")
        elif wg and wg not in groups:
            problems.append(f"no worker group {wg!r}; worker groups: {', '.join(groups)}")
        if at and not re.fullmatch(r"-?\d+", at):
            problems.append(f"{at!r} is not an iteration")
        if problems:
            raise ValueError(f"--force {item}: {'; '.join(problems)}")
        entries.add((stage, wg or None, int(at) if at else None))
    return Force(frozenset(entries))


def pipeline_name(kind: str, config: DrmasConfig) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", config.experiment.name.lower()).strip("-")
    return f"drmas-{kind.replace('_', '-')}-{slug}"


def store_uri(config: DrmasConfig, path: str) -> str:
    """The store address of ``path`` for this config, without opening the store (no S3
    call at compile time); the same string as ``Store.uri``."""
    root = config.store.root
    root = root.rstrip("/") if root.startswith("s3://") else str(Path(root).resolve())
    return f"{root}/{path}"


class _Builder:
    """Creates the tasks of one pipeline: placed, named, and forced where asked."""

    def __init__(
        self, config: DrmasConfig, force: Force, placement: PlacementRule, images: dict[str, str] | None = None
    ) -> None:
        self.config, self.force, self.placement = config, force, placement
        self.images = {**components.IMAGES, **(images or {})}
        self.groups = [group.name for group in config.worker_groups()]
        if len(self.groups) > components.MAX_WORKER_GROUPS:
            raise ValueError(
                f"{len(self.groups)} worker groups; the pipelines take at most {components.MAX_WORKER_GROUPS}"
            )

    def task(self, stage: str, task: PipelineTask, name: str, forced: bool = False) -> PipelineTask:
        task.set_display_name(name)
        task.set_caching_options(not forced and self._cacheable(stage))
        placement = self.placement(stage, self.config)
        with cheap_setter_checks():
            task.set_container_image(self.images[image_flavor(placement)])
            return place(task, placement)

    def _cacheable(self, stage: str) -> bool:
        """Whether KFP may skip the task when its inputs are the same artifacts. Not an
        update whose optimizer states are stored only every ``checkpoint.every``-th
        iteration: skipped, it leaves the pool no state for the next update (drmas's own
        cache, which the task still consults, reuses only updates whose state is stored). Nor
        the tracking step that opens the MLflow run."""
        if stage == "track_start":
            return False  # each KFP run that continues the drmas run tags it with its own id
        return stage != "update" or self.config.checkpoint.every == 1

    def starting_point(self, config_json, run_id, first: int, start_checkpoint):
        """(policies, reference) for iteration ``first``: the warm start, or the imported
        checkpoint of iteration ``first - 1``; the warm start stays the KL anchor."""
        warm = None
        if first == 0 or self.config.algorithm.kl_coef:
            forced = self.force("warmstart")
            warm = self.task(
                "warmstart",
                components.warmstart(config_json=config_json, run_id=run_id, force=forced),
                "warm start",
                forced,
            )
        if first == 0:
            return warm.outputs["policies"], warm.outputs["policies"]
        imported = dsl.importer(artifact_uri=start_checkpoint, artifact_class=Model, reimport=False)
        imported.set_display_name(f"import checkpoint {first - 1}")
        loaded = components.load_checkpoint(
            config_json=config_json, checkpoint=imported.output, run_id=run_id, next_iteration=first
        )
        self.task("load_checkpoint", loaded, f"load checkpoint {first - 1}")
        policies = loaded.outputs["policies"]
        return policies, (warm.outputs["policies"] if warm is not None else policies)

    def evaluate_checkpoint(self, config_json, policies):
        """The evaluation pipeline's one evaluation, named after its settings."""
        forced = self.force("evaluate")
        task = components.evaluate(config_json=config_json, policies=policies, label="", force=forced)
        return self.task("evaluate", task, "evaluate", forced)

    def track_start(self, config_json, run_id, first: int) -> PipelineTask:
        """The step that opens the run's MLflow run and links to it (runs beside the stages)."""
        task = components.track_start(
            config_json=config_json,
            run_id=run_id,
            first_iteration=first,
            kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            image=self.images["gpu"],
        )
        return self.task("track_start", task, "mlflow: start")

    def track(self, config_json, run_id, iteration: int, after: PipelineTask, name: str, **inputs) -> PipelineTask:
        """The step that logs ``iteration`` (-1: the evaluation before training) once its
        ``inputs`` exist, after the tracking step ``after`` (MLflow gets the steps in order)."""
        task = components.track(config_json=config_json, run_id=run_id, iteration=iteration, **inputs)
        return self.task("track", task, name).after(after)

    def run(self, config_json, run_id, start, reference, steps: list[Step], tracked: PipelineTask):
        """The tasks of ``steps`` (``drmas.stages.iteration.run_steps``): each wired to the
        outputs it reads, each pool user after the one before it, and each iteration
        logged to MLflow once its last step is done, after the tracking step ``tracked``;
        returns the last policy set and its tracking step."""
        policies, pool_user = start, None
        for iteration, group in itertools.groupby(steps, key=lambda step: step.iteration):
            made: dict[str, PipelineTask] = {}
            for step in group:
                made[step.name] = task = self.step(step, config_json, run_id, policies, reference, made)
                if step.uses_pool:
                    if pool_user is not None:
                        task.after(pool_user)
                    pool_user = task
            logged = {}
            if "checkpoint" in made:
                policies = logged["checkpoint"] = made["checkpoint"].outputs["checkpoint"]
            if "evaluate" in made:
                logged["evaluation"] = made["evaluate"].outputs["results"]
            name = "mlflow: before training" if iteration < 0 else f"mlflow: iteration {iteration}"
            tracked = self.track(config_json, run_id, iteration, tracked, name, **logged)
        return policies, tracked

    def step(self, step: Step, config_json, run_id, start, reference, made: dict[str, PipelineTask]) -> PipelineTask:
        """The task of one step; ``start`` is the policy set its iteration starts from and
        ``made`` the tasks of its iteration so far (what it reads)."""
        i, forced = step.iteration, self.force(step.stage, step.iteration, step.wg)
        if step.stage == "rollout":
            task = components.rollout(config_json=config_json, run_id=run_id, iteration=i, policies=start, force=forced)
        elif step.stage == "advantage":
            trajectories = made["rollout"].outputs["trajectories"]
            task = components.advantage(
                config_json=config_json, run_id=run_id, iteration=i, trajectories=trajectories, force=forced
            )
        elif step.stage == "update":
            task = components.update(
                config_json=config_json,
                run_id=run_id,
                iteration=i,
                wg=step.wg,
                batch=made["advantage"].outputs["batch"],
                policies=start,
                reference=reference,
                force=forced,
            )
        elif step.stage == "checkpoint":
            slots = {f"update_{slot}": made[name].outputs["policy"] for slot, name in enumerate(step.reads)}
            task = components.checkpoint(config_json=config_json, run_id=run_id, iteration=i, force=forced, **slots)
        elif step.stage == "evaluate":
            policies = made["checkpoint"].outputs["checkpoint"] if "checkpoint" in made else start
            label = step.variant or "evaluate"  # the final evaluation is stored as iter-N/final
            task = components.evaluate(
                config_json=config_json, policies=policies, run_id=run_id, label=label, force=forced
            )
        else:
            raise ValueError(f"{step.title}: no component for the stage {step.stage!r}")
        return self.task(step.stage, task, step.title, forced)


def _iteration_pipeline(
    kind: str,
    config: DrmasConfig,
    run_id: str,
    first: int,
    last: int,
    force: Force,
    placement: PlacementRule,
    images: dict[str, str] | None = None,
):
    builder = _Builder(config, force, placement, images)
    before = kind == "train" and first == 0 and bool(config.eval.every)

    def body(config_json, run_id, start_checkpoint):
        tracked = builder.track_start(config_json, run_id, first)
        policies, reference = builder.starting_point(config_json, run_id, first, start_checkpoint)
        steps = run_steps(config, first, last, evaluate_before=before)
        checkpoint, tracked = builder.run(config_json, run_id, policies, reference, steps, tracked)
        end = components.track_end(
            config_json=config_json, run_id=run_id, last_iteration=last - 1, checkpoint=checkpoint
        )
        builder.task("track", end, "mlflow: end").after(tracked)
        return checkpoint

    what = f"iterations {first}..{last - 1}" if last - first > 1 else f"iteration {first}"
    start = "from the warm start" if first == 0 else f"from the checkpoint of iteration {first - 1}"
    description = f"drmas {kind}: {config.experiment.name}, {what} {start}; worker groups {', '.join(builder.groups)}"
    decorate = dsl.pipeline(name=pipeline_name(kind, config), description=description)
    defaults = {"config_json": config.to_json(), "run_id": run_id}
    if first == 0:

        def pipeline(config_json: str = defaults["config_json"], run_id: str = defaults["run_id"]) -> Model:
            return body(config_json, run_id, None)

    else:
        default_checkpoint = store_uri(config, stage_path(config.experiment.name, run_id, first - 1, "checkpoint"))

        def pipeline(
            config_json: str = defaults["config_json"],
            run_id: str = defaults["run_id"],
            start_checkpoint: str = default_checkpoint,
        ) -> Model:
            return body(config_json, run_id, start_checkpoint)

    return decorate(pipeline)


def training_pipeline(
    config: DrmasConfig,
    run_id: str,
    start_iteration: int = 0,
    force: Force = Force(),
    placement: PlacementRule = placement_for,
    iterations: int | None = None,
    images: dict[str, str] | None = None,
):
    """Warm start (or the checkpoint of ``start_iteration - 1``), then every iteration up to
    ``experiment.iterations`` (or ``iterations`` of them), chained; evaluation before
    training and when due.

    A compiled pipeline holds every task's spec (a few KiB each, about 37 KiB per
    iteration of two worker groups), and KFP keeps a run's whole spec in its database and
    workflow: split a long run into pipelines of ``iterations`` each, every one starting
    from the checkpoint the previous one ended with.
    """
    total = config.total_iterations
    if not 0 <= start_iteration < total:
        raise ValueError(f"start iteration {start_iteration} is not in 0..{total - 1} (experiment.iterations={total})")
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations must be at least 1, not {iterations}")
    last = config.iterations_from(start_iteration, iterations).stop
    return _iteration_pipeline("train", config, run_id, start_iteration, last, force, placement, images)


def iteration_pipeline(
    config: DrmasConfig,
    run_id: str,
    iteration: int = 0,
    force: Force = Force(),
    placement: PlacementRule = placement_for,
    images: dict[str, str] | None = None,
):
    """One RL iteration of the run: from the warm start (iteration 0) or the checkpoint of
    the iteration before (imported by URI)."""
    if iteration < 0:
        raise ValueError(f"iteration {iteration} is negative")
    return _iteration_pipeline("rl_iteration", config, run_id, iteration, iteration + 1, force, placement, images)


def evaluation_pipeline(
    config: DrmasConfig,
    checkpoint: str,
    force: Force = Force(),
    placement: PlacementRule = placement_for,
    images: dict[str, str] | None = None,
):
    """Evaluate the checkpoint at URI ``checkpoint`` (a pipeline parameter) on the eval set
    and eval settings of ``config``; results go beside it, to ``evaluate-{hash}``."""
    builder = _Builder(config, force, placement, images)

    @dsl.pipeline(
        name=pipeline_name("evaluate", config),
        description=f"drmas evaluate: a checkpoint of {config.experiment.name} on {config.data_spec('eval')}",
    )
    def pipeline(config_json: str = config.to_json(), checkpoint: str = checkpoint) -> Dataset:
        imported = dsl.importer(artifact_uri=checkpoint, artifact_class=Model, reimport=False)
        imported.set_display_name("import checkpoint")
        loaded = builder.task(
            "load_checkpoint",
            components.load_checkpoint(config_json=config_json, checkpoint=imported.output),
            "load checkpoint",
        )
        return builder.evaluate_checkpoint(config_json, loaded.outputs["policies"]).outputs["results"]

    return pipeline


def default_checkpoint(config: DrmasConfig, run_id: str, iteration: int | None = None) -> str:
    """The store URI of the run's checkpoint of ``iteration`` (default: the last one)."""
    i = config.total_iterations - 1 if iteration is None else iteration
    return store_uri(config, stage_path(config.experiment.name, run_id, i, "checkpoint"))


def build_pipeline(
    kind: str,
    config: DrmasConfig,
    run_id: str,
    start_iteration: int = 0,
    checkpoint: str | None = None,
    force: Iterable[str] = (),
    iterations: int | None = None,
    images: dict[str, str] | None = None,
):
    """The pipeline ``kind`` (train, rl_iteration or evaluate) for this config, and the
    arguments to run it with (every parameter, explicitly); ``images``: the image of each
    flavor ({"cpu": ..., "gpu": ...}; default the components' own)."""
    forced = parse_force(force, config)
    if kind == "evaluate":
        uri = checkpoint or default_checkpoint(config, run_id)
        return evaluation_pipeline(config, uri, forced, images=images), {
            "config_json": config.to_json(),
            "checkpoint": uri,
        }
    if kind == "train":
        func = training_pipeline(config, run_id, start_iteration, forced, iterations=iterations, images=images)
    elif kind == "rl_iteration":
        func = iteration_pipeline(config, run_id, start_iteration, forced, images=images)
    else:
        raise ValueError(f"unknown pipeline {kind!r}; pipelines: {', '.join(PIPELINES)}")
    arguments = {"config_json": config.to_json(), "run_id": run_id}
    if start_iteration > 0:
        arguments["start_checkpoint"] = checkpoint or default_checkpoint(config, run_id, start_iteration - 1)
    return func, arguments


def compile_pipeline(func, path: str | Path) -> Path:
    """Write the compiled pipeline (IR YAML with the Kubernetes platform spec)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(func, str(path))
    return path
