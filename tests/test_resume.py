"""Exact resume: a run killed after its second iteration and resumed ends with the same
weights, bit for bit, as a run that was never interrupted (CPU, same machine).

The runs that train (and the one that is killed) are ``drmas`` processes; the commands that
stop before Ray starts (a rerun of the advantage stage, a resume with nothing left to do,
a resume with a changed config) call ``drmas.cli.main`` in this process, as the console
script does, which spares a process start each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES
from test_bad_input import refuse_ray

from drmas.cli import main
from drmas.infra.store import MANIFEST

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
SMALL = ["experiment.iterations=3", *TINY_OVERRIDES]


def drmas_run(tmp_path: Path, *args: str, wait: bool = True, config: str = "math_tiny.yaml"):
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "run",
        str(ROOT / "configs" / config),
        *SMALL,
        f"store.root={tmp_path / 'runs'}",
        *args,
    ]
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
    """``drmas COMMAND`` on the tiny math config with the settings of ``drmas_run`` and its
    store under ``tmp_path``, in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    status = main([command, str(ROOT / "configs" / "math_tiny.yaml"), *SMALL, f"store.root={tmp_path / 'runs'}", *args])
    out, err = capsys.readouterr()
    return status, out, err


def weights(tmp_path: Path, run: str) -> dict[str, bytes]:
    folder = tmp_path / "runs" / "math-tiny" / run / "iter-000002" / "policy"
    return {wg: (folder / wg / "model.safetensors").read_bytes() for wg in ("solver", "verifier")}


def test_kill_and_resume_equals_uninterrupted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the working folder of the commands run in this process
    monkeypatch.setattr("drmas.generation.ray_session.connect_ray", refuse_ray)  # they stop before Ray
    full = drmas_run(tmp_path, "--run-id", "full", "eval.every=2", "eval.max_questions=3", "eval.k=2")
    assert full.returncode == 0, full.stdout + full.stderr
    assert "iter 2:" in full.stdout and "before training: eval avg@2" in full.stdout
    table = full.stdout.split("before    after")[1]
    assert table.splitlines()[1].startswith("eval avg@2") and "solver valid outputs" in table
    assert f"checkpoint: {tmp_path / 'runs'}/math-tiny/full/iter-000002/checkpoint" in full.stdout
    assert_tracked(tmp_path, "full")
    assert_rerun_recomputes_only_the_stage(tmp_path, capsys)

    # The killed run stores its optimizer states only after its last iteration
    # (checkpoint.every=3): in between its pool's workers hold them.
    cut = ("checkpoint.every=3", "eval.every=2", "eval.max_questions=3", "eval.k=2")
    killed = drmas_run(tmp_path, "--run-id", "cut", *cut, wait=False)
    marker = tmp_path / "runs" / "math-tiny" / "cut" / "iter-000001" / "checkpoint" / "_MANIFEST.json"
    deadline = time.monotonic() + 300
    while not marker.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), killed.communicate()[0]
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert not (tmp_path / "runs" / "math-tiny" / "cut" / "iter-000002" / "checkpoint" / "_MANIFEST.json").exists()

    cut_dir = tmp_path / "runs" / "math-tiny" / "cut"
    assert not list(cut_dir.glob("iter-*/optim/*/_MANIFEST.json"))  # held by the pool the kill took
    written = {
        kind: (cut_dir / "iter-000000" / kind / MANIFEST).stat().st_mtime_ns for kind in ("rollout", "policy/solver")
    }
    resumed = drmas_run(tmp_path, "--resume", "cut", *cut)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # iteration 1 was killed after its checkpoint, before its due evaluation: it is not done yet
    assert "iterations 0-0 are checkpointed, but their optimizer states were held only by the pool" in resumed.stdout
    assert "iter 0:" in resumed.stdout and "iter 2:" in resumed.stdout
    rewritten = {kind: (cut_dir / "iter-000000" / kind / MANIFEST).stat().st_mtime_ns for kind in written}
    assert rewritten["rollout"] == written["rollout"] and rewritten["policy/solver"] != written["policy/solver"]
    assert weights(tmp_path, "cut") == weights(tmp_path, "full")
    assert sorted(path.parent.parent.parent.name for path in cut_dir.glob("iter-*/optim/*/_MANIFEST.json")) == [
        "iter-000002",
        "iter-000002",
    ]

    status, out, _ = drmas_here(capsys, tmp_path, "run", "--resume", "cut", *cut)
    assert status == 0 and "nothing left to do" in out

    # A damaged last checkpoint: say which file and stop, non-zero, before Ray (refused
    # here) or anything else starts; never run zero steps.
    optimizer = tmp_path / "runs" / "math-tiny" / "cut" / "iter-000002" / "optim" / "solver" / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    status, _, err = drmas_here(capsys, tmp_path, "run", "--resume", "cut", *cut, "experiment.iterations=4")
    assert status == 1
    assert "optim/solver/optimizer.safetensors: 100 bytes, but the manifest says" in err

    status, _, err = drmas_here(
        capsys, tmp_path, "run", "--resume", "full", "eval.every=2", "eval.max_questions=3", "eval.k=2", "train.lr=0.5"
    )
    assert status == 1 and "train.lr: the run was started with 0.001, now 0.5" in err


