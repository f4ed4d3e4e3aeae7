"""Updates on every engine, as one rank and as two: per-agent gradient norms
(``diagnostics.per_agent_grad_norm``), and what shares their runs: ZeRO-3 saving and
resuming, activation checkpointing, the mean over micro-batches across ranks.

One script runs a list of updates in one process (one rank) and under torchrun (two
ranks, gloo); the tests compare what they wrote. Every row gets its own random advantage,
so no agent's gradient cancels out (the scripted verifier rows are the same text in both
samples of a prompt). ZeRO-3 runs with ``stage3_param_persistence_threshold=0``: DeepSpeed
would otherwise keep parameters this small whole, and the partitioned path would go
untested.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from helpers import WG, make_run, torch_env, torch_launcher
from safetensors.torch import load_file

from drmas.config import StoreConfig
from drmas.stages.advantage import advantage

pytestmark = pytest.mark.slow

BASE = ["train.micro_batch_size=1", "train.updates_per_iteration=3", "diagnostics.per_agent_grad_norm=true"]
# 8 rows in mini-batches of 3, 3 and 2 rows: on two ranks one rank is a micro-batch short.
ENGINES = {
    "torch": ["train.backend=torch"],
    **{f"zero{stage}": ["train.backend=deepspeed", f"train.zero_stage={stage}"] for stage in range(4)},
}
SOLO = "solver"  # the only agent left in the "-solo" cases
CASES = {
    **ENGINES,
    **{
        f"{name}-off": [*ENGINES[name], "diagnostics.per_agent_grad_norm=false"] for name in ("torch", "zero2", "zero3")
    },
    # a clip below their norms: what is compared is the norm before clipping
    **{f"{name}-solo": [*ENGINES[name], "train.grad_clip=0.05"] for name in ("torch", "zero0", "zero2", "zero3")},
    "zero3-checkpointed": [*ENGINES["zero3"], "train.gradient_checkpointing=true"],
    "per-micro-batch": ["algorithm.loss_aggregation=token-mean-per-micro-batch"],
    "zero3-resumed": ENGINES["zero3"],  # a second update from the first's saved state
}
ONE_RANK = list(CASES)
TWO_RANKS = ["torch", "zero0", "zero2", "zero3", "zero2-off", "zero3-off", "per-micro-batch", "zero3-resumed"]

# Runs the cases listed in argv[1] (one update each, two for "-resumed"), as one rank or as
# every rank under torchrun; rank 0 writes metrics.json and the new weights per case under
# argv[2].
SCRIPT = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
import drmas.stages.update as U
import drmas.training.engines as E
import drmas.training.engines.deepspeed as DS
from drmas.config import DrmasConfig
from drmas.infra.layout import optim_path
from drmas.infra.store import Store
from drmas.infra.layout import PolicyRef

config_for = DS.deepspeed_config
def small_params_partitioned(config, group, world):
    ds = config_for(config, group, world)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return ds
DS.deepspeed_config = small_params_partitioned
made = []
make_engine = E.make_engine
E.make_engine = lambda *args: made.append(make_engine(*args)) or made[-1]

if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
out = Path(sys.argv[2])
for case in json.loads(Path(sys.argv[1]).read_text()):
    config = DrmasConfig.from_json(Path(case["config"]).read_text())
    store = Store.from_config(config.store)
    result = U.update(config, store, "run", 0, case["wg"], PolicyRef(case["policy"]), None, overwrite=True)
    if case["name"].endswith("-resumed"):
        optim = PolicyRef(optim_path(config.experiment.name, "run", 0, case["wg"]))
        result = U.update(config, store, "run", 0, case["wg"], PolicyRef(result.artifact), optim, overwrite=True)
    if config.train.zero_stage == 3 and config.train.backend == "deepspeed":
        assert all(p.numel() == 0 for p in made[-1].params), "ZeRO-3 kept parameters whole"
    if E.rank_and_world()[0] == 0:
        store.open(result.artifact).download(out / case["name"])
        (out / case["name"] / "metrics.json").write_text(json.dumps(result.metrics))
if dist.is_initialized():  # leave the group before exit: gloo torn down by the exit aborts a rank now and then
    dist.barrier()
    dist.destroy_process_group()
"""


def prepare(tmp_path: Path, name: str) -> dict[str, str]:
    """Case ``name`` ready for its first update, with random advantages (and the solver's
    rows only in a "-solo" case); returns its entry for SCRIPT."""
    config, store, policy, _ = make_run(tmp_path / name, *BASE, *CASES[name])
    path = advantage(config, store, "run", 0).artifact
    batch = store.open(path).read_table("batch.parquet")
    advantages = np.random.default_rng(7).normal(size=batch.num_rows).astype(np.float32)
    batch = batch.set_column(batch.schema.get_field_index("advantage"), "advantage", pa.array(advantages))
    if name.endswith("-solo"):
        batch = batch.filter(pc.equal(batch["agent"], SOLO))
    with store.writer(path, overwrite=True) as out:
        out.write_table("batch.parquet", batch)
    config_file = tmp_path / name / "config.json"
    config_file.write_text(config.model_copy(update={"store": StoreConfig(**store.settings().as_dict())}).to_json())
    return {"name": name, "config": str(config_file), "policy": policy.artifact, "wg": WG}


