"""``bench/gpu_checks.py`` rehearsed on the CPU, and where ZeRO-3's onload puts the optimizer.

Only a GPU shows the fault the onload fix is for: with ``offload_optimizer`` DeepSpeed keeps
ZeRO-3's fp32 master partitions on the host with a pinned host ``.grad``, and moving the
partitions and their moments to the GPU by hand made the next step mix devices. Here the
CPU is the only device, so the rehearsal checks the script's path (its engine cases run
drmas's own DeepSpeed engine and update loop, write their report, survive a failing case)
and a unit test checks the placement decision against a device that is not the host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import torch_env

from drmas.training.engines.deepspeed import zero3_optimizer_homes

pytestmark = pytest.mark.standin

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "bench" / "gpu_checks.py"


def test_zero3_onload_leaves_offloaded_partitions_where_deepspeed_keeps_them():
    """DeepSpeed records each sub-group's optimizer device (``subgroup_to_device``): an
    offloaded one stays on the host, the rest come to the training device; without
    ``offload_optimizer`` every partition comes to the device."""
    gpu = torch.device("cuda", 0)  # a device object only: nothing is allocated on it
    flats = [torch.zeros(2), torch.zeros(2), torch.zeros(2)]
    offloaded = SimpleNamespace(
        offload_optimizer=True, fp32_partitioned_groups_flat=flats, subgroup_to_device={0: "cpu", 1: "cuda", 2: "cpu"}
    )
    assert zero3_optimizer_homes(offloaded, gpu) == [torch.device("cpu"), gpu, torch.device("cpu")]
    resident = SimpleNamespace(offload_optimizer=False, fp32_partitioned_groups_flat=flats)
    assert zero3_optimizer_homes(resident, gpu) == [gpu, gpu, gpu]


def gpu_checks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=torch_env(threads=1), timeout=900
    )


@pytest.mark.slow
def test_the_rehearsal_runs_each_engine_case_through_update_offload_onload_and_update(tmp_path):
    out = tmp_path / "report.json"
    done = gpu_checks("--checks", "env,engine", "--tiny", "--cases", "zero2-offload,zero3-offload", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())["checks"]
    assert report["env"]["versions"]["deepspeed"][0].isdigit()
    for name, stage in (("zero2-offload", 2), ("zero3-offload", 3)):
        case = report["engine"][name]
        assert (case["stage"], case["offload_optimizer"], case["passed"]) == (stage, True, True)
        assert case["second_update_ok"] and case["state_over_round_trip"]["identical"]
        assert case["state_over_round_trip"]["tensors"] > 10  # masters and moments of every parameter
        assert case["first_update"]["wg/solver/steps"] == case["second_update"]["wg/solver/steps"] == 2.0
        assert all(slot["master"] == slot["exp_avg"] == "cpu" for slot in case["placement_after_onload"])


def test_a_failing_check_is_reported_and_the_report_is_still_written(tmp_path):
    """An engine case that fails (here: one the script does not know) is a FAIL with its
    error in the report, the other checks still run, and the exit code is not 0."""
    out = tmp_path / "report.json"
    done = gpu_checks("--checks", "engine,env", "--tiny", "--cases", "no-such-case", "--out", str(out))
    assert done.returncode != 0
    assert "engine no-such-case: FAIL" in done.stdout
    report = json.loads(out.read_text())["checks"]
    assert report["engine"]["no-such-case"]["passed"] is False
    assert "KeyError" in report["engine"]["no-such-case"]["error"]
    assert "versions" in report["env"]
    assert not list(tmp_path.glob("*.draft"))
