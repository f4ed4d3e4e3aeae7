"""Exact resume: a run killed after its first iteration and resumed ends with the same
weights, bit for bit, as the session's uninterrupted run (``baseline_run``, CPU, same
machine), which is also tracked in MLflow and rerun stage by stage here.

The runs that train (and the one that is killed) are ``drmas`` processes; the commands that
stop before Ray starts (a rerun of the advantage stage, a resume with nothing left to do,
a resume with a changed config) call ``drmas.cli.main`` in this process, as the console
script does, which spares a process start each."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BASELINE_RUN, BASELINE_SETTINGS, BaselineRun
from helpers import TINY_OVERRIDES, refuse_ray

from drmas.cli import main
from drmas.infra.layout import current_update
from drmas.infra.store import MANIFEST, Store
from drmas.training.shards import shard_file

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
ROOT = Path(__file__).parent.parent
LAST = "iter-000001"
"""The last iteration of ``BASELINE_SETTINGS`` (two)."""


def drmas_run(tmp_path: Path, *args: str, wait: bool = True, config: str = "math_tiny.yaml"):
    command = [str(Path(sys.executable).parent / "drmas"), "run", str(ROOT / "configs" / config)]
    command += [*args, f"store.root={tmp_path / 'runs'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if not wait:
        # Its own process group: the kill takes the driver and the Ray it started, nothing else.
        return subprocess.Popen(
            command,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def drmas_here(capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, *args: str) -> tuple[int, str, str]:
    """``drmas COMMAND`` on the tiny math config with the baseline's settings and its store
    under ``tmp_path``, in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    config = str(ROOT / "configs" / "math_tiny.yaml")
    status = main([command, config, *BASELINE_SETTINGS, f"store.root={tmp_path / 'runs'}", *args])
    out, err = capsys.readouterr()
    return status, out, err


def weights(root: Path, run: str) -> dict[str, bytes]:
    """The last iteration's policies, each its newest version (an update computed again)."""
    store = Store(str(root))
    newest = {
        wg: current_update(store, "math-tiny", run, int(LAST.split("-")[1]), wg)[0] for wg in ("solver", "verifier")
    }
    return {wg: store.open(path).read_bytes("model.safetensors") for wg, path in newest.items()}


