"""What every drmas command shares, the library's and the Kubeflow layer's alike: the
CONFIG argument and its overrides, loading it, the run id, the memory check, how a command
says why it stops. ``drmas.cli`` builds the command line from these, and
``drmas_kfp.cli`` (compile, submit, run --via kfp-local) registers its commands with them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import typing

from drmas.config import DrmasConfig, load_config

__all__ = [
    "config_arguments",
    "fail",
    "iteration_count",
    "load",
    "print_worker_groups",
    "refuse_unless_it_fits",
    "run_id_of",
    "start_run",
    "underlying",
    "with_run_length",
]


def config_arguments(
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


def fail(command: str, message: object, status: int = 1) -> int:
    """Say on stderr why ``drmas COMMAND`` stops, and return its exit status: every
    handler's failures read the same way (``drmas COMMAND: ...``)."""
    print(f"drmas {command}: {underlying(message)}", file=sys.stderr)
    return status


def underlying(error: object) -> object:
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


def load(args: argparse.Namespace, logs: bool = True) -> DrmasConfig:
    """The command's config: its CONFIG file with the overrides. ``logs`` sends the
    library's progress lines (logging INFO) to stdout, beside the command's own output,
    for the commands that run stages."""
    if logs:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
        logging.getLogger("urllib3").setLevel(logging.ERROR)  # drmas reports MLflow outages itself
    return load_config(args.config, args.overrides)


def run_id_of(args: argparse.Namespace, config: DrmasConfig) -> str:
    """The run a command trains or compiles for: --resume (run only), --run-id, the
    config's experiment.run_id, or a new one named by the time."""
    return getattr(args, "resume", None) or args.run_id or config.experiment.run_id or time.strftime("%Y%m%d-%H%M%S")


def start_run(args: argparse.Namespace) -> tuple[DrmasConfig, str]:
    """What both ways of ``drmas run`` (embedded, kfp-local) do first: the config, with
    logs on, the run id, and the worker groups printed."""
    config = load(args)
    run_id = run_id_of(args, config)
    print_worker_groups(config)
    warn_if_bf16_is_slow_here(config)
    return config, run_id


def warn_if_bf16_is_slow_here(config: DrmasConfig) -> None:
    """A bfloat16 worker group on a pool of this machine's CPU, which has no native bf16:
    say that it trains many times slower than float32 here, and how to switch."""
    if config.ray.address or config.ray.pool_resource == "GPU":
        return  # the pool is not this machine's CPU
    groups = sorted({g.model for g in config.worker_groups() if g.spec is not None and g.spec.dtype == "bfloat16"})
    if not groups:
        return
    from drmas.config.hardware import native_bf16  # noqa: PLC0415 - imports torch

    if native_bf16():
        return
    switch = " ".join(f"models.{model}.dtype=float32" for model in groups)
    print(
        f"drmas run: warning: this CPU has no native bf16 (AVX-512 or AMX): the bfloat16 model(s) "
        f"{', '.join(groups)} will train about ten times slower than in float32 here; add {switch}",
        file=sys.stderr,
    )


def with_run_length(config: DrmasConfig) -> DrmasConfig:
    """``config`` with ``experiment.epochs`` resolved against its training set (read once
    to count it), for the commands that fix a run's length before any stage runs (a
    compiled pipeline holds its iterations); a ConfigError when it cannot be."""
    from drmas.tasks import run_length  # noqa: PLC0415

    return run_length(config)


def refuse_unless_it_fits(command: str, config: DrmasConfig) -> int | None:
    """Exit status 2, the plan's problems printed, when a config cannot fit the devices of
    ``ray.device_memory_gb`` or the host memory of ``ray.host_memory_gb``: better now than
    out of memory an hour into a cluster run. Neither set (CPU runs) or a model the plan
    cannot size: no check (the latter says so)."""
    if config.ray.device_memory_gb is None and config.ray.host_memory_gb is None:
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
    return fail(
        command,
        f"the config does not fit {_limits(config)}; drmas plan prints the whole plan:\n{problems}",
        2,
    )


def _limits(config: DrmasConfig) -> str:
    """The memory a config was checked against: ``80 GB per slot (ray.device_memory_gb)``..."""
    limits = [
        f"{value:g} GB per slot ({name})"
        for name, value in (
            ("ray.device_memory_gb", config.ray.device_memory_gb),
            ("ray.host_memory_gb", config.ray.host_memory_gb),
        )
        if value is not None
    ]
    return " and ".join(limits)


def iteration_count(text: str) -> int:
    """--iterations: a whole number of at least 1 (0 or less would train nothing)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of iterations") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: a run part takes at least 1 iteration")
    return count


def print_worker_groups(config: DrmasConfig, file: typing.TextIO | None = None) -> None:
    """One line per worker group, on ``file`` (default: stdout, as it is when printing)."""
    for group in config.worker_groups():
        print(
            f"worker group {group.name}: model {group.model}, agents {', '.join(group.agents)}, "
            f"lr {group.lr}, micro-batch {group.micro_batch_size}",
            file=file,
        )
