"""The Kubeflow verbs of the command line: ``drmas compile``, ``drmas submit`` and
``drmas run --via kfp-local``. ``drmas.cli`` registers them (``register``) and keeps no
Kubeflow logic of its own.

This module imports only the standard library and drmas at its top, so the commands exist
(and ``--help`` works) without kfp; kfp, which the ``kubeflow`` extra installs, is imported
when a command builds a pipeline, and without it the command says which extra to install.
"""

from __future__ import annotations

import argparse
import sys
import time
import typing
from pathlib import Path

from drmas.cli_common import (
    config_arguments,
    fail,
    iteration_count,
    load,
    refuse_unless_it_fits,
    run_id_of,
    start_run,
    with_run_length,
)
from drmas.config import DrmasConfig

__all__ = ["KUBEFLOW_EXTRA", "add_run_options", "register", "run_kfp_local"]

KUBEFLOW_EXTRA = "the Kubeflow layer needs kfp: install drmas with its kubeflow extra (pip install 'drmas[kubeflow]')"


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``compile`` and ``submit`` to the command line; each dispatches to its handler
    (``args.handler``)."""
    compile_cmd = commands.add_parser("compile", help="compile the Kubeflow pipeline of a config to YAML")
    config_arguments(compile_cmd)
    compile_cmd.add_argument("-o", "--output", required=True, help="where to write the compiled pipeline (YAML)")
    pipeline_options(compile_cmd)
    _cluster_options(compile_cmd)
    compile_cmd.set_defaults(handler=compile_or_submit)

    submit_cmd = commands.add_parser("submit", help="compile the Kubeflow pipeline of a config and start a run")
    config_arguments(submit_cmd)
    submit_cmd.add_argument("--host", required=True, help="the Kubeflow Pipelines API, e.g. http://localhost:8080")
    submit_cmd.add_argument("--experiment", help="KFP experiment (default: experiment.name)")
    submit_cmd.add_argument("--run-name", help="KFP run name (default: the run id and the pipeline)")
    submit_cmd.add_argument("--namespace", help="Kubernetes namespace of a multi-user Kubeflow")
    submit_cmd.add_argument(
        "--service-account",
        default=None,
        help="the steps' ServiceAccount (default: drmas-pipeline, or with --namespace '': the namespace's "
        "default-editor; '' for the namespace default)",
    )
    submit_cmd.add_argument("-o", "--output", help="also keep the compiled pipeline here (the first part's)")
    pipeline_options(submit_cmd)
    _cluster_options(submit_cmd)
    submit_cmd.set_defaults(handler=compile_or_submit)


def add_run_options(run_cmd: argparse.ArgumentParser) -> None:
    """The options ``drmas run`` takes for ``--via kfp-local``."""
    pipeline_options(run_cmd, run_id=False)
    run_cmd.add_argument(
        "--parallel",
        action="store_true",
        help="with --via kfp-local: start every task whose dependencies are done at once, each in its own "
        "process, as Argo does on a cluster (default: one task at a time, as kfp.local does)",
    )


def pipeline_options(command: argparse.ArgumentParser, run_id: bool = True) -> None:
    """The options shared by compile, submit and run --via kfp-local."""
    command.add_argument(
        "--pipeline",
        choices=("train", "rl_iteration", "evaluate"),
        default="train",
        help="train: warm start then every iteration (default); rl_iteration: one iteration; evaluate: a checkpoint",
    )
    if run_id:
        command.add_argument("--run-id", help="the drmas run (store folder; default: experiment.run_id or a timestamp)")
    command.add_argument(
        "--start-iteration",
        type=int,
        default=0,
        metavar="K",
        help="train: start at iteration K from the checkpoint of K-1; rl_iteration: the iteration to run",
    )
    command.add_argument(
        "--iterations",
        type=iteration_count,
        metavar="N",
        help="train: at most N iterations from the start (default: up to experiment.iterations); "
        "split long runs: KFP keeps a run's whole spec, about 37 KiB per iteration",
    )
    command.add_argument(
        "--checkpoint",
        metavar="URI",
        help="store URI of the checkpoint to start from (default: the run's checkpoint of K-1) or, "
        "for --pipeline evaluate, to evaluate (default: the run's last)",
    )
    command.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="STAGE[@I]",
        help="recompute this stage (warmstart, rollout, advantage, update, update/WG, checkpoint, evaluate), "
        "in every iteration or in iteration I only, even where a cached result exists; repeatable",
    )


def _build_pipeline(
    args: argparse.Namespace,
    config: DrmasConfig,
    run_id: str,
    images: dict[str, str] | None = None,
    start: int | None = None,
    iterations: int | None = None,
    checkpoint: str | None = None,
):
    """The pipeline named by --pipeline, and its arguments (--start-iteration, --iterations,
    --checkpoint unless given here); None after printing a problem."""
    try:
        from drmas_kfp.pipelines.build import build_pipeline  # noqa: PLC0415 - kfp only for these commands
    except ImportError as error:
        fail(args.command, f"{error}: {KUBEFLOW_EXTRA}")
        return None
    try:
        return build_pipeline(
            args.pipeline,
            config,
            run_id,
            args.start_iteration if start is None else start,
            args.checkpoint if checkpoint is None else checkpoint,
            args.force,
            args.iterations if iterations is None else iterations,
            images=images,
        )
    except ValueError as error:
        fail(args.command, error)
        return None


LARGE_PIPELINE = 1 << 20
"""Compiled pipelines above this size get a warning (KFP keeps a run's whole spec)."""


ITERATIONS_PER_RUN = 10
"""The most iterations ``drmas submit`` puts in one KFP run (about 37 KiB of spec each)."""


def _cluster_options(command: argparse.ArgumentParser) -> None:
    """The options of compile and submit only: the images, the KFP backend, the parts."""
    command.add_argument(
        "--image-registry",
        metavar="REGISTRY",
        help="registry and namespace of the drmas images, e.g. registry.example.com/ml (default: that of the last "
        "images/build.sh, recorded in images/.last-build)",
    )
    command.add_argument(
        "--image-tag", metavar="TAG", help="tag of the drmas images (default: that of the last images/build.sh)"
    )
    command.add_argument(
        "--kfp-backend",
        metavar="VERSION",
        default="2.15",
        help="the Kubeflow Pipelines version the pipeline runs on (default 2.15; 2.3 or later: older versions get "
        "a spec without the fields they do not know, and the drmas-s3 secret must then hold AWS_ENDPOINT_URL)",
    )
    command.add_argument(
        "--iterations-per-run",
        type=int,
        default=ITERATIONS_PER_RUN,
        metavar="N",
        help=f"train: at most N iterations in one KFP run (default {ITERATIONS_PER_RUN}; 0: no limit); submit "
        "starts the first part and prints the command of each next one, compile warns above it",
    )


def _parts(args: argparse.Namespace, config: DrmasConfig) -> list[tuple[int, int]]:
    """(first iteration, iterations) of each KFP run a train submission takes."""
    start = args.start_iteration
    end = config.iterations_from(start, args.iterations).stop
    size = args.iterations_per_run
    if args.pipeline != "train" or size <= 0 or end - start <= size or start >= end:
        return [(start, args.iterations)] if args.pipeline == "train" else [(start, 0)]
    return [(first, min(size, end - first)) for first in range(start, end, size)]


def _next_part_command(
    args: argparse.Namespace, run_id: str, images: dict[str, str], first: int, count: int, part: str
) -> str:
    """The exact `drmas submit` of a later part: the same config, overrides and options,
    the run id and images pinned (a later build does not change a run's images)."""
    import shlex  # noqa: PLC0415

    words = ["drmas", "submit", args.config, *args.overrides, "--host", args.host, "--run-id", run_id]
    words += ["--start-iteration", str(first), "--iterations", str(count)]
    words += ["--iterations-per-run", str(args.iterations_per_run)]
    registries = {reference.rpartition(":")[0].rpartition("/")[0] for reference in images.values()}
    tags = {reference.rpartition(":")[2] for reference in images.values()}
    if len(registries) == 1 and len(tags) == 1:
        words += ["--image-registry", registries.pop(), "--image-tag", tags.pop()]
    if args.kfp_backend != "2.15":
        words += ["--kfp-backend", args.kfp_backend]
    for option in ("experiment", "namespace", "service_account"):
        if getattr(args, option) is not None:
            words += [f"--{option.replace('_', '-')}", getattr(args, option)]
    words += ["--run-name", f"{args.run_name or run_id} {part}"]
    for item in args.force:
        words += ["--force", item]
    return shlex.join(words)


def compile_or_submit(args: argparse.Namespace) -> int:
    """``drmas compile`` and ``drmas submit``: the pipeline built from the config and
    compiled for --kfp-backend, then written (compile) or started on Kubeflow (submit: a
    train run longer than --iterations-per-run starts its first part and prints the rest)."""
    config = load(args, logs=False)
    if (refused := refuse_unless_it_fits(args.command, config)) is not None:
        return refused
    run_id = run_id_of(args, config)
    try:
        images = _pipeline_images(args)
    except ValueError as error:
        return fail(args.command, error)
    if args.iterations_per_run < 0:
        return fail(args.command, f"--iterations-per-run must be 0 (no limit) or more, not {args.iterations_per_run}")
    config = with_run_length(config)
    parts = _parts(args, config) if args.command == "submit" else [(args.start_iteration, args.iterations)]
    first, count = parts[0]
    built = _build_pipeline(args, config, run_id, images, first, count if len(parts) > 1 else None)
    if built is None:
        return 2
    func, arguments = built
    iterations = (
        len(config.iterations_from(first, count)) if args.pipeline == "train" else int(args.pipeline == "rl_iteration")
    )
    if args.command == "submit":
        return _submit(args, config, run_id, images, parts, func, arguments, iterations)
    try:
        path = _compiled(args, func, Path(args.output), iterations)
    except ValueError as error:
        return fail(args.command, error, 2)
    print(f"compiled the {args.pipeline} pipeline {func.name} to {path}")
    print(f"parameters: {', '.join(f'{k}={v}' for k, v in arguments.items() if k != 'config_json')} (and config_json)")
    return 0


def _pipeline_images(args: argparse.Namespace) -> dict[str, str]:
    """The images the pipeline's tasks run (--image-registry/--image-tag, else the last
    images/build.sh), its warnings printed; ValueError for an unknown --kfp-backend or
    images it cannot name. Nothing when the Kubeflow layer is not installed
    (``_build_pipeline`` says why)."""
    try:
        from drmas_kfp.components.images import resolve_images  # noqa: PLC0415
        from drmas_kfp.pipelines.platform import check_backend  # noqa: PLC0415
    except ImportError:
        return {}
    check_backend(args.kfp_backend)
    resolved = resolve_images(args.image_registry, args.image_tag)
    for warning in resolved.warnings:
        print(f"drmas {args.command}: warning: {warning}", file=sys.stderr)
    return resolved.images


def _compiled(args: argparse.Namespace, func: typing.Any, path: Path, iterations: int) -> Path:
    """The pipeline compiled to ``path`` for --kfp-backend, the changes that backend needs
    printed (ValueError: it cannot run there), and a warning when it is too large for one
    KFP run."""
    from drmas_kfp.pipelines.build import compile_pipeline  # noqa: PLC0415
    from drmas_kfp.pipelines.platform import for_backend  # noqa: PLC0415

    compile_pipeline(func, path)
    for change in for_backend(path, args.kfp_backend):
        print(f"drmas {args.command}: for KFP {args.kfp_backend}: {change}", file=sys.stderr)
    if args.iterations_per_run and iterations > args.iterations_per_run:
        print(
            f"drmas {args.command}: warning: the pipeline runs {iterations} iterations, more than "
            f"--iterations-per-run {args.iterations_per_run}; KFP keeps a run's whole spec (its database, "
            "the Argo workflow in etcd: 1.5 MiB): drmas submit runs it in parts, or compile parts with "
            "--start-iteration K --iterations N",
            file=sys.stderr,
        )
    elif path.stat().st_size > LARGE_PIPELINE:
        print(
            f"drmas {args.command}: warning: the compiled pipeline is {path.stat().st_size >> 20} MiB; "
            "KFP keeps a run's whole spec (its database, the Argo workflow in etcd: 1.5 MiB): run it in "
            "parts with --iterations N and --start-iteration K",
            file=sys.stderr,
        )
    return path


def _submit(
    args: argparse.Namespace,
    config: DrmasConfig,
    run_id: str,
    images: dict[str, str],
    parts: list[tuple[int, int]],
    func: typing.Any,
    arguments: dict[str, typing.Any],
    iterations: int,
) -> int:
    """Start the pipeline (the first of ``parts``) as a KFP run, and print how to submit
    each later part."""
    import tempfile  # noqa: PLC0415

    from drmas_kfp.pipelines.submit import submit  # noqa: PLC0415

    if not config.store.root.startswith("s3://"):
        print(
            f"drmas submit: warning: store.root is {config.store.root!r}, a local folder; the pipeline's pods "
            "see it only if it is a volume mounted there (use s3://bucket/prefix)",
            file=sys.stderr,
        )
    first = parts[0][0]
    part = f"iterations {first}..{first + iterations - 1} (part 1/{len(parts)})" if len(parts) > 1 else ""
    if part:
        name = f"{args.run_name or run_id} {part}"
    else:
        name = args.run_name or f"{run_id} {args.pipeline}" + (
            f" (force {', '.join(args.force)})" if args.force else ""
        )
    with tempfile.TemporaryDirectory() as scratch:
        try:
            path = _compiled(
                args, func, Path(args.output) if args.output else Path(scratch) / "pipeline.yaml", iterations
            )
        except ValueError as error:
            return fail(args.command, error, 2)
        try:  # service account None: drmas-pipeline, or in a Profile namespace its default-editor
            kfp_run, url = submit(
                path,
                args.host,
                arguments,
                args.experiment or config.experiment.name,
                name,
                args.namespace,
                args.service_account,
            )
        except Exception as error:
            return fail("submit", f"could not start the run on {args.host}: {type(error).__name__}: {error}")
    what = f"{args.pipeline} pipeline {func.name}"
    if not part:
        print(f"submitted the {what} as KFP run {kfp_run} (drmas run {run_id}): {url}")
        return 0
    print(f"submitted {part} of the {what} as KFP run {kfp_run} (drmas run {run_id}): {url}")
    print(
        f"the run has {sum(count for _, count in parts)} iterations, more than --iterations-per-run "
        f"{args.iterations_per_run}: KFP keeps a run's whole spec, and cannot start a run when another ends. "
        "Each next part starts from the checkpoint of the part before it: submit it once the KFP run before "
        "it has succeeded:"
    )
    for index, (start, size) in enumerate(parts[1:], start=2):
        label = f"iterations {start}..{start + size - 1} (part {index}/{len(parts)})"
        print(f"  # {label}")
        print(f"  {_next_part_command(args, run_id, images, start, size, label)}")
    return 0


def run_kfp_local(args: argparse.Namespace) -> int:
    """``drmas run --via kfp-local``: the pipeline with kfp.local on this machine (finished
    tasks cached, so the same command continues), then what the embedded runner prints."""
    config, run_id = start_run(args)
    if (refused := refuse_unless_it_fits(args.command, config)) is not None:
        return refused
    config = with_run_length(config)
    built = _build_pipeline(args, config, run_id)
    if built is None:
        return 2
    func, arguments = built
    from drmas_kfp.pipelines.local import DEFAULT_ROOT, TaskLog, run_local  # noqa: PLC0415

    print(
        f"run {run_id}: the {args.pipeline} pipeline {func.name} with kfp.local (outputs and cache in {DEFAULT_ROOT})"
    )
    log = TaskLog(DEFAULT_ROOT / "logs" / f"{run_id}-{args.pipeline}-{time.strftime('%Y%m%d-%H%M%S')}.log", sys.stdout)
    try:
        output = run_local(func, arguments, config, DEFAULT_ROOT, log, parallel=args.parallel)
    except RuntimeError as error:
        return fail("run", f"the pipeline failed: {error}; kfp.local's log: {log.path}")
    except KeyboardInterrupt:
        return fail(
            "run", f"interrupted; run the same command again to continue run {run_id} (finished tasks are cached)", 130
        )
    finally:
        log.close()
    if args.pipeline != "evaluate":
        _print_pipeline_summary(args, config, run_id)
    where = output.metadata.get("store_uri", output.uri) if output is not None else ""
    print(f"{'results' if args.pipeline == 'evaluate' else 'checkpoint'}: {where}")
    print(f"kfp.local's log: {log.path}")
    return 0


def _print_pipeline_summary(args: argparse.Namespace, config: DrmasConfig, run_id: str) -> None:
    """What the embedded runner prints, from what the pipeline stored: a line per iteration
    it ran, the before/after table, and where the report and the MLflow run are."""
    import json  # noqa: PLC0415

    from drmas.analysis.report import run_history  # noqa: PLC0415
    from drmas.infra.layout import run_path  # noqa: PLC0415
    from drmas.infra.store import Store  # noqa: PLC0415
    from drmas.stages.track import TRACKING_FILE, RunSummary, summary_line, summary_table  # noqa: PLC0415

    store = Store.from_config(config.store)
    steps = dict(run_history(config, store, run_id))
    first = args.start_iteration
    span = (
        range(first, first + 1) if args.pipeline == "rl_iteration" else config.iterations_from(first, args.iterations)
    )
    ran = [i for i in span if i + 1 in steps]
    for i in ran:
        print(summary_line(i, steps[i + 1], config.eval.k))
    if not ran:
        return
    before = steps.get(0, {}) if first == 0 else {}
    if table := summary_table(RunSummary(run_id, len(ran), ran[-1], steps[ran[-1] + 1], before), config.eval.k):
        print(table)
    report = f"{run_path(config.experiment.name, run_id)}/report"
    if store.exists(report) and TRACKING_FILE in store.open(report).files:
        tracking = json.loads(store.open(report).read_bytes(TRACKING_FILE))
        print(f"report: {store.uri(report)}/report.md\nmlflow: {tracking.get('link', tracking['uri'])}")
