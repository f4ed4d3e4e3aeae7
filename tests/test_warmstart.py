"""Warm-start demonstrations: correct working (math), episodes played out against the real
retriever (search), controlled imperfection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from drmas.config import load_config
from drmas.tasks import Question
from drmas.tasks.math import (
    answers_match,
    column_working,
    generate_arithmetic,
    load_math_questions,
    math_demonstrations,
    solution_demonstration,
)
from drmas.tasks.search.answers import exact_match
from drmas.tasks.search.retrieval import Retriever
from drmas.tasks.search.task import search_demonstrations
from drmas.tasks.search.world import demonstration_queries, generated_facts
from drmas.tasks.word_problems import generate_word_problems
from drmas.team.agents import extract_boxed

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize(
    ("a", "op", "b", "expected"),
    [
        (37, "+", 48, "7+8=15, 3+4+1=8. \\boxed{85}"),
        (57, "+", 48, "7+8=15, 5+4+1=10, carry 1. \\boxed{105}"),
        (52, "-", 17, "12-7=5, 5-1-1=3. \\boxed{35}"),
        (50, "-", 45, "10-5=5, 5-4-1=0. \\boxed{5}"),
        (9, "-", 9, "9-9=0. \\boxed{0}"),
    ],
)
def test_column_working(a, op, b, expected):
    assert column_working(a, op, b) == expected


def test_every_generated_problem_is_worked_correctly():
    for question in generate_arithmetic(500, "train", seed=0, max_digits=2):
        _, a, op, b = question.question.rstrip("?").rsplit(" ", 3)
        assert answers_match(extract_boxed(column_working(int(a), op, int(b))), question.answers[0])


def test_demonstrations_are_imperfect_as_configured():
    config = load_config(
        ROOT / "configs" / "math_tiny.yaml", ["warmstart.wrong_fraction=0.3", "warmstart.verdict_noise=0.1"]
    )
    questions = generate_arithmetic(2000, "train", seed=0)
    demos = math_demonstrations(questions, config, np.random.default_rng(0))
    by_prompt = {prompt: response for prompt, response in demos["solver"] if prompt.count("Solver:") == 1}
    wrong = sum(
        not answers_match(extract_boxed(response) or "", q.answers[0])
        for q, response in zip(questions, by_prompt.values(), strict=True)
    )
    assert 0.25 < wrong / len(questions) < 0.35
    verdicts = [response for _, response in demos["verifier"]]
    assert len(verdicts) == len(questions) and set(verdicts) == {"<verify>approve</verify>", "<verify>reject</verify>"}
    # Every rejection is followed by a correct second attempt that saw the rejection.
    seconds = [(p, r) for p, r in demos["solver"] if "Verifier: <verify>reject</verify>" in p]
    assert len(seconds) == verdicts.count("<verify>reject</verify>")


def test_questions_without_a_worked_solution_have_no_demonstrations():
    config = load_config(ROOT / "configs" / "math_tiny.yaml")
    with pytest.raises(ValueError, match=r"Fermat's last theorem\.\": it has no worked solution"):
        math_demonstrations(
            [Question("q", "Prove Fermat's last theorem.", ("x",), "t")], config, np.random.default_rng(0)
        )


def test_worked_solutions_become_demonstrations_in_the_asked_format():
    """A GSM8K file's and the generated word problems' worked solutions teach the Solver its
    steps without the calculator notes, then the boxed answer; the wrong first attempts box
    another number and the Verifier is shown both."""
    config = load_config(
        ROOT / "configs" / "math_tiny.yaml",
        [f"data.train={ROOT / 'tests/data/gsm8k_style_train.jsonl'}", "warmstart.wrong_fraction=0.5"],
    )
    questions = load_math_questions(config.data.train, "train", config.data, 0)
    assert all(question.solution for question in questions)
    right, value = solution_demonstration(questions[0])
    assert "<<" not in right and right.endswith(f"The answer is \\boxed{{{questions[0].answers[0]}}}.")
    assert value == int(questions[0].answers[0])
    demos = math_demonstrations(questions, config, np.random.default_rng(0))
    firsts = [response for prompt, response in demos["solver"] if "Verifier:" not in prompt]
    graded = [answers_match(extract_boxed(r) or "", q.answers[0]) for q, r in zip(questions, firsts, strict=True)]
    assert 0 < graded.count(False) < len(questions)
    assert {r.rpartition("\\boxed")[0] for r in firsts} <= {
        solution_demonstration(q)[0].rpartition("\\boxed")[0] for q in questions
    }
    words = generate_word_problems(50, "train", seed=3)
    for question in words:
        worked, value = solution_demonstration(question)
        assert value == int(question.answers[0]) and extract_boxed(worked) == question.answers[0]


SMALL_WORLD = "data.generated_train_size=1200"


def _search_demos(*overrides: str):
    config = load_config(ROOT / "configs" / "search_tiny.yaml", [SMALL_WORLD, *overrides])
    passages, train, _ = generated_facts(config.data, config.experiment.seed)
    retriever = Retriever.build(passages)
    return config, train, search_demonstrations(train, config, retriever, np.random.default_rng(0))


def test_every_question_has_a_plan_that_finds_its_answer():
    """Following each question's queries, hop by hop, brings the gold answer into the
    retrieved passages: the Search demonstrations teach queries that work."""
    config = load_config(ROOT / "configs" / "search_tiny.yaml", [SMALL_WORLD])
    passages, train, evaluation = generated_facts(config.data, config.experiment.seed)
    retriever = Retriever.build(passages)
    plans = demonstration_queries(config.data, config.experiment.seed)
    for question in train[:300] + evaluation[:60]:
        plan = plans[question.qid]
        assert len(plan) == (2 if question.data_source == "facts-2hop" else 1)
        found = [
            passage.text for query in plan for passage in retriever.search([query], config.task.retrieval_top_k)[0]
        ]
        assert any(question.answers[0] in text for text in found[-config.task.retrieval_top_k :]), (
            question,
            plan,
            found,
        )


def test_perfect_search_demonstrations_answer_every_question():
    """With no noise, every episode routes no until its hops are searched, then answers
    the gold answer; a two-hop question takes three turns."""
    config, train, demos = _search_demos("warmstart.wrong_fraction=0", "warmstart.verdict_noise=0")
    answers = [
        response.removeprefix("<think></think><answer>").removesuffix("</answer>") for _, response in demos["answer"]
    ]
    assert len(answers) == len(train)
    assert all(exact_match(answer, q.answers) for answer, q in zip(answers, train, strict=True))
    two_hop = sum(q.data_source == "facts-2hop" for q in train)
    assert len(demos["search"]) == len(train) + two_hop
    assert len(demos["verifier"]) == 2 * len(train) + two_hop
    assert all(response.startswith("<think></think><search>") for _, response in demos["search"])
    assert all("History:" in prompt for prompt, _ in demos["answer"])


def test_search_demonstrations_are_imperfect_as_configured():
    config, train, demos = _search_demos("warmstart.wrong_fraction=0.3", "warmstart.verdict_noise=0.1")
    answered = [(prompt, response) for prompt, response in demos["answer"]]
    by_question = {q.question: q for q in train}
    right = sum(
        exact_match(
            response.removeprefix("<think></think><answer>").removesuffix("</answer>"),
            by_question[prompt.split("\n", 1)[0].removeprefix("Question: ")].answers,
        )
        for prompt, response in answered
    )
    # wrong answers: 30% on purpose, plus early answers without the passage
    assert 0.55 < right / len(answered) < 0.7
    # noisy routes: some episodes end without an answer, some answer at the first turn
    assert len(train) * 0.9 < len(answered) < len(train)
    assert any("History:" not in prompt for prompt, _ in answered)


def test_a_hesitant_router_runs_out_of_turns_without_answering_early():
    """hesitation 0.5, no other noise, three turns: the router never answers before the
    passages are in, and once they are it says "no" half the time. A one-hop question is
    answered at turn 2 or 3 (1 - 0.5^2 = 75%), a two-hop one only at turn 3 (50%); four in
    six questions are one-hop: 2/3 of the episodes reach an answer, all of them informed.
    The Answer agent is shown an answer at every state it could answer from (one-hop:
    turns 2 and, after a "no", 3, i.e. 1.5 per question; two-hop: turn 3 only)."""
    config, train, demos = _search_demos("warmstart.verdict_noise=0", "warmstart.hesitation=0.5", "task.max_turns=3")
    answered = sum(response == "<verify>yes</verify>" for _, response in demos["verifier"])
    assert 0.6 < answered / len(train) < 0.73
    assert all("History:" in prompt for prompt, _ in demos["answer"])
    assert 1.2 < len(demos["answer"]) / len(train) < 1.45


def test_questions_outside_the_generated_world_have_no_demonstrations():
    config = load_config(ROOT / "configs" / "search_tiny.yaml", [SMALL_WORLD])
    retriever = Retriever.build(generated_facts(config.data, config.experiment.seed)[0])
    with pytest.raises(ValueError, match="only generated:facts"):
        search_demonstrations(
            [Question("nq-1", "Who wrote Hamlet?", ("Shakespeare",), "nq")], config, retriever, np.random.default_rng(0)
        )


@pytest.mark.slow
def test_warm_start_trains_each_worker_group_reproducibly(tmp_path, monkeypatch):
    """Both groups are fine-tuned into their own artifacts, once in parallel processes and
    once in this process, in turn (a warm start of a few steps): the same seed gives the
    same weights either way, whatever order the processes finish in."""
    import torch
    from helpers import TINY_OVERRIDES

    from drmas.infra.store import Store
    from drmas.stages import warmstart as W
    from drmas.stages.policies import init_policies

    weights = []
    for attempt, in_process_steps in (("processes", 2), ("in turn", 3)):
        monkeypatch.setattr(W, "IN_PROCESS_STEPS", in_process_steps)
        config = load_config(
            ROOT / "configs" / "math_tiny.yaml",
            [*TINY_OVERRIDES, "warmstart.steps=3", f"store.root={tmp_path / attempt}"],
        )
        store = Store.from_config(config.store)
        threads = torch.get_num_threads()
        warmed = W.warmstart(config, store, "r", init_policies(config, store, "r"))
        assert torch.get_num_threads() == threads  # this process's threads are given back
        assert sorted(warmed) == ["solver", "verifier"]
        for wg, ref in warmed.items():
            metrics = store.open(ref.artifact).read_json("metrics.json")
            assert metrics["warmstart/demonstrations"] > 0 and np.isfinite(metrics["warmstart/loss"])
            assert store.open(ref.artifact).read_bytes("model.safetensors") != store.open(
                f"math-tiny/r/init/policy/{wg}"
            ).read_bytes("model.safetensors")
        weights.append({wg: store.open(ref.artifact).read_bytes("model.safetensors") for wg, ref in warmed.items()})
    assert weights[0] == weights[1]


@pytest.mark.parametrize(
    ("omp_num_threads", "expected"),
    [("3", 3), ("1", 1), (None, "cores"), ("", "cores"), ("0", "cores"), ("four", "cores"), ("-2", "cores")],
)
def test_the_cpu_threads_are_omp_num_threads_when_it_is_a_positive_number(omp_num_threads, expected, monkeypatch):
    """A test runner or a second job on the machine sets OMP_NUM_THREADS; anything else
    there (unset, empty, zero, not a number) means every core."""
    import os

    from drmas.infra.cpus import cpu_threads
    from drmas.stages import warmstart as W

    if omp_num_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    threads = os.cpu_count() if expected == "cores" else expected
    assert cpu_threads() == threads
    assert W._thread_share(2) == max(1, threads // 2)  # each of two groups warm-starting at once