def test_the_uninterrupted_run_reports_tracks_and_reruns_a_stage_alone(
    baseline_run: BaselineRun, tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the working folder of the commands run in this process
    monkeypatch.setattr("drmas.generation.ray_session.connect_ray", refuse_ray)  # they stop before Ray
    output = baseline_run.output
    assert "iter 1:" in output and "before training: eval avg@2" in output
    table = output.split("before    after")[1]
    assert table.splitlines()[1].startswith("eval avg@2") and "solver valid outputs" in table
    assert f"checkpoint: {baseline_run.root}/math-tiny/{BASELINE_RUN}/{LAST}/checkpoint" in output
    assert_tracked(baseline_run)

    shutil.copytree(baseline_run.root, tmp_path / "runs")  # what follows writes to the store
    assert_rerun_recomputes_only_the_stage(tmp_path, capsys)
    status, _, err = drmas_here(capsys, tmp_path, "run", "--resume", BASELINE_RUN, "train.lr=0.5")
    assert status == 1 and "train.lr: the run was started with 0.001, now 0.5" in err


def test_kill_and_resume_equals_uninterrupted(baseline_run: BaselineRun, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("drmas.generation.ray_session.connect_ray", refuse_ray)
    # The killed run stores its optimizer states only after its last iteration
    # (checkpoint.every=2): in between its pool's workers hold them.
    cut = (*BASELINE_SETTINGS, "checkpoint.every=2")
    killed = drmas_run(tmp_path, "--run-id", "cut", *cut, wait=False)
    # Killed once iteration 0 is done (checkpointed, then evaluated): a kill between the two would
    # leave iteration 0 to do again, and the resume below would have nothing checkpointed to report.
    marker = tmp_path / "runs" / "math-tiny" / "cut" / "iter-000000" / "evaluate" / MANIFEST
    deadline = time.monotonic() + 300
    while not marker.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), killed.communicate()[0]
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert not (tmp_path / "runs" / "math-tiny" / "cut" / LAST / "checkpoint" / MANIFEST).exists()

    cut_dir = tmp_path / "runs" / "math-tiny" / "cut"
    assert not list(cut_dir.glob(f"iter-*/optim/*/{MANIFEST}"))  # held by the pool the kill took
    written = {
        kind: (cut_dir / "iter-000000" / kind / MANIFEST).stat().st_mtime_ns for kind in ("rollout", "policy/solver")
    }
    resumed = drmas_run(tmp_path, "--resume", "cut", *cut)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "iterations 0-0 are checkpointed, but their optimizer states were held only by the pool" in resumed.stdout
    assert "iter 0:" in resumed.stdout and "iter 1:" in resumed.stdout
    rewritten = {kind: (cut_dir / "iter-000000" / kind / MANIFEST).stat().st_mtime_ns for kind in written}
    assert rewritten == written  # the policy computed again went beside the first, never over it
    assert (cut_dir / "iter-000000" / "policy" / "solver@v2" / MANIFEST).exists()
    assert weights(tmp_path / "runs", "cut") == weights(baseline_run.root, BASELINE_RUN)
    assert sorted(path.parent.parent.parent.name for path in cut_dir.glob(f"iter-*/optim/*/{MANIFEST}")) == [LAST] * 2

    status, out, _ = drmas_here(capsys, tmp_path, "run", "--resume", "cut", "checkpoint.every=2")
    assert status == 0 and "nothing left to do" in out

    # A damaged last checkpoint: say which file and stop, non-zero, before Ray (refused
    # here) or anything else starts; never run zero steps.
    optimizer = cut_dir / LAST / "optim" / "solver" / shard_file(0, 1)
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    status, _, err = drmas_here(
        capsys, tmp_path, "run", "--resume", "cut", "checkpoint.every=2", "experiment.iterations=3"
    )
    assert status == 1
    assert f"optim/solver/{shard_file(0, 1)}: 100 bytes, but the manifest says" in err


def assert_tracked(run: BaselineRun) -> None:
    """MLflow (sqlite in the store's folder by default) holds params, per-iteration metrics,
    lineage, the datasets, the report's figures and a registered version per worker group;
    the report is in the store too."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run.root / 'mlflow.db'}")
    [found] = client.search_runs(
        [client.get_experiment_by_name("math-tiny").experiment_id], f"tags.`drmas.run_id` = '{BASELINE_RUN}'"
    )
    assert found.data.params["algorithm.advantage"] == "drmas"
    assert [m.step for m in client.get_metric_history(found.info.run_id, "reward/mean")] == [1, 2]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "eval/avg_at_2")] == [0, 1, 2]
    assert found.data.tags["lineage.checkpoint"].endswith(f"math-tiny/{BASELINE_RUN}/{LAST}/checkpoint")
    assert found.info.status == "FINISHED"
    episodes = [a.path for a in client.list_artifacts(found.info.run_id, "episodes")]
    assert episodes == [f"episodes/iter-{i:06d}.json" for i in range(2)]
    datasets = {d.dataset.name: d for d in client.get_run(found.info.run_id).inputs.dataset_inputs}
    assert {"math-train", "math-eval", f"trajectories-{LAST}"} <= datasets.keys()
    assert f"math-tiny/{BASELINE_RUN}/{LAST}/rollout" in datasets[f"trajectories-{LAST}"].dataset.source
    assert (run.root / "mlartifacts").is_dir() and not (run.folder / "mlruns").exists()
    report = run.root / "math-tiny" / BASELINE_RUN / "report"
    figures = {"reward.png", "grad_norms.png", "advantages.png", "lemma.png"}
    assert figures <= {p.name for p in report.iterdir()} and (report / MANIFEST).exists()
    assert all((report / name).read_bytes().startswith(b"\x89PNG") for name in figures)
    assert figures | {"report.md"} <= {
        a.path.split("/")[-1] for a in client.list_artifacts(found.info.run_id, "report")
    }
    for wg in ("solver", "verifier"):
        [version] = [v for v in client.search_model_versions(f"name='math-tiny-{wg}'") if v.run_id == found.info.run_id]
        assert version.source.endswith(f"math-tiny/{BASELINE_RUN}/{LAST}/policy/{wg}")


def test_search_team_end_to_end(tmp_path):
    """The search task through `drmas run`: every stage's artifact is in the store."""
    done = drmas_run(
        tmp_path,
        *TINY_OVERRIDES,
        "--run-id",
        "s",
        "experiment.iterations=2",
        "warmstart.steps=0",
        "task.max_turns=2",
        "eval.every=1",
        "eval.max_questions=2",
        "eval.k=2",
        config="search_tiny.yaml",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    run = tmp_path / "runs" / "search-tiny" / "s"
    for stage in (
        "rollout",
        "advantage",
        "policy/verifier-search-answer",
        "optim/verifier-search-answer",
        "evaluate",
        "checkpoint",
    ):
        for iteration in (0, 1):
            assert (run / f"iter-{iteration:06d}" / stage / "_MANIFEST.json").exists(), stage
    assert (run / "init" / "evaluate" / "_MANIFEST.json").exists()
    assert "iter 1:" in done.stdout


def assert_rerun_recomputes_only_the_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`drmas rerun` of the advantage stage reproduces the stored batch byte for byte, and
    every other stage of the iteration is a cache hit (their manifests are untouched)."""
    iteration = tmp_path / "runs" / "math-tiny" / BASELINE_RUN / LAST
    manifests = {path: path.read_bytes() for path in iteration.glob(f"*/**/{MANIFEST}")}
    batch = (iteration / "advantage" / "batch.parquet").read_bytes()
    status, out, err = drmas_here(
        capsys, tmp_path, "rerun", "--run-id", BASELINE_RUN, "--iteration", "1", "--stage", "advantage"
    )
    assert status == 0, out + err
    assert (
        "recomputed: advantage;" in out
        and "cache hits: rollout, update/solver, update/verifier, checkpoint, evaluate" in out
    )
    assert (iteration / "advantage" / "batch.parquet").read_bytes() == batch
    changed = [p for p, data in manifests.items() if p.read_bytes() != data]
    assert changed == [iteration / "advantage" / MANIFEST] or changed == []
