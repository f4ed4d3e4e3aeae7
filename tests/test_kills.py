"""Kill -9 inside every stage, resume, and end exactly where a run that was never killed ends.

One run is killed again and again at seeded points (``drmas.infra.faults``: a SIGKILL of the run's
whole process group at a chosen file of a chosen artifact, sometimes half-way through
writing it), plus kills at seeded random times, and resumed after each. After every kill
no artifact a reader can open is partial (every manifest's files match it) and the killed
artifact has no manifest; at the end, every iteration's policies, optimizer states and eval
results equal, byte for byte, those of an uninterrupted run, and its non-timing metrics
equal them too (forward-pass diagnostics to float32 noise: ``FORWARD_NOISE``).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES

from drmas.infra.faults import KILL_AT
from drmas.infra.store import MANIFEST, Store

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
ITERATIONS = 2
WORKER_GROUPS = ("solver", "verifier")
SETTINGS = [*TINY_OVERRIDES, f"experiment.iterations={ITERATIONS}", "eval.every=1", "eval.max_questions=3", "eval.k=2"]
STAGE_KINDS = ("rollout", "advantage", "update", "evaluate", "checkpoint")


@dataclass(frozen=True)
class KillPoint:
    """A write inside a stage: the artifact (path suffix), the file number or 'manifest'."""

    kind: str
    artifact: str
    position: int | str
    torn: bool = False

    @property
    def spec(self) -> str:
        return f"{self.artifact}#{self.position}" + ("~torn" if self.torn else "")


def stage_artifacts(iteration: int) -> list[tuple[str, str, int]]:
    """Every artifact an iteration writes, in the order the runner writes them, with its
    stage kind and how many files it has before its manifest (the policy: at least 3)."""
    prefix = f"iter-{iteration:06d}"
    artifacts = [("rollout", f"{prefix}/rollout", 2), ("advantage", f"{prefix}/advantage", 2)]
    for wg in WORKER_GROUPS:
        artifacts += [("update", f"{prefix}/optim/{wg}", 2), ("update", f"{prefix}/policy/{wg}", 3)]
    return artifacts + [("checkpoint", f"{prefix}/checkpoint", 2), ("evaluate", f"{prefix}/evaluate", 2)]


def kill_plan(seed: int, per_kind: int = 1) -> list[KillPoint]:
    """``per_kind`` seeded kill points in each stage kind, in the order a run reaches them."""
    rng = random.Random(seed)
    candidates = []
    for iteration in range(ITERATIONS):
        for kind, artifact, files in stage_artifacts(iteration):
            candidates += [KillPoint(kind, artifact, "manifest")]
            candidates += [KillPoint(kind, artifact, n, torn) for n in range(1, files + 1) for torn in (False, True)]
    chosen = {
        point for kind in STAGE_KINDS for point in rng.sample([c for c in candidates if c.kind == kind], per_kind)
    }
    return [point for point in candidates if point in chosen]


def drmas_run(tmp_path: Path, run: str, resume: bool, kill_at: str | None = None) -> subprocess.Popen:
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / "math_tiny.yaml"),
        *SETTINGS,
        f"store.root={tmp_path / 'runs'}",
    ]
    command += ["--resume", run] if resume else ["--run-id", run]
    env = {key: value for key, value in os.environ.items() if key != KILL_AT} | {"HF_HUB_OFFLINE": "1"}
    if kill_at:
        env[KILL_AT] = kill_at
    # Its own session: a kill takes the driver, its Ray and its update processes, nothing else.
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def assert_readers_see_only_whole_artifacts(store: Store, run: str) -> int:
    """Every artifact with a manifest reads back whole; returns how many there are."""
    artifacts = store.list(f"math-tiny/{run}")
    for path in artifacts:
        artifact = store.open(path)
        for name in artifact.files:
            artifact.read_bytes(name)  # raises CorruptArtifact on any mismatch
    return len(artifacts)


def final_state(store: Store, run: str) -> dict[str, bytes]:
    """What must not depend on the kills: weights, optimizer states, eval results, metrics
    (without wall-clock timings and throughputs)."""
    state: dict[str, bytes] = {}
    for iteration in range(ITERATIONS):
        prefix = f"math-tiny/{run}/iter-{iteration:06d}"
        for wg in WORKER_GROUPS:
            state[f"{iteration}/policy/{wg}"] = store.open(f"{prefix}/policy/{wg}").read_bytes("model.safetensors")
            optim = store.open(f"{prefix}/optim/{wg}")
            state |= {f"{iteration}/optim/{wg}/{name}": optim.read_bytes(name) for name in sorted(optim.files)}
        state[f"{iteration}/eval"] = store.open(f"{prefix}/evaluate").read_bytes("eval.parquet")
        metrics = store.open(f"{prefix}/checkpoint").read_json("metrics.json")
        steady = {
            k: v for k, v in metrics.items() if not k.startswith("time/") and not k.endswith(("/time", "tokens_per_s"))
        }
        state[f"{iteration}/metrics"] = json.dumps(steady, sort_keys=True).encode()
    return state


@pytest.mark.timeout(1500)  # 9 runs of the CLI: about 3 minutes on 2 quiet cores
def test_killed_at_every_stage_and_resumed_equals_uninterrupted(tmp_path):
    store = Store(str(tmp_path / "runs"))
    code, output = finish(drmas_run(tmp_path, "whole", resume=False))
    assert code == 0, output
    expected = final_state(store, "whole")

    # One kill inside each stage kind (seed 11: a torn rollout, an update's policy killed
    # before its manifest, a torn evaluation, both iterations); one process start each, which
    # is most of the suite's time in this test.
    plan = kill_plan(seed=11)
    assert {point.kind for point in plan} == set(STAGE_KINDS) and len(plan) == len(STAGE_KINDS)
    rng = random.Random(8)
    kills, torn_seen = 0, 0
    # Two kills at seeded random times first: anywhere in start-up, warm start or iteration 0.
    for delay in (rng.uniform(3, 12), rng.uniform(3, 12)):
        process = drmas_run(tmp_path, "cut", resume=(tmp_path / "runs/math-tiny/cut/run" / MANIFEST).exists())
        time.sleep(delay)
        os.killpg(process.pid, signal.SIGKILL)
        finish(process)
        kills += 1
        assert_readers_see_only_whole_artifacts(store, "cut")
    for point in plan:
        resume = (tmp_path / "runs/math-tiny/cut/run" / MANIFEST).exists()
        code, output = finish(drmas_run(tmp_path, "cut", resume=resume, kill_at=point.spec))
        assert code == -signal.SIGKILL, f"{point.spec} never fired (exit {code}):\n{output[-3000:]}"
        kills += 1
        killed = tmp_path / "runs/math-tiny/cut" / point.artifact
        assert not (killed / MANIFEST).exists(), point.spec
        if point.torn:
            torn_seen += any(path.is_file() for path in killed.rglob("*"))
        assert_readers_see_only_whole_artifacts(store, "cut")

    code, output = finish(drmas_run(tmp_path, "cut", resume=True))
    assert code == 0, output
    assert differences(final_state(store, "cut"), expected) == []
    assert kills == len(plan) + 2 and torn_seen >= 1


FORWARD_NOISE = 1e-6
"""How far a metric computed by a forward pass (approx_kl, logprob_gap, entropy, the loss)
may differ between two processes that hold the same weights: float32 kernels on a CPU take
different paths by memory layout (a model kept in the pool's worker since the last update
against one loaded from the store), which moves the last bits. Weights, optimizer states
and evaluation results are still compared byte for byte; counts and rewards exactly."""


def _same(mine: object, theirs: object) -> bool:
    if isinstance(mine, float) and isinstance(theirs, float):
        return math.isclose(mine, theirs, rel_tol=FORWARD_NOISE, abs_tol=FORWARD_NOISE)
    return mine == theirs


def differences(actual: dict[str, bytes], expected: dict[str, bytes]) -> list[str]:
    """The state entries that differ, metrics down to the metric names and values (so
    that a failure says what differs, not only that something does)."""
    found = []
    for key in sorted(set(actual) | set(expected)):
        if actual.get(key) == expected.get(key):
            continue
        if key.endswith("/metrics") and key in actual and key in expected:
            mine, theirs = json.loads(actual[key]), json.loads(expected[key])
            found += [
                f"{key}: {name} {mine.get(name)} != {theirs.get(name)}"
                for name in sorted(set(mine) | set(theirs))
                if not _same(mine.get(name), theirs.get(name))
            ]
        else:
            found.append(key)
    return found
