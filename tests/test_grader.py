"""drmas.tasks.grading: agreement with people on a labelled corpus, the forms issue 18 found
graded wrong, hostile answers, the deadline in any thread, and the final-answer extraction
(a box, or DAPO's ``Answer:`` line).

The corpus (tests/data/math_grading_pairs.jsonl) holds responses in GSM8K, MATH, DAPO and
AIME forms with their gold answers (as ``Question.answers`` holds them) and a person's
label: is the final answer right? Labels follow what the graders of those sets ask: a
calculation left unevaluated (``37+48``) or a decimal approximation of an exact answer is
not an answer; units, notation and order of a list do not matter.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from drmas.tasks import Question, grading
from drmas.tasks.grading import answers_match, clean_answer, grade_answer, normalize_answer
from drmas.tasks.math import math_reward
from drmas.team.agents import SolverAgent, extract_final_answer

CORPUS = Path(__file__).parent / "data" / "math_grading_pairs.jsonl"
SOURCES = {"gsm8k", "math", "dapo", "aime"}


def _corpus() -> list[dict]:
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    for row in rows:
        assert set(row) == {"id", "source", "response", "gold", "label", "why"}, row["id"]
        assert row["source"] in SOURCES and isinstance(row["label"], bool) and row["gold"], row["id"]
    return rows


@pytest.fixture
def patient_deadline(monkeypatch):
    """A deadline no comparison of the corpus reaches on a loaded machine, so that the
    agreement figure measures the grader, not the machine (the deadline has its own tests)."""
    monkeypatch.setattr(grading, "FALLBACK_TIMEOUT_S", 30.0)


# --------------------------------------------------------------------------------------
# Agreement with people
# --------------------------------------------------------------------------------------


def test_the_corpus_covers_every_form_with_right_and_wrong_answers():
    rows = _corpus()
    assert len(rows) >= 150
    assert len({row["id"] for row in rows}) == len(rows)
    counts = Counter((row["source"], row["label"]) for row in rows)
    assert all(counts[source, label] >= 10 for source in SOURCES for label in (True, False)), counts
    assert sum(row["why"].startswith("hostile") for row in rows) >= 20


@pytest.mark.slow
def test_the_grader_agrees_with_people_and_never_scores_a_wrong_answer_right(patient_deadline):
    rows = _corpus()
    graded = {
        row["id"]: math_reward(row["response"], Question(row["id"], "?", (row["gold"],), row["source"])) for row in rows
    }
    wrong_scored_right = [row["id"] for row in rows if graded[row["id"]] == 1.0 and not row["label"]]
    disagreements = [row["id"] for row in rows if (graded[row["id"]] == 1.0) != row["label"]]
    assert wrong_scored_right == []
    assert len(disagreements) <= 0.05 * len(rows), disagreements
    for source in SOURCES:  # not carried by one easy form
        of_source = [row for row in rows if row["source"] == source]
        agreed = sum((graded[row["id"]] == 1.0) == row["label"] for row in of_source)
        assert agreed >= 0.9 * len(of_source), source


@pytest.mark.slow
def test_sympys_text_parser_only_ever_sees_number_tokens(monkeypatch, patient_deadline):
    """math-verify's expression extraction reads free text with sympy ``parse_expr``, which
    evaluates; the grader uses its LaTeX reading only. There, latex2sympy turns each number
    token of the ANTLR lexer into ``sympy.Number(token)``, which goes through ``parse_expr``:
    every call, recorded while the corpus is graded from empty caches, must be such a token."""
    import latex2sympy2_extended.latex2sympy2 as latex2sympy
    import math_verify.parser
    import sympy.parsing.sympy_parser

    parse_expr, seen = sympy.parsing.sympy_parser.parse_expr, []

    def recording(text, *args, **kwargs):
        seen.append(text)
        return parse_expr(text, *args, **kwargs)

    for module in (math_verify.parser, latex2sympy, sympy.parsing.sympy_parser):
        monkeypatch.setattr(module, "parse_expr", recording)
    grading._verify.cache_clear()
    grading._parsed.cache_clear()
    for row in _corpus():
        math_reward(row["response"], Question(row["id"], "?", (row["gold"],), row["source"]))
    assert grading._verify.cache_info().misses >= 40  # the control: the fallback did read the pairs
    assert seen  # the control: the recorder is in the path
    assert all(re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", text) for text in seen), sorted(set(seen))


# --------------------------------------------------------------------------------------
# The forms issue 18 found graded wrong, and a person's rules
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),  # "\\ " kept whole
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}2\\1\end{pmatrix}", False),
        (r"18\text{ dollars}", "18", True),
        (r"90 \text{ degrees}", "90", True),
        ("18 dollars", "18", True),
        (r"5\text{ or more}", "5", False),  # a word that changes the number is no unit
        ("2t", "2", False),  # math-verify's unit list would drop "t"
        ("3 ab", "3", False),
        (r"2\mathrm{i}", "2", False),
        ("\u22125", "-5", True),  # Unicode minus
        ("3, 5", "5, 3", True),
        ("3, 5", "3", False),
        ("x=5, y=3", "(5,3)", True),
        ("(3,5)", "(5,3)", False),
        (r"\{1,2\}", "1, 2", True),
        (r"(-\infty, 2)", r"(-\infty,2]", False),
        (r"2\sqrt2", r"\sqrt8", True),
        (r"2\sqrt2", r"\sqrt6", False),
        (r"\pi/2", r"\frac{\pi}{2}", True),
        (r"2^{10}", "1024", True),
        (r"2^{9}", "1024", False),
        ("1+2x", "2x+1", True),
        ("1+2x", "2x-1", False),
        (r"1\frac12", r"\frac32", True),
        (r"1.5\times10^{3}", "1500", True),
        (r"\mathbf{7}", "7", True),
        (r"\displaystyle\frac12", "0.5", True),
        (r"\text{(C)}", "C", True),
        (r"\text{(B)}", "C", False),
        ("37+48", "85", False),  # a calculation is not its result
        (r"6 \times 7", "42", False),
        ("37+48=85", "85", True),  # an equation answers with its last side
        ("84=85", "85", False),
        ("1.414", r"\sqrt{2}", False),  # an approximation is not the exact answer
        ("0.3333333", r"\frac13", False),
        (r"50\%", "0.5", False),
        ("033", "33", True),
        (r"\text{east}", r"\text{seat}", False),
        ("", "0", False),
    ],
)
def test_grade_answer(predicted, gold, expected, patient_deadline):
    assert grade_answer(predicted, gold) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
        (r"18\text{ dollars}", "18"),
        (r"5 \text{cm}^2", "5"),
        (r"4 \pi \text{ square units}", r"4\pi"),
        ("\u22125", "-5"),
        (r"\mathbf{7}", "7"),
        (r"\textbf{(C)}", "(C)"),
        (r"\displaystyle \frac{1}{2}", r"\frac{1}{2}"),
        (r"1\quad 2", "12"),
        (r"\varnothing", r"\emptyset"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_clean_answer_keeps_the_spaces_latex_needs():
    assert clean_answer(r"\pi r^2 \text{ cm}^2") == r"\pi r^2"
    assert clean_answer("  3,\n 5 ") == "3, 5"


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("3,5", "5, 3", True),  # lists of numbers are unordered
        (r"\{1,2\}", "2,1", True),
        ("(1,2)", "(2,1)", False),  # tuples and intervals are ordered, brackets must agree
        ("[1,2)", "[1,2]", False),
        (r"(-\infty,2]", r"\left(-\infty, 2\right]", True),
        (r"\text{(C)}", "C", True),
        (r"2\sqrt2", r"\sqrt8", False),  # the exact path alone does not do algebra
    ],
)
def test_answers_match_is_the_exact_path(predicted, gold, expected):
    assert answers_match(predicted, gold) is expected


# --------------------------------------------------------------------------------------
# Hostile answers: quick, False, nothing run
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        (r"10^{10^{10}}", "1"),
        (r"2^3^4^5", "1"),
        (r"((2^{1000})^{1000})^{1000}", "2"),
        (r"9^{999999}", "1"),
        (r"\binom{100000}{50000}", "7"),
        ("100000!", "3"),
        (r"\Gamma(10^{6})", "3"),
        ("(99999)_{5000}", "3"),
        (r"\sum_{n=1}^{10^{9}} n", "5"),
        (r"\int_0^1 x\,dx", r"\frac12"),
        ("{" * 50_000 + "8" + "}" * 50_000, "7"),
        (r"\sqrt{" * 20_000 + "2" + "}" * 20_000, "2"),
        ("9" * 200_000, "9"),
        ("x" * 200_000, "x"),
        ("1+" * 100_000 + "1", "100001"),
        ("1," * 100_000 + "1", "1"),
        ("1=" * 100_000 + "1", "1"),
        ("{" * 500 + "8" + "}" * 500, "7"),
        ("1=" * 200 + "1", "1"),
        (r"\frac{1}{" * 100 + "2" + "}" * 100, r"\frac12"),
        ("84=84=84=84=84=85", "85"),
        ("((5!)!)!", "1"),
        ("8\u200b5", "85"),
        ("\uff18\uff15", "85"),
        (r"\frac{1}{0}", "0"),
    ],
    ids=lambda value: value[:24],
)
def test_hostile_answers_are_refused_quickly(answer, gold):
    """(Reading a box of 200,000 characters is extract_boxed's share of the second.)"""
    started = time.perf_counter()
    assert grade_answer(answer, gold) is False
    assert math_reward(rf"\boxed{{{answer}}}", Question("q", "?", (gold,), "t")) == 0.0
    assert time.perf_counter() - started < 1.0


def test_a_huge_answer_is_not_even_read():
    started = time.perf_counter()
    assert grade_answer("9" * 10_000_000, "9") is False
    assert time.perf_counter() - started < 0.05
    assert grade_answer("9" * 5000, "9" * 5000) is True  # the control: as long as its gold answer, it is read


@pytest.mark.parametrize(
    "payload",
    [
        "__import__('os').system('touch {marker}')",
        "eval(\"open('{marker}', 'w')\")",
        r"\input{{marker}}",
        r"\def\x{\x}\x",
        "$(touch {marker}) `touch {marker}`",
    ],
)
def test_answers_are_never_run(payload, tmp_path):
    marker = tmp_path / "pwned"
    answer = payload.replace("{marker}", str(marker))
    assert grade_answer(answer, "85") is False
    assert math_reward(f"Working.\nAnswer: {answer}", Question("q", "?", ("85",), "t")) == 0.0
    assert not marker.exists()


# --------------------------------------------------------------------------------------
# The deadline, in any thread
# --------------------------------------------------------------------------------------

SLOW = (r"(a+b+c+d+e)^{20}", "a^{20}+e^{20}")
"""Passes every guard (small powers, short) and keeps sympy busy for minutes: it expands."""


def test_a_slow_comparison_is_stopped_at_its_deadline_and_frees_the_worker():
    grade_answer("x+1", "1+x")  # the worker is started (its start-up is not under the deadline)
    started = time.perf_counter()
    assert grade_answer(*SLOW, timeout_s=0.2) is False
    assert time.perf_counter() - started < 1.0
    started = time.perf_counter()
    assert grade_answer(r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt2}", timeout_s=30) is True
    assert time.perf_counter() - started < 5.0  # the slow job was stopped, not left running ahead
    assert grading._worker()._thread.is_alive()


def test_a_dropped_deadline_is_not_reported_but_other_unraisables_are(monkeypatch):
    """A deadline that lands in a weakref callback is dropped by Python and handed to
    ``sys.unraisablehook`` (in CI, pytest's hook made it an error of an unrelated test).
    Only the deadline is kept quiet: a ValueError raised the same way still reaches the
    hook that was in place before."""
    reported: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.exc_value))
    grading.quiet_dropped_deadlines()
    grading.quiet_dropped_deadlines()  # wrapped once, not twice

    class Target:
        pass

    for error in (grading._Deadline, ValueError):

        def raise_it(_ref: object, error: type[BaseException] = error) -> None:
            raise error("from a weakref callback")

        target = Target()
        kept = weakref.ref(target, raise_it)
        del target
        gc.collect()
        assert kept() is None
    assert [type(exc) for exc in reported] == [ValueError]


