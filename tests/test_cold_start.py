"""A cold update's ranks meet after their downloads on a group with a long timeout of its
own (issue 28 §6: every long single-rank step under the process group's timeout): two
spawned gloo ranks, DeepSpeed ZeRO-3 on CPU, a real local store."""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drmas.config import load_config
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _cold_start(rank: int, rendezvous: str, store_root: str, results: dict) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2)
    )
    try:
        from drmas.infra.store import Artifact
        from drmas.stages.update import _start_training

        if rank == 1:  # this rank's download is slow: longer than the group's own timeout
            download = Artifact.download

            def slow_download(self, *args, **kwargs):
                time.sleep(5)
                return download(self, *args, **kwargs)

            Artifact.download = slow_download  # type: ignore[method-assign]
        config = load_config(CONFIGS / "math_tiny.yaml", [*COLD_START_OVERRIDES, f"store.root={store_root}"])
        store = Store.from_config(config.store)
        group = config.worker_groups()[0]
        with tempfile.TemporaryDirectory() as scratch:
            held = _start_training(config, store, group, PolicyRef(COLD_START_POLICY), None, None, Path(scratch))
        results[rank] = sum(p.ds_tensor.numel() for p in held.model.parameters())
    finally:
        dist.destroy_process_group()


COLD_START_OVERRIDES = [
    "models.tiny.hidden_size=32",
    "models.tiny.intermediate_size=64",
    "models.tiny.num_layers=1",
    "workers.sharing=by_model",
    "ray.pool_size=2",
    "train.backend=deepspeed",
    "train.zero_stage=3",
]
COLD_START_POLICY = "run/policy"


def test_a_cold_update_waits_for_a_rank_whose_download_is_slow(tmp_path):
    """A cold update's ranks each download the policy at the store's pace; they meet on a
    group with a long timeout of its own before ZeRO-3's partitioned load, whose collectives
    time out after 2 s here (10 minutes in a pool): rank 1 downloads for 5 s, and the load
    still succeeds on both ranks, each with its partition."""
    from drmas.stages.policies import init_policies

    config = load_config(CONFIGS / "math_tiny.yaml", [*COLD_START_OVERRIDES, f"store.root={tmp_path / 'store'}"])
    store = Store.from_config(config.store)
    policy = init_policies(config, store, "run")[config.worker_groups()[0].name]
    with store.writer(COLD_START_POLICY) as out:
        out.put_dir(store.open(policy.artifact).download(tmp_path / "policy", prefix=policy.prefix), "")
    with mp.Manager() as manager:
        results = manager.dict()
        args = (f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "store"), results)
        mp.spawn(_cold_start, args=args, nprocs=2, join=True)
        partitions = dict(results)
    assert set(partitions) == {0, 1} and partitions[0] == partitions[1] > 0
