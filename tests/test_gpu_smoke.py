"""bench/gpu_smoke.py on CPU: its help, the config it writes (validated by drmas itself),
its report when checks fail or raise, and its checks on hand-made stores and numbers. The
run, the SGLang engine probe and the memory it measures need a GPU and the GPU image: they
are not run here (on CPU the probe raises, which the report test relies on)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from drmas.config import ModelSpec, load_config
from drmas.infra.layout import stage_path
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store
from drmas.models import build_scratch_policy, load_model

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "bench" / "gpu_smoke.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_smoke  # noqa: E402

pytestmark = pytest.mark.standin

GIB = 2**30


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> Path:
    """A tiny model folder in Hugging Face layout, standing for the pretrained model."""
    spec = ModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300)
    return build_scratch_policy(spec, ["12 + 30 = 42"] * 20, tmp_path_factory.mktemp("model"), seed=0)


def smoke(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_help_runs_without_a_gpu():
    done = smoke("--help")
    assert done.returncode == 0, done.stderr
    for option in ("--model", "--no-sglang", "--zero-stage", "--report", "--lr", "--min-release", "--sync-tol"):
        assert option in done.stdout


@pytest.mark.parametrize(("sglang", "stage"), [(True, None), (False, "3")])
def test_dry_run_writes_the_smoke_config_and_drmas_accepts_it(tmp_path, local_model, sglang, stage):
    """The default is the recipes' ZeRO-2 with their optimizer offload; ``--zero-stage 3``
    gives ZeRO-3. The learning rate is the smoke's, large enough for the staleness check."""
    zero = ["--zero-stage", stage] if stage else []
    done = smoke(
        "--model", str(local_model), "--out", str(tmp_path), "--dry-run", "--sglang" if sglang else "--no-sglang", *zero
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS  config valid (drmas config)" in done.stdout
    config = load_config(tmp_path / "smoke.yaml")
    assert config.experiment.iterations == 2
    assert (config.train.backend, config.train.zero_stage) == ("deepspeed", int(stage or 2))
    assert config.train.offload_optimizer  # as the recipe sets it
    assert config.train.lr == gpu_smoke.SMOKE_LR == 1e-4
    assert (config.ray.pool_resource, config.ray.pool_size, config.ray.address) == ("GPU", 1, None)
    assert config.rollout.engine == ("sglang" if sglang else "hf")
    assert config.train.recompute_old_logprobs  # bf16 and SGLang: the trainer recomputes
    for group in config.worker_groups():
        assert group.spec is not None and group.spec.source == str(local_model) and group.spec.dtype == "bfloat16"
    assert config.store.root == str(tmp_path / "runs")
    assert config.rollout.group_size * config.rollout.prompts_per_iteration <= 16
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["finished"] and (report["passed"], report["failed"]) == (1, 0)
    assert report["config"] == str(tmp_path / "smoke.yaml")


def test_a_model_folder_that_is_not_one_fails_writes_no_config_and_reports_it(tmp_path):
    (tmp_path / "model").mkdir()
    report = tmp_path / "elsewhere" / "r.json"
    done = smoke(
        "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--dry-run", "--report", str(report)
    )
    assert done.returncode == 1
    assert "FAIL  config valid" in done.stdout and str(tmp_path / "model") in done.stdout
    assert not list((tmp_path / "out").glob("smoke.yaml*"))
    written = json.loads(report.read_text())
    [check] = written["checks"]
    assert not check["passed"] and str(tmp_path / "model") in check["detail"] and written["failed"] == 1


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


# -- the report -------------------------------------------------------------------------


def test_a_check_that_raises_is_a_fail_with_its_error_and_the_next_ones_run(tmp_path):
    """The report is on disk after every check (the second step reads the first's entry)
    and whole at the end; a raising check is a FAIL naming its error."""
    report = tmp_path / "report.json"
    seen = []

    def second() -> gpu_smoke.Check:
        seen.append(json.loads(report.read_text()))
        raise FileNotFoundError("no policy at iter-000001")

    steps = [
        ("first", lambda: gpu_smoke.Check("first", True, "fine")),
        ("second", second),
        ("third", lambda: gpu_smoke.Check("third", False, "wrong")),
    ]
    checks = gpu_smoke.run_steps(steps, report, {"script": "x"})
    assert [(c.name, c.passed) for c in checks] == [("first", True), ("second", False), ("third", False)]
    assert checks[1].detail == "raised FileNotFoundError: no policy at iter-000001"
    [early] = seen
    assert not early["finished"] and [c["name"] for c in early["checks"]] == ["first"]
    written = json.loads(report.read_text())
    assert written["finished"] and (written["passed"], written["failed"], written["script"]) == (1, 2, "x")
    assert written["checks"][1] == {"name": "second", "passed": False, "detail": checks[1].detail}


def test_a_failed_run_still_reports_every_check_and_exits_with_their_count(tmp_path, local_model, monkeypatch):
    """The run fails (stood in for: no GPU here): every later check is still recorded, each
    a FAIL with why (nothing stored; the SGLang probe stops where a failed run leaves no
    iteration-1 policy, stood in for too: it would start an engine on a GPU), the report is
    written, and the exit code is the number of failed checks."""

    def probe(found, store, model, wg, zero_stage):
        found["free_before"] = 100 * GIB
        raise FileNotFoundError(gpu_smoke.policy_dir(store, wg, 1))

    monkeypatch.setattr(gpu_smoke, "check_run", lambda *_: gpu_smoke.Check("run completed", False, "exit 1"))
    monkeypatch.setattr(gpu_smoke, "_probe", probe)
    code = gpu_smoke.main(["--model", str(local_model), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    names = [check["name"] for check in report["checks"]]
    assert names == [
        "config valid (drmas config)",
        "run completed",
        "policies updated",
        "rollout/trainer log-prob gap",
        "grad norms finite",
        "no step skipped",
        "peak GPU memory (GiB)",
        "SGLang release frees memory",
        "SGLang weight sync",
        "rollout engine held the update (iteration 1)",
    ]
    assert [check["passed"] for check in report["checks"]] == [True] + [False] * 9
    assert code == report["failed"] == 9 and report["finished"]
    details = {check["name"]: check["detail"] for check in report["checks"]}
    for name in ("SGLang release frees memory", "SGLang weight sync"):
        assert details[name].startswith("raised RuntimeError: the engine probe stopped before it: FileNotFoundError")
        assert "iter-000001/policy/solver" in details[name]
    assert "no committed policy" in details["policies updated"]
    assert details["rollout engine held the update (iteration 1)"].startswith("raised ArtifactNotFound")


# -- the comparisons --------------------------------------------------------------------


def test_mean_abs_gap_is_a_token_mean_over_rows():
    # |0 - 0.5| + |-1 - -1| + |-2 - -1| = 1.5 over 3 tokens
    assert gpu_smoke.mean_abs_gap([[0.0, -1.0], [-2.0]], [[0.5, -1.0], [-1.0]]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        gpu_smoke.mean_abs_gap([[0.0, -1.0]], [[0.0]])
    with pytest.raises(ValueError):
        gpu_smoke.mean_abs_gap([[]], [[]])


def test_staleness_passes_an_engine_near_the_new_policy_and_fails_a_stale_or_undecidable_one():
    # fresh engine: 0.02 from the new policy (noise), 0.3 from the old: >= 3 x 0.02
    assert gpu_smoke.staleness_problem(0.02, 0.3, max_gap=0.1, ratio=3) is None
    # stale engine: it holds the old policy, so 0.3 from the new one and 0.02 from the old
    assert "from the policy it should hold" in gpu_smoke.staleness_problem(0.3, 0.02, max_gap=0.1, ratio=3)
    # a step too small to tell: both gaps near the noise, a stale engine would pass
    assert "would not be told apart" in gpu_smoke.staleness_problem(0.02, 0.04, max_gap=0.1, ratio=3)
    # identical policies: no difference at all is not evidence
    assert "would not be told apart" in gpu_smoke.staleness_problem(0.0, 0.005, max_gap=0.1, ratio=3)


def probe(**overrides) -> dict:
    new = [-0.5, -1.25, -2.0]
    old = [-0.5, -1.0, -2.5]  # 0.5 away at most
    return {"initial": old, "pushed": new, "cycled": new, "from_disk": list(new)} | overrides


def test_sync_passes_when_pushed_weights_score_as_the_disk_load():
    check = gpu_smoke.sync_check(probe(), tol=1e-3, ratio=3, wg="solver")
    assert check.passed and check.name == "SGLang weight sync (solver)", check.detail
    nearly = probe(pushed=[-0.5, -1.2505, -2.0])  # within the tolerance
    assert gpu_smoke.sync_check(nearly, tol=1e-3, ratio=3, wg="solver").passed


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"pushed": [-0.5, -1.0, -2.5]}, "after the push"),  # the push left the initial weights
        ({"cycled": [-0.5, -1.0, -2.5]}, "after a release and resume"),  # the host backup was stale
        ({"initial": [-0.5, -1.25, -2.0005]}, "stale would pass"),  # policies too close to tell
    ],
)
def test_sync_fails_a_stale_push_a_lost_backup_and_an_undecidable_comparison(overrides, why):
    check = gpu_smoke.sync_check(probe(**overrides), tol=1e-3, ratio=3, wg="solver")
    assert not check.passed and why in check.detail


