"""drmas: train cooperative multi-agent LLM teams with RL (Dr. MAS), here or on Kubeflow.

examples:
    drmas config CONFIG [a.b=value ...] [-o json|yaml]
                                          validate, print the resolved config (worker
                                          groups on stderr)
    drmas config --docs                   every config field with its documentation
    drmas run CONFIG [a.b=value ...] [--run-id ID] [--resume ID]
                                          train with the embedded runner (resumable)
    drmas eval CONFIG --run-id ID [--iteration I] [data.eval=FILE ...]
                                          evaluate a checkpoint (avg@k, pass@k)
    drmas rerun CONFIG --run-id ID --iteration I --stage advantage [--worker-group WG]
                                          recompute one stage from its stored inputs
    drmas compare CONFIG --advantage grpo,drmas --seeds 3 [a.b=value ...] [--name NAME]
                                          train per mode and seed, report gradient norms,
                                          Lemma 4.2 terms, spikes and eval side by side
    drmas plan CONFIG [a.b=value ...] [--device-memory 80GB] [-o text|json]
                                          memory per pool slot (engines, training state,
                                          activations, logits) and whether it fits
    drmas compile CONFIG [a.b=value ...] -o pipeline.yaml [--pipeline train|rl_iteration|evaluate]
                                          compile the Kubeflow pipeline of this config
    drmas submit CONFIG [a.b=value ...] --host URL [--experiment NAME] [--run-name NAME]
                                          compile it and start a run on Kubeflow Pipelines
                                          (a long run in parts of --iterations-per-run)
    drmas run CONFIG --via kfp-local [--force STAGE]
                                          run that pipeline with kfp.local on this machine
    drmas serve-retrieval --corpus FILE --store ROOT [--host H --port P]
                                          serve a search corpus (BM25) over HTTP for
                                          task.retrieval_url
    drmas import-gguf GGUF_FILE OUT_DIR [--dtype float32|bfloat16]
                                          convert a GGUF model file (llama.cpp's format)
                                          into a policy folder for models.NAME.source

Pipelines (compile, submit, run --via kfp-local) take --run-id, --start-iteration K (start
from the checkpoint of iteration K-1), --checkpoint URI and --force STAGE[@I] (recompute
that stage even where a cached result exists; repeatable). compile and submit take
--image-registry/--image-tag (default: the last images/build.sh) and --kfp-backend.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import types
import typing
from pathlib import Path

from pydantic import BaseModel

import drmas
from drmas.config import ConfigError, DrmasConfig, load_config
from drmas.stages.iteration import ITERATION_STAGES

if typing.TYPE_CHECKING:
    from drmas.infra.store import Store


def main(argv: list[str] | None = None) -> int:
    # transformers' per-file "Loading weights" bars would bury the per-iteration lines (Ray
    # workers inherit this too: they start after it is set).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    description, examples = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        prog="drmas", description=description, epilog=examples, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {drmas.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    config_cmd = commands.add_parser("config", help="validate a config and print it resolved")
    _config_arguments(config_cmd, optional=True)
    config_cmd.add_argument("--docs", action="store_true", help="document every field")
    config_cmd.add_argument(
        "-o",
        "--output",
        choices=("json", "yaml"),
        default="json",
        help="format of the resolved config on stdout (default: json); the worker groups go to stderr",
    )

    run_cmd = commands.add_parser("run", help="train a team with the embedded runner")
    _config_arguments(run_cmd)
    run_cmd.add_argument("--run-id", help="name of the run (default: experiment.run_id or a timestamp)")
    run_cmd.add_argument("--resume", metavar="RUN_ID", help="continue this run after its last complete iteration")
    run_cmd.add_argument(
        "--via",
        choices=("embedded", "kfp-local"),
        default="embedded",
        help="embedded: the runner in this process (default); kfp-local: the Kubeflow pipeline with kfp.local",
    )
    _pipeline_options(run_cmd, run_id=False)

    eval_cmd = commands.add_parser("eval", help="evaluate a run's checkpoint on an eval set")
    _config_arguments(
        eval_cmd, "YAML config file (its eval section and data.eval are used)", "e.g. data.eval=other.jsonl"
    )
    eval_cmd.add_argument("--run-id", required=True, help="the run whose checkpoint to evaluate")
    eval_cmd.add_argument("--iteration", type=int, metavar="I", help="checkpointed iteration (default: the last)")

    rerun_cmd = commands.add_parser("rerun", help="recompute one stage of an iteration from its stored inputs")
    _config_arguments(rerun_cmd, "YAML config file of the run", "must match the run's")
    rerun_cmd.add_argument("--run-id", required=True, help="the run whose iteration to recompute")
    rerun_cmd.add_argument(
        "--iteration", type=int, required=True, metavar="I", help="a checkpointed iteration of the run"
    )
    rerun_cmd.add_argument("--stage", required=True, choices=ITERATION_STAGES, help="the stage to recompute")
    rerun_cmd.add_argument(
        "--worker-group",
        metavar="WG",
        help="with --stage update: only this worker group's update (default: every group's)",
    )

    compare_cmd = commands.add_parser(
        "compare", help="train the same team per advantage mode and seed, and compare them"
    )
    _config_arguments(compare_cmd, overrides_help="for every run")
    compare_cmd.add_argument(
        "--advantage", default="grpo,drmas", help="comma-separated advantage modes (default: grpo,drmas)"
    )
    compare_cmd.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default: 3)")
    compare_cmd.add_argument(
        "--name", default="compare", help="prefix of the runs and folder of the report (default: compare)"
    )

    plan_cmd = commands.add_parser(
        "plan",
        help="the memory per pool slot and whether it fits the device (exit 1 when it does not)",
    )
    _config_arguments(plan_cmd)
    plan_cmd.add_argument(
        "--device-memory",
        metavar="SIZE",
        type=_device_memory,
        help="memory of one accelerator, e.g. 80GB (10^9 bytes) or 80GiB (default: ray.device_memory_gb)",
    )
    plan_cmd.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="a table (default) or JSON, bytes"
    )

    pool_cmd = commands.add_parser("pool", help="show or free a run's pool of workers on a Ray cluster")
    pool_cmd.add_argument("action", choices=("status", "down"), help="status: its workers; down: free them")
    pool_cmd.add_argument("run", metavar="EXPERIMENT/RUN_ID", help="the run, as its folder in the store names it")
    pool_cmd.add_argument("--address", help="the Ray cluster (default: $RAY_ADDRESS)")

    compile_cmd = commands.add_parser("compile", help="compile the Kubeflow pipeline of a config to YAML")
    _config_arguments(compile_cmd)
    compile_cmd.add_argument("-o", "--output", required=True, help="where to write the compiled pipeline (YAML)")
    _pipeline_options(compile_cmd)
    _cluster_options(compile_cmd)

    submit_cmd = commands.add_parser("submit", help="compile the Kubeflow pipeline of a config and start a run")
    _config_arguments(submit_cmd)
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
    _pipeline_options(submit_cmd)
    _cluster_options(submit_cmd)

    import_cmd = commands.add_parser(
        "import-gguf", help="convert a GGUF model file into a policy folder (HF layout, safetensors)"
    )
    import_cmd.add_argument("gguf_file", metavar="GGUF_FILE", help="the model file, e.g. from a package")
    import_cmd.add_argument("out_dir", metavar="OUT_DIR", help="the policy folder to create (must not exist)")
    import_cmd.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the saved weights (default: float32, the dequantised values exactly)",
    )

    # The service's command parses its own arguments (drmas.tasks.retrieval_service.main).
    commands.add_parser(
        "serve-retrieval",
        add_help=False,
        help="serve a search corpus over HTTP for every rollout and evaluation (drmas serve-retrieval --help)",
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-retrieval"]:
        from drmas.tasks.retrieval_service import main as serve  # noqa: PLC0415

        logging.getLogger("bm25s").setLevel(logging.WARNING)
        return serve(argv[1:])

    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow options (`--resume ID experiment.iterations=4`).
    if any("=" not in item or item.startswith("-") for item in extra) or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if getattr(args, "config", None) is not None and (problem := _config_file_problem(args.config)):
        commands.choices[args.command].error(problem)
    try:
        if args.command == "config":
            return _config(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "rerun":
            return _rerun(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "pool":
            return _pool(args)
        if args.command == "import-gguf":
            return _import_gguf(args)
        if args.command in ("compile", "submit"):
            return _compile_or_submit(args)
        if args.via == "kfp-local":
            return _run_kfp_local(args)
        if args.force or args.pipeline != "train" or args.start_iteration or args.checkpoint or args.iterations:
            return _fail(
                "run",
                "--pipeline, --start-iteration, --iterations, --checkpoint and --force need --via kfp-local "
                "(the embedded runner resumes with --resume; drmas rerun recomputes a stage)",
                2,
            )
        return _run(args)
    except ConfigError as error:
        print(f"drmas: {error}", file=sys.stderr)
        return 2


def _import_gguf(args: argparse.Namespace) -> int:
    """``drmas import-gguf``: the folder on stdout, for a config's ``models.NAME.source``."""
    from drmas.config import PolicyError  # noqa: PLC0415
    from drmas.model_import import import_gguf  # noqa: PLC0415

    try:
        folder = import_gguf(args.gguf_file, args.out_dir, args.dtype)
    except PolicyError as error:
        return _fail("import-gguf", error)
    print(folder)
    return 0


