"""Builders of small, valid test data, and the ways tests start drmas and torch processes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from drmas.cli import main
from drmas.config import DrmasConfig, load_config
from drmas.generation.workers import GenerationResult
from drmas.infra.layout import policy_path, stage_path
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store
from drmas.models import load_model, load_tokenizer
from drmas.stages.policies import init_policies
from drmas.tasks import Question
from drmas.team.episodes import Call, Episode, episodes_to_table
from drmas.team.orchestras import Passage
from drmas.training.batching import collate

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


UPDATE_OVERRIDES = [
    "models.tiny.hidden_size=32",
    "models.tiny.intermediate_size=64",
    "models.tiny.num_layers=1",
    "data.generated_train_size=40",
    "data.generated_eval_size=10",
    "workers.sharing=by_model",
    "train.lr=0.01",
]
"""Overrides of ``configs/math_tiny.yaml`` for the tests of the update on its own
(``make_run``): one worker group for both agents, a large enough step to see it move."""

WG = "solver-verifier"
"""The one worker group of ``UPDATE_OVERRIDES``."""


def make_run(tmp_path: Path, *overrides: str):
    """A run whose iteration 0 has a rollout artifact made of scripted responses, with the
    rollout log-probs computed by the initial policy itself at the sampling temperature, as
    an engine reports them (so the ratio starts at 1)."""
    config = load_config(ROOT / "configs" / "math_tiny.yaml", [*UPDATE_OVERRIDES, *overrides])
    store = Store(str(tmp_path / "store"))
    [policy] = init_policies(config, store, "run").values()
    local = store.open(policy.artifact).download(tmp_path / "init")
    tokenizer, model = load_tokenizer(local), load_model(local)
    episodes = []
    for q, (question, good) in enumerate([("What is 2 + 2?", "\\boxed{4}"), ("What is 3 + 5?", "\\boxed{8}")]):
        for sample, (solution, reward) in enumerate([(good, 1.0), ("\\boxed{0}", 0.0)]):
            episode = Episode(
                f"u{q}",
                f"u{q}-s{sample}",
                sample,
                Question(f"q{q}", question, ("x",), "test"),
                reward=reward,
                success=reward > 0,
            )
            for agent, text in (("solver", solution), ("verifier", "<verify>approve</verify>")):
                prompt = tokenizer(f"{question} {agent}", add_special_tokens=False)["input_ids"]
                response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                episode.calls.append(Call(agent, WG, 1, prompt, response, [0.0] * len(response), text, True, "stop"))
            episodes.append(episode)
    table = episodes_to_table(episodes, "run", 0)
    rows = table.to_pylist()
    for row in rows:
        row["advantage"] = 0.0
    batch = collate(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logprobs = (
            torch.log_softmax(logits / config.rollout.sampling.temperature, dim=-1)
            .gather(-1, batch.input_ids[:, 1:].unsqueeze(-1))
            .squeeze(-1)
        )
    rollout_logprobs = [logprobs[b][batch.response_mask[b] > 0].tolist() for b in range(len(rows))]
    table = table.set_column(
        table.schema.get_field_index("rollout_logprobs"),
        "rollout_logprobs",
        pa.array(rollout_logprobs, pa.list_(pa.float32())),
    )
    with store.writer(stage_path(config.experiment.name, "run", 0, "rollout")) as out:
        out.write_table("trajectories.parquet", table)
    return config, store, policy, tokenizer


def refuse_ray(*args: object) -> bool:
    """Patched over ``drmas.generation.ray_session.connect_ray`` by tests of commands that
    must stop before Ray starts."""
    raise AssertionError("Ray started: the bad input was not refused first")


def record_policy(store: Store, run_id: str, wg: str, experiment: str = "math-tiny") -> None:
    """Make the checkpoint of iteration 0 record the policy now stored for ``wg``, as if the
    checkpoint had been written with it: only a check of the model itself can tell."""
    path = stage_path(experiment, run_id, 0, "checkpoint")
    record = store.open(path).read_json("checkpoint.json")
    record["worker_groups"][wg]["policy_manifest"] = store.fingerprint(policy_path(experiment, run_id, 0, wg))
    metrics = store.open(path).read_json("metrics.json")
    with store.writer(path, overwrite=True, meta=store.open(path).meta) as out:
        out.write_json("checkpoint.json", record)
        out.write_json("metrics.json", metrics)


class ScriptedPool:
    """Answers each generate with ``script(wg, prompt)``; records every batched call."""

    def __init__(self, script: Callable[[str, str], str]) -> None:
        self.script = script
        self.calls: list[tuple[str, int]] = []

    def load(self, policies) -> None:
        pass

    def generate(self, wg, messages, sampling, seed):
        self.calls.append((wg, len(messages)))
        return [GenerationResult([1, 2, 3], [4, 5], [-0.5, -0.25], self.script(wg, m), "stop") for m in messages]


ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOG_MARK = "\n--- kfp.local's log ---\n"
"""Where ``via_kfp_local``'s output ends and kfp.local's log begins."""


def via_kfp_local(tmp_path: Path, settings: list[str], *args: str) -> str:
    """`drmas run --via kfp-local` of the tiny math config with ``settings`` in tmp_path
    (kfp.local's root and cache in tmp_path/.cache); its output, which must say success."""
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / "math_tiny.yaml"),
        *settings,
        f"store.root={tmp_path / 'runs'}",
        "--via",
        "kfp-local",
        *args,
    ]
    # The console goes to a file as it comes, so that a run the test's timeout stops still
    # shows (in tmp_path/console.txt) where it was.
    console_file = tmp_path / "console.txt"
    with console_file.open("w") as sink:
        done = subprocess.run(
            command, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=sink, stderr=subprocess.STDOUT
        )
    console = ANSI.sub("", console_file.read_text())
    assert done.returncode == 0, console[-6000:]
    [log] = re.findall(r"^kfp.local's log: (.+)$", console, re.M)
    return console + LOG_MARK + (tmp_path / log).read_text()


@contextmanager
def running(server: ThreadingHTTPServer) -> Iterator[ThreadingHTTPServer]:
    """``server`` answering in a thread of the test until the block ends."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def write_corpus(path: Path, passages: list[Passage]) -> Path:
    """``passages`` as a JSONL corpus file (one {"id", "text"} a line) at ``path``."""
    path.write_text("".join(json.dumps({"id": p.pid, "text": p.text}) + "\n" for p in passages))
    return path
