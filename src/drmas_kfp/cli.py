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
    submit_cmd.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding a bearer token for the KFP API server (multi-user Kubeflow from outside the "
        "cluster, e.g. `kubectl create token default-editor -n NAMESPACE > token`), re-read before every "
        "request; default $KF_PIPELINES_SA_TOKEN_PATH. A token can also come from $DRMAS_KFP_TOKEN, and "
        "Kubeflow's login cookie (authservice_session=...) from $DRMAS_KFP_COOKIES",
    )
    submit_cmd.add_argument("-o", "--output", help="also keep the compiled pipeline here (the first part's)")
    submit_cmd.add_argument(
        "--follow",
        action="store_true",
        help="stay and submit each next part when the part before it has succeeded; stop on a failure with "
        "the command that continues. Run again, it submits no part that already succeeded and follows a "
        "part still running instead of submitting it twice",
    )
    submit_cmd.add_argument(
        "--poll-seconds",
        type=float,
        default=FOLLOW_POLL_S,
        metavar="S",
        help=f"with --follow: ask the API server for the run's state every S seconds (default {FOLLOW_POLL_S:g})",
    )
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
"""The most iterations ``drmas compile|submit`` put in one KFP run (about 37 KiB of spec each)."""
FOLLOW_POLL_S = 60.0
"""How often ``drmas submit --follow`` asks for the state of the run it follows: an
iteration of the GPU recipes takes many minutes."""


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
        help=f"train: at most N iterations in one KFP run (default {ITERATIONS_PER_RUN}; 0: no limit); a longer "
        "run is split in parts: compile writes one file per part, submit starts the first part and prints the "
        "command of each next one (with --follow it submits each itself)",
    )


def _parts(args: argparse.Namespace, config: DrmasConfig) -> list[tuple[int, int]]:
    """(first iteration, iterations) of each KFP run a train pipeline is split in; one part
    (its iterations as given) for a run of at most --iterations-per-run, or another pipeline."""
    start = args.start_iteration
    end = config.iterations_from(start, args.iterations).stop
    size = args.iterations_per_run
    if args.pipeline != "train" or size <= 0 or end - start <= size or start >= end:
        return [(start, args.iterations)] if args.pipeline == "train" else [(start, 0)]
    return [(first, min(size, end - first)) for first in range(start, end, size)]


def _submit_command(
    args: argparse.Namespace,
    run_id: str,
    images: dict[str, str],
    first: int,
    count: int | None,
    run_name: str | None,
    follow: bool = False,
) -> str:
    """The exact `drmas submit` of a later part (or, with ``follow``, of the parts from
    ``first`` on): the same config, overrides and options, the run id and images pinned (a
    later build does not change a run's images). Credentials stay out of it: a token file
    is named by its path, a token or cookies stay in the environment."""
    import shlex  # noqa: PLC0415

    words = ["drmas", "submit", args.config, *args.overrides, "--host", args.host, "--run-id", run_id]
    words += ["--start-iteration", str(first)] + (["--iterations", str(count)] if count is not None else [])
    words += ["--iterations-per-run", str(args.iterations_per_run)]
    if args.pipeline != "train":
        words += ["--pipeline", args.pipeline]
    if args.checkpoint is not None:
        words += ["--checkpoint", args.checkpoint]
    registries = {reference.rpartition(":")[0].rpartition("/")[0] for reference in images.values()}
    tags = {reference.rpartition(":")[2] for reference in images.values()}
    if len(registries) == 1 and len(tags) == 1:
        words += ["--image-registry", registries.pop(), "--image-tag", tags.pop()]
    if args.kfp_backend != "2.15":
        words += ["--kfp-backend", args.kfp_backend]
    for option in ("experiment", "namespace", "service_account", "token_file"):
        if getattr(args, option) is not None:
            words += [f"--{option.replace('_', '-')}", getattr(args, option)]
    if run_name is not None:
        words += ["--run-name", run_name]
    for item in args.force:
        words += ["--force", item]
    if follow:
        words += ["--follow"] + (
            ["--poll-seconds", f"{args.poll_seconds:g}"] if args.poll_seconds != FOLLOW_POLL_S else []
        )
    return shlex.join(words)


def compile_or_submit(args: argparse.Namespace) -> int:
    """``drmas compile`` and ``drmas submit``: the pipeline built from the config and
    compiled for --kfp-backend, then written (compile) or started on Kubeflow (submit). A
    train run longer than --iterations-per-run is split in parts (``_parts``): compile
    writes one file per part, submit starts the first part and prints the rest, or with
    --follow submits each when the one before it has succeeded."""
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
    parts = _parts(args, config)
    if args.command == "submit":
        return _submit(args, config, run_id, images, parts)
    return _compile_parts(args, config, run_id, images, parts)