def _config_arguments(
    command: argparse.ArgumentParser,
    config_help: str = "YAML config file",
    overrides_help: str = "",
    optional: bool = False,
) -> None:
    """The CONFIG file and the overrides that every command takes first; the overrides
    may be none (``default``: argparse would otherwise call them required)."""
    command.add_argument("config", nargs="?" if optional else None, metavar="CONFIG", help=config_help)
    command.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="a.b=value",
        help="section.field=value overrides" + (f" ({overrides_help})" if overrides_help else ""),
    )


def _config_file_problem(config: str) -> str | None:
    """Why CONFIG, as given, cannot be a config file, where the reason is not that it
    is missing: an override or a folder in its place."""
    path = Path(config)
    if path.is_dir():
        files = sorted(str(file) for file in path.glob("*.y*ml"))
        return f"CONFIG {config} is a folder, not a YAML file" + (
            f"; its YAML files: {', '.join(files)}" if files else ""
        )
    if "=" in config and not path.exists():
        return f"CONFIG is missing: {config} is an override; the YAML file comes first (CONFIG a.b=value ...)"
    return None


def _fail(command: str, message: object, status: int = 1) -> int:
    """Say on stderr why ``drmas COMMAND`` stops, and return its exit status: every
    handler's failures read the same way (``drmas COMMAND: ...``)."""
    print(f"drmas {command}: {_underlying(message)}", file=sys.stderr)
    return status


