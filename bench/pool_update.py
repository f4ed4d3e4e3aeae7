"""The update on the pool: tokens/s on 2 slots over 1, each rank's memory under ZeRO-3 over
ZeRO-0, and an update that continues from the training state its workers kept over one
rebuilt from the store (a ~20M-parameter worker group, synthetic rows, a local Ray with 2
slots).

    .venv/bin/python bench/pool_update.py [--rows 64] [--steps 2]

Each case runs the real update (``drmas.stages.update.update_rank`` in the pool's workers,
as ``RayPool.train`` runs it) three times on a fresh pool: the first builds the training
state from the store (the whole model loaded by each rank before DeepSpeed partitions it);
the second continues from the state the workers kept (offloaded, onloaded); the third
starts again from the store (the kept state dropped). Memory is each rank's peak resident
memory during the call (sampled every 5 ms) less its resident memory before it; it
includes the whole weights each rank gathers for its engine (the in-memory sync), which
ZeRO-3 does not shard. On 2 CPU cores both ranks share the cores, so 2 slots cannot be
faster than 1 here; on GPUs each slot is a device.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pyarrow as pa
import ray

from drmas.config import load_config
from drmas.generation.pool import RayPool
from drmas.generation.ray_session import connect_ray
from drmas.infra.layout import PolicyRef, optim_path, policy_path, stage_path
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


def measured_update(worker, *args, drop_kept: bool = False):
    """The update as the pool runs it, with this rank's peak memory growth (MiB) during it
    and its wall time beside it; ``drop_kept``: start from the store, not the kept state."""
    import threading
    import time

    def resident_mib() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    if drop_kept:
        worker.take_training()
    before, peak, done = resident_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], resident_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    result = update_rank(worker, *args)
    elapsed = time.perf_counter() - started
    done.set()
    sampler.join()
    return result, max(peak[0], resident_mib()) - before, elapsed


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
            first = (config, store.settings(), "bench", 0, wg, policies[wg], None, None, True, "")
            policy, optim = (
                PolicyRef(policy_path("math-tiny", "bench", 0, wg)),
                PolicyRef(optim_path("math-tiny", "bench", 0, wg)),
            )
            again = (config, store.settings(), "bench", 0, wg, policy, optim, None, True, "")
            calls = {}
            with RayPool(config, store, threads=os.cpu_count()) as pool:
                pool._form_group(wg)
                for name, call, drop in (("cold", first, False), ("kept", again, False), ("rebuilt", again, True)):
                    refs = [
                        worker.run.remote(partial(measured_update, drop_kept=drop), *call)
                        for worker in pool.workers[wg]
                    ]
                    calls[name] = ray.get(refs)
            rate = calls["cold"][0][0].metrics[f"wg/{wg}/tokens_per_s"]
            memory = {name: max(growth for _, growth, _ in ranks) for name, ranks in calls.items()}
            seconds = {name: max(elapsed for _, _, elapsed in ranks) for name, ranks in calls.items()}
            results[label] = (rate, memory, seconds)
            print(
                f"{label:16} {rate:8.0f} response tok/s   peak memory growth per rank (MiB): "
                + ", ".join(f"{name} {memory[name]:.0f}" for name in calls)
                + "   seconds: "
                + ", ".join(f"{name} {seconds[name]:.2f}" for name in calls)
            )
        ray.shutdown()
    one, two, three = (results[label] for label, _ in CASES)
    print(f"tokens/s, 2 slots / 1 slot (ZeRO-0): {two[0] / one[0]:.2f}x")
    for name in ("cold", "kept"):
        print(f"peak memory per rank, ZeRO-3 / ZeRO-0 at 2 ranks, {name} update: {three[1][name] / two[1][name]:.2f}x")
    for label, (_, _, seconds) in results.items():
        print(
            f"update time, kept state / rebuilt from the store ({label}): {seconds['kept'] / seconds['rebuilt']:.2f}x"
        )


if __name__ == "__main__":
    main()