def assert_tracked(tmp_path: Path, run: str) -> None:
    """MLflow (sqlite in the store's folder by default) holds params, per-iteration metrics,
    lineage, the datasets, the report's figures and a registered version per worker group;
    the report is in the store too."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    [found] = client.search_runs(
        [client.get_experiment_by_name("math-tiny").experiment_id], f"tags.`drmas.run_id` = '{run}'"
    )
    assert found.data.params["algorithm.advantage"] == "drmas"
    assert [m.step for m in client.get_metric_history(found.info.run_id, "reward/mean")] == [1, 2, 3]
    assert [m.step for m in client.get_metric_history(found.info.run_id, "eval/avg_at_2")] == [0, 2, 3]
    assert found.data.tags["lineage.checkpoint"].endswith(f"math-tiny/{run}/iter-000002/checkpoint")
    assert found.info.status == "FINISHED"
    episodes = [a.path for a in client.list_artifacts(found.info.run_id, "episodes")]
    assert episodes == [f"episodes/iter-{i:06d}.json" for i in range(3)]
    datasets = {d.dataset.name: d for d in client.get_run(found.info.run_id).inputs.dataset_inputs}
    assert {"math-train", "math-eval", "trajectories-iter-000002"} <= datasets.keys()
    assert f"math-tiny/{run}/iter-000002/rollout" in datasets["trajectories-iter-000002"].dataset.source
    assert (tmp_path / "runs" / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()
    report = tmp_path / "runs" / "math-tiny" / run / "report"
    figures = {"reward.png", "grad_norms.png", "advantages.png", "lemma.png"}
    assert figures <= {p.name for p in report.iterdir()} and (report / "_MANIFEST.json").exists()
    assert all((report / name).read_bytes().startswith(b"\x89PNG") for name in figures)
    assert figures | {"report.md"} <= {
        a.path.split("/")[-1] for a in client.list_artifacts(found.info.run_id, "report")
    }
    for wg in ("solver", "verifier"):
        [version] = [v for v in client.search_model_versions(f"name='math-tiny-{wg}'") if v.run_id == found.info.run_id]
        assert version.source.endswith(f"math-tiny/{run}/iter-000002/policy/{wg}")


def test_search_team_end_to_end(tmp_path):
    """The search task through `drmas run`: every stage's artifact is in the store."""
    done = drmas_run(
        tmp_path,
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
    iteration = tmp_path / "runs" / "math-tiny" / "full" / "iter-000001"
    manifests = {path: path.read_bytes() for path in iteration.glob("*/**/_MANIFEST.json")}
    batch = (iteration / "advantage" / "batch.parquet").read_bytes()
    status, out, err = drmas_here(
        capsys,
        tmp_path,
        "rerun",
        "eval.every=2",
        "eval.max_questions=3",
        "eval.k=2",
        "--run-id",
        "full",
        "--iteration",
        "1",
        "--stage",
        "advantage",
    )
    assert status == 0, out + err
    assert (
        "recomputed: advantage;" in out
        and "cache hits: rollout, update/solver, update/verifier, checkpoint, evaluate" in out
    )
    assert (iteration / "advantage" / "batch.parquet").read_bytes() == batch
    changed = [p for p, data in manifests.items() if p.read_bytes() != data]
    assert changed == [iteration / "advantage" / "_MANIFEST.json"] or changed == []