def test_sync_and_release_raise_with_the_probes_error_when_it_stopped():
    stopped = {"free_before": 100 * GIB, "error": "FileNotFoundError: iter-000001/policy/solver"}
    for check in (
        lambda: gpu_smoke.sync_check(stopped, tol=1e-3, ratio=3, wg="solver"),
        lambda: gpu_smoke.release_check(stopped, min_share=0.8),
    ):
        with pytest.raises(RuntimeError, match="iter-000001/policy/solver"):
            check()


def test_release_must_give_back_most_of_what_the_engine_took():
    # took 100 - 30 = 70 GiB; gave back 95 - 30 = 65 GiB, 93% >= 80%
    freed = {"free_before": 100 * GIB, "free_resident": 30 * GIB, "free_released": 95 * GIB}
    check = gpu_smoke.release_check(freed, min_share=0.8)
    assert check.passed and "took 70.00 GiB" in check.detail and "gave back 65.00 GiB (93%" in check.detail
    # a no-op memory saver: gave back 10 of 70 GiB
    assert not gpu_smoke.release_check(freed | {"free_released": 40 * GIB}, min_share=0.8).passed
    # an engine that took nothing measurable proves nothing
    idle = {"free_resident": 100 * GIB, "free_released": 100 * GIB}
    assert not gpu_smoke.release_check(freed | idle, min_share=0.8).passed