def _stopping_errors() -> tuple[type[Exception], ...]:
    """What stops a training command with a message rather than a traceback: bad input or
    a damaged store (ValueError, StoreError), an MLflow server that cannot open the run,
    a worker group whose actor kept dying, a retrieval service that is down or serves
    another corpus."""
    from drmas.generation.pool import WorkerGroupDied  # noqa: PLC0415
    from drmas.infra.store import StoreError  # noqa: PLC0415
    from drmas.infra.tracking import TrackingUnavailable  # noqa: PLC0415
    from drmas.tasks.retrieval_service import RetrievalError  # noqa: PLC0415

    return StoreError, ValueError, TrackingUnavailable, WorkerGroupDied, RetrievalError


def _underlying(error: object) -> object:
    """The exception a Ray task raised rather than Ray's wrapper around it, whose text is
    the remote traceback: the user needs the reason, which the cause's message gives."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    while (
        ray_exceptions is not None
        and isinstance(error, ray_exceptions.RayTaskError)
        and isinstance(error.cause, BaseException)
    ):
        error = error.cause
    return error


def _check_inputs(config: DrmasConfig) -> None:
    """Read the question sets (and a search corpus) before anything is written or started,
    so that a bad data file stops the command with its DataError (file, row, reason), not
    after a run was recorded or Ray was started."""
    from drmas.stages.rollout import task_questions  # noqa: PLC0415

    for split in ("train", "eval"):
        task_questions(config, split)
    from drmas.registry import task_for  # noqa: PLC0415

    task_for(config).corpus(config)


def _with_run_length(config: DrmasConfig) -> DrmasConfig:
    """``config`` with ``experiment.epochs`` resolved against its training set (read once
    to count it), for the commands that fix a run's length before any stage runs (a
    compiled pipeline holds its iterations); a ConfigError when it cannot be."""
    from drmas.stages.rollout import run_length  # noqa: PLC0415

    return run_length(config)


def _load(args: argparse.Namespace, logs: bool = True) -> DrmasConfig:
    """The command's config: its CONFIG file with the overrides. ``logs`` sends the
    library's progress lines (logging INFO) to stdout, beside the command's own output,
    for the commands that run stages."""
    if logs:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
        logging.getLogger("urllib3").setLevel(logging.ERROR)  # drmas reports MLflow outages itself
    return load_config(args.config, args.overrides)


def _missing_run(config: DrmasConfig, store: Store, run_id: str) -> str | None:
    """Why ``run_id`` cannot be continued, evaluated or rerun when it was never started
    (a typo, another store.root): the runs that the store does hold, to pick from."""
    from drmas.infra.layout import run_path  # noqa: PLC0415

    if store.exists(f"{run_path(config.experiment.name, run_id)}/run"):
        return None
    experiment = config.experiment.name
    runs = [path.split("/")[1] for path in store.list(experiment) if path.count("/") == 2 and path.endswith("/run")]
    return f"no run {run_id!r} in {store.uri(experiment)} (" + (
        f"its runs: {', '.join(runs)})" if runs else "it has no runs)"
    )


def _run_id(args: argparse.Namespace, config: DrmasConfig) -> str:
    """The run a command trains or compiles for: --resume (run only), --run-id, the
    config's experiment.run_id, or a new one named by the time."""
    return getattr(args, "resume", None) or args.run_id or config.experiment.run_id or time.strftime("%Y%m%d-%H%M%S")


