"""The glue the Kubeflow components share (``drmas.stages.io``), on fake artifact objects
shaped like KFP's (``metadata``, ``path``, ``uri``; ``log_metric`` for metrics) and a
real local store: the pointer metadata, the metrics file, drmas' cache rule and the input
check. The last test runs a component's body directly on such fakes."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from helpers import stored_rollout

from drmas.config import load_config
from drmas.infra.layout import METRICS_FILE
from drmas.infra.lease import LEASE_FILE, RunBusy, RunLease, stage_lease
from drmas.infra.store import Store
from drmas.stages.contracts import StageContract
from drmas.stages.io import (
    InputNotStored,
    check_inputs,
    expect_input,
    open_stage,
    policy_set,
    publish,
    publish_metrics,
    reuse_or_compute,
)

ROOT = Path(__file__).resolve().parents[1]
OUT = "exp/r/iter-000003/advantage"


class FakeArtifact:
    """What KFP hands a component for an artifact: metadata, a local file, a URI."""

    def __init__(self, path: Path, uri: str = "gs://pipeline-root/task/out", metadata: dict | None = None) -> None:
        self.path = str(path)
        self.uri = uri
        self.metadata = dict(metadata or {})


class FakeMetrics(FakeArtifact):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.logged: dict[str, float] = {}

    def log_metric(self, metric: str, value: float) -> None:
        assert isinstance(value, float), f"{metric}: KFP wants floats, got {type(value).__name__}"
        self.logged[metric] = value


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "store"))


def write(
    store: Store, path: str, files: dict[str, bytes], metrics: dict | None = None, key: str | None = None
) -> None:
    with store.writer(path, overwrite=True, meta={"cache_key": key} if key else None) as out:
        for name, data in files.items():
            out.write_bytes(name, data)
        out.write_json(METRICS_FILE, metrics or {})


# --------------------------------------------------------------------------------------
# publish
# --------------------------------------------------------------------------------------


def test_publish_points_the_artifact_at_the_store_output_and_writes_the_same_json(store, tmp_path):
    write(store, "exp/r/iter-000002/advantage", {"batch.parquet": b"rows"}, {"batch/rows": 4.0})
    out = FakeArtifact(tmp_path / "batch", metadata={"kept": "from KFP"})
    returned = publish(store, "exp/r/iter-000002/advantage", out, 2, wg="solver")

    assert out.metadata == {
        "kept": "from KFP",
        "store_uri": store.uri("exp/r/iter-000002/advantage"),
        "artifact": "exp/r/iter-000002/advantage",
        "fingerprint": store.fingerprint("exp/r/iter-000002/advantage", ignore=(METRICS_FILE,)),
        "iteration": 2,
        "wg": "solver",
    }
    assert returned is out.metadata
    assert json.loads(Path(out.path).read_text()) == out.metadata
    assert out.uri == "gs://pipeline-root/task/out", "the KFP URI stays (the backend would upload to it)"


def test_publish_fingerprints_the_content_without_the_metrics(store, tmp_path):
    """Two outputs with the same files but other timings are the same output; other files
    are not."""
    write(store, "a", {"w.bin": b"1"}, {"time/s": 1.0})
    write(store, "b", {"w.bin": b"1"}, {"time/s": 2.0})
    write(store, "c", {"w.bin": b"2"}, {"time/s": 1.0})
    prints = {path: publish(store, path, FakeArtifact(tmp_path / path), 0)["fingerprint"] for path in "abc"}
    assert prints["a"] == prints["b"] != prints["c"]


def test_publish_takes_a_given_fingerprint_for_an_output_that_is_not_one_artifact(store, tmp_path):
    out = FakeArtifact(tmp_path / "policies")
    publish(store, "exp/r", out, -1, fingerprint="abc123", home="exp/r/init")  # exp/r has no manifest
    assert out.metadata["fingerprint"] == "abc123" and out.metadata["iteration"] == -1
    assert out.metadata["store_uri"] == store.uri("exp/r") and out.metadata["home"] == "exp/r/init"
    assert list(out.metadata)[:4] == ["store_uri", "artifact", "fingerprint", "iteration"]


def test_policy_set_names_each_group_policy_and_optimizer_state(store):
    write(store, "exp/r/iter-000001/policy/solver", {"model.safetensors": b"s"})
    write(store, "init/verifier", {"model/model.safetensors": b"v"})
    extra = policy_set(
        store,
        "exp/r/iter-000001",
        {"solver": ("exp/r/iter-000001/policy/solver", ""), "verifier": ("init/verifier", "model/")},
        {"solver": "exp/r/iter-000001/optim/solver", "verifier": None},
    )
    assert extra == {
        "home": "exp/r/iter-000001",
        "policies": {
            "solver": {"artifact": "exp/r/iter-000001/policy/solver", "prefix": ""},
            "verifier": {"artifact": "init/verifier", "prefix": "model/"},
        },
        "optims": {"solver": {"artifact": "exp/r/iter-000001/optim/solver", "prefix": ""}, "verifier": None},
        "policy_uris": {"solver": store.uri("exp/r/iter-000001/policy/solver"), "verifier": store.uri("init/verifier")},
        "fingerprints": {
            "exp/r/iter-000001/policy/solver": store.fingerprint("exp/r/iter-000001/policy/solver", (METRICS_FILE,)),
            "init/verifier": store.fingerprint("init/verifier", (METRICS_FILE,)),
        },
    }


# --------------------------------------------------------------------------------------
# inputs that KFP's cache still points at (issue 29 §5)
# --------------------------------------------------------------------------------------


def test_an_input_gone_from_the_store_is_refused_with_the_command_that_recomputes_it(store, tmp_path):
    """A store cleared under KFP's cache: the cached task's pointer names an artifact that
    is gone. The stage says which, and how to recompute it, before it reads anything."""
    write(store, OUT, {"batch.parquet": b"rows"})
    batch = FakeArtifact(tmp_path / "batch.json")
    publish(store, OUT, batch, 3)
    check_inputs(store, "r", "the update of solver in iteration 3", batch)  # there: accepted
    store.delete(OUT)
    with pytest.raises(InputNotStored) as refused:
        check_inputs(store, "r", "the update of solver in iteration 3", batch)
    assert str(refused.value) == (
        f"the update of solver in iteration 3: its input {store.uri(OUT)} is not in the store, though the task "
        "that wrote it is done (KFP reused it from its cache: the store was cleared, or this is another "
        "bucket); recompute it with: drmas submit CONFIG --run-id r --force advantage@3"
    )


def test_an_input_rewritten_since_its_task_ran_is_refused(store, tmp_path):
    """A policy recomputed in place after a checkpoint recorded it: the checkpoint's policy
    set names content that is no longer there; metrics alone may change."""
    policy = "exp/r/iter-000002/policy/solver"
    write(store, policy, {"model.safetensors": b"first"}, metrics={"loss": 1.0})
    policies = FakeArtifact(
        tmp_path / "policies.json", metadata=policy_set(store, "exp/r", {"solver": (policy, "")}, {})
    )
    write(store, policy, {"model.safetensors": b"first"}, metrics={"loss": 2.0})
    check_inputs(store, "r", "the rollout of iteration 3", policies)
    write(store, policy, {"model.safetensors": b"again"})
    with pytest.raises(
        InputNotStored,
        match=r"policy/solver was rewritten since the task that wrote it ran .* --force update/solver@2$",
    ):
        check_inputs(store, "r", "the rollout of iteration 3", policies)
    store.delete(policy)
    with pytest.raises(InputNotStored, match=r"not in the store.*--force update/solver@2$"):
        check_inputs(store, "r", "the evaluation", policies)


def test_a_policy_set_published_at_a_folder_is_checked_by_its_policies(store, tmp_path):
    """The warm start publishes its policy set at the run's folder, which is no artifact:
    the check reads the policies the set names, and refuses only when one of them is gone."""
    policy = "exp/r/init/policy/solver"
    write(store, policy, {"model.safetensors": b"first"})
    policies = FakeArtifact(tmp_path / "policies.json")
    publish(store, "exp/r", policies, -1, fingerprint="set", **policy_set(store, "exp/r", {"solver": (policy, "")}, {}))
    assert not store.exists("exp/r")
    check_inputs(store, "r", "the rollout of iteration 0", policies)
    store.delete(policy)
    with pytest.raises(InputNotStored, match=r"init/policy/solver is not in the store.*--force warmstart$"):
        check_inputs(store, "r", "the rollout of iteration 0", policies)


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------


def test_publish_metrics_logs_finite_values_and_writes_every_value(tmp_path):
    metrics = FakeMetrics(tmp_path / "metrics")
    publish_metrics(
        {"reward/mean": 0.5, "batch/rows": 12, "adv/std": math.nan, "ratio/max": math.inf, "kl": -math.inf}, metrics
    )
    assert metrics.logged == {"reward/mean": 0.5, "batch/rows": 12.0}
    assert json.loads(Path(metrics.path).read_text()) == {
        "reward/mean": 0.5,
        "batch/rows": 12,
        "adv/std": "nan",
        "ratio/max": "inf",
        "kl": "-inf",
    }


def test_publish_metrics_writes_the_file_even_without_metrics(tmp_path):
    """kfp.local caches a task only when its metrics file exists."""
    metrics = FakeMetrics(tmp_path / "metrics")
    publish_metrics({}, metrics)
    assert metrics.logged == {} and json.loads(Path(metrics.path).read_text()) == {}


# --------------------------------------------------------------------------------------
# the cache rule and the input check
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class At(StageContract):
    """A stage contract whose output is ``path``, reused only when ``may_reuse``."""

    path: str
    may_reuse: bool = True
    name: ClassVar[str] = "test"
    module: ClassVar[str] = "drmas.stages.io"
    fields: ClassVar[tuple[str, ...]] = ()

    def output(self, config: object) -> str:
        return self.path

    def inputs(self, config: object) -> dict[str, str]:
        return {}

    def reusable(self, config: object, store: Store) -> bool:
        return self.may_reuse


def test_reuse_or_compute_follows_the_cache_key(store, capsys):
    calls = []

    def compute():
        calls.append(1)
        write(store, "exp/r/iter-000000/rollout", {"t.parquet": b"x"}, key="k1")

    assert (
        reuse_or_compute(None, store, At("exp/r/iter-000000/rollout"), "k1", False, compute) is False
    )  # nothing stored
    assert len(calls) == 1
    assert reuse_or_compute(None, store, At("exp/r/iter-000000/rollout"), "k1", False, compute) is True  # same key
    assert len(calls) == 1
    assert reuse_or_compute(None, store, At("exp/r/iter-000000/rollout"), "k2", False, compute) is False  # other inputs
    assert len(calls) == 2
    assert reuse_or_compute(None, store, At("exp/r/iter-000000/rollout"), "k1", True, compute) is False  # forced
    assert len(calls) == 3
    assert capsys.readouterr().out == "", "silent without a label"


def test_reuse_or_compute_recomputes_what_its_contract_may_not_reuse(store):
    """The reuse rule is the contract's too (``reuses``): an output stored with the same key
    is recomputed when the contract says it may not be skipped (an update whose optimizer
    state was not stored)."""
    write(store, OUT, {"f": b"1"}, key="k")
    calls = []
    assert reuse_or_compute(None, store, At(OUT, may_reuse=False), "k", False, lambda: calls.append(1)) is False
    assert calls == [1]


def test_reuse_or_compute_says_what_it_did(store, capsys):
    write(store, OUT, {"f": b"1"}, key="k")
    reuse_or_compute(
        None, store, At(OUT), "k", False, lambda: pytest.fail("recomputed a cached output"), label="advantage iter 3"
    )
    reuse_or_compute(None, store, At(OUT), "k", True, lambda: None, label="policy/solver iter 3")
    assert capsys.readouterr().out.splitlines() == [
        f"drmas: advantage iter 3 reused {store.uri(OUT)}",
        f"drmas: policy/solver iter 3 computed {store.uri(OUT)}",
    ]


def test_reuse_or_compute_computes_holding_the_lease_of_its_output(store):
    """The Kubeflow side of one writer per run: while ``compute`` runs, the run's lease
    lists this process as the holder of exactly that output, and it is gone afterwards."""
    seen = []

    def compute():
        seen.append(json.loads((Path(store.root) / "exp/r" / LEASE_FILE).read_text())["holders"])
        write(store, OUT, {"f": b"1"}, key="k")

    reuse_or_compute(None, store, At(OUT), "k", False, compute)
    assert list(seen[0]) == [OUT]
    assert seen[0][OUT]["pid"] == os.getpid()
    assert json.loads((Path(store.root) / "exp/r" / LEASE_FILE).read_text())["holders"] == {}


def test_reuse_or_compute_waits_for_the_embedded_runner_then_gives_up(store):
    """A task of a run that ``drmas run`` holds waits twice the lease timeout (here 0.2 s),
    then fails naming the holder, without computing."""
    store.lease_timeout_s = 0.2
    with RunLease(store, "exp", "r"):
        began = time.monotonic()
        with pytest.raises(
            RunBusy,
            match=rf"run exp/r is being written by another process: pid {os.getpid()} .*"
            r"writing the whole run",
        ):
            reuse_or_compute(None, store, At(OUT), "k", False, lambda: pytest.fail("computed while the run was held"))
        assert 0.4 <= time.monotonic() - began < 3


def test_parallel_tasks_on_other_outputs_of_the_run_do_not_wait(store):
    """The worker groups' updates run in parallel: each holds its own output."""
    store.lease_timeout_s = 30.0
    with stage_lease(store, "exp/r/iter-000000/policy/solver"):
        began = time.monotonic()
        reuse_or_compute(None, store, At("exp/r/iter-000000/policy/verifier"), "k", False, lambda: None)
        assert time.monotonic() - began < 1


