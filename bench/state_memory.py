"""Host memory of saving and restoring the optimizer state, per rank: sharded, streamed, whole.

Two ranks (gloo, on the CPU) train a ~20M-parameter model with DeepSpeed ZeRO-2 or ZeRO-3
for one step, then, in the same processes, save and restore the optimizer state both ways:

- whole (drmas before): every rank gathers the whole state (``export_state``), rank 0
  serialises it into a second copy in memory (``state_files``); a restore reads the whole
  file into memory (``safetensors.torch.load_file``);
- streamed (drmas before the shards): every rank takes part in each tensor's gather and
  only rank 0 keeps it, long enough to append it to the file (``state_stream`` +
  ``write_state``/``drain``); a restore reads one tensor at a time (``load_state``);
- sharded (now): every rank writes the ranges it holds to its own file and stores it
  (``shard_stream`` + ``store_shards``, a local store); a restore downloads the shards that
  hold its ranges and reads just those (``update.import_stored_state``).

Each phase's peak is the process's anonymous resident memory sampled every 2 ms, above what it held
when the phase started (``malloc_trim`` between phases, so freed memory is given back). It
prints MB per rank and phase, and each sharded peak against the rank's shard (its file).

    python bench/state_memory.py --stage 2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
}
"""A Qwen3 of ~20M parameters (a third of them the embedding)."""
MB = 10**6


def rss() -> int:
    """Anonymous resident memory: what the process itself holds. The file a restore reads
    is memory-mapped, and its pages (counted in the whole RSS) are the kernel's page cache,
    given back under pressure."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def peak_above_start(work: Callable[[], object]) -> int:
    """The most resident memory above the start while ``work`` runs (sampled every 2 ms)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], rss()) - start


def rank_main(rank: int, rendezvous: str, folder: str, stage: int, results: dict) -> None:
    os.environ |= {"LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    from gpu_checks import build_model, engine_config, random_rows
    from safetensors.torch import load_file

    from drmas.infra.layout import PolicyRef
    from drmas.infra.store import Store
    from drmas.stages.optimizer_store import store_shards
    from drmas.stages.update import import_stored_state
    from drmas.training.engines import make_engine
    from drmas.training.loop import train_worker_group
    from drmas.training.shards import shard_file
    from drmas.training.state import TrainState, drain, load_state, state_files, write_state

    config = engine_config(stage, offload=False, bf16=False)
    group = config.worker_groups()[0]
    model = build_model(SHAPE, torch.float32)
    engine = make_engine(model, group, config)
    rows = random_rows(4, 16, 16, SHAPE["vocab_size"], list(group.agents))
    train_worker_group(config, group, engine, model, None, rows, 0, 0, rank, 2)
    streamed = Path(folder) / "streamed"

    def save_whole() -> None:
        state = engine.export_state()
        if rank == 0:
            files = state_files(state)
            del files

    def save_streamed() -> None:
        stream = engine.state_stream()
        write_state(stream, streamed) if rank == 0 else drain(stream)

    def restore_whole() -> None:
        state = load_state(streamed)
        whole = TrainState(load_file(str(streamed / "optimizer.safetensors")), state.meta)
        engine.import_state(whole)

    def restore_streamed() -> None:
        engine.import_state(load_state(streamed))

    store = Store(str(Path(folder) / "store"))

    def save_sharded() -> None:
        store_shards(engine.shard_stream(), store, "optim", False, {}, Path(folder) / f"save{rank}", 600)

    def restore_sharded() -> None:
        import_stored_state(engine, store, PolicyRef("optim"), Path(folder) / f"restore{rank}")

    phases: dict[str, int] = {}
    for name, work in (("save sharded", save_sharded), ("save streamed", save_streamed), ("save whole", save_whole)):
        phases[name] = peak_above_start(work)
        dist.barrier()
    restores = (("restore sharded", restore_sharded), ("restore streamed", restore_streamed))
    for name, work in (*restores, ("restore whole", restore_whole)):
        phases[name] = peak_above_start(work)
        dist.barrier()
    results[rank] = {
        "phases": phases,
        "state_bytes": (streamed / "optimizer.safetensors").stat().st_size,
        "shard_bytes": (Path(folder) / "store" / "optim" / shard_file(rank, 2)).stat().st_size,
        "params": sum(p.numel() for p in model.parameters()),
    }
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    args = parser.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        rendezvous = f"file://{Path(folder) / 'rendezvous'}"
        mp.spawn(rank_main, args=(rendezvous, folder, args.stage, results), nprocs=2, join=True)
        report = dict(results)
    state = report[0]["state_bytes"]
    print(f"ZeRO-{args.stage}, 2 ranks, {report[0]['params'] / 1e6:.1f}M parameters (fp32)")
    print(f"optimizer state: {state / MB:.0f} MB whole")
    print(
        f"{'rank':>4}  {'phase':<8} {'whole MB':>9} {'streamed MB':>12} {'sharded MB':>11} "
        f"{'shard MB':>9} {'sharded/shard':>14}"
    )
    for rank in (0, 1):
        phases, shard = report[rank]["phases"], report[rank]["shard_bytes"]
        for phase in ("save", "restore"):
            whole, streamed, sharded = (phases[f"{phase} {way}"] for way in ("whole", "streamed", "sharded"))
            print(
                f"{rank:>4}  {phase:<8} {whole / MB:9.1f} {streamed / MB:12.1f} {sharded / MB:11.1f} "
                f"{shard / MB:9.1f} {sharded / shard:14.2f}"
            )
    print(json.dumps({str(rank): value for rank, value in report.items()}))


if __name__ == "__main__":
    main()