def run_cases(tmp_path: Path, cases: list[dict[str, str]], ranks: int) -> Path:
    """SCRIPT over ``cases`` on ``ranks`` processes; the folder of what rank 0 wrote."""
    listing, out = tmp_path / "cases.json", tmp_path / "out"
    listing.write_text(json.dumps(cases))
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [*torch_launcher(ranks), str(script), str(listing), str(out)],
        capture_output=True,
        text=True,
        env=torch_env(),
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


class Results:
    """What one run of SCRIPT wrote: metrics and weights per case."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def metrics(self, name: str) -> dict[str, float]:
        return json.loads((self.folder / name / "metrics.json").read_text())

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.folder / name / "model.safetensors"))

    def agent_norms(self, name: str) -> dict[str, float]:
        return {
            key.split("/")[1]: value
            for key, value in self.metrics(name).items()
            if key.startswith("agent/") and key.endswith("/grad_norm")
        }


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Results:
    tmp = tmp_path_factory.mktemp("one")
    return Results(run_cases(tmp, [prepare(tmp, name) for name in ONE_RANK], ranks=1))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Results:
    tmp = tmp_path_factory.mktemp("two")
    return Results(run_cases(tmp, [prepare(tmp, name) for name in TWO_RANKS], ranks=2))


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[key] - b[key]).abs().max()) for key in a)


def test_the_diagnostic_leaves_the_update_unchanged(one_rank, two_ranks):
    """With the per-agent norms on, the new weights are those of the update without them,
    bit for bit: the diagnostic gradients never reach the optimizer (under ZeRO-2 they
    used to, and every per-agent norm read 0)."""
    for results, names in ((one_rank, ("torch", "zero2", "zero3")), (two_ranks, ("zero2", "zero3"))):
        for name in names:
            assert max_gap(results.weights(name), results.weights(f"{name}-off")) == 0.0, name
            assert results.metrics(name)[f"wg/{WG}/grad_norm"] == results.metrics(f"{name}-off")[f"wg/{WG}/grad_norm"]


def test_per_agent_norms_agree_across_engines_and_ranks(one_rank, two_ranks):
    """The same norms from torch, ZeRO-0/1/2/3, one rank or two (multi-rank ZeRO-0 used to
    read world-size times too large): within 1e-5 relative (fp32 summation order)."""
    reference = one_rank.agent_norms("torch")
    assert set(reference) == {"solver", "verifier"} and min(reference.values()) > 0.01
    measured = {f"{name}/1": one_rank.agent_norms(name) for name in ENGINES}
    measured |= {f"{name}/2": two_ranks.agent_norms(name) for name in ("torch", "zero0", "zero2", "zero3")}
    for where, norms in measured.items():
        assert norms.keys() == reference.keys(), where
        for agent, value in norms.items():
            assert value == pytest.approx(reference[agent], rel=1e-5), (where, agent)


def test_one_agents_norm_is_the_groups_norm(one_rank):
    """With only the solver's rows in the batch, its norm is the worker group's gradient
    norm before clipping, on the torch engine and on DeepSpeed (ZeRO-0, -2, -3)."""
    for name in ("torch", "zero0", "zero2", "zero3"):
        metrics = one_rank.metrics(f"{name}-solo")
        assert set(one_rank.agent_norms(f"{name}-solo")) == {SOLO}
        assert metrics[f"agent/{SOLO}/grad_norm"] == pytest.approx(metrics[f"wg/{WG}/grad_norm"], rel=1e-5), name
        assert metrics[f"wg/{WG}/grad_norm"] > 0.05  # so the step clipped


def test_activation_checkpointing_under_zero3_changes_nothing(one_rank):
    """Recomputed activations give the same update and per-agent norms (ZeRO-3 gathers the
    parameters again for the recompute)."""
    assert max_gap(one_rank.weights("zero3-checkpointed"), one_rank.weights("zero3")) < 1e-7
    for agent, value in one_rank.agent_norms("zero3-checkpointed").items():
        assert value == pytest.approx(one_rank.agent_norms("zero3")[agent], rel=1e-6)


def test_the_mean_over_micro_batches_counts_every_ranks_micro_batches(one_rank, two_ranks):
    """token-mean-per-micro-batch divides each micro-batch's loss by the mini-batch's
    micro-batch count, all ranks together: two ranks (one a micro-batch short, padded with
    an empty one that must not count) update as one does."""
    # 1e-4: Adam turns summation-order noise on near-zero gradients into visible steps.
    assert max_gap(two_ranks.weights("per-micro-batch"), one_rank.weights("per-micro-batch")) < 1e-4
    one, two = one_rank.metrics("per-micro-batch"), two_ranks.metrics("per-micro-batch")
    assert two[f"wg/{WG}/grad_norm"] == pytest.approx(one[f"wg/{WG}/grad_norm"], rel=1e-5)
    assert two[f"wg/{WG}/loss"] == pytest.approx(one[f"wg/{WG}/loss"], rel=1e-5)


def test_two_ranks_save_and_resume_as_one(one_rank, two_ranks):
    """ZeRO-3 on two ranks: weights and Adam's moments gathered from both ranks' partitions
    when saving (every rank takes part), split again when resuming; the second update ends
    where one rank's does."""
    assert max_gap(two_ranks.weights("zero3-resumed"), one_rank.weights("zero3-resumed")) < 1e-4
    assert max_gap(one_rank.weights("zero3-resumed"), one_rank.weights("zero3")) > 1e-3  # it did step again
