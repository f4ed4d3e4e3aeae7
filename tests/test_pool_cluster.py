"""The shared pool on a real two-node Ray cluster: a head and a second node started here
on 127.0.0.1 (one pool slot each), stopped by PID. One worker group on both slots, one
worker per slot (so one per node): generation split over them, a DeepSpeed ZeRO-3 update
sharded over them (gloo, over TCP between the nodes), the new weights handed to both
engines in memory. Compared with the same stages on a one-slot pool."""

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

import pytest
from helpers import ROOT, TINY_OVERRIDES, free_port

pytestmark = pytest.mark.slow

DRIVER = r"""
import json, sys
from pathlib import Path
import ray, torch
from safetensors.torch import load_file
from drmas.config import load_config
from drmas.generation.pool import RayPool
from drmas.generation.ray_session import connect_ray
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store
from drmas.stages.advantage import advantage
from drmas.stages.policies import init_policies
from drmas.stages.rollout import rollout
from drmas.stages.update import update

config_path, root, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])

def engine_weights(self):
    self.engine.resume()
    return {name: tensor.clone() for name, tensor in self.engine.model.state_dict().items()}

found = {}
for slots in (1, 2):
    config = load_config(config_path, overrides + [f"ray.pool_size={slots}"])
    connect_ray(config)
    store = Store(str(root / f"store{slots}"))
    policies = init_policies(config, store, "run")
    [wg] = policies
    with RayPool(config, store, threads=1) as pool:
        table = store.open(rollout(config, store, "run", 0, policies, pool).artifact).read_table(
            "trajectories.parquet", TRAJECTORY_SCHEMA
        )
        advantage(config, store, "run", 0)
        result = update(config, store, "run", 0, wg, policies[wg], None, pool=pool)
        engines = [ray.get(worker.__ray_call__.remote(engine_weights)) for worker in pool.workers[wg]]
        places = [ray.get(worker.rendezvous.remote())["node"] for worker in pool.workers[wg]]
        status = pool.status()[wg]
    stored = load_file(store.open(result.artifact).download(root / f"policy{slots}") / "model.safetensors")
    found[slots] = (table, stored, engines, places, status, result.metrics)

(table1, stored1, _, _, _, metrics1), (table2, stored2, engines2, places2, status2, metrics2) = found[1], found[2]
print(json.dumps({
    "same_responses": table1["response_ids"].to_pylist() == table2["response_ids"].to_pylist(),
    "rows": [table1.num_rows, table2.num_rows],
    "max_logprob_gap": max(
        (abs(x - y) for a, b in zip(table1["rollout_logprobs"].to_pylist(), table2["rollout_logprobs"].to_pylist())
         for x, y in zip(a, b)), default=0.0),
    "max_weight_gap": max(float((stored1[k] - stored2[k]).abs().max()) for k in stored1),
    "engines_equal_stored": [all(torch.equal(engine[k], stored2[k]) for k in stored2) for engine in engines2],
    "nodes": len(set(places2)),
    "worlds": [(s["rank"], s["world"]) for s in status2],
    "steps": [metrics1[f"wg/{wg}/steps"], metrics2[f"wg/{wg}/steps"]],
    "loss": [metrics1[f"wg/{wg}/loss"], metrics2[f"wg/{wg}/loss"]],
}))
ray.shutdown()
"""


def _start_node(args: list[str], temp: Path, env: dict[str, str]) -> subprocess.Popen:
    """A Ray node in its own session (its raylet and workers in its process group)."""
    command = [str(Path(sys.executable).parent / "ray"), "start", "--block", *args, f"--temp-dir={temp}"]
    return subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a second node on 127.0.0.1, one ``pool_slot`` each; stopped by PID."""
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="drmas-2n-"))  # Ray's socket paths must stay short
    env = {
        **{key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"},
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # a multi-node cluster (on 127.0.0.1 only)
    }
    slot = ["--node-ip-address=127.0.0.1", "--num-cpus=2", '--resources={"pool_slot": 1}']
    nodes = [_start_node(["--head", f"--port={port}", "--include-dashboard=false", *slot], folder / "h", env)]
    address = f"127.0.0.1:{port}"
    try:
        _wait_for_nodes(address, 1, env)
        nodes.append(_start_node([f"--address={address}", *slot], folder / "w", env))
        _wait_for_nodes(address, 2, env)
        yield address, env
    finally:
        # `ray start --block` takes over 15 s to stop its node on SIGTERM; these nodes are
        # this fixture's own (their process groups hold nothing else): kill them outright.
        for node in reversed(nodes):
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for_nodes(address: str, count: int, env: dict[str, str]) -> None:
    probe = (
        f"import ray; ray.init(address='{address}', log_to_driver=False); "
        "print(len([n for n in ray.nodes() if n['Alive']]))"
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        if done.returncode == 0 and int(done.stdout.strip().splitlines()[-1]) >= count:
            return
        time.sleep(1)
    raise TimeoutError(f"the Ray cluster at {address} did not reach {count} node(s)")


def _drive(script: str, two_nodes: tuple[str, dict[str, str]], tmp_path: Path, overrides: list[str]):
    """Run a driver ``script`` on the two-node cluster (math_tiny with ``overrides``);
    returns the JSON of its last line and its stderr."""
    address, env = two_nodes
    done = subprocess.run(
        [sys.executable, "-c", script, str(ROOT / "configs" / "math_tiny.yaml"), str(tmp_path), json.dumps(overrides)],
        env={**env, "RAY_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_zero3_update_across_two_nodes_equals_one_slots_and_syncs_the_engines(two_nodes, tmp_path):
    overrides = [
        *TINY_OVERRIDES,
        "workers.sharing=by_model",
        "train.backend=deepspeed",
        "train.zero_stage=3",
        "ray.max_resident=1",
    ]
    found, _ = _drive(DRIVER, two_nodes, tmp_path, overrides)
    print("two-node pool:", json.dumps(found))  # the figures (pytest -s shows them)
    assert found["nodes"] == 2 and found["worlds"] == [[0, 2], [1, 2]]  # one rank per node
    # Generation split over the two workers samples what one worker samples (a seed per request).
    assert found["same_responses"], found
    assert found["max_logprob_gap"] < 1e-4
    # ZeRO-3 over 2 ranks (parameters sharded, gradients reduced over gloo) = 1 rank, up to
    # the order of floating-point sums.
    assert found["steps"][0] == found["steps"][1] and found["loss"][0] == pytest.approx(found["loss"][1], rel=1e-5)
    assert found["max_weight_gap"] < 1e-5
    # Both engines generate from exactly the stored policy (handed over in memory).
    assert found["engines_equal_stored"] == [True, True]


KILLED_MID_UPDATE = r"""
import json, os, signal, sys
from pathlib import Path
from safetensors.torch import load_file
from drmas.config import load_config
from drmas.generation.pool import RayPool
from drmas.generation.ray_session import connect_ray
from drmas.infra.store import Store
from drmas.stages.advantage import advantage
from drmas.stages.policies import init_policies
from drmas.stages.rollout import rollout
from drmas.stages.update import update

