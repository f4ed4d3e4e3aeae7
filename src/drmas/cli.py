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
    drmas plan CONFIG [a.b=value ...] [--device-memory 80GB] [--gpus-per-node 8] [-o text|json]
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
import typing
from pathlib import Path

import drmas
import drmas_kfp.cli as kubeflow
from drmas.cli_common import (
    config_arguments,
    fail,
    load,
    print_worker_groups,
    refuse_unless_it_fits,
    start_run,
    underlying,
    with_run_length,
)
from drmas.config import ConfigError, DrmasConfig
from drmas.config.docs import describe_fields
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
    config_arguments(config_cmd, optional=True)
    config_cmd.add_argument("--docs", action="store_true", help="document every field")
    config_cmd.add_argument(
        "-o",
        "--output",
        choices=("json", "yaml"),
        default="json",
        help="format of the resolved config on stdout (default: json); the worker groups go to stderr",
    )
    config_cmd.set_defaults(handler=_config)

    run_cmd = commands.add_parser("run", help="train a team with the embedded runner")
    config_arguments(run_cmd)
    run_cmd.add_argument("--run-id", help="name of the run (default: experiment.run_id or a timestamp)")
    run_cmd.add_argument("--resume", metavar="RUN_ID", help="continue this run after its last complete iteration")
    run_cmd.add_argument(
        "--via",
        choices=("embedded", "kfp-local"),
        default="embedded",
        help="embedded: the runner in this process (default); kfp-local: the Kubeflow pipeline with kfp.local",
    )
    kubeflow.add_run_options(run_cmd)
    run_cmd.set_defaults(handler=_run_via)

    eval_cmd = commands.add_parser("eval", help="evaluate a run's checkpoint on an eval set")
    config_arguments(
        eval_cmd, "YAML config file (its eval section and data.eval are used)", "e.g. data.eval=other.jsonl"
    )
    eval_cmd.add_argument("--run-id", required=True, help="the run whose checkpoint to evaluate")
    eval_cmd.add_argument("--iteration", type=int, metavar="I", help="checkpointed iteration (default: the last)")
    eval_cmd.add_argument(
        "--final", action="store_true", help="with eval.final's settings (its data, k, questions, sampling)"
    )
    eval_cmd.set_defaults(handler=_eval)

    rerun_cmd = commands.add_parser("rerun", help="recompute one stage of an iteration from its stored inputs")
    config_arguments(rerun_cmd, "YAML config file of the run", "must match the run's")
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
    rerun_cmd.set_defaults(handler=_rerun)

    compare_cmd = commands.add_parser(
        "compare", help="train the same team per advantage mode and seed, and compare them"
    )
    config_arguments(compare_cmd, overrides_help="for every run")
    compare_cmd.add_argument(
        "--advantage", default="grpo,drmas", help="comma-separated advantage modes (default: grpo,drmas)"
    )
    compare_cmd.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default: 3)")
    compare_cmd.add_argument(
        "--name", default="compare", help="prefix of the runs and folder of the report (default: compare)"
    )
    compare_cmd.set_defaults(handler=_compare)

    plan_cmd = commands.add_parser(
        "plan",
        help="the memory per pool slot and whether it fits the device (exit 1 when it does not)",
    )
    config_arguments(plan_cmd)
    plan_cmd.add_argument(
        "--device-memory",
        metavar="SIZE",
        type=_device_memory,
        help="memory of one accelerator, e.g. 80GB (10^9 bytes) or 80GiB (default: ray.device_memory_gb)",
    )
    plan_cmd.add_argument(
        "--gpus-per-node",
        metavar="N",
        type=_positive_int,
        default=8,
        help="GPUs of a KubeRay worker pod (one per node, all its GPUs), which the plan sizes (default: 8)",
    )
    plan_cmd.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="a table (default) or JSON, bytes"
    )
    plan_cmd.set_defaults(handler=_plan)

    pool_cmd = commands.add_parser("pool", help="show or free a run's pool of workers on a Ray cluster")
    pool_cmd.add_argument("action", choices=("status", "down"), help="status: its workers; down: free them")
    pool_cmd.add_argument("run", metavar="EXPERIMENT/RUN_ID", help="the run, as its folder in the store names it")
    pool_cmd.add_argument(
        "--address",
        help="the Ray cluster (default: $RAY_ADDRESS); from outside it, ray://127.0.0.1:10001 through "
        "`kubectl -n drmas port-forward svc/drmas-raycluster-head-svc 10001:10001`",
    )
    pool_cmd.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding the cluster's Ray token (Secret drmas-ray-token, key auth_token); default "
        "$RAY_AUTH_TOKEN, then the file $RAY_AUTH_TOKEN_PATH names. Never printed",
    )
    pool_cmd.set_defaults(handler=_pool)

    kubeflow.register(commands)

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
    import_cmd.set_defaults(handler=_import_gguf)

    # The service's command parses its own arguments (drmas.tasks.search.service.main).
    commands.add_parser(
        "serve-retrieval",
        add_help=False,
        help="serve a search corpus over HTTP for every rollout and evaluation (drmas serve-retrieval --help)",
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-retrieval"]:
        from drmas.tasks.search.service import main as serve  # noqa: PLC0415

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
        return args.handler(args)
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
        return fail("import-gguf", error)
    print(folder)
    return 0


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


def _stopping_errors() -> tuple[type[Exception], ...]:
    """What stops a training command with a message rather than a traceback: bad input or
    a damaged store (ValueError, StoreError), an MLflow server that cannot open the run,
    a worker group whose actor kept dying, a retrieval service that is down or serves
    another corpus."""
    from drmas.generation.pool import WorkerGroupDied  # noqa: PLC0415
    from drmas.infra.store import StoreError  # noqa: PLC0415
    from drmas.infra.tracking import TrackingUnavailable  # noqa: PLC0415
    from drmas.tasks.search.client import RetrievalError  # noqa: PLC0415

    return StoreError, ValueError, TrackingUnavailable, WorkerGroupDied, RetrievalError


def _check_inputs(config: DrmasConfig) -> None:
    """Read the question sets (and a search corpus) before anything is written or started,
    so that a bad data file stops the command with its DataError (file, row, reason), not
    after a run was recorded or Ray was started."""
    from drmas.stages.rollout import task_questions  # noqa: PLC0415

    for split in ("train", "eval"):
        task_questions(config, split)
    if config.eval.final is not None and config.eval.final.data:
        task_questions(config.final_evaluation(), "eval")
    from drmas.tasks import task_for  # noqa: PLC0415

    task_for(config).corpus(config)


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


def _config(args: argparse.Namespace) -> int:
    """Validate the config; print it resolved on stdout (JSON or YAML, nothing else)."""
    if args.docs:
        print("\n".join(describe_fields(DrmasConfig)))
        return 0
    if not args.config:
        return fail("config", "give a CONFIG file, or --docs", 2)
    config = load(args, logs=False)
    print_worker_groups(config, sys.stderr)  # stdout holds only the config, for a parser
    if args.output == "yaml":
        import json  # noqa: PLC0415

        import yaml  # noqa: PLC0415

        print(yaml.safe_dump(json.loads(config.to_json()), sort_keys=False), end="")
    else:
        print(config.to_json(indent=2))
    return 0


def _run_via(args: argparse.Namespace) -> int:
    """``drmas run``: the embedded runner, or the pipeline with kfp.local (``--via``)."""
    if args.via == "kfp-local":
        return kubeflow.run_kfp_local(args)
    if (
        args.force
        or args.pipeline != "train"
        or args.start_iteration
        or args.checkpoint
        or args.iterations
        or args.parallel
    ):
        return fail(
            "run",
            "--pipeline, --start-iteration, --iterations, --checkpoint, --force and --parallel need --via "
            "kfp-local (the embedded runner resumes with --resume; drmas rerun recomputes a stage)",
            2,
        )
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from drmas.infra.store import Store  # noqa: PLC0415
    from drmas.runner import open_run, train  # noqa: PLC0415
    from drmas.stages.track import summary_table  # noqa: PLC0415

    config, run_id = start_run(args)
    if (refused := refuse_unless_it_fits(args.command, config)) is not None:
        return refused
    try:
        _check_inputs(config)
        config = with_run_length(config)
    except ValueError as error:
        return fail("run", error)
    try:
        store = Store.from_config(config.store)
        if args.resume is not None and (missing := _missing_run(config, store, run_id)):
            return fail("run", missing)
        config = open_run(config, store, run_id, resume=args.resume is not None)
        print(f"run {run_id}: {config.total_iterations} iterations, store {store.uri(config.experiment.name)}/{run_id}")
        summary = train(config, store, run_id, cache_dir=Path(".cache") / "drmas", config_path=args.config)
    except _stopping_errors() as error:
        return fail("run", f"cannot continue run {run_id}: {underlying(error)}")
    except KeyboardInterrupt:
        return fail("run", f"interrupted; resume with: drmas run {args.config} --resume {run_id}", 130)
    if summary.iterations_run == 0:
        print(f"run {run_id}: nothing left to do (all {config.total_iterations} iterations are complete)")
        return 0
    if table := summary_table(summary, config.eval.k):
        print(table)
    print(f"checkpoint: {summary.checkpoint}\nreport: {summary.report}/report.md\nmlflow: {summary.tracking}")
    return 0


def _rerun(args: argparse.Namespace) -> int:
    from drmas.infra.store import Store  # noqa: PLC0415
    from drmas.runner import open_run, rerun  # noqa: PLC0415

    config = load(args)
    stage = args.stage
    if args.worker_group is not None:
        groups = [group.name for group in config.worker_groups()]
        if stage != "update" or args.worker_group not in groups:
            return fail(
                "rerun",
                f"--worker-group takes --stage update and one of {', '.join(groups)} "
                f"(got --stage {stage} --worker-group {args.worker_group})",
                2,
            )
        stage = f"update/{args.worker_group}"
    try:
        store = Store.from_config(config.store)
        if missing := _missing_run(config, store, args.run_id):
            return fail("rerun", missing)
        config = open_run(config, store, args.run_id, resume=True)
        result = rerun(config, store, args.run_id, args.iteration, stage, cache_dir=Path(".cache") / "drmas")
    except _stopping_errors() as error:
        return fail("rerun", error)
    print(
        f"recomputed: {', '.join(result.recomputed)}; cache hits: "
        f"{', '.join(step for step in result.ran if step not in result.recomputed)}"
    )
    return 0


def _compare(args: argparse.Namespace) -> int:
    from drmas.analysis.compare import compare  # noqa: PLC0415

    load(args)  # validates the config and the overrides before any run starts
    modes = [mode.strip() for mode in args.advantage.split(",") if mode.strip()]
    if not modes or any(mode not in ("grpo", "drmas") for mode in modes) or args.seeds < 1:
        return fail(
            "compare", f"--advantage takes grpo and/or drmas (got {args.advantage!r}) and --seeds at least 1", 2
        )
    cache_dir = Path(".cache") / "drmas"
    try:
        runs, report = compare(args.config, args.overrides, modes, list(range(args.seeds)), args.name, cache_dir)
    except _stopping_errors() as error:
        return fail("compare", error)
    except KeyboardInterrupt:
        return fail("compare", "interrupted; the same command continues where it stopped", 130)
    print(f"runs: {', '.join(run.run_id for run in runs)}\nreport: {report}/report.md")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint; results go to ``iter-I/evaluate-{hash of the eval settings}``."""
    from drmas.generation.pool import RayPool  # noqa: PLC0415
    from drmas.generation.ray_session import ray_session  # noqa: PLC0415
    from drmas.infra.layout import (  # noqa: PLC0415
        PolicyRef,
        current_update,
        stage_path,
    )
    from drmas.infra.store import Store  # noqa: PLC0415
    from drmas.stages.contracts import settings_label  # noqa: PLC0415
    from drmas.stages.evaluate import evaluate  # noqa: PLC0415

    config = load(args)
    experiment = config.experiment.name
    try:
        if args.final:
            config = config.final_evaluation()
        _check_inputs(config)
        store = Store.from_config(config.store)
        if missing := _missing_run(config, store, args.run_id):
            return fail("eval", missing)
        iteration = args.iteration
        if iteration is None:
            from drmas.stages.checkpoint import resume_point  # noqa: PLC0415

            iteration = resume_point(config, store, args.run_id).next_iteration - 1
        if iteration < 0 or not store.exists(stage_path(experiment, args.run_id, iteration, "checkpoint")):
            return fail("eval", f"run {args.run_id} has no checkpoint for iteration {iteration}")
        path = stage_path(experiment, args.run_id, iteration, settings_label(config))
        if store.exists(path):
            metrics = store.open(path).read_json("metrics.json")
        else:
            policies = {
                g.name: PolicyRef(current_update(store, experiment, args.run_id, iteration, g.name)[0])
                for g in config.worker_groups()
            }
            if gone := [ref.artifact for ref in policies.values() if not store.exists(ref.artifact)]:
                return fail(
                    "eval",
                    f"{store.uri(gone[0])}: the policy of iteration {iteration} is no longer stored "
                    "(checkpoint.prune_policies keeps those of the kept optimizer states and the last ones)",
                )
            with ray_session(config), RayPool(config, store) as pool:
                metrics = evaluate(config, store, path, policies, pool).metrics
    except _stopping_errors() as error:
        return fail("eval", error)
    print(f"{store.uri(path)}")
    for key in sorted(metrics):
        print(f"{key} {metrics[key]:.4f}")
    return 0


def _pool(args: argparse.Namespace) -> int:
    """``drmas pool status|down EXPERIMENT/RUN_ID``: a run's named pool on a Ray cluster (a
    local run's pool lives only as long as the run's own Ray), from a pod of the cluster or
    from outside it through a port-forward of the head's Ray Client port, with the token."""
    experiment, _, run_id = args.run.partition("/")
    if not experiment or not run_id or "/" in run_id:
        return fail("pool", f"{args.run!r}: expected EXPERIMENT/RUN_ID, e.g. math-tiny/20261201-120000", 2)
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        return fail("pool", "no Ray cluster to ask: pass --address or set RAY_ADDRESS", 2)
    try:
        token_from = _ray_token(args.token_file)
    except ValueError as error:
        return fail("pool", error, 2)
    # Ray reads RAY_AUTH_MODE and the token's variables when imported: after _ray_token.
    import ray  # noqa: PLC0415

    from drmas.generation.named_pool import ClusterUnreachable, check_cluster, free_pool  # noqa: PLC0415

    try:
        check_cluster(address, token_from)
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except ClusterUnreachable as error:
        return fail("pool", error)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as error:
        return fail("pool", f"cannot join the Ray cluster at {address}: {error}")
    try:
        if args.action == "down":
            print(f"{args.run}: freed {free_pool(experiment, run_id)} worker(s)")
        else:
            _print_pool(args.run, experiment, run_id)
        return 0
    finally:
        ray.shutdown()