def test_a_deadline_the_job_drops_is_raised_again_until_the_job_stops(monkeypatch):
    """The deadline's exception can land where Python drops it: in a weakref callback that
    the garbage collector runs on the worker thread (SQLAlchemy's, in a CI run whose worker
    had tracked runs before). Here a job drops the first two on purpose; the watchdog
    raises it again, with no caller waiting, until the job stops."""
    grade_answer("x+1", "1+x")  # the worker is started before its comparison is replaced
    dropped: list[float] = []
    stopped = threading.Event()

    def stubborn_or_quick(predicted: str, gold: str) -> bool:
        if predicted != "stubborn":
            return True
        while True:
            try:
                while True:
                    time.sleep(0.001)
            except grading._Deadline:
                dropped.append(time.perf_counter())
                if len(dropped) == 3:
                    stopped.set()
                    raise

    started = time.perf_counter()
    assert grading.bounded(stubborn_or_quick, "stubborn", "x", timeout_s=0.2) is False
    assert time.perf_counter() - started < 1.0
    assert stopped.wait(timeout=5.0)
    assert len(dropped) == 3
    started = time.perf_counter()
    assert grading.bounded(stubborn_or_quick, "quick", "x", timeout_s=5.0) is True
    assert time.perf_counter() - started < 1.0


