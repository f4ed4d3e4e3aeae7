"""The rollout stage end to end: real tiny models (random init, tokenizers trained on the
fly) in Ray actors, both tasks, shared, separate and heterogeneous worker groups."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest

from drmas.config import load_config
from drmas.generation.pool import RayPool, WorkerGroupDied
from drmas.generation.workers import WorkerGroupRuntime
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store
from drmas.models import load_tokenizer
from drmas.stages.policies import init_policies
from drmas.stages.rollout import rollout

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).parent.parent / "configs"
SMALL = [
    "rollout.prompts_per_iteration=3",
    "rollout.group_size=2",
    "rollout.sampling.max_new_tokens=12",
    "data.generated_train_size=50",
    "data.generated_eval_size=10",
    "models.tiny.hidden_size=32",
    "models.tiny.intermediate_size=64",
    "models.tiny.num_layers=1",
]


def run_rollouts(config, tmp_path, iterations=(0,), run_id="run"):
    store = Store(str(tmp_path / "store"))
    policies = init_policies(config, store, run_id)
    with RayPool(config, store, cache_dir=tmp_path / "cache", threads=1) as pool:
        results = [rollout(config, store, run_id, i, policies, pool) for i in iterations]
        status, loads = pool.status(), pool.loads
    tables = [store.open(r.artifact).read_table("trajectories.parquet", TRAJECTORY_SCHEMA) for r in results]
    return store, results, tables, status, loads


def test_math_rollout_separate_models_is_deterministic(local_ray, tmp_path):
    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, "workers.sharing=none", "ray.max_resident=1"])
    _, results, [table], status, loads = run_rollouts(config, tmp_path / "a")
    metrics = results[0].metrics
    assert table.num_rows == metrics["agent/solver/calls"] + metrics["agent/verifier/calls"]
    assert set(table["agent"].to_pylist()) <= {"solver", "verifier"}
    assert table["wg"].to_pylist() == table["agent"].to_pylist()  # sharing: none
    # 3 prompts x 2 episodes, grouped by uid; at most solver, verifier, solver batched calls.
    assert len(set(table["uid"].to_pylist())) == 3 and len(set(table["traj_uid"].to_pylist())) == 6
    assert metrics["rollout/generate_calls"] <= 3
    assert all(
        len(ids) == len(lp)
        for ids, lp in zip(table["response_ids"].to_pylist(), table["rollout_logprobs"].to_pylist(), strict=True)
    )
    assert pc.max(pc.list_value_length(table["response_ids"])).as_py() <= 12
    # max_resident 1: only one worker group holds its weights after the rollout.
    assert sum(worker["resident"] for workers in status.values() for worker in workers) == 1 and loads == 2
    _, _, [again], _, _ = run_rollouts(config, tmp_path / "b")
    assert again.equals(table)  # same seed, same file


def test_the_pool_truncates_prompts_as_configured(local_ray, tmp_path):
    """The pool's actors get ``rollout.truncation``: a middle cut keeps every prompt's
    chat-template opening (the same first tokens on every row), a left cut drops it."""
    openings = {}
    for truncation in ("middle", "left"):
        config = load_config(
            CONFIGS / "math_tiny.yaml", [*SMALL, "rollout.max_prompt_tokens=16", f"rollout.truncation={truncation}"]
        )
        _, _, [table], _, _ = run_rollouts(config, tmp_path / truncation)
        prompts = table["prompt_ids"].to_pylist()
        assert all(len(ids) == 16 for ids in prompts)
        openings[truncation] = {tuple(ids[:3]) for ids in prompts}
    assert len(openings["middle"]) == 1 and len(openings["left"]) > 1


def test_search_rollout_one_shared_model(local_ray, tmp_path):
    config = load_config(
        CONFIGS / "search_tiny.yaml",
        [*SMALL, "workers.sharing=by_model", "task.max_turns=2", "ray.max_resident=1"],
    )
    store, results, [table], status, _ = run_rollouts(config, tmp_path)
    assert set(table["wg"].to_pylist()) == {"verifier-search-answer"}
    agents = table["agent"].to_pylist()
    assert agents.count("verifier") >= 6  # every episode's first turn routes
    assert set(agents) <= {"verifier", "search", "answer"}
    assert store.list("_cache/bm25")  # the BM25 index was built once and cached in the store
    assert set(table["data_source"].to_pylist()) <= {"facts-1hop", "facts-2hop"}


def test_heterogeneous_models_use_their_own_tokenizers(local_ray, tmp_path):
    config = load_config(
        CONFIGS / "math_tiny.yaml",
        [
            *SMALL,
            "models.big={hidden_size: 64, intermediate_size: 128, num_layers: 2, vocab_size: 400}",
            "models.tiny.vocab_size=300",
            "agents.verifier.model=big",
            "workers.sharing=by_model",
            "ray.max_resident=2",
        ],
    )
    store, results, tables, status, loads = run_rollouts(config, tmp_path, iterations=(0, 1))
    assert loads == 2  # the second iteration reused both resident policy versions
    assert all(worker["resident"] for workers in status.values() for worker in workers)
    table = tables[1]
    tokenizers = {
        wg: load_tokenizer(store.open(f"math-tiny/run/init/policy/{wg}").download(tmp_path / wg))
        for wg in ("solver", "verifier")
    }
    assert len(tokenizers["solver"]) != len(tokenizers["verifier"])
    for row in table.to_pylist():
        prompt = tokenizers[row["wg"]].decode(row["prompt_ids"])
        assert "Problem: What is" in prompt, prompt  # each prompt decodes with its own tokenizer


class ActorKiller:
    """The real pool, whose worker-group actor process gets SIGKILL right before the
    generate calls numbered in ``kill_before`` (as an OOM kill or a lost node would)."""

    def __init__(self, pool: RayPool, kill_before: set[int]) -> None:
        self.pool, self.kill_before, self.calls = pool, kill_before, 0

    def load(self, policies):
        self.pool.load(policies)

    def generate(self, wg, messages, sampling, seed):
        self.calls += 1
        if self.calls in self.kill_before:
            os.kill(self.pool.status()[wg][0]["pid"], signal.SIGKILL)
        return self.pool.generate(wg, messages, sampling, seed)


def test_a_killed_worker_group_actor_is_restarted_and_the_rollout_is_unchanged(local_ray, tmp_path):
    """Ray restarts the actor, the pool reloads its policy and repeats the call: the stage
    writes the trajectories an undisturbed rollout writes."""
    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, "workers.sharing=none", "ray.max_resident=1"])
    *_, [expected], _, _ = run_rollouts(config, tmp_path / "calm")
    store = Store(str(tmp_path / "store"))
    policies = init_policies(config, store, "run")
    with RayPool(config, store, cache_dir=tmp_path / "cache", threads=1) as pool:
        killer = ActorKiller(pool, kill_before={1, 2})
        result = rollout(config, store, "run", 0, policies, killer)
        assert pool.restarts == 2
    table = store.open(result.artifact).read_table("trajectories.parquet", TRAJECTORY_SCHEMA)
    assert table.equals(expected)


def test_an_actor_that_keeps_dying_fails_the_stage_cleanly(local_ray, tmp_path, monkeypatch):
    """Past ACTOR_RESTARTS (1 here: each restart starts a process) the stage stops with an
    error naming the worker group, and no trajectories appear in the store."""
    monkeypatch.setattr("drmas.generation.pool.ACTOR_RESTARTS", 1)
    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, "workers.sharing=none"])
    store = Store(str(tmp_path / "store"))
    policies = init_policies(config, store, "run")
    with RayPool(config, store, cache_dir=tmp_path / "cache", threads=1) as pool:
        pool.load(policies)
        os.kill(pool.status()["solver"][0]["pid"], signal.SIGKILL)
        pool.status()  # waits for the restart and reloads the policy
        assert pool.restarts == 1
        os.kill(pool.status()["solver"][0]["pid"], signal.SIGKILL)
        with pytest.raises(WorkerGroupDied, match="worker group 'solver'.*wrote nothing"):
            rollout(config, store, "run", 0, policies, pool)
    assert not store.exists("math-tiny/run/iter-000000/rollout")


JOIN_AND_LEAVE = """
import ray
from drmas.config import DrmasConfig
from drmas.generation.ray_session import connect_ray
config = DrmasConfig.model_validate({"agents": [{"name": "solver", "model": "m"}, {"name": "verifier", "model": "m"}]})
assert connect_ray(config)
print(ray.get_runtime_context().gcs_address, ray.cluster_resources().get("pool_slot"))
ray.shutdown()
"""


def test_a_worker_meets_its_group_in_its_own_temp_folder_which_it_makes(local_ray, tmp_path, monkeypatch):
    """Rank 0's answer names the folder of the group's file rendezvous: the worker's
    RAY_TMPDIR, made if missing. A rendezvous file in a folder nothing had made (the
    driver's RAY_TMPDIR) waited out the whole collective timeout (600 s)."""
    folder = tmp_path / "absent" / "ray"
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    config = load_config(CONFIGS / "math_tiny.yaml", [f"store.root={tmp_path / 'store'}"])
    place = WorkerGroupRuntime(config.worker_groups()[0], config.store).rendezvous()
    assert place["folder"] == str(folder) and folder.is_dir()


def test_a_stage_process_joins_the_ray_that_ray_address_names(local_ray):
    """How kfp-local's tasks share one Ray: a process with RAY_ADDRESS set joins that Ray
    (its pool resource is there) instead of starting its own, and leaving it with
    ray.shutdown() does not stop it."""
    import ray

    address = ray.get_runtime_context().gcs_address
    pool = ray.cluster_resources()["pool_slot"]
    done = subprocess.run(
        [sys.executable, "-c", JOIN_AND_LEAVE],
        env={**os.environ, "RAY_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [address, str(pool)]
    assert ray.cluster_resources()["pool_slot"] == pool  # still up for the next task


ON_GPUS = """
import json, sys
from pathlib import Path
import ray
from drmas.config import load_config
from drmas.generation.pool import RayPool
from drmas.generation.ray_session import connect_ray
from drmas.infra.store import Store
config = load_config(sys.argv[1], ["ray.pool_resource=GPU", "ray.pool_size=2", "workers.sharing=none"])
assert connect_ray(config, Path(sys.argv[2]))
with RayPool(config, Store(sys.argv[3]), threads=1) as pool:
    granted = {
        name: [
            ray.get(worker.__ray_call__.remote(lambda self: ray.get_runtime_context().get_assigned_resources()))
            for worker in workers
        ]
        for name, workers in pool.workers.items()
    }
print(json.dumps({"cluster": ray.cluster_resources().get("GPU"), "granted": granted}))
ray.shutdown()
"""


def test_a_gpu_pool_asks_ray_for_gpus_by_num_gpus(tmp_path):
    """``ray.pool_resource: GPU`` (the GPU configs) cannot be a custom resource: Ray refuses
    'GPU' in ``resources``. The local node declares the pool as GPUs (Ray schedules them on
    CPU too, as a count). Both worker groups run on both slots: each has a worker per slot,
    granted half of that slot's GPU by num_gpus."""
    import ray

    with pytest.raises(ValueError, match="Use the 'num_cpus' and 'num_gpus' keyword"):
        ray.remote(RayPool).options(resources={"GPU": 1.0})
    short = Path(tempfile.mkdtemp(prefix="drmas-gpu-"))  # Ray's socket paths must stay short
    try:
        done = subprocess.run(
            [sys.executable, "-c", ON_GPUS, str(CONFIGS / "math_tiny.yaml"), str(short), str(tmp_path / "store")],
            env={key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["cluster"] == 2.0
    assert {name: [grant.get("GPU") for grant in grants] for name, grants in found["granted"].items()} == {
        "solver": [0.5, 0.5],
        "verifier": [0.5, 0.5],
    }


def test_a_runs_pool_outlives_its_stage_and_frees_itself_when_idle(local_ray, tmp_path):
    """A run's pool is named and detached: a second pool object of the run (the next stage,
    another process) finds its workers warm, holding their policy; ``drmas pool status``
    lists them; past ``ray.idle_timeout_s`` without a call the pool frees itself, workers
    and placement group."""
    from drmas.cli import main
    from drmas.generation.named_pool import pool_status

    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, "ray.idle_timeout_s=4"])
    store = Store(str(tmp_path / "store"))
    policies = init_policies(config, store, "run")
    with RayPool(config, store, cache_dir=tmp_path / "cache", threads=1, run=("math-tiny", "idle")) as first:
        first.load(policies)
        assert first.started == 2
    with RayPool(config, store, cache_dir=tmp_path / "cache", threads=1, run=("math-tiny", "idle")) as again:
        assert again.started == 0 and set(again.resident) == set(policies)  # warm: nothing to load
        again.load(policies)
        assert again.loads == 0
    workers = pool_status("math-tiny", "idle")
    assert len(workers) == 2 and all(worker["version"] for worker in workers)
    import ray

    address = ray.get_runtime_context().gcs_address
    listed = subprocess.run(
        [sys.executable, "-m", "drmas.cli", "pool", "status", "math-tiny/idle", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and listed.stdout.count("drmas.math-tiny.idle.") == 2, listed.stderr
    assert "math-tiny/idle: no driver now" in listed.stdout  # both pool objects gave the lease back
    assert main(["pool", "status", "math-tiny"]) == 2  # not EXPERIMENT/RUN_ID
    deadline = time.monotonic() + 60
    while pool_status("math-tiny", "idle") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pool_status("math-tiny", "idle") == []
    from drmas.generation.named_pool import named_placement_group

    assert named_placement_group("drmas.math-tiny.idle") is None


def test_on_a_cluster_each_worker_takes_its_own_containers_threads(local_ray, tmp_path):
    """With ``ray.address`` set the driver's pod knows nothing of the workers' pods: each
    worker sets its torch threads from its own container's CPUs, not from the driver's and
    not from the ``OMP_NUM_THREADS=1`` Ray puts in an actor that asks for no CPU, shared
    among the pool slots its node advertises (a pod with all of a node's GPUs)."""
    import ray

    from drmas.infra.cpus import cpu_threads

    address = ray.get_runtime_context().gcs_address
    config = load_config(CONFIGS / "math_tiny.yaml", [*SMALL, f"ray.address={address}"])
    with RayPool(config, Store(str(tmp_path / "store")), cache_dir=tmp_path / "cache") as pool:
        assert pool.threads is None
        seen = [
            ray.get(
                worker.__ray_call__.remote(
                    lambda self: (
                        __import__("torch").get_num_threads(),
                        __import__("os").environ.get("OMP_NUM_THREADS"),
                    )
                )
            )
            for workers in pool.workers.values()
            for worker in workers
        ]
    (node,) = ray.nodes()
    slots = round(node["Resources"][config.ray.pool_resource])
    assert seen and all(threads == max(1, cpu_threads(environment=False) // slots) for threads, _ in seen), seen
    assert {omp for _, omp in seen} == {"1"}  # what Ray set, and the workers did not follow
