"""A cold update's ranks meet after their downloads on a group with a long timeout of its
own (issue 28 §6: every long single-rank step under the process group's timeout): two
spawned gloo ranks, DeepSpeed ZeRO-3 on CPU, a real local store."""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drmas.config import load_config
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _slowed(method_name: str) -> None:
    """This rank's downloads by ``Artifact.<method_name>`` take 5 s: longer than the group's
    own timeout."""
    from drmas.infra.store import Artifact

    download = getattr(Artifact, method_name)

    def slow(self, *args, **kwargs):
        time.sleep(5)
        return download(self, *args, **kwargs)

    setattr(Artifact, method_name, slow)


def _cold_start(rank: int, rendezvous: str, store_root: str, restore: bool, results: dict) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2)
    )
    try:
        from drmas.stages.update import _start_training

        overrides = RESTORE_OVERRIDES if restore else COLD_START_OVERRIDES
        config = load_config(CONFIGS / "math_tiny.yaml", [*overrides, f"store.root={store_root}"])
        store = Store.from_config(config.store)
        group = config.worker_groups()[0]
        policy, optim = PolicyRef(COLD_START_POLICY), None
        with tempfile.TemporaryDirectory() as scratch:
            if restore:  # a stored optimizer state, after one step, which the second start reads
                optim = _stored_state(config, store, group, policy, rank, Path(scratch))
            if rank == 1:
                _slowed("download_file" if restore else "download")
            held = _start_training(config, store, group, policy, optim, None, Path(scratch) / "start")
            if restore:  # the next collective: the step's gradient all-reduce
                _train_one_step(config, group, held, rank)
        results[rank] = sum(
            p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in held.model.parameters()
        )
    finally:
        dist.destroy_process_group()


def _train_one_step(config, group, held, rank: int) -> None:
    import sys

    from drmas.training.loop import train_worker_group

    sys.path.insert(0, str(CONFIGS.parent / "bench"))
    from gpu_checks import random_rows

    rows = random_rows(4, 8, 8, held.model.get_input_embeddings().num_embeddings, list(group.agents))
    train_worker_group(config, group, held.engine, held.model, None, rows, 0, 0, rank, 2)


def _stored_state(config, store, group, policy, rank: int, scratch: Path) -> PolicyRef:
    from drmas.stages.optimizer_store import store_shards
    from drmas.stages.update import _start_training

    held = _start_training(config, store, group, policy, None, None, scratch / "first")
    _train_one_step(config, group, held, rank)
    store_shards(held.engine.shard_stream(), store, "run/optim", False, {}, scratch / "save", 60)
    return PolicyRef("run/optim")


COLD_START_OVERRIDES = [
    "models.tiny.hidden_size=32",
    "models.tiny.intermediate_size=64",
    "models.tiny.num_layers=1",
    "workers.sharing=by_model",
    "ray.pool_size=2",
    "train.backend=deepspeed",
    "train.zero_stage=3",
]
RESTORE_OVERRIDES = [*COLD_START_OVERRIDES[:-2], "train.backend=torch"]
"""The torch engine: its gradients are all-reduced on the process group itself."""
COLD_START_POLICY = "run/policy"


@pytest.mark.parametrize("restore", [False, True], ids=["policy", "optimizer shards"])
def test_a_cold_update_waits_for_a_rank_whose_download_is_slow(tmp_path, restore):
    """A cold update's ranks each download at the store's pace; they meet on a group with a
    long timeout of its own before the next collective, which times out after 2 s here (10
    minutes in a pool): rank 1's downloads take 5 s, and the start still succeeds on both
    ranks. The policy before ZeRO-3's partitioned load; a stored optimizer state's shards
    before the torch engine's first gradient all-reduce."""
    from drmas.stages.policies import init_policies

    overrides = RESTORE_OVERRIDES if restore else COLD_START_OVERRIDES
    config = load_config(CONFIGS / "math_tiny.yaml", [*overrides, f"store.root={tmp_path / 'store'}"])
    store = Store.from_config(config.store)
    policy = init_policies(config, store, "run")[config.worker_groups()[0].name]
    with store.writer(COLD_START_POLICY) as out:
        out.put_dir(store.open(policy.artifact).download(tmp_path / "policy", prefix=policy.prefix), "")
    with mp.Manager() as manager:
        results = manager.dict()
        args = (f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "store"), restore, results)
        mp.spawn(_cold_start, args=args, nprocs=2, join=True)
        held = dict(results)
    assert set(held) == {0, 1} and held[0] == held[1] > 0