def test_expect_input_refuses_a_pointer_to_another_output(store, tmp_path):
    expected = "exp/r/iter-000003/rollout"
    expect_input(
        FakeArtifact(tmp_path / "in", metadata={"artifact": expected}), expected, store, "the advantage of iteration 3"
    )
    other = FakeArtifact(
        tmp_path / "in",
        metadata={"artifact": "exp/r/iter-000002/rollout", "store_uri": "s3://b/exp/r/iter-000002/rollout"},
    )
    with pytest.raises(
        ValueError,
        match=r"^the advantage of iteration 3 reads .*/iter-000003/rollout, but was given s3://b/exp/r/iter-000002/rollout$",
    ):
        expect_input(other, expected, store, "the advantage of iteration 3")
    bare = FakeArtifact(tmp_path / "in", uri="gs://root/imported")  # no pointer metadata at all
    with pytest.raises(ValueError, match="but was given gs://root/imported$"):
        expect_input(bare, expected, store, "the update of iteration 3")


def test_open_stage_reads_the_config_parameter_and_opens_its_store(tmp_path):
    config = load_config(ROOT / "configs" / "math_tiny.yaml", [f"store.root={tmp_path / 'runs'}"])
    opened, store = open_stage(config.to_json())
    assert opened == config and store.root == str(tmp_path / "runs")