def _start_run(args: argparse.Namespace) -> tuple[DrmasConfig, str]:
    """What both ways of ``drmas run`` (embedded, kfp-local) do first: the config, with
    logs on, the run id, and the worker groups printed."""
    config = _load(args)
    run_id = _run_id(args, config)
    _print_worker_groups(config)
    _warn_if_bf16_is_slow_here(config)
    return config, run_id


def _warn_if_bf16_is_slow_here(config: DrmasConfig) -> None:
    """A bfloat16 worker group on a pool of this machine's CPU, which has no native bf16:
    say that it trains many times slower than float32 here, and how to switch."""
    if config.ray.address or config.ray.pool_resource == "GPU":
        return  # the pool is not this machine's CPU
    groups = sorted({g.model for g in config.worker_groups() if g.spec is not None and g.spec.dtype == "bfloat16"})
    if not groups:
        return
    from drmas.infra.cpus import native_bf16  # noqa: PLC0415 - imports torch

    if native_bf16():
        return
    switch = " ".join(f"models.{model}.dtype=float32" for model in groups)
    print(
        f"drmas run: warning: this CPU has no native bf16 (AVX-512 or AMX): the bfloat16 model(s) "
        f"{', '.join(groups)} will train about ten times slower than in float32 here; add {switch}",
        file=sys.stderr,
    )


def _config(args: argparse.Namespace) -> int:
    """Validate the config; print it resolved on stdout (JSON or YAML, nothing else)."""
    if args.docs:
        print("\n".join(describe_fields(DrmasConfig)))
        return 0
    if not args.config:
        return _fail("config", "give a CONFIG file, or --docs", 2)
    config = _load(args, logs=False)
    _print_worker_groups(config, sys.stderr)  # stdout holds only the config, for a parser
    if args.output == "yaml":
        import json  # noqa: PLC0415

        import yaml  # noqa: PLC0415

        print(yaml.safe_dump(json.loads(config.to_json()), sort_keys=False), end="")
    else:
        print(config.to_json(indent=2))
    return 0