config_path, root, overrides = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
marker = root / "rank-1-died"

def dies_once_on_rank_1(worker, *args):
    # The update as the pool runs it, except that rank 1's process is SIGKILLed once,
    # in the middle of the update (the model loaded, before its first step).
    import drmas.stages.update as stage
    import drmas.training.loop as loop
    from drmas.training.engines import rank_and_world

    if rank_and_world()[0] == 1 and not marker.exists():
        marker.touch()
        loop.train_worker_group = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    return stage.update_rank(worker, *args)

config = load_config(config_path, overrides)
connect_ray(config)
store = Store(str(root / "store"))
policies = init_policies(config, store, "run")
[wg] = policies
with RayPool(config, store, threads=1) as pool:
    rollout(config, store, "run", 0, policies, pool)
    advantage(config, store, "run", 0)
    calm = update(config, store, "run", 0, wg, policies[wg], None, pool=pool)
    undisturbed = load_file(store.open(calm.artifact).download(root / "calm") / "model.safetensors")
    args = (config, store.settings(), "run", 0, wg, policies[wg], None, None, True, "")
    again = pool.train(wg, dies_once_on_rank_1, *args)
    restarts, worlds = pool.restarts, [(s["rank"], s["world"]) for s in pool.status()[wg]]
rebuilt = load_file(store.open(again.artifact).download(root / "rebuilt") / "model.safetensors")
print(json.dumps({
    "died": marker.exists(),
    "restarts": restarts,
    "worlds": worlds,
    "same_policy": sorted(rebuilt) == sorted(undisturbed)
    and all((rebuilt[k] == undisturbed[k]).all().item() for k in rebuilt),
}))
"""


def test_a_worker_killed_mid_update_is_rebuilt_and_the_update_equals_an_undisturbed_one(two_nodes, tmp_path):
    """Rank 1 of a two-node group is SIGKILLed in the middle of the update, while rank 0
    waits for it in a collective: the pool rebuilds the group's workers from the store and
    runs the update again; the stored policy is bit-identical to an undisturbed update's."""
    overrides = [*TINY_OVERRIDES, "workers.sharing=by_model", "ray.pool_size=2", "ray.max_resident=1"]
    found, stderr = _drive(KILLED_MID_UPDATE, two_nodes, tmp_path, overrides)
    assert found == {"died": True, "restarts": 1, "worlds": [[0, 2], [1, 2]], "same_policy": True}
    assert "a worker died during the update; rebuilding its 2 worker(s)" in stderr


@pytest.mark.standin
def test_a_local_ray_runs_without_authentication_and_a_cluster_keeps_its_own(monkeypatch, tmp_path):
    """A local Ray (loopback only) starts with RAY_AUTH_MODE=disabled; joining a cluster
    (ray.address) sets nothing, so a pod's RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (from the
    drmas-ray-token Secret) reach Ray. ``ray.init`` is recorded, not called: a stand-in at
    the boundary, as no token-protected cluster runs here."""
    import ray

    from drmas.config import load_config
    from drmas.generation import ray_session as pool

    calls: list[tuple[dict, str | None]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append((kwargs, os.environ.get("RAY_AUTH_MODE"))))
    monkeypatch.setattr(pool, "_keep_local_ray_on_loopback", lambda: None)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster = load_config(ROOT / "configs" / "math_tiny.yaml", ["ray.address=ray://head.drmas.svc.cluster.local:10001"])
    assert pool.connect_ray(cluster)
    assert calls[-1] == ({"address": "ray://head.drmas.svc.cluster.local:10001", "log_to_driver": False}, None)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert pool.connect_ray(cluster) and calls[-1][1] == "token"
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert pool.connect_ray(load_config(ROOT / "configs" / "math_tiny.yaml"), tmp_path)
    assert "address" not in calls[-1][0] and calls[-1][1] == "disabled"
