"""Kill -9 at any write to the store, and inside every stage of a run, resume, and end exactly
where a run that was never killed ends.

Kills land at exact, repeatable places through ``drmas.infra.faults`` (a SIGKILL of the
writer's whole process group at a chosen file of a chosen artifact, sometimes half-way
through writing it). At the store: a writer killed at each kind of write (a file, a streamed
file, torn half-way, before the manifest) leaves nothing a reader can open, and the write
that a resumed stage makes replaces its leftovers; a tiny process, on both backends. End to
end: one run is killed in the warm start and in each stage of the iteration (``KILLED_STAGES``,
at seeded writes), and resumed after each; after every kill no artifact a reader can open
is partial (every manifest's files match it) and the killed artifact has no manifest;
at the end, every iteration's policies, optimizer states and eval results equal, byte for
byte, those of the session's uninterrupted run (``baseline_run``), and its non-timing
metrics equal them too (forward-pass diagnostics to float32 noise: ``FORWARD_NOISE``).
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BASELINE_RUN, BASELINE_SETTINGS, BaselineRun

from drmas.config import load_config
from drmas.infra.faults import KILL_AT
from drmas.infra.layout import (
    current_update,
    optim_path,
    policy_path,
    run_path,
    run_record_path,
    stage_path,
    warmstart_path,
)
from drmas.infra.store import MANIFEST, ArtifactNotFound, Store
from drmas.stages.iteration import ITERATION_STAGES, Step, iteration_steps

ROOT = Path(__file__).parent.parent
CONFIG = load_config(ROOT / "configs" / "math_tiny.yaml", BASELINE_SETTINGS)
EXPERIMENT = CONFIG.experiment.name
ITERATIONS = CONFIG.experiment.iterations
RUN = "cut"


# --------------------------------------------------------------------------------------
# At the store: one writer, killed at each kind of write
# --------------------------------------------------------------------------------------

ARTIFACT = stage_path("exp", "run", 0, "rollout")
NEIGHBOUR = stage_path("exp", "run", 0, "advantage")
KILLED_WRITER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    from drmas.infra.store import Store

    store = Store(sys.argv[1], sys.argv[2] or None)
    with store.writer(sys.argv[4]) as out:  # a complete artifact beside the killed one
        out.write_json("metrics.json", {"done": True})
    with store.writer(sys.argv[3]) as out:
        out.write_bytes("first.bin", b"1" * 1000)
        out.write_table("second.parquet", pa.table({"x": list(range(1000))}))
        out.put_file(sys.argv[5], "third/streamed.bin")
    """
)


@pytest.mark.parametrize(
    ("point", "leftover"),
    [("1", None), ("2~torn", "second.parquet"), ("3~torn", "third/streamed.bin"), ("manifest", "third/streamed.bin")],
)
def test_a_writer_killed_at_any_write_leaves_nothing_a_reader_opens(
    store: Store, tmp_path: Path, point: str, leftover: str | None
):
    """Before a file, half-way through one (bytes, or streamed from disk), and after every
    file but before the manifest: the killed artifact is not listed and cannot be opened,
    its neighbour reads back whole, and the stage's next write (no overwrite: nothing is
    stored there) replaces the leftovers."""
    streamed = tmp_path / "streamed.bin"
    streamed.write_bytes(os.urandom(300_000))
    env = {**os.environ, KILL_AT: f"{ARTIFACT}#{point}"}
    done = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, store.root, store.endpoint or "", ARTIFACT, NEIGHBOUR, str(streamed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # the kill takes the writer's own group, nothing else
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    if leftover is not None:  # the kill really was where it was meant to be
        info = store.fs.get_file_info(store._abs(ARTIFACT, leftover))
        assert info.type.name == "File" and info.size > 0, f"{point}: no {leftover} left behind"
    assert store.list() == [NEIGHBOUR]
    assert store.open(NEIGHBOUR).read_json("metrics.json") == {"done": True}
    with pytest.raises(ArtifactNotFound):
        store.open(ARTIFACT)

    with store.writer(ARTIFACT) as out:
        out.write_bytes("result.txt", b"done")
    assert set(store.open(ARTIFACT).files) == {"result.txt"}
    assert store.open(ARTIFACT).read_bytes("result.txt") == b"done"


# --------------------------------------------------------------------------------------
# End to end: a run killed in every stage kind and resumed
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KillPoint:
    """A write inside a stage: the artifact (its path under the run), the file number or
    'manifest'."""

    stage: str
    artifact: str
    position: int | str
    torn: bool = False

    @property
    def spec(self) -> str:
        return f"{self.artifact}#{self.position}" + ("~torn" if self.torn else "")


SEED = 6
"""The kill plan's seed: the verifier's warm start torn (the solver's is stored), iteration 0's
advantage, checkpoint (torn) and evaluation (before its manifest), iteration 1's rollout
(torn) and an update's optimizer state (torn)."""
KILLED_STAGES = ("warmstart", *ITERATION_STAGES)
"""The stages a run is killed in, once each: the warm start (the starting point; the initial
policies before it are written and reused the same way) and every stage of the iteration."""


def written_by(step: Step, run: str) -> list[str]:
    """The artifacts a step of the iteration writes, in the order it writes them."""
    if step.stage == "update":
        assert step.wg is not None
        return [
            optim_path(EXPERIMENT, run, step.iteration, step.wg),
            policy_path(EXPERIMENT, run, step.iteration, step.wg),
        ]
    return [stage_path(EXPERIMENT, run, step.iteration, step.stage)]


def stage_writes(run: str) -> list[tuple[str, str]]:
    """(stage, artifact) for every artifact of a killed stage a run writes, in its order."""
    groups = [group.name for group in CONFIG.worker_groups()]
    writes = [("warmstart", warmstart_path(EXPERIMENT, run, wg)) for wg in groups]
    for iteration in range(ITERATIONS):
        writes += [(step.stage, path) for step in iteration_steps(CONFIG, iteration) for path in written_by(step, run)]
    return writes


def kill_plan(baseline: Store, seed: int) -> list[KillPoint]:
    """One seeded kill point in each of ``KILLED_STAGES``, in the order a run reaches them:
    any file (whole or torn) of any artifact the stage writes, or its manifest (the files as
    the uninterrupted run's manifests list them)."""
    candidates = []
    for (stage, path), (_, stored) in zip(stage_writes(RUN), stage_writes(BASELINE_RUN), strict=True):
        artifact = path.removeprefix(run_path(EXPERIMENT, RUN) + "/")
        files = len(baseline.open(stored).files)
        candidates += [KillPoint(stage, artifact, "manifest")]
        candidates += [KillPoint(stage, artifact, n, torn) for n in range(1, files + 1) for torn in (False, True)]
    rng = random.Random(seed)
    chosen = {rng.choice([c for c in candidates if c.stage == stage]) for stage in KILLED_STAGES}
    return [point for point in candidates if point in chosen]


def drmas_run(tmp_path: Path, resume: bool, kill_at: str | None = None) -> subprocess.Popen:
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / "math_tiny.yaml"),
        *BASELINE_SETTINGS,
        f"store.root={tmp_path / 'runs'}",
    ]
    command += ["--resume", RUN] if resume else ["--run-id", RUN]
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