# --------------------------------------------------------------------------------------
# a component body on the fakes
# --------------------------------------------------------------------------------------


def test_the_advantage_component_body_on_fake_artifacts(tmp_path, monkeypatch, capsys):
    """The shipped function itself (what KFP's executor calls), without KFP: it reads the
    rollout its input points at, writes the batch under drmas' cache key, publishes the
    pointer and the metrics, reuses the output on a second call and recomputes it forced."""
    from drmas.infra.layout import stage_path
    from drmas.stages.contracts import AdvantageContract, cache_key
    from drmas_kfp import components

    monkeypatch.chdir(tmp_path)
    config, store, source = stored_rollout(tmp_path, rows=12)
    body = components.advantage.python_func

    def call(force: bool = False, artifact: str = source) -> tuple[FakeArtifact, FakeMetrics]:
        trajectories = FakeArtifact(tmp_path / "in", metadata={"artifact": artifact, "store_uri": store.uri(artifact)})
        batch, metrics = FakeArtifact(tmp_path / "batch"), FakeMetrics(tmp_path / "metrics")
        body(
            config_json=config.to_json(),
            run_id="r",
            iteration=0,
            trajectories=trajectories,
            batch=batch,
            metrics=metrics,
            force=force,
        )
        return batch, metrics

    batch, metrics = call()
    path = stage_path(config.experiment.name, "r", 0, "advantage")
    assert store.open(path).meta["cache_key"] == cache_key(config, store, AdvantageContract("r", 0))
    assert batch.metadata["artifact"] == path and batch.metadata["store_uri"] == store.uri(path)
    assert (
        batch.metadata["fingerprint"] == store.fingerprint(path, ignore=(METRICS_FILE,))
        and batch.metadata["iteration"] == 0
    )
    assert json.loads(Path(batch.path).read_text()) == batch.metadata
    assert metrics.logged["batch/rows"] == 12.0
    assert json.loads(Path(metrics.path).read_text())["batch/rows"] == 12.0

    again, _ = call()
    assert again.metadata == batch.metadata
    call(force=True)
    assert [
        line.split()[4] for line in capsys.readouterr().out.splitlines() if line.startswith("drmas: advantage")
    ] == [
        "computed",
        "reused",
        "computed",
    ]
    with pytest.raises(ValueError, match="the advantage of iteration 0 reads .* but was given"):
        call(artifact=stage_path(config.experiment.name, "r", 1, "rollout"))
    store.delete(source)  # the store cleared under KFP's cache (issue 29 §5)
    with pytest.raises(InputNotStored, match=r"iteration 0: its input .* is not in the store.*--force rollout@0$"):
        call()