def test_grading_works_outside_the_main_thread():
    """math-verify's own timeout (signal.alarm) raises there; the grader's does not."""
    pairs = [(r"2\sqrt2", r"\sqrt8", True), ("3, 5", "5, 3", True), ("1+2x", "2x-1", False), ("7", "7", True)] * 10
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda pair: grade_answer(pair[0], pair[1], timeout_s=30), pairs))
    assert results == [expected for _, _, expected in pairs]
    assert threading.current_thread() is threading.main_thread()


def test_concurrent_callers_each_wait_at_most_their_deadline():
    grade_answer("x+1", "1+x")
    with ThreadPoolExecutor(max_workers=4) as pool:
        started = time.perf_counter()
        results = list(pool.map(lambda n: grade_answer(f"(a+b+c+d+e)^{{{20 + n}}}", "a", timeout_s=0.3), range(4)))
    assert results == [False] * 4
    assert time.perf_counter() - started < 2.0


def _grade_in_child(queue) -> None:
    queue.put(grade_answer(r"2\sqrt2", r"\sqrt8", timeout_s=30))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_starts_its_own_worker():
    grade_answer("x+1", "1+x")  # the parent's worker thread does not survive a fork
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_grade_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=60) is True
    child.join(timeout=60)
    assert child.exitcode == 0


