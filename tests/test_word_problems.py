"""The generated GSM8K-style word problems: right answers, disjoint splits, their worked
solutions in GSM8K's form, and the config that names them."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from drmas.config import load_config
from drmas.stages.rollout import task_questions
from drmas.tasks.math import load_math_questions
from drmas.tasks.word_problems import WORD_PROBLEM_TEMPLATES, generate_word_problems

ROOT = Path(__file__).parent.parent
STEP = re.compile(r"<<(\d+)([+\-*/])(\d+)=(\d+)>>")


def _arithmetic_of(solution: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(b), int(c)) for a, op, b, c in STEP.findall(solution)]


def test_every_worked_solution_computes_its_answer():
    """Each step's calculator note is right, each step uses the numbers before it, and the
    last one's value is the gold answer after ``####``."""
    questions = generate_word_problems(600, "train", seed=0) + generate_word_problems(200, "eval", seed=0)
    for question in questions:
        steps = _arithmetic_of(question.solution)
        assert 1 <= len(steps) <= 2, question
        for a, op, b, c in steps:
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] == c and (op != "/" or a % b == 0)
        assert steps[-1][3] == int(question.answers[0]) >= 0
        assert question.solution.endswith(f"#### {question.answers[0]}")
        numbers_in_question = {int(n) for n in re.findall(r"\d+", question.question)}
        first_a, _, first_b, _ = steps[0]
        assert {first_a, first_b} <= numbers_in_question, question


def test_splits_are_disjoint_and_seeded():
    train = generate_word_problems(1500, "train", seed=0)
    evaluation = generate_word_problems(300, "eval", seed=1)
    arithmetic = {tuple(_arithmetic_of(q.solution)) for q in train}
    assert not arithmetic & {tuple(_arithmetic_of(q.solution)) for q in evaluation}
    assert len({q.question for q in train}) == 1500
    assert generate_word_problems(40, "eval", seed=1) == evaluation[:40]
    assert generate_word_problems(40, "eval", seed=2) != evaluation[:40]
    kinds = Counter(q.data_source for q in train)
    assert set(kinds) == {f"word-{t.name}" for t in WORD_PROBLEM_TEMPLATES}
    two_step = sum(len(_arithmetic_of(q.solution)) == 2 for q in train)
    assert 0.4 < two_step / len(train) < 0.7


def test_the_config_names_them_and_sizes_them():
    config = load_config(
        ROOT / "configs" / "math_tiny.yaml",
        ["data.train=generated:word_problems", "data.generated_train_size=64", "data.eval=generated:word_problems"],
    )
    train = load_math_questions(config.data.train, "train", config.data, config.experiment.seed)
    assert len(train) == 64 and all(q.solution and q.qid.startswith("word-train-") for q in train)
    with pytest.raises(ValueError, match="unknown generated set 'word_problem'; known: arithmetic, word_problems"):
        load_math_questions("generated:word_problem", "train", config.data, 0)


def test_data_seed_holds_the_questions_still_while_the_experiment_seed_varies():
    """Unset, ``data.seed`` follows ``experiment.seed`` (each seed of a comparison draws its
    own questions); set, every experiment seed trains and is evaluated on the same ones."""
    word_problems = ["data.train=generated:word_problems", "data.eval=generated:word_problems"]
    sizes = ["data.generated_train_size=40", "data.generated_eval_size=20"]

    def questions(*overrides: str) -> dict[str, list[str]]:
        config = load_config(ROOT / "configs" / "math_tiny.yaml", [*word_problems, *sizes, *overrides])
        return {split: [q.question for q in task_questions(config, split)] for split in ("train", "eval")}

    assert questions("experiment.seed=1") != questions("experiment.seed=2")
    assert questions("experiment.seed=1") == questions("experiment.seed=5", "data.seed=1")
    held = questions("experiment.seed=1", "data.seed=3")
    assert held == questions("experiment.seed=2", "data.seed=3") != questions("experiment.seed=3", "data.seed=4")


def test_an_impossible_size_is_refused():
    with pytest.raises(
        ValueError, match="could not draw 1000000 distinct train problems .the split holds about [0-9]+.: ask for fewer"
    ):
        generate_word_problems(1_000_000, "train", seed=0)
