"""The advantage-mode comparison: its spike statistic and its report."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES

from drmas.analysis.compare import ComparisonRun, mismatch_reading, spike, write_comparison
from drmas.config import load_config
from drmas.infra.store import Store

ROOT = Path(__file__).parent.parent


def test_spike_is_the_worst_step_over_the_median():
    assert spike([1.0, 1.0, 1.0, 5.0]) == 5.0
    assert spike([2.0, 2.0, 2.0]) == 1.0
    assert spike([1.0, float("nan"), 3.0, 1.0]) == 3.0  # a skipped (non-finite) step is not a spike
    assert math.isnan(spike([]))


def _history(norms: list[float], ratio: float, final_eval: float) -> list[tuple[int, dict[str, float]]]:
    history = [(0, {"eval/avg_at_4": 0.5, "eval/pass_at_4": 0.8})]
    for i, norm in enumerate(norms):
        history.append(
            (
                i + 1,
                {
                    "agent/solver/reward_mean": 0.6,
                    "agent/verifier/reward_mean": 0.7,
                    "agent/solver/calls": 12.0,
                    "agent/verifier/calls": 8.0,
                    "agent/solver/grad_norm": norm,
                    "agent/verifier/grad_norm": 1.0,
                    "agent/solver/adv_sq_ratio": ratio,
                    "agent/verifier/adv_sq_ratio": 1.0,
                    "agent/solver/lemma_multiplier": 4.0,
                    "agent/verifier/lemma_multiplier": 1.0,
                    "agent/solver/lemma_multiplier_p95": 9.0,
                    "agent/solver/lemma_var_ratio": 3.0,
                    "agent/solver/lemma_mean_gap": 0.5,
                    "agent/solver/lemma_groups": 4.0,
                    "agent/solver/lemma_flat_groups": 1.0,
                    "wg/solver/skipped": 0.0,
                    "wg/verifier/skipped": 1.0 if i == 0 else 0.0,
                },
            )
        )
    history[-1][1].update({"eval/avg_at_4": final_eval, "eval/pass_at_4": 0.9})
    return history


def test_report_names_modes_agents_spikes_and_results(tmp_path):
    config = load_config("configs/math_tiny.yaml", [f"store.root={tmp_path}"])
    store = Store.from_config(config.store)
    runs = [
        ComparisonRun("grpo", 0, "c-grpo-s0", _history([1.0, 1.0, 8.0, 1.0], 1.5, 0.60)),
        ComparisonRun("grpo", 1, "c-grpo-s1", _history([1.0, 4.0, 1.0, 1.0], 1.5, 0.70)),
        ComparisonRun("drmas", 0, "c-drmas-s0", _history([1.0, 1.0, 1.0, 1.0], 1.5, 0.80)),
    ]
    uri = write_comparison(config, store, "c", runs)
    assert uri == store.uri("math-tiny/c/report")
    report = store.open("math-tiny/c/report")
    assert report.read_bytes("grad_norms.png").startswith(b"\x89PNG") and report.read_bytes("lemma.png").startswith(
        b"\x89PNG"
    )
    text = report.read_bytes("report.md").decode()
    assert "| grpo | solver | 6.000 ± 2.000 |" in text  # spikes 8 and 4 over a median of 1
    assert "| drmas | solver | 1.000 |" in text
    assert "| solver | 12.000 | 0.600 | 1.500 | 4.000 | 9.000 | 0.500 | 3.000 | 25% |" in text
    assert mismatch_reading({"solver": 1.5, "verifier": 1.0}) in text
    # Solver grad norms: grpo runs 2.75 and 1.75 (mean 2.25), drmas 1.0: observed 2.25
    # against sqrt(1.5) = 1.225 (measured) and sqrt(4) = 2 (lemma).
    assert "| solver | 2.250 | 1.000 | 2.250 | 1.225 | 2.000 |" in text
    assert "| grpo | 0.650 ± 0.050 | 0.900 ± 0.000 | 2 |" in text  # one skipped step per grpo run
    assert "| drmas | 0.800 | 0.900 | 1 |" in text


def test_the_report_says_what_the_multipliers_predict():
    reading = mismatch_reading({"solver": 4.0, "verifier": 1.0})
    assert "scales solver's advantage second moment by 4.00" in reading and "gradient norm by about 2.00" in reading
    assert "scales verifier's advantage second moment by 0.70" in mismatch_reading({"solver": 1.05, "verifier": 0.7})
    alike = mismatch_reading({"solver": 1.008, "verifier": 0.991})
    assert "within 0.01 of 1" in alike and "should behave alike" in alike
    assert "by 1.20" in mismatch_reading({"solver": 1.2, "verifier": float("nan")})
    assert "undefined" in mismatch_reading({"solver": float("nan")})


def test_report_means_skip_iterations_without_reward_spread(tmp_path):
    """An iteration whose rewards are all equal has no ratio (NaN): the report's means skip
    it instead of printing nan."""
    config = load_config("configs/math_tiny.yaml", [f"store.root={tmp_path}"])
    history = _history([1.0, 2.0, 1.0], 1.5, 0.6)
    history[2][1]["agent/solver/adv_sq_ratio"] = float("nan")
    history[2][1]["agent/solver/lemma_multiplier"] = float("nan")
    write_comparison(config, Store.from_config(config.store), "c", [ComparisonRun("grpo", 0, "c-grpo-s0", history)])
    text = (tmp_path / "math-tiny" / "c" / "report" / "report.md").read_text()
    assert "| solver | 12.000 | 0.600 | 1.500 | 4.000 |" in text and "nan" not in text
    assert "| grpo | solver | 2.000 | 2.000 | 1.000 |" in text  # spike, largest, median


@pytest.mark.slow
@pytest.mark.e2e
def test_drmas_compare_trains_every_run_from_one_warm_start(tmp_path):
    """`drmas compare` end to end on a tiny team: one run per mode and seed, all in one Ray;
    every run starts from the first one's warm start (copied, not retrained), one report for
    all."""
    command = [
        str(Path(sys.executable).parent / "drmas"),
        "compare",
        str(ROOT / "configs" / "math_tiny.yaml"),
        "--seeds",
        "2",
        "--name",
        "cmp",
        "experiment.iterations=1",
        "eval.every=1",
        "eval.max_questions=3",
        "eval.k=2",
        *TINY_OVERRIDES,
        f"store.root={tmp_path / 'runs'}",
    ]
    ray_dir = Path(tempfile.mkdtemp(prefix="drmas-cmp-"))  # short: Ray's socket paths
    try:
        done = subprocess.run(
            command,
            cwd=tmp_path,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(ray_dir)},
            capture_output=True,
            text=True,
            timeout=900,
        )
        ray_sessions = [path for path in ray_dir.glob("drmas-ray-*/session_2*") if path.is_dir()]
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stdout + done.stderr
    root = tmp_path / "runs" / "math-tiny"
    runs = ["cmp-grpo-s0", "cmp-drmas-s0", "cmp-grpo-s1", "cmp-drmas-s1"]
    assert f"runs: {', '.join(runs)}" in done.stdout
    # one local Ray for the four runs (one session folder), each run's own pool started in it
    assert len(ray_sessions) == 1 and done.stdout.count("drmas: pool started: 2 worker(s)") == len(runs)
    for wg in ("solver", "verifier"):
        start = (root / runs[0] / "warmstart" / "policy" / wg / "model.safetensors").read_bytes()
        for other in runs[1:]:
            copy = root / other / "warmstart" / "policy" / wg
            assert (copy / "model.safetensors").read_bytes() == start
            assert json.loads((copy / "_MANIFEST.json").read_text())["meta"]["copied_from"].endswith(
                f"{runs[0]}/warmstart/policy/{wg}"
            )
    # the seeds then train apart from the same start: other questions, other samples
    rollouts = {run: (root / run / "iter-000000" / "rollout" / "trajectories.parquet").read_bytes() for run in runs}
    assert rollouts["cmp-grpo-s0"] != rollouts["cmp-grpo-s1"]
    recorded = {m: json.loads((root / f"cmp-{m}-s1" / "run" / "config.json").read_text()) for m in ("grpo", "drmas")}
    assert recorded["grpo"]["experiment"]["seed"] == 1
    assert (
        recorded["grpo"]["algorithm"]["advantage"] == "grpo" and recorded["drmas"]["algorithm"]["advantage"] == "drmas"
    )
    assert recorded["drmas"]["diagnostics"]["per_agent_grad_norm"] is True
    text = (root / "cmp" / "report" / "report.md").read_text()
    assert "| grpo | solver |" in text and "| drmas | verifier |" in text and "eval avg@2" in text
    assert (root / "cmp" / "report" / "grad_norms.png").read_bytes().startswith(b"\x89PNG")
