"""The update on the pool: tokens/s on 2 slots over 1, and each rank's memory under ZeRO-3
over ZeRO-0 (a ~20M-parameter worker group, synthetic rows, a local Ray with 2 slots).

    .venv/bin/python bench/pool_update.py [--rows 64] [--steps 2]

Each case runs the real update (``drmas.stages.update.update`` through ``RayPool.train``)
on a fresh pool, so that every rank is a fresh process: its peak resident memory
(``ru_maxrss``) less its resident memory before the update is what the update cost it.
That includes the whole model each rank loads before DeepSpeed partitions it and the whole
weights each rank gathers for its engine (the in-memory sync), which ZeRO-3 does not shard.
On 2 CPU cores both ranks share the cores, so 2 slots cannot be faster than 1 here; on
GPUs each slot is a device.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pyarrow as pa
import ray

from drmas.config import load_config
from drmas.generation.pool import RayPool, connect_ray
from drmas.infra.layout import stage_path
from drmas.infra.schema import BATCH_SCHEMA
from drmas.infra.store import Store
from drmas.stages.policies import init_policies
from drmas.stages.update import update_rank

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import MODEL_20M
from update_throughput import synthetic_rows

from tests.helpers import trajectory_table

CASES = [
    ("ZeRO-0, 1 slot", ["train.zero_stage=0", "ray.pool_size=1"]),
    ("ZeRO-0, 2 slots", ["train.zero_stage=0", "ray.pool_size=2"]),
    ("ZeRO-3, 2 slots", ["train.zero_stage=3", "ray.pool_size=2"]),
]


def measured_update(worker, *args):
    """The update as the pool runs it, with this rank's memory growth (MiB) beside it."""
    import resource

    def resident_mib() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    before = resident_mib()
    result = update_rank(worker, *args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result, peak - before


def write_batch(store: Store, config, run_id: str, wg: str, rows: list[dict]) -> None:
    table = trajectory_table(len(rows)).to_pylist()
    for row, synthetic in zip(table, rows, strict=True):
        row.update(synthetic, wg=wg, score=synthetic["advantage"], group_id=row["uid"])
    with store.writer(stage_path(config.experiment.name, run_id, 0, "advantage")) as out:
        out.write_table("batch.parquet", pa.Table.from_pylist(table, schema=BATCH_SCHEMA), BATCH_SCHEMA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    common = [*MODEL_20M, "workers.sharing=by_model", "train.backend=deepspeed", "train.micro_batch_size=8"]
    common.append(f"train.updates_per_iteration={args.steps}")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        connect_ray(load_config(ROOT / "configs" / "math_tiny.yaml", [*common, "ray.pool_size=2"]))
        for label, overrides in CASES:
            config = load_config(ROOT / "configs" / "math_tiny.yaml", [*common, *overrides])
            store = Store(str(Path(scratch) / label.replace(" ", "").replace(",", "-")))
            policies = init_policies(config, store, "bench")
            [wg] = policies
            write_batch(store, config, "bench", wg, synthetic_rows(args.rows, vocab=64))  # ids every tokenizer has
            call = (config, store.settings(), "bench", 0, wg, policies[wg], None, None, True, "")
            with RayPool(config, store, threads=os.cpu_count()) as pool:
                pool._form_group(wg)
                refs = [worker.run.remote(measured_update, *call) for worker in pool.workers[wg]]
                ranks = ray.get(refs)
            metrics = ranks[0][0].metrics
            rate = metrics[f"wg/{wg}/tokens_per_s"]
            memory = [growth for _, growth in ranks]
            results[label] = (rate, max(memory))
            print(f"{label:16} {rate:8.0f} response tok/s   memory growth per rank (MiB): {memory}")
        ray.shutdown()
    one, two, three = (results[label] for label, _ in CASES)
    print(f"tokens/s, 2 slots / 1 slot (ZeRO-0): {two[0] / one[0]:.2f}x")
    print(f"peak memory per rank, ZeRO-3 / ZeRO-0 at 2 ranks: {three[1] / two[1]:.2f}x")


if __name__ == "__main__":
    main()