def assert_readers_see_only_whole_artifacts(store: Store) -> int:
    """Every artifact with a manifest reads back whole; returns how many there are."""
    artifacts = store.list(run_path(EXPERIMENT, RUN))
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
        for group in CONFIG.worker_groups():
            wg = group.name
            newest_policy, newest_optim = current_update(store, EXPERIMENT, run, iteration, wg)  # computed again
            policy = store.open(newest_policy)
            state[f"{iteration}/policy/{wg}"] = policy.read_bytes("model.safetensors")
            optim = store.open(newest_optim)
            state |= {f"{iteration}/optim/{wg}/{name}": optim.read_bytes(name) for name in sorted(optim.files)}
        state[f"{iteration}/eval"] = store.open(stage_path(EXPERIMENT, run, iteration, "evaluate")).read_bytes(
            "eval.parquet"
        )
        metrics = store.open(stage_path(EXPERIMENT, run, iteration, "checkpoint")).read_json("metrics.json")
        steady = {
            k: v
            for k, v in metrics.items()
            # the version: a killed update is computed again beside what it left
            if not k.startswith("time/") and not k.endswith(("/time", "tokens_per_s", "/policy_version"))
        }
        state[f"{iteration}/metrics"] = json.dumps(steady, sort_keys=True).encode()
    return state


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)  # 7 runs of the CLI: about 4 minutes on 2 quiet cores
def test_killed_in_every_stage_and_resumed_equals_uninterrupted(tmp_path: Path, baseline_run: BaselineRun):
    store = Store(str(tmp_path / "runs"))
    baseline = Store(str(baseline_run.root))
    expected = final_state(baseline, BASELINE_RUN)

    # One kill inside each stage kind; one process start each, which is most of this test's time.
    plan = kill_plan(baseline, seed=SEED)
    assert sorted(point.stage for point in plan) == sorted(KILLED_STAGES)
    torn_seen = 0
    for point in plan:
        resume = store.exists(run_record_path(EXPERIMENT, RUN))
        code, output = finish(drmas_run(tmp_path, resume=resume, kill_at=point.spec))
        assert code == -signal.SIGKILL, f"{point.spec} never fired (exit {code}):\n{output[-3000:]}"
        killed = tmp_path / "runs" / run_path(EXPERIMENT, RUN) / point.artifact
        assert not (killed / MANIFEST).exists(), point.spec
        if point.torn:
            torn_seen += any(path.is_file() for path in killed.rglob("*"))
        assert_readers_see_only_whole_artifacts(store)

    code, output = finish(drmas_run(tmp_path, resume=True))
    assert code == 0, output
    assert differences(final_state(store, RUN), expected) == []
    assert torn_seen >= 1


FORWARD_NOISE = 1e-6
"""How far a metric computed by a forward pass (approx_kl, logprob_gap, entropy, the loss)
may differ between two processes that hold the same weights: float32 kernels on a CPU take
different paths by memory layout (a model kept in the pool's worker since the last update
against one loaded from the store), which moves the last bits. Weights, optimizer states
and evaluation results are still compared byte for byte; counts and rewards exactly."""


def _same(mine: object, theirs: object) -> bool:
    if isinstance(mine, float) and isinstance(theirs, float):
        both_undefined = math.isnan(mine) and math.isnan(theirs)  # a statistic of a one-row group
        return both_undefined or math.isclose(mine, theirs, rel_tol=FORWARD_NOISE, abs_tol=FORWARD_NOISE)
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
