"""Throughput of drmas.algos.compute_advantages against the plain-loop oracle.

    .venv/bin/python bench/advantage.py [--rows 10000000] [--oracle-rows 200000]

Builds a trajectories-like Parquet file once (string keys uid/traj_uid/agent, 8 rollouts
per prompt, 2-3 agents, 2-7 calls per trajectory), then times, on one core:
  - compute_advantages on the keys read as plain strings,
  - compute_advantages on the keys read dictionary-encoded (how the advantage stage reads),
  - compute_advantages on the keys as numpy string arrays (what a user holds in memory),
  - the loop oracle (tests/oracle.py: plain Python over lists and dicts) on a prefix of
    the rows, scaled to the full size,
  - a per-row loop over torch tensors, the shape of the reference code's (veRL's) GRPO
    advantage function, on a smaller prefix, scaled,
for both modes, and prints rows/s and the speed-up over each loop (same process, same data).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the oracle lives with the tests

from oracle import loop_advantages

from drmas.algos import compute_advantages

ROLLOUTS_PER_PROMPT = 8
AGENTS = np.array(["solver", "verifier", "answer"])


def build_rows(rows: int, seed: int = 0) -> pa.Table:
    """Trajectories of 2-7 calls, agents drawn from 2-3 roles, 8 trajectories per prompt."""
    rng = np.random.default_rng(seed)
    calls = rng.integers(2, 8, size=rows // 4 + 1)  # calls per trajectory, mean 4.5
    calls = calls[: np.searchsorted(np.cumsum(calls), rows) + 1]
    calls[-1] -= calls.sum() - rows
    traj = np.repeat(np.arange(len(calls)), calls)  # [N]
    prompt = traj // ROLLOUTS_PER_PROMPT  # [N]
    roles = np.where(prompt % 2 == 0, 2, 3)  # math-like (2 agents) or search-like (3)
    agent = rng.integers(0, 3, size=rows) % roles  # [N]
    success = rng.random(len(calls)) < 0.4  # per trajectory
    valid = rng.random(rows) < 0.95
    score = success[traj].astype(np.float32) - 0.1 * (~valid)

    def as_strings(prefix: str, codes: np.ndarray) -> pa.Array:
        dictionary = pa.array([f"{prefix}{i:08d}" for i in range(int(codes.max()) + 1)])
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), dictionary).cast(pa.string())

    return pa.table(
        {
            "uid": as_strings("prompt-", prompt),
            "traj_uid": as_strings("traj-", traj),
            "agent": pa.array(AGENTS[agent]),
            "score": pa.array(score),
        }
    )


def tensor_loop(score: torch.Tensor, uid, traj_uid, agent, mode: str, eps: float = 1e-6):
    """What users have today: a Python loop over rows that indexes torch tensors, builds
    per-group lists of 0-d tensors, and reduces them with torch (written for this bench)."""
    rows = len(score)
    if mode == "grpo":
        per_traj = defaultdict(list)
        for i in range(rows):
            per_traj[traj_uid[i]].append(score[i])
        traj_mean = {t: torch.stack(v).mean() for t, v in per_traj.items()}
        score = torch.stack([traj_mean[traj_uid[i]] for i in range(rows)])
        keys = [uid[i] for i in range(rows)]
        seen, groups = set(), defaultdict(list)
        for i in range(rows):
            if traj_uid[i] not in seen:
                seen.add(traj_uid[i])
                groups[keys[i]].append(score[i])
    else:
        keys = [(uid[i], agent[i]) for i in range(rows)]
        groups = defaultdict(list)
        for i in range(rows):
            groups[keys[i]].append(score[i])
    stats = {}
    for key, values in groups.items():
        stacked = torch.stack(values)
        one = len(values) == 1
        stats[key] = (torch.tensor(0.0) if one else stacked.mean(), torch.tensor(1.0) if one else stacked.std())
    out = score.clone()
    for i in range(rows):
        mean, std = stats[keys[i]]
        out[i] = (score[i] - mean) / (std + eps)
    return out


def timed(function, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--oracle-rows", type=int, default=200_000)
    parser.add_argument("--tensor-loop-rows", type=int, default=20_000)
    parser.add_argument("--data", type=Path, default=ROOT / "bench" / "data")
    args = parser.parse_args()

    pa.set_cpu_count(1)  # one core, as the target says
    pa.set_io_thread_count(1)
    path = args.data / f"advantage-{args.rows}.parquet"
    if not path.exists():
        args.data.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        pq.write_table(build_rows(args.rows), path, row_group_size=1_000_000)
        print(f"built {path} in {time.perf_counter() - started:.1f} s")
    keys = ["uid", "traj_uid", "agent"]
    plain = pq.read_table(path, use_threads=False)
    encoded = pq.read_table(path, read_dictionary=keys, use_threads=False)
    rows = plain.num_rows
    numpy_keys = [plain[k].to_numpy(zero_copy_only=False).astype(str) for k in keys]
    score = plain["score"].to_numpy()
    head = plain.slice(0, args.oracle_rows)
    head_columns = [head[k].to_pylist() for k in keys]
    head_score = score[: args.oracle_rows].tolist()
    torch.set_num_threads(1)
    small = args.tensor_loop_rows
    small_score = torch.tensor(score[:small])
    print(
        f"rows {rows:,}, prompts {len(plain['uid'].unique()):,}, trajectories "
        f"{len(plain['traj_uid'].unique()):,}, threads 1 (pid {os.getpid()})"
    )
    header = f"{'mode':6} {'method':19} {'seconds':>8} {'rows/s':>12} {'vs oracle':>10} {'vs tensor loop':>15}"
    print(header)
    for mode in ("grpo", "drmas"):
        oracle_s = timed(lambda mode=mode: loop_advantages(head_score, *head_columns, mode), repeats=1)
        oracle_rate = args.oracle_rows / oracle_s
        tensor_s = timed(lambda mode=mode: tensor_loop(small_score, *head_columns, mode), repeats=1)
        tensor_rate = small / tensor_s
        measured = [
            ("loop oracle", rows / oracle_rate, f"(timed on {args.oracle_rows:,} rows, scaled)"),
            ("tensor loop", rows / tensor_rate, f"(timed on {small:,} rows, scaled)"),
        ]
        for label, columns in (
            ("vectorised, strings", [plain[k] for k in keys]),
            ("vectorised, dict", [encoded[k] for k in keys]),
            ("vectorised, numpy", numpy_keys),
        ):
            seconds = timed(lambda columns=columns, mode=mode: compute_advantages(score, *columns, mode))
            measured.append((label, seconds, ""))
        for label, seconds, note in measured:
            rate = rows / seconds
            print(
                f"{mode:6} {label:19} {seconds:8.2f} {rate:12,.0f} {rate / oracle_rate:10.1f} "
                f"{rate / tensor_rate:15.1f}  {note}"
            )


if __name__ == "__main__":
    main()
