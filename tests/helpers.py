"""Builders of small, valid test data, and the ways tests start drmas and torch processes."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from drmas.cli import main
from drmas.config import DrmasConfig, load_config
from drmas.infra.layout import stage_path
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store

ROOT = Path(__file__).resolve().parents[1]

TINY_OVERRIDES = [
    "rollout.prompts_per_iteration=3",
    "rollout.group_size=2",
    "rollout.sampling.max_new_tokens=10",
    "data.generated_train_size=40",
    "data.generated_eval_size=10",
    "models.tiny.hidden_size=32",
    "models.tiny.intermediate_size=64",
    "models.tiny.num_layers=1",
    "ray.max_resident=2",
    "train.lr=0.001",
    "warmstart.steps=5",
]
"""Overrides that shrink a tiny config (``configs/*_tiny.yaml``) to a few seconds per
iteration on CPU, for the end-to-end tests that run ``drmas run`` (embedded or kfp-local);
each test adds its own iteration count and evaluation settings."""


def trajectory_table(rows: int = 6, seed: int = 0) -> pa.Table:
    """A schema-valid trajectories table: 2 prompts x 3 episodes, solver/verifier calls."""
    rng = np.random.default_rng(seed)
    index = np.arange(rows)
    agents = np.where(index % 2 == 0, "solver", "verifier")
    lengths = rng.integers(1, 6, size=rows)
    return pa.table(
        {
            "run_id": ["run-test"] * rows,
            "iteration": np.zeros(rows, dtype=np.int32),
            "uid": [f"p{i // 6}" for i in index],
            "traj_uid": [f"p{i // 6}-t{(i // 2) % 3}" for i in index],
            "sample_idx": ((index // 2) % 3).astype(np.int32),
            "data_source": ["arithmetic"] * rows,
            "env_step": np.ones(rows, dtype=np.int32),
            "call_idx": (index % 2).astype(np.int32),
            "agent": agents,
            "wg": agents,
            "prompt_ids": [list(range(3)) for _ in index],
            "response_ids": [list(range(n)) for n in lengths],
            "rollout_logprobs": [[-0.5] * n for n in lengths],
            "response_text": ["\\boxed{4}"] * rows,
            "is_valid": index % 3 != 0,
            "finish_reason": ["stop"] * rows,
            "reward": (index // 2 % 2).astype(np.float32),
            "success": index // 2 % 2 == 1,
        },
        schema=TRAJECTORY_SCHEMA,
    )


def stored_rollout(tmp_path: Path, rows: int = 12, run_id: str = "r") -> tuple[DrmasConfig, Store, str]:
    """The tiny math config with its store under ``tmp_path/runs``, holding the rollout of
    iteration 0 of ``run_id`` (``rows`` trajectory rows, no metrics): the input of an
    advantage stage run on its own. Returns the config, the store and the rollout's path."""
    config = load_config(ROOT / "configs" / "math_tiny.yaml", [f"store.root={tmp_path / 'runs'}"])
    store = Store.from_config(config.store)
    source = stage_path(config.experiment.name, run_id, 0, "rollout")
    with store.writer(source, meta={"stage": "rollout", "iteration": 0}) as out:
        out.write_table("trajectories.parquet", trajectory_table(rows), TRAJECTORY_SCHEMA)
        out.write_json("metrics.json", {})
    return config, store, source


def drmas(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``drmas ARGS`` in this process, as the console script runs it: its exit status,
    stdout and stderr, whether it returns or exits."""
    try:
        status = main(list(args))
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def torch_launcher(ranks: int) -> list[str]:
    """The command that starts a script on ``ranks`` processes: Python itself for one,
    torchrun on a free loopback port for more (torchrun hangs with --master_port=0)."""
    if ranks == 1:
        return [sys.executable]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def torch_env(threads: int | None = 1) -> dict[str, str]:
    """The environment of a training subprocess: DeepSpeed's compiled ops in the project's
    cache (built once), and ``threads`` torch threads per process (None: torch's default)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions")}
    return env | {"OMP_NUM_THREADS": str(threads)} if threads else env