def _run(args: argparse.Namespace) -> int:
    from drmas.infra.store import Store  # noqa: PLC0415
    from drmas.runner import open_run, train  # noqa: PLC0415
    from drmas.stages.track import summary_table  # noqa: PLC0415

    config, run_id = _start_run(args)
    if (refused := _refuse_unless_it_fits(args.command, config)) is not None:
        return refused
    try:
        _check_inputs(config)
        config = _with_run_length(config)
    except ValueError as error:
        return _fail("run", error)
    try:
        store = Store.from_config(config.store)
        if args.resume is not None and (missing := _missing_run(config, store, run_id)):
            return _fail("run", missing)
        config = open_run(config, store, run_id, resume=args.resume is not None)
        print(f"run {run_id}: {config.total_iterations} iterations, store {store.uri(config.experiment.name)}/{run_id}")
        summary = train(config, store, run_id, cache_dir=Path(".cache") / "drmas", config_path=args.config)
    except _stopping_errors() as error:
        return _fail("run", f"cannot continue run {run_id}: {_underlying(error)}")
    except KeyboardInterrupt:
        return _fail("run", f"interrupted; resume with: drmas run {args.config} --resume {run_id}", 130)
    if summary.iterations_run == 0:
        print(f"run {run_id}: nothing left to do (all {config.total_iterations} iterations are complete)")
        return 0
    if table := summary_table(summary, config.eval.k):
        print(table)
    print(
        f"checkpoint: {summary.checkpoint}\nreport: {summary.report}/report.md\n"
        f"mlflow: {summary.tracking} (browse with: make ui)"
    )
    return 0


def _rerun(args: argparse.Namespace) -> int:
    from drmas.infra.store import Store  # noqa: PLC0415
    from drmas.runner import open_run, rerun  # noqa: PLC0415

    config = _load(args)
    stage = args.stage
    if args.worker_group is not None:
        groups = [group.name for group in config.worker_groups()]
        if stage != "update" or args.worker_group not in groups:
            return _fail(
                "rerun",
                f"--worker-group takes --stage update and one of {', '.join(groups)} "
                f"(got --stage {stage} --worker-group {args.worker_group})",
                2,
            )
        stage = f"policy/{args.worker_group}"
    try:
        store = Store.from_config(config.store)
        if missing := _missing_run(config, store, args.run_id):
            return _fail("rerun", missing)
        config = open_run(config, store, args.run_id, resume=True)
        result = rerun(config, store, args.run_id, args.iteration, stage, cache_dir=Path(".cache") / "drmas")
    except _stopping_errors() as error:
        return _fail("rerun", error)
    print(
        f"recomputed: {', '.join(result.recomputed)}; cache hits: "
        f"{', '.join(n for n in result.stages if n not in result.recomputed and not n.startswith('optim/'))}"
    )
    return 0