def _compile_parts(
    args: argparse.Namespace, config: DrmasConfig, run_id: str, images: dict[str, str], parts: list[tuple[int, int]]
) -> int:
    """``drmas compile``: the pipeline written to --output, or, split in parts, each part
    to its own file beside it (``_part_path``): KFP keeps a run's whole spec, and a
    200-iteration spec (7.4 MB) is more than its database row and Argo's workflow object
    in etcd (1.5 MiB) hold. Each part's ``start_checkpoint`` defaults to the checkpoint
    the part before it ends with, so the parts run one after the other as compiled."""
    output = Path(args.output)
    for index, (first, count) in enumerate(parts, start=1):
        built = _build_pipeline(args, config, run_id, images, first, count if len(parts) > 1 else None)
        if built is None:
            return 2
        func, arguments = built
        try:
            path = _compiled(args, func, _part_path(output, index, len(parts)))
        except ValueError as error:
            return fail(args.command, error, 2)
        what = f"iterations {first}..{first + count - 1} (part {index}/{len(parts)}) of " if len(parts) > 1 else ""
        print(f"compiled {what}the {args.pipeline} pipeline {func.name} to {path}")
        print(
            f"parameters: {', '.join(f'{k}={v}' for k, v in arguments.items() if k != 'config_json')} (and config_json)"
        )
    if len(parts) > 1:
        print(
            f"the run has {sum(count for _, count in parts)} iterations, more than --iterations-per-run "
            f"{args.iterations_per_run}: run the parts in order, each once the one before it has succeeded "
            "(drmas submit --follow does that)"
        )
    return 0


def _part_path(output: Path, index: int, parts: int) -> Path:
    """Where part ``index`` of ``parts`` is written: --output itself for a single part, else
    ``NAME-partKK-of-NN.SUFFIX`` beside it (numbers padded, so the files sort in order)."""
    if parts == 1:
        return output
    width = len(str(parts))
    return output.with_name(f"{output.stem}-part{index:0{width}d}-of-{parts}{output.suffix}")


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


def _compiled(args: argparse.Namespace, func: typing.Any, path: Path) -> Path:
    """The pipeline compiled to ``path`` for --kfp-backend, the changes that backend needs
    printed (ValueError: it cannot run there), and a warning when it is too large for one
    KFP run (with --iterations-per-run 0, or a pipeline of very many worker groups)."""
    from drmas_kfp.pipelines.build import compile_pipeline  # noqa: PLC0415
    from drmas_kfp.pipelines.platform import for_backend  # noqa: PLC0415

    compile_pipeline(func, path)
    for change in for_backend(path, args.kfp_backend):
        print(f"drmas {args.command}: for KFP {args.kfp_backend}: {change}", file=sys.stderr)
    if path.stat().st_size > LARGE_PIPELINE:
        print(
            f"drmas {args.command}: warning: the compiled pipeline is {path.stat().st_size >> 20} MiB; "
            "KFP keeps a run's whole spec (its database, the Argo workflow in etcd: 1.5 MiB): run it in "
            "parts with --iterations N and --start-iteration K",
            file=sys.stderr,
        )
    return path


def _part_label(parts: list[tuple[int, int]], index: int) -> str:
    """``iterations A..B (part K/N)`` for part ``index`` (from 1) of a run split in parts."""
    first, count = parts[index - 1]
    return f"iterations {first}..{first + count - 1} (part {index}/{len(parts)})"


def _run_name(args: argparse.Namespace, run_id: str, parts: list[tuple[int, int]], index: int) -> str:
    """The KFP run name of part ``index``: the same for the same command, which is how a
    resubmission finds the part's earlier runs (``find_run``)."""
    if len(parts) > 1:
        return f"{args.run_name or run_id} {_part_label(parts, index)}"
    return args.run_name or f"{run_id} {args.pipeline}" + (f" (force {', '.join(args.force)})" if args.force else "")


def _submit(
    args: argparse.Namespace,
    config: DrmasConfig,
    run_id: str,
    images: dict[str, str],
    parts: list[tuple[int, int]],
) -> int:
    """Start the pipeline's first part as a KFP run and print how to submit each later part;
    with --follow, submit each part once the one before it has succeeded, skipping a part
    that an earlier submission already ran to success and following one still running."""
    from drmas_kfp.pipelines.submit import Credentials, connect  # noqa: PLC0415

    if not config.store.root.startswith("s3://"):
        print(
            f"drmas submit: warning: store.root is {config.store.root!r}, a local folder; the pipeline's pods "
            "see it only if it is a volume mounted there (use s3://bucket/prefix)",
            file=sys.stderr,
        )
    if not (config.tracking.uri or "").startswith(("http://", "https://")):
        print(
            f"drmas submit: warning: tracking.uri is {config.tracking.uri or 'unset'}: each pipeline step would "
            "log to an MLflow file in its own pod, lost when the pod ends; give the MLflow server's address "
            "(the manifests': tracking.uri=http://mlflow.drmas.svc.cluster.local:5000)",
            file=sys.stderr,
        )
    if args.poll_seconds <= 0:
        return fail(args.command, f"--poll-seconds must be more than 0, not {args.poll_seconds:g}")
    try:
        client = connect(args.host, args.namespace, Credentials.from_environment(args.token_file))
    except ImportError as error:
        return fail(args.command, f"{error}: {KUBEFLOW_EXTRA}", 2)
    except ValueError as error:
        return fail(args.command, error)
    except Exception as error:
        return fail(args.command, f"could not start the run on {args.host}: {type(error).__name__}: {error}")
    if not args.follow:
        submitted = _submit_part(args, config, run_id, images, parts, 1, client)
        if submitted is None:
            return 1
        if len(parts) > 1:
            _print_next_parts(args, run_id, images, parts)
        return 0
    return _follow(args, config, run_id, images, parts, client)