def test_prompt_logprobs_reads_sglangs_input_token_logprobs():
    # (logprob, token id, text) per prompt token; the first token has no log-prob
    output = {"meta_info": {"input_token_logprobs": [(None, 11, None), (-0.5, 12, None), (-1.25, 13, None)]}}
    assert gpu_smoke.prompt_logprobs(output) == [-0.5, -1.25]
    with pytest.raises(ValueError):  # not from position 0 (logprob_start_len unset)
        gpu_smoke.prompt_logprobs({"meta_info": {"input_token_logprobs": [(-0.5, 12, None), (-1.25, 13, None)]}})


# -- the staleness check on a hand-made store ---------------------------------------------


def reference_logprobs(folder: Path, rows: list[dict]) -> list[list[float]]:
    """The response tokens' log-probs under the policy, computed here independently (one
    row at a time, float32, temperature 1 as the smoke config samples)."""
    model = load_model(folder, "float32")
    found = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            taken = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            found.append(taken[len(row["prompt_ids"]) - 1 :].tolist())
    return found


@pytest.mark.parametrize("engine_holds", ["update", "initial"])
def test_the_staleness_check_tells_an_engine_that_kept_the_initial_weights(tmp_path, local_model, engine_holds):
    """Iteration 1's rollout log-probs from the policy of iteration 0's update pass; the
    same rows with the initial policy's log-probs (an engine that never took the update)
    fail. The stored policies are a tiny model and a perturbed copy of it."""
    path = gpu_smoke.write_config(local_model, False, tmp_path)
    store = tmp_path / "runs"
    groups = [group.name for group in load_config(path).worker_groups()]
    generator = torch.Generator().manual_seed(0)
    for wg in groups:
        shutil.copytree(local_model, gpu_smoke.policy_dir(store, wg, None))
        updated = load_model(local_model, "float32")
        with torch.no_grad():
            for parameter in updated.parameters():
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
        updated.save_pretrained(gpu_smoke.policy_dir(store, wg, 0))
    vocab = load_model(local_model, "float32").config.vocab_size
    table = []
    for wg in groups:
        agent = load_config(path).worker_group(wg).agents[0]
        for row in range(3):
            prompt = torch.randint(0, vocab, (5 + row,), generator=generator).tolist()
            response = torch.randint(0, vocab, (6,), generator=generator).tolist()
            table.append({"prompt_ids": prompt, "response_ids": response, "agent": agent, "wg": wg, "row": row})
        holds = gpu_smoke.policy_dir(store, wg, 0 if engine_holds == "update" else None)
        mine = [row for row in table if row["wg"] == wg]
        for row, logprobs in zip(mine, reference_logprobs(holds, mine), strict=True):
            row["rollout_logprobs"] = logprobs
    trajectories = pa.Table.from_pylist(
        [
            {
                "run_id": gpu_smoke.RUN_ID,
                "iteration": 1,
                "uid": f"u{row['row']}",
                "traj_uid": f"t{row['row']}",
                "sample_idx": 0,
                "data_source": "arithmetic",
                "env_step": 1,
                "call_idx": 0,
                "response_text": "",
                "is_valid": True,
                "finish_reason": "stop",
                "reward": 0.0,
                "success": False,
            }
            | {key: row[key] for key in ("agent", "wg", "prompt_ids", "response_ids", "rollout_logprobs")}
            for row in table
        ],
        schema=TRAJECTORY_SCHEMA,
    )
    with Store(str(store)).writer(stage_path(gpu_smoke.EXPERIMENT, gpu_smoke.RUN_ID, 1, "rollout")) as out:
        out.write_table("trajectories.parquet", trajectories, TRAJECTORY_SCHEMA)
    check = gpu_smoke.check_not_stale(store, path, max_gap=0.1, ratio=3, max_rows=32)
    assert check.passed == (engine_holds == "update"), check.detail
    for wg in groups:
        assert f"{wg}: " in check.detail and "18 tokens of 3 rows" in check.detail