def _ray_token(token_file: str | None) -> str | None:
    """Where ``drmas pool``'s Ray token comes from (for messages: a flag, a variable, a path;
    never the token), and RAY_AUTH_MODE=token set so that Ray sends it: Ray sends a token
    only in that mode, and would otherwise be refused, after half a minute of retries, by a
    cluster that requires one. None when no token is to be sent. ValueError when the file
    meant to hold it does not."""
    if not os.environ.get("RAY_AUTH_TOKEN", "").strip():
        os.environ.pop("RAY_AUTH_TOKEN", None)  # blank: not a token (Ray would prefer it to a file)
    if token_file:
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ["RAY_AUTH_TOKEN_PATH"] = _token_path(token_file, "--token-file")
        source = f"--token-file {token_file}"
    elif os.environ.get("RAY_AUTH_TOKEN"):
        source = "$RAY_AUTH_TOKEN"
    elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = os.environ["RAY_AUTH_TOKEN_PATH"]
        os.environ["RAY_AUTH_TOKEN_PATH"] = _token_path(path, "$RAY_AUTH_TOKEN_PATH")
        source = f"$RAY_AUTH_TOKEN_PATH ({path})"
    elif os.environ.get("RAY_AUTH_MODE") == "token":
        default = Path.home() / ".ray" / "auth_token"
        if not default.is_file():
            raise ValueError(
                "RAY_AUTH_MODE=token but no token: pass --token-file PATH or set RAY_AUTH_TOKEN "
                f"(Ray's default file {default} does not exist)"
            )
        return str(default)
    else:
        return None
    os.environ["RAY_AUTH_MODE"] = "token"
    return source


