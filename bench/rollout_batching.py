"""Rollout throughput: one batched generate per agent step vs one generate per episode.

    .venv/bin/python bench/rollout_batching.py [--episodes 64] [--hidden 128]

Same worker group (a scratch model and tokenizer), same prompts (math Solver prompts of
generated arithmetic), same sampling and seed, in one process: new tokens per second of
the batched call, of per-episode calls, and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from drmas.config import SamplingConfig, load_config
from drmas.generation.workers import WorkerGroupRuntime
from drmas.infra.store import Store
from drmas.stages.policies import init_policies
from drmas.stages.rollout import task_questions
from drmas.team.agents import SolverAgent
from drmas.team.episodes import Episode

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(
        ROOT / "configs" / "math_tiny.yaml",
        [
            f"models.tiny.hidden_size={args.hidden}",
            f"models.tiny.intermediate_size={args.hidden * 4}",
            f"models.tiny.num_layers={args.layers}",
            "workers.sharing=by_model",
        ],
    )
    with tempfile.TemporaryDirectory() as scratch:
        store = Store(f"{scratch}/store")
        [policy] = init_policies(config, store, "bench").values()
        worker = WorkerGroupRuntime(
            "solver-verifier", store.settings(), cache_dir=f"{scratch}/cache", threads=args.threads
        )
        worker.load_policy(policy)
        solver = SolverAgent()
        questions = task_questions(config, "train")[: args.episodes]
        prompts = [solver.prompt(Episode("u", "t", 0, q), 1) for q in questions]
        # Untrained models rarely stop early: both runs generate (almost) max_new_tokens.
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)
        worker.generate(prompts[:4], sampling, seed=0)  # warm-up

        started = time.perf_counter()
        batched = worker.generate(prompts, sampling, seed=1)
        batched_s = time.perf_counter() - started
        started = time.perf_counter()
        single = [worker.generate([prompt], sampling, seed=1 + i)[0] for i, prompt in enumerate(prompts)]
        single_s = time.perf_counter() - started

    params = sum(p.numel() for p in worker.engine.model.parameters())
    batched_tokens = sum(len(r.response_ids) for r in batched)
    single_tokens = sum(len(r.response_ids) for r in single)
    batched_rate, single_rate = batched_tokens / batched_s, single_tokens / single_s
    print(
        f"model {params / 1e6:.2f}M params, {args.episodes} episodes, "
        f"prompts ~{len(batched[0].prompt_ids)} tokens, threads {args.threads}"
    )
    print(f"batched     {batched_tokens:6d} tokens {batched_s:7.2f} s {batched_rate:9.0f} tok/s")
    print(f"per episode {single_tokens:6d} tokens {single_s:7.2f} s {single_rate:9.0f} tok/s")
    print(f"ratio batched / per-episode: {batched_rate / single_rate:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
