"""Time per call of drmas's math grader, and of a rollout batch's grading, against math-verify.

    .venv/bin/python bench/grading.py [--calls 1000] [--samples 8] [--seed 0]

Workload: the labelled corpus of tests/data/math_grading_pairs.jsonl (GSM8K, MATH, DAPO and
AIME forms). Prints, in one process:
  - the exact path: ``math_reward`` on pairs the exact path decides (a number against a
    number), per call;
  - the math-verify fallback: ``math_reward`` on the pairs that reach it, per call, first
    with empty caches (sympy and ANTLR already loaded: the first fallback of a process
    loads them, timed apart as the start-up) and then cached;
  - a rollout batch of ``--calls`` calls: prompts drawn from the corpus, ``--samples``
    responses per prompt drawn from the responses to the same gold answer (a group's
    samples share answers, as in GRPO), graded from empty caches, in wall-clock and CPU
    seconds (the CPU figure is what a loaded machine cannot inflate); and the same batch
    through the baseline, math-verify as open-r1's accuracy reward calls it (``parse`` with
    LaTeX extraction, boxed first, then ``verify``, its ``signal.alarm`` timeouts on: this
    runs in the main thread), with the ratio.
The corpus's hostile rows (power towers, huge factorials: each would take the baseline to
its 5-second timeouts) are left out of the batches, and counted in the exact path's and
the fallback's figures only as they are graded.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

from drmas.tasks import Question, grading
from drmas.tasks.math import math_reward
from drmas.team.agents import extract_final_answer

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "math_grading_pairs.jsonl"


def load_pairs() -> list[tuple[str, Question, bool]]:
    """(response, question, hostile) for every corpus row."""
    pairs = []
    for line in CORPUS.read_text().splitlines():
        row = json.loads(line)
        question = Question(row["id"], "?", (row["gold"],), row["source"])
        pairs.append((row["response"], question, row["why"].startswith("hostile")))
    return pairs


def reaches_fallback(response: str, question: Question) -> bool:
    """Whether grading this pair calls math-verify (found by counting the worker's calls)."""
    answer = extract_final_answer(response)
    if answer is None:
        return False
    before = grading._verify.cache_info()
    grading.grade_answer(answer, question.answers[0])
    after = grading._verify.cache_info()
    return (after.hits + after.misses) > (before.hits + before.misses)


def clear_caches() -> None:
    grading._verify.cache_clear()
    grading._parsed.cache_clear()


def per_call(pairs: list[tuple[str, Question]], repeats: int = 1) -> list[float]:
    """Seconds of each ``math_reward`` call."""
    times = []
    for _ in range(repeats):
        for response, question in pairs:
            started = time.perf_counter()
            math_reward(response, question)
            times.append(time.perf_counter() - started)
    return times


def rollout_batch(pairs: list[tuple[str, Question, bool]], calls: int, samples: int, seed: int):
    """``calls`` (response, question) pairs: prompts drawn from the corpus, ``samples``
    responses each drawn from the rows with the same gold answer."""
    rng = random.Random(seed)
    usable = [(response, question) for response, question, hostile in pairs if not hostile]
    by_gold = defaultdict(list)
    for response, question in usable:
        by_gold[question.answers[0]].append((response, question))
    batch = []
    while len(batch) < calls:
        _, question = rng.choice(usable)
        group = by_gold[question.answers[0]]
        batch += [(rng.choice(group)[0], question) for _ in range(min(samples, calls - len(batch)))]
    return batch


def baseline_reward(response: str, question: Question) -> float:
    """math-verify alone, as open-r1's accuracy reward calls it (LaTeX extraction only)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    config = LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
    gold = parse(f"${question.answers[0]}$", extraction_config=[LatexExtractionConfig()])
    answer = parse(response, extraction_config=[config], extraction_mode="first_match")
    return float(bool(gold) and bool(answer) and verify(gold, answer))


def describe(label: str, times: list[float]) -> None:
    ms = sorted(t * 1000 for t in times)
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    print(
        f"{label:44} {len(ms):6} calls  mean {statistics.fmean(ms):9.3f} ms  median "
        f"{statistics.median(ms):9.3f} ms  p95 {p95:9.3f} ms  max {ms[-1]:9.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the baseline's timeout warnings

    pairs = load_pairs()
    started = time.perf_counter()
    grading.grade_answer("x+1", "1+x")
    print(f"start-up (first fallback of the process: sympy, ANTLR, warm-up): {time.perf_counter() - started:.2f} s")
    fallback, exact = [], []
    for response, question, _ in pairs:
        (fallback if reaches_fallback(response, question) else exact).append((response, question))
    print(f"corpus: {len(pairs)} pairs, {len(exact)} decided by the exact path, {len(fallback)} reach math-verify")

    describe("exact path (math_reward)", per_call(exact, repeats=20))
    clear_caches()
    describe("fallback, empty caches (math_reward)", per_call(fallback))
    describe("fallback, cached (math_reward)", per_call(fallback, repeats=5))

    batch = rollout_batch(pairs, args.calls, args.samples, args.seed)
    clear_caches()
    started, cpu_started = time.perf_counter(), time.process_time()
    ours = [math_reward(response, question) for response, question in batch]
    ours_s, ours_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    started, cpu_started = time.perf_counter(), time.process_time()
    theirs = [baseline_reward(response, question) for response, question in batch]
    theirs_s, theirs_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    distinct = len({(response, question.answers[0]) for response, question in batch})
    print(
        f"rollout batch: {len(batch)} calls ({len(batch) // args.samples} prompts x {args.samples}, "
        f"{distinct} distinct pairs, reward mean {sum(ours) / len(ours):.3f} vs baseline "
        f"{sum(theirs) / len(theirs):.3f})"
    )
    print(f"  drmas grader, empty caches: {ours_s:8.3f} s wall, {ours_cpu:8.3f} s CPU")
    print(
        f"  math-verify alone:          {theirs_s:8.3f} s wall, {theirs_cpu:8.3f} s CPU   ratio "
        f"{theirs_s / ours_s:.1f}x wall, {theirs_cpu / ours_cpu:.1f}x CPU"
    )


if __name__ == "__main__":
    main()