def _token_path(path: str, given_as: str) -> str:
    """``path`` made absolute, once it is known to hold a token (not just whitespace)."""
    file = Path(path).expanduser()
    try:
        empty = not file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{given_as} {path}: cannot read the token ({type(error).__name__})") from error
    if empty:
        raise ValueError(f"{given_as} {path}: the file is empty")
    return str(file.resolve())


def _print_pool(run: str, experiment: str, run_id: str) -> None:
    """``drmas pool status``: each worker's line, then who drives the pool."""
    from drmas.generation.named_pool import lease_status, pool_status  # noqa: PLC0415

    workers = pool_status(experiment, run_id)
    if not workers:
        print(f"{run}: no pool (never started, freed, or gone after ray.idle_timeout_s)")
    for worker in workers:
        fields = " ".join(
            f"{key}={worker[key]}" for key in ("version", "resident", "rank", "world", "pid", "error") if key in worker
        )
        print(f"{worker['worker']} {fields}")
    lease = lease_status(experiment, run_id)
    if lease and lease["holder"]:
        print(f"{run}: driven by {lease['holder']} for {lease['held_s']} s (last heartbeat {lease['silent_s']} s ago)")
    elif lease:
        print(f"{run}: no driver now")


def _positive_int(text: str) -> int:
    """A count of at least 1; anything else is a usage error naming the text."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


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

    config = load(args, logs=False)
    try:
        plan = plan_memory(config, args.device_memory)
    except PlanError as error:
        return fail("plan", error, 2)
    gpus = args.gpus_per_node
    print(json.dumps(plan.to_dict(gpus), indent=2) if args.output == "json" else plan.text(gpus))
    return 1 if plan.fits is False else 0


if __name__ == "__main__":
    sys.exit(main())
