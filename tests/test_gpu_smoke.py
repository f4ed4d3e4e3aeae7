"""bench/gpu_smoke.py on CPU: its help, the config it writes (validated by drmas itself)
and its checks on a hand-made store. The run and the SGLang check need a GPU and the GPU
image: they are not run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from drmas.config import ModelSpec, load_config
from drmas.models import build_scratch_policy

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "bench" / "gpu_smoke.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_smoke  # noqa: E402


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> Path:
    """A tiny model folder in Hugging Face layout, standing for the pretrained model."""
    spec = ModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300)
    return build_scratch_policy(spec, ["12 + 30 = 42"] * 20, tmp_path_factory.mktemp("model"), seed=0)


def smoke(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_help_runs_without_a_gpu():
    done = smoke("--help")
    assert done.returncode == 0 and "--model" in done.stdout and "--no-sglang" in done.stdout


@pytest.mark.parametrize("sglang", [True, False])
def test_dry_run_writes_the_smoke_config_and_drmas_accepts_it(tmp_path, local_model, sglang):
    done = smoke(
        "--model", str(local_model), "--out", str(tmp_path), "--dry-run", "--sglang" if sglang else "--no-sglang"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS  config valid (drmas config)" in done.stdout
    config = load_config(tmp_path / "smoke.yaml")
    assert config.experiment.iterations == 2
    assert (config.train.backend, config.train.zero_stage) == ("deepspeed", 3)
    assert (config.ray.pool_resource, config.ray.pool_size, config.ray.address) == ("GPU", 1, None)
    assert config.rollout.engine == ("sglang" if sglang else "hf")
    assert config.train.recompute_old_logprobs  # bf16 and SGLang: the trainer recomputes
    for group in config.worker_groups():
        assert group.spec is not None and group.spec.source == str(local_model) and group.spec.dtype == "bfloat16"
    assert config.store.root == str(tmp_path / "runs")
    assert config.rollout.group_size * config.rollout.prompts_per_iteration <= 16


def test_a_model_folder_that_is_not_one_fails_and_writes_nothing(tmp_path):
    (tmp_path / "model").mkdir()
    done = smoke("--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--dry-run")
    assert done.returncode == 1
    assert "FAIL  config valid" in done.stdout and str(tmp_path / "model") in done.stdout
    assert not list((tmp_path / "out").glob("smoke.yaml*"))


def write_policy(store: Path, wg: str, iteration: int, weight: float, metrics: dict[str, float]) -> None:
    folder = gpu_smoke.policy_dir(store, wg, iteration)
    folder.mkdir(parents=True)
    save_file({"w": torch.full((2,), weight)}, str(folder / "model.safetensors"))
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "_MANIFEST.json").write_text("{}")


def test_the_checks_fail_on_what_they_look_for(tmp_path):
    """A worker group whose weights did not move, a large log-prob gap, a NaN norm, a
    skipped step and a missing memory figure each fail their check."""
    good = {"wg/a/logprob_gap": 0.01, "wg/a/grad_norm": 0.5, "wg/a/skipped": 0.0, "wg/a/peak_memory_gib": 3.2}
    bad = {"wg/b/logprob_gap": 0.5, "wg/b/grad_norm": float("nan"), "wg/b/skipped": 1.0}
    for iteration in range(2):
        write_policy(tmp_path, "a", iteration, float(iteration), good)
        write_policy(tmp_path, "b", iteration, 1.0, bad)
    moved = gpu_smoke.check_policies_moved(tmp_path, ["a", "b"])
    assert not moved.passed and "b:" in moved.detail and "a:" not in moved.detail
    assert gpu_smoke.check_policies_moved(tmp_path, ["a"]).passed
    metrics = gpu_smoke.update_metrics(tmp_path, ["a", "b"])
    only_a = {key: value for key, value in metrics.items() if key.startswith("a@")}
    checks = {
        "logprob_gap": lambda v: v <= 0.1,
        "grad_norm": lambda v: v == v,
        "skipped": lambda v: v == 0,
        "peak_memory_gib": lambda v: v > 0,
    }
    for suffix, ok in checks.items():
        assert gpu_smoke.check_metric(only_a, suffix, suffix, ok, "").passed
        failed = gpu_smoke.check_metric(metrics, suffix, suffix, ok, "")
        assert not failed.passed and "b@" in failed.detail