def _compare(args: argparse.Namespace) -> int:
    from drmas.analysis.compare import compare  # noqa: PLC0415

    _load(args)  # validates the config and the overrides before any run starts
    modes = [mode.strip() for mode in args.advantage.split(",") if mode.strip()]
    if not modes or any(mode not in ("grpo", "drmas") for mode in modes) or args.seeds < 1:
        return _fail(
            "compare", f"--advantage takes grpo and/or drmas (got {args.advantage!r}) and --seeds at least 1", 2
        )
    cache_dir = Path(".cache") / "drmas"
    try:
        runs, report = compare(args.config, args.overrides, modes, list(range(args.seeds)), args.name, cache_dir)
    except _stopping_errors() as error:
        return _fail("compare", error)
    except KeyboardInterrupt:
        return _fail("compare", "interrupted; the same command continues where it stopped", 130)
    print(f"runs: {', '.join(run.run_id for run in runs)}\nreport: {report}/report.md")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint; results go to ``iter-I/evaluate-{hash of the eval settings}``."""
    from drmas.generation.pool import RayPool, ray_session  # noqa: PLC0415
    from drmas.generation.workers import PolicyRef  # noqa: PLC0415
    from drmas.infra.layout import policy_path, stage_path  # noqa: PLC0415
    from drmas.infra.store import Store  # noqa: PLC0415
    from drmas.stages.contracts import settings_label  # noqa: PLC0415
    from drmas.stages.evaluate import evaluate  # noqa: PLC0415

    config = _load(args)
    experiment = config.experiment.name
    try:
        _check_inputs(config)
        store = Store.from_config(config.store)
        if missing := _missing_run(config, store, args.run_id):
            return _fail("eval", missing)
        iteration = args.iteration
        if iteration is None:
            from drmas.stages.checkpoint import resume_point  # noqa: PLC0415

            iteration = resume_point(config, store, args.run_id).next_iteration - 1
        if iteration < 0 or not store.exists(stage_path(experiment, args.run_id, iteration, "checkpoint")):
            return _fail("eval", f"run {args.run_id} has no checkpoint for iteration {iteration}")
        path = stage_path(experiment, args.run_id, iteration, settings_label(config))
        if store.exists(path):
            metrics = store.open(path).read_json("metrics.json")
        else:
            policies = {
                g.name: PolicyRef(policy_path(experiment, args.run_id, iteration, g.name))
                for g in config.worker_groups()
            }
            with ray_session(config), RayPool(config, store) as pool:
                metrics = evaluate(config, store, path, policies, pool).metrics
    except _stopping_errors() as error:
        return _fail("eval", error)
    print(f"{store.uri(path)}")
    for key in sorted(metrics):
        print(f"{key} {metrics[key]:.4f}")
    return 0


def _pool(args: argparse.Namespace) -> int:
    """``drmas pool status|down EXPERIMENT/RUN_ID``: a run's named pool on a Ray cluster (a
    local run's pool lives only as long as the run's own Ray)."""
    experiment, _, run_id = args.run.partition("/")
    if not experiment or not run_id or "/" in run_id:
        return _fail("pool", f"{args.run!r}: expected EXPERIMENT/RUN_ID, e.g. math-tiny/20261201-120000", 2)
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        return _fail("pool", "no Ray cluster to ask: pass --address or set RAY_ADDRESS", 2)
    import ray  # noqa: PLC0415

    from drmas.generation.pool import free_pool, pool_status  # noqa: PLC0415

    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        return _fail("pool", f"cannot join the Ray cluster at {address}: {error}")
    try:
        if args.action == "down":
            print(f"{args.run}: freed {free_pool(experiment, run_id)} worker(s)")
            return 0
        workers = pool_status(experiment, run_id)
        if not workers:
            print(f"{args.run}: no pool (never started, freed, or gone after ray.idle_timeout_s)")
        for worker in workers:
            fields = " ".join(
                f"{key}={worker[key]}"
                for key in ("version", "resident", "rank", "world", "pid", "error")
                if key in worker
            )
            print(f"{worker['worker']} {fields}")
        return 0
    finally:
        ray.shutdown()


def _iteration_count(text: str) -> int:
    """--iterations: a whole number of at least 1 (0 or less would train nothing)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of iterations") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: a run part takes at least 1 iteration")
    return count


def _device_memory(text: str) -> int:
    """--device-memory as bytes; a bad size is a usage error naming the text."""
    from drmas.planning import PlanError, parse_size  # noqa: PLC0415

    try:
        return parse_size(text)
    except PlanError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _plan(args: argparse.Namespace) -> int:
    """Print the memory plan; exit 1 when it does not fit, 2 when a model cannot be sized."""
    import json  # noqa: PLC0415

    from drmas.planning import PlanError, plan_memory  # noqa: PLC0415

    config = _load(args, logs=False)
    try:
        plan = plan_memory(config, args.device_memory)
    except PlanError as error:
        return _fail("plan", error, 2)
    print(json.dumps(plan.to_dict(), indent=2) if args.output == "json" else plan.text())
    return 1 if plan.fits is False else 0