def _submit_part(
    args: argparse.Namespace,
    config: DrmasConfig,
    run_id: str,
    images: dict[str, str],
    parts: list[tuple[int, int]],
    index: int,
    client: typing.Any,
) -> str | None:
    """Compile part ``index`` and create its KFP run; its run id, or None after saying why not."""
    import tempfile  # noqa: PLC0415

    from drmas_kfp.pipelines.submit import run_url, submit  # noqa: PLC0415

    first, count = parts[index - 1]
    built = _build_pipeline(args, config, run_id, images, first, count if len(parts) > 1 else None)
    if built is None:
        return None
    func, arguments = built
    with tempfile.TemporaryDirectory() as scratch:
        keep = args.output and index == 1
        try:
            path = _compiled(args, func, Path(args.output) if keep else Path(scratch) / "pipeline.yaml")
        except ValueError as error:
            fail(args.command, error)
            return None
        try:  # service account None: drmas-pipeline, or in a Profile namespace its default-editor
            kfp_run = submit(
                client,
                path,
                arguments,
                args.experiment or config.experiment.name,
                _run_name(args, run_id, parts, index),
                args.namespace,
                args.service_account,
            )
        except Exception as error:
            fail(args.command, f"could not start the run on {args.host}: {type(error).__name__}: {error}")
            return None
    what = f"{_part_label(parts, index)} of the " if len(parts) > 1 else "the "
    print(
        f"submitted {what}{args.pipeline} pipeline {func.name} as KFP run {kfp_run} (drmas run {run_id}): "
        f"{run_url(args.host, kfp_run)}",
        flush=True,
    )
    return kfp_run


def _print_next_parts(
    args: argparse.Namespace, run_id: str, images: dict[str, str], parts: list[tuple[int, int]]
) -> None:
    """The exact command of each part after the first, to run once the one before it succeeded."""
    print(
        f"the run has {sum(count for _, count in parts)} iterations, more than --iterations-per-run "
        f"{args.iterations_per_run}: KFP keeps a run's whole spec, and cannot start a run when another ends. "
        "Each next part starts from the checkpoint of the part before it: submit it once the KFP run before "
        "it has succeeded (or submit with --follow, which does that):"
    )
    for index, (start, size) in enumerate(parts[1:], start=2):
        print(f"  # {_part_label(parts, index)}")
        print(f"  {_submit_command(args, run_id, images, start, size, _run_name(args, run_id, parts, index))}")


def _follow(
    args: argparse.Namespace,
    config: DrmasConfig,
    run_id: str,
    images: dict[str, str],
    parts: list[tuple[int, int]],
    client: typing.Any,
) -> int:
    """``drmas submit --follow``: each part in turn, submitted unless an earlier run of it
    (found by its run name) succeeded or is still going, then followed until it ends. A
    part that fails, an API server that stops answering and an interrupt all end with the
    command that continues: this one again, which skips the parts that succeeded."""
    from drmas_kfp.pipelines.submit import SUCCEEDED, find_run, run_url, wait_for_run  # noqa: PLC0415

    experiment = args.experiment or config.experiment.name
    again = _submit_command(args, run_id, images, args.start_iteration, args.iterations, args.run_name, follow=True)

    def stop(message: str, status: int = 1) -> int:
        fail(args.command, message)
        print(f"to continue (the parts that succeeded are not submitted again):\n  {again}", file=sys.stderr)
        return status

    for index in range(1, len(parts) + 1):
        name = _run_name(args, run_id, parts, index)
        try:
            earlier = find_run(client, experiment, name, args.namespace)
            if earlier is not None and earlier.state == SUCCEEDED:
                print(f"{name}: KFP run {earlier.run_id} succeeded before: not submitted again", flush=True)
                continue
            if earlier is not None:
                print(f"{name}: following KFP run {earlier.run_id}, submitted before ({earlier.state.lower()})")
                kfp_run = earlier.run_id
            elif (kfp_run := _submit_part(args, config, run_id, images, parts, index, client)) is None:
                return stop(f"{name} was not submitted")
            ended = wait_for_run(client, kfp_run, args.poll_seconds, lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            return stop("interrupted; the KFP runs go on without this command", 130)
        except Exception as error:
            return stop(f"the KFP API server {args.host} failed: {type(error).__name__}: {error}")
        if ended.state != SUCCEEDED:
            return stop(f"{name}: KFP run {kfp_run} {ended.state.lower()}: {run_url(args.host, kfp_run)}")
    print(f"every part of drmas run {run_id} succeeded", flush=True)
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
