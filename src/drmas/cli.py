"""The ``drmas`` command line.

    drmas config CONFIG [a.b=value ...]   validate, print worker groups and the resolved JSON
    drmas config --docs                   every config field with its documentation
    drmas run CONFIG [a.b=value ...] [--run-id ID] [--resume ID]
                                          train with the embedded runner (resumable)
    drmas eval CONFIG --run-id ID [--iteration I] [data.eval=FILE ...]
                                          evaluate a checkpoint (avg@k, pass@k)
    drmas rerun CONFIG --run-id ID --iteration I --stage advantage
                                          recompute one stage from its stored inputs
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import typing
from pathlib import Path

from pydantic import BaseModel

from drmas.config import ConfigError, DrmasConfig, load_config


def main(argv: list[str] | None = None) -> int:
    # transformers' per-file "Loading weights" bars would bury the per-iteration lines (Ray
    # workers inherit this too: they start after it is set).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = argparse.ArgumentParser(prog="drmas", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    config_cmd = commands.add_parser("config", help="validate a config and print it resolved")
    config_cmd.add_argument("config", nargs="?", help="YAML config file")
    config_cmd.add_argument("overrides", nargs="*", help="section.field=value overrides")
    config_cmd.add_argument("--docs", action="store_true", help="document every field")

    run_cmd = commands.add_parser("run", help="train a team with the embedded runner")
    run_cmd.add_argument("config", help="YAML config file")
    run_cmd.add_argument("overrides", nargs="*", help="section.field=value overrides")
    run_cmd.add_argument("--run-id", help="name of the run (default: experiment.run_id or a timestamp)")
    run_cmd.add_argument("--resume", metavar="RUN_ID", help="continue this run after its last complete iteration")

    eval_cmd = commands.add_parser("eval", help="evaluate a run's checkpoint on an eval set")
    eval_cmd.add_argument("config", help="YAML config file (its eval section and data.eval are used)")
    eval_cmd.add_argument("overrides", nargs="*", help="section.field=value overrides, e.g. data.eval=other.jsonl")
    eval_cmd.add_argument("--run-id", required=True, help="the run whose checkpoint to evaluate")
    eval_cmd.add_argument("--iteration", type=int, help="checkpointed iteration (default: the last)")

    rerun_cmd = commands.add_parser("rerun", help="recompute one stage of an iteration from its stored inputs")
    rerun_cmd.add_argument("config", help="YAML config file of the run")
    rerun_cmd.add_argument("overrides", nargs="*", help="section.field=value overrides (must match the run's)")
    rerun_cmd.add_argument("--run-id", required=True)
    rerun_cmd.add_argument("--iteration", type=int, required=True)
    rerun_cmd.add_argument("--stage", required=True, help="rollout, advantage, update (or policy/WG), evaluate or checkpoint")

    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow options (`--resume ID experiment.iterations=4`).
    if any("=" not in item or item.startswith("-") for item in extra) or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        if args.command == "config":
            return _config(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "rerun":
            return _rerun(args)
        return _run(args)
    except ConfigError as error:
        print(f"drmas: {error}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace) -> int:
    if args.docs:
        print("\n".join(describe_fields(DrmasConfig)))
        return 0
    if not args.config:
        print("drmas config: give a CONFIG file, or --docs", file=sys.stderr)
        return 2
    config = load_config(args.config, args.overrides)
    _print_worker_groups(config)
    print(config.to_json(indent=2))
    return 0


def _run(args: argparse.Namespace) -> int:
    from drmas.runner import open_run, summary_table, train  # noqa: PLC0415
    from drmas.store import Store, StoreError  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    config = load_config(args.config, args.overrides)
    run_id = args.resume or args.run_id or config.experiment.run_id or time.strftime("%Y%m%d-%H%M%S")
    _print_worker_groups(config)
    try:
        store = Store.from_config(config.store)
        config = open_run(config, store, run_id, resume=args.resume is not None)
        print(f"run {run_id}: {config.experiment.iterations} iterations, store {store.uri(config.experiment.name)}/{run_id}")
        summary = train(config, store, run_id, cache_dir=Path(".cache") / "drmas", config_path=args.config)
    except (StoreError, ValueError) as error:
        print(f"drmas run: cannot continue run {run_id}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"drmas run: interrupted; resume with: drmas run {args.config} --resume {run_id}", file=sys.stderr)
        return 130
    if summary.iterations_run == 0:
        print(f"run {run_id}: nothing left to do (all {config.experiment.iterations} iterations are complete)")
        return 0
    if summary.before or any(key.startswith("eval/") for key in summary.metrics):
        print(summary_table(summary, config.eval.k))
    print(f"checkpoint: {summary.checkpoint}\nreport: {summary.report}/report.md\nmlflow: {summary.tracking} (browse with: make ui)")
    return 0


def _rerun(args: argparse.Namespace) -> int:
    from drmas.runner import open_run, rerun  # noqa: PLC0415
    from drmas.store import Store, StoreError  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    config = load_config(args.config, args.overrides)
    try:
        store = Store.from_config(config.store)
        config = open_run(config, store, args.run_id, resume=True)
        result = rerun(config, store, args.run_id, args.iteration, args.stage, cache_dir=Path(".cache") / "drmas")
    except (StoreError, ValueError) as error:
        print(f"drmas rerun: {error}", file=sys.stderr)
        return 1
    print(f"recomputed: {', '.join(result.recomputed)}; cache hits: {', '.join(n for n in result.stages if n not in result.recomputed and not n.startswith('optim/'))}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint; results go to ``iter-I/evaluate-{hash of the eval settings}``."""
    import hashlib  # noqa: PLC0415
    import json  # noqa: PLC0415

    from drmas.evaluate import evaluate  # noqa: PLC0415
    from drmas.layout import policy_path, stage_path  # noqa: PLC0415
    from drmas.pool import RayPool, connect_ray  # noqa: PLC0415
    from drmas.store import Store, StoreError  # noqa: PLC0415
    from drmas.workers import PolicyRef  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    config = load_config(args.config, args.overrides)
    store = Store.from_config(config.store)
    experiment = config.experiment.name
    try:
        iteration = args.iteration
        if iteration is None:
            from drmas.checkpoint import resume_point  # noqa: PLC0415

            iteration = resume_point(config, store, args.run_id).next_iteration - 1
        if iteration < 0 or not store.exists(stage_path(experiment, args.run_id, iteration, "checkpoint")):
            print(f"drmas eval: run {args.run_id} has no checkpoint for iteration {iteration}", file=sys.stderr)
            return 1
        settings = json.dumps({"data": config.data_spec("eval"), "eval": config.eval.model_dump()}, sort_keys=True)
        path = stage_path(experiment, args.run_id, iteration, f"evaluate-{hashlib.sha256(settings.encode()).hexdigest()[:8]}")
        if store.exists(path):
            metrics = store.open(path).read_json("metrics.json")
        else:
            policies = {g.name: PolicyRef(policy_path(experiment, args.run_id, iteration, g.name)) for g in config.worker_groups()}
            started = connect_ray(config)
            try:
                with RayPool(config, store) as pool:
                    metrics = evaluate(config, store, path, policies, pool).metrics
            finally:
                if started:
                    import ray  # noqa: PLC0415

                    ray.shutdown()
    except (StoreError, ValueError) as error:
        print(f"drmas eval: {error}", file=sys.stderr)
        return 1
    print(f"{store.uri(path)}")
    for key in sorted(metrics):
        print(f"{key} {metrics[key]:.4f}")
    return 0


def _print_worker_groups(config: DrmasConfig) -> None:
    for group in config.worker_groups():
        print(
            f"worker group {group.name}: model {group.model}, agents {', '.join(group.agents)}, "
            f"lr {group.lr}, micro-batch {group.micro_batch_size}"
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
        default = (
            "required"
            if field.is_required()
            else f"default {field.get_default(call_default_factory=True)!r}"
        )
        kind = getattr(field.annotation, "__name__", str(field.annotation).replace("typing.", ""))
        lines.append(f"{path} ({kind}, {default}): {(field.description or '').replace(chr(10), ' ')}")
    return lines


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