def _refuse_unless_it_fits(command: str, config: DrmasConfig) -> int | None:
    """Exit status 2, the plan's problems printed, when a config cannot fit the devices of
    ``ray.device_memory_gb``: better now than out of memory an hour into a cluster run.
    No device memory (CPU runs) or a model the plan cannot size: no check (the latter says
    so)."""
    if config.ray.device_memory_gb is None:
        return None
    from drmas.planning import PlanError, plan_memory  # noqa: PLC0415

    try:
        plan = plan_memory(config)
    except PlanError as error:
        print(f"drmas {command}: warning: no memory check: {error}", file=sys.stderr)
        return None
    if plan.fits:
        return None
    problems = "\n".join(f"  - {problem}" for problem in plan.problems)
    return _fail(
        command,
        f"the config does not fit {config.ray.device_memory_gb:g} GB per slot (ray.device_memory_gb); "
        f"drmas plan prints the whole plan:\n{problems}",
        2,
    )


def _pipeline_options(command: argparse.ArgumentParser, run_id: bool = True) -> None:
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
        type=_iteration_count,
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
        _fail(
            args.command,
            f"the Kubeflow pipelines are not installed here ({error}); "
            "install drmas from its repository (pip install -e .)",
        )
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
        _fail(args.command, error)
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


def _compile_or_submit(args: argparse.Namespace) -> int:
    """``drmas compile`` and ``drmas submit``: the pipeline built from the config and
    compiled for --kfp-backend, then written (compile) or started on Kubeflow (submit: a
    train run longer than --iterations-per-run starts its first part and prints the rest)."""
    config = _load(args, logs=False)
    if (refused := _refuse_unless_it_fits(args.command, config)) is not None:
        return refused
    run_id = _run_id(args, config)
    try:
        images = _pipeline_images(args)
    except ValueError as error:
        return _fail(args.command, error)
    if args.iterations_per_run < 0:
        return _fail(args.command, f"--iterations-per-run must be 0 (no limit) or more, not {args.iterations_per_run}")
    config = _with_run_length(config)
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
        return _fail(args.command, error, 2)
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
            return _fail(args.command, error, 2)
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
            return _fail("submit", f"could not start the run on {args.host}: {type(error).__name__}: {error}")
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


def _run_kfp_local(args: argparse.Namespace) -> int:
    config, run_id = _start_run(args)
    if (refused := _refuse_unless_it_fits(args.command, config)) is not None:
        return refused
    config = _with_run_length(config)
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
        output = run_local(func, arguments, config, DEFAULT_ROOT, log)
    except RuntimeError as error:
        return _fail("run", f"the pipeline failed: {error}; kfp.local's log: {log.path}")
    except KeyboardInterrupt:
        return _fail(
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
        print(f"report: {store.uri(report)}/report.md\nmlflow: {tracking['uri']}")


def _print_worker_groups(config: DrmasConfig, file: typing.TextIO | None = None) -> None:
    """One line per worker group, on ``file`` (default: stdout, as it is when printing)."""
    for group in config.worker_groups():
        print(
            f"worker group {group.name}: model {group.model}, agents {', '.join(group.agents)}, "
            f"lr {group.lr}, micro-batch {group.micro_batch_size}",
            file=file,
        )


def describe_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per field, 'section.field (type, default): docstring', recursively."""
    lines = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = _section_type(field.annotation)
        if nested is not None:
            lines.append(f"{path}: {field.description or ''}")
            lines += describe_fields(nested, prefix=f"{path}{_container_suffix(field)}.")
            continue
        default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
        lines.append(
            f"{path} ({_type_name(field.annotation)}, {default}): {(field.description or '').replace(chr(10), ' ')}"
        )
    return lines


def _type_name(annotation: typing.Any) -> str:
    """A field's type as the user writes its value: a Literal as its allowed values
    ('none' | 'by_model'), so that the docs say what the field takes."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(option) for option in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")  # a generic: dict[str, list[str]]


def _section_type(annotation: typing.Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _container_suffix(field: typing.Any) -> str:
    """'[]' for a list of sections, '.<name>' for a mapping of them."""
    origin = typing.get_origin(field.annotation)
    return "[]" if origin is list else ".<name>" if origin is dict else ""


if __name__ == "__main__":
    sys.exit(main())
