"""The reference's math grader (``task.grader: reference``; issue 31 §4): its rules one by
one, its behaviour on hostile answers, and its agreement with people and with drmas's own
grader on the labelled corpus (tests/data/math_grading_pairs.jsonl, 250 pairs)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from drmas.config import load_config
from drmas.tasks import Question, grading
from drmas.tasks.math import MathOrchestra, math_reward
from drmas.tasks.reference_grading import grade_answer_reference, mathd_normalize, sympy_normalize
from drmas.team.episodes import Episode
from drmas.team.orchestras import Tools

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "math_grading_pairs.jsonl"


@pytest.mark.parametrize(
    ("predicted", "gold", "right"),
    [
        # Rule 1, Hendrycks normalisation: units after "\text{ ", dfrac, bare fractions and
        # roots, 0.5, a/b, a short name on the left of "=", percent signs.
        ("72 \\text{ clips}", "72", True),
        ("\\dfrac{3}{4}", "3/4", True),
        ("\\frac12", "\\frac{1}{2}", True),
        ("0.5", "\\frac{1}{2}", True),
        ("x = 5", "5", True),
        ("10\\%", "10", True),
        # Rule 2, sympy element by element: equal values, but an integer gold answer needs
        # the integer and an unreduced gold fraction needs that fraction; order and
        # brackets count.
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("x+1", "1+x", True),
        ("1,000", "1000", True),
        ("080", "80", True),
        ("5.0", "5", True),
        ("\\frac{10}{2}", "5", False),
        ("2^{10}", "1024", False),
        ("\\frac{1}{2}", "\\frac{2}{4}", False),
        ("(1,2)", "(2,1)", False),
        ("[1,2)", "(1,2)", False),
        ("(1,2)", "(1,2)", True),
        ("37+48", "85", False),
    ],
)
def test_the_references_rules(predicted, gold, right):
    assert grade_answer_reference(predicted, gold) is right


def test_the_normalisations():
    assert mathd_normalize("\\left( \\frac12, .5 \\right)") == "(\\frac{1}{2},0.5)"
    assert mathd_normalize("\\$4.50") == "4.50" and mathd_normalize("90^\\circ") == "90"
    assert sympy_normalize("\\text{5 million}") == "5*10^6"
    assert sympy_normalize("\\mathbf{007}") == "7" and sympy_normalize("12 meters") == "12"


@pytest.mark.parametrize("hostile", ["9" * 8000, "2^{2^{2^{2^{20}}}}", "(" * 5000 + "1" + ")" * 5000, "x" * 20000])
def test_a_hostile_answer_is_graded_wrong_quickly(hostile):
    started = time.perf_counter()
    assert grade_answer_reference(hostile, "7", timeout_s=1.0) is False
    assert time.perf_counter() - started < 3.0


def test_the_paper_recipes_grade_by_the_references_rules():
    """``task.grader: reference`` reaches the reward: a power for an integer answer is wrong
    by the reference's rules and right by drmas's."""
    question = Question("q", "How many subsets?", ("1024",), "test")
    episode = Episode("u", "t", 0, question, final_answer="\\boxed{2^{10}}")
    drmas_rules = MathOrchestra(load_config(ROOT / "configs" / "math_tiny.yaml").task, Tools())
    assert drmas_rules.reward(episode) == 1.0
    recipe = load_config(ROOT / "configs" / "math_qwen3_4b_gpu.yaml", ["experiment.epochs=null"])
    assert (recipe.task.grader, recipe.task.parsing) == ("reference", "reference")
    assert MathOrchestra(recipe.task, Tools()).reward(episode) == 0.0


@pytest.mark.slow
def test_both_graders_on_the_labelled_corpus(monkeypatch, capsys):
    """The figures issue 31 §4 asks for, printed, with floors under them: each grader's
    agreement with the labels (answers read by drmas's extraction, so that the graders alone
    differ, and by the reference's, a last box only) and the graders' agreement with each
    other. The reference's rules score one wrong answer right (gsm8k-022, a hedged
    ``42 \\text{ or } 43``: Hendrycks's unit rule cuts everything from ``\\text{ `` on)."""
    monkeypatch.setattr(grading, "FALLBACK_TIMEOUT_S", 30.0)  # the machine's load is not the grader's
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines()]

    def graded(parsing: str, grader: str) -> dict[str, bool]:
        return {
            row["id"]: math_reward(row["response"], Question(row["id"], "?", (row["gold"],), "x"), parsing, grader)
            == 1.0
            for row in rows
        }

    label = {row["id"]: row["label"] for row in rows}
    drmas_grader, reference_grader = graded("drmas", "drmas"), graded("drmas", "reference")
    reference_whole = graded("reference", "reference")

    def agreement(verdicts: dict[str, bool], other: dict[str, bool]) -> int:
        return sum(verdicts[key] == other[key] for key in verdicts)

    figures = {
        "drmas grader vs people": agreement(drmas_grader, label),
        "reference grader vs people": agreement(reference_grader, label),
        "reference parsing and grader vs people": agreement(reference_whole, label),
        "reference grader vs drmas grader": agreement(reference_grader, drmas_grader),
    }
    with capsys.disabled():
        print("\n" + "\n".join(f"{name}: {count}/{len(rows)}" for name, count in figures.items()))
    assert figures["drmas grader vs people"] >= 0.99 * len(rows)
    assert figures["reference grader vs people"] >= 0.85 * len(rows)
    assert figures["reference parsing and grader vs people"] >= 0.80 * len(rows)
    assert [key for key, right in reference_grader.items() if right and not label[key]] == ["gsm8k-022"]