# --------------------------------------------------------------------------------------
# The final answer: a box, or DAPO's Answer line
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so it is 34.\nAnswer: 34", "34"),
        ("so it is 34.\n\nAnswer: $34$\n\n", "34"),
        ("**Answer:** 34", "34"),
        ("**Final Answer**: 34", "34"),
        ("answer: \\(34\\)", "34"),
        ("Answer:", ""),
        ("Answer: 34\nI hope this helps.", None),  # not on the last line
        ("The answer is 34.", None),
        ("Answer: 35 \\boxed{34}", "34"),  # a box decides first
        ("\\boxed{34}\nAnswer: 35", "34"),
        ("<think>\nAnswer: 35\n</think>\nAnswer: 34", "34"),
        ("<think>\nAnswer: 35\n</think>", None),  # the thoughts are no answer
        ("\\boxed{3", None),  # a box cut off decides: nothing
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "valid"),
    [
        ("The count is 34.\nAnswer: 34", True),
        ("The count is \\boxed{34}.", True),
        ("The count is 34.", False),
        ("Answer: 3\u200b4", False),  # a hidden character in the answer
        ("Answer: " + "9" * 100_000, True),  # well-formed, and quick to read (graded wrong)
    ],
)
def test_the_solver_accepts_dapos_answer_line(response, valid):
    started = time.perf_counter()
    assert SolverAgent().parse(response).is_valid is valid
    assert time.perf_counter() - started < 1.0


def test_a_dapo_response_that_obeys_its_prompt_is_rewarded():
    question = Question(
        "q", "... The last line of your response should be of the form Answer: $Answer", ("34",), "dapo"
    )
    assert math_reward("Checking the cases gives 34.\nAnswer: 34", question) == 1.0
    assert math_reward("Checking the cases gives 35.\nAnswer: 35", question) == 0.0


def test_an_orchestra_starts_the_grader_in_the_background():
    """A stage's process (a Kubeflow task is a fresh one) starts math-verify's worker when
    its orchestra is made, off the main thread, so the import overlaps the generations."""
    probe = """
import sys, threading, time
from drmas.config import TaskConfig
from drmas.tasks import grading
from drmas.tasks.math import MathOrchestra
assert "math_verify" not in sys.modules and grading._the_worker is None
MathOrchestra(TaskConfig(name="math"), tools=None)
assert "drmas-grader-start" in [t.name for t in threading.enumerate()]
deadline = time.monotonic() + 60
while grading._the_worker is None and time.monotonic() < deadline:
    time.sleep(0.05)
assert grading._the_worker is not None and "math_verify" in sys.modules
assert grading.grade_answer("\\\\frac{6}{2}", "3")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
