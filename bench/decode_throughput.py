"""Rollout decoding of a real model: drmas's engine against plain ``model.generate``.

    .venv/bin/python bench/decode_throughput.py [--model .cache/models/smollm2-135m-instruct]
        [--prompts 8] [--group 4] [--prompt-set reference] [--max-new-tokens 96] [--threads 2]

Same model, same requests, same sampling settings, in one process, alternating (so that
load from other processes hits both alike):

    baseline  transformers' ``model.generate`` on the left-padded batch of every request
              (each prompt ``--group`` times, as GRPO asks it), ``do_sample=True`` with the
              temperature and top-p, ``output_logits`` for the sampled tokens' log-probs
              (the rollout needs them), stopping at the model's end-of-turn tokens
    drmas     ``HFEngine.generate`` (``drmas.generation.engines.decode``): each distinct
              prompt prefilled once, ended rows leaving the batch, the KV cache written into
              reserved room, the nucleus found among the top candidates

The prompts are the math Solver's (``--prompt-set``) for questions of the word-problem
config, through the model's chat template and the config's system prompt. Printed:
completion tokens per second of each (tokens up to and including the stop token) and the
ratio drmas / baseline, per repeat and overall.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from drmas.config import SamplingConfig, load_config
from drmas.generation.engines import request_seeds
from drmas.generation.engines.decode import left_pad
from drmas.generation.engines.hf import HFEngine
from drmas.generation.workers import stop_token_ids
from drmas.models import chat_prompt, load_tokenizer
from drmas.stages.rollout import task_questions
from drmas.team.agents import SolverAgent
from drmas.team.episodes import Episode

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "math_smollm2_word_problems.yaml"


def requests(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Every prompt ``--group`` times, rendered as the rollout renders the Solver's."""
    config = load_config(CONFIG, [f"models.smollm2.source={args.model}"])
    system = config.models["smollm2"].system_prompt
    solver = SolverAgent(prompts=args.prompt_set)
    questions = task_questions(config, "train")[: args.prompts]
    prompts = []
    for question in questions:
        text = chat_prompt(tokenizer, solver.prompt(Episode("u", "t", 0, question), 1), system)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [prompt for prompt in prompts for _ in range(args.group)]


def completion_tokens(rows: torch.Tensor, stops: list[int]) -> int:
    """Tokens of each row up to and including its first stop token."""
    total = 0
    for row in rows.tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in stops), len(row))
        total += end
    return total


def plain_generate(engine: HFEngine, prompts: list[list[int]], sampling: SamplingConfig, stops: list[int]) -> int:
    model = engine.model
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else stops[0]
    ids, mask = left_pad(prompts, pad, engine.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=None,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stops,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return completion_tokens(out.sequences[:, ids.shape[1] :], stops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / ".cache" / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-set", default="reference", choices=["reference", "compact"])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    prompts = requests(args, tokenizer)
    stops = stop_token_ids(tokenizer)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    engine = HFEngine(args.dtype)
    engine.load(Path(args.model))
    engine.generate(prompts[:2], SamplingConfig(temperature=0.0, max_new_tokens=4), stops, [0, 1])  # warm-up
    lengths = [len(p) for p in prompts]
    print(
        f"{args.model}: {len(prompts)} requests ({args.prompts} prompts x {args.group}), prompts "
        f"{min(lengths)}-{max(lengths)} tokens, T {args.temperature} top-p {args.top_p}, "
        f"max {args.max_new_tokens} new tokens, {args.threads} threads, {args.dtype}"
    )
    totals = {"baseline": [0, 0.0], "unfused": [0, 0.0], "drmas": [0, 0.0]}
    for repeat in range(args.repeats):
        torch.manual_seed(repeat)
        started = time.perf_counter()
        tokens = plain_generate(engine, prompts, sampling, stops)
        runs = {"baseline": (tokens, time.perf_counter() - started)}
        for name, fused in (("unfused", False), ("drmas", True)):
            engine.fused_step = fused
            started = time.perf_counter()
            generations = engine.generate(prompts, sampling, stops, request_seeds(repeat, 0, len(prompts)))
            runs[name] = (sum(len(g.response_ids) for g in generations), time.perf_counter() - started)
        for name, (count, seconds) in runs.items():
            totals[name][0] += count
            totals[name][1] += seconds
            print(f"  repeat {repeat} {name:8s} {count:5d} tokens {seconds:7.1f} s {count / seconds:7.1f} tok/s")
    rates = {name: count / seconds for name, (count, seconds) in totals.items()}
    print(
        f"baseline {rates['baseline']:.1f} tok/s, drmas {rates['drmas']:.1f} tok/s: "
        f"{rates['drmas'] / rates['baseline']:.2f}x (through the model's forward: "
        f"{rates['unfused']:.1f} tok/s, {rates['unfused'] / rates['baseline']:.2f}x)"
    )


if __name__ == "__main__":
    sys.exit(main())
