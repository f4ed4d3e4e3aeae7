"""drmas.tasks.math: boxed extraction, normalisation, the safe checker, generated and file data."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from drmas.config import DataConfig
from drmas.tasks import DataError, Question
from drmas.tasks.math import (
    answers_match,
    generate_arithmetic,
    load_math_questions,
    math_reward,
    normalize_answer,
)
from drmas.team.agents import extract_boxed

# --------------------------------------------------------------------------------------
# extract_boxed
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{a_{1} + {b}^{2}}", r"a_{1} + {b}^{2}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are content
        (r"\boxed{\left\{ x \right.}", r"\left\{ x \right."),  # even when unpaired
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last box wins
        (r"\boxed{\boxed{7}}", "7"),  # the innermost box starts last
        (r"\fbox{7}", "7"),
        (r"$\boxed 5$", "5"),  # bare token up to '$'
        (r"\boxed 12 apples", "12"),  # bare token up to a space
        (r"\boxed {3}", "3"),
        (r"\boxed{}", ""),
        ("no box here: 42", None),
        ("", None),
        (r"\boxed{1} and then \boxed{2", None),  # unclosed last box: no fallback
        (r"\boxedx{3}", None),  # not the \boxed command
        (r"\boxed", None),
        (r"<think>\boxed{1}</think> so \boxed{2}", "2"),
        (r"<think>\boxed{1}</think> I am not sure", None),  # boxes in the thoughts do not count
        (r"<think>a</think>\boxed{1}<think>b</think>\boxed{3}", "3"),  # after the last </think>
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_is_fast_on_huge_unbalanced_text():
    start = time.perf_counter()
    assert extract_boxed(r"\boxed{" + "{" * 100_000) is None
    assert extract_boxed("x" * 100_000 + r"\boxed{9}") == "9"
    assert time.perf_counter() - start < 0.5


# --------------------------------------------------------------------------------------
# normalize_answer and answers_match
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  $5$ ", "5"),
        (r"\text{(A)}", "(A)"),
        (r"\text{a{b}c}", "a{b}c"),  # nested braces inside the wrapper survive
        (r"\mbox{yes}", "yes"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\rightarrow", r"\rightarrow"),  # \right only as a whole command
        (r"1\!2\,3", "123"),
        ("5.", "5"),
        (r"45^\circ", "45"),
        (r"45^{\circ}", "45"),
        (r"10\%", "10"),
        (r"\$3", "3"),
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{72}", r"\frac{1}{72}"),
        (r"\frac{1}2", r"\frac{1}{2}"),
        (r"\sqrt3", r"\sqrt{3}"),
        ("1,000", "1000"),
        ("12,345,678", "12345678"),
        ("1{,}000", "1000"),
        ("1,2", "1,2"),  # a pair, not a thousands separator
        ("x = 3", "3"),
        (r"\theta = \pi", r"\pi"),
        ("y = 2x + 1", "2x+1"),
        ("a=b=c", "a=b=c"),  # not a single assignment
        ("0.5", "0.5"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("0.5", r"\frac{1}{2}", True),
        ("1/2", "0.5", True),
        ("85", "85.0", True),
        ("1,000", "1000", True),
        ("3", "4", False),
        (r"\sqrt{2}", r"\sqrt{2}", True),
        (r"\sqrt2", r"\sqrt{2}", True),
        (r"\sqrt{2}", r"\sqrt{3}", False),
        ("", "0", False),
        ("0", "", False),
        (" ", " ", False),
        (r"\dfrac{3}{4}", r"\frac34", True),
        (r"\frac{2}{4}", "0.5", True),  # same rational, unreduced
        (r"-\frac{1}{2}", "-0.5", True),
        (r"\frac{-1}{2}", "-1/2", True),
        (r"-\frac{1}{2}", "0.5", False),
        ("+3", "3", True),
        ("-0", "0", True),
        (".5", "1/2", True),
        ("0.1", "1/10", True),
        ("0.333", "1/3", False),
        ("1/0", "0", False),  # no ZeroDivisionError
        (r"50\%", "50", True),
        (r"50\%", r"\frac{1}{2}", False),  # a percentage is not a fraction
        ("50%", "0.5", False),
        ("x = 5", "5", True),
        (r"\text{(B)}", "(B)", True),
        (r"(1, 2)", r"\left(1,2\right)", True),
        ("(1,2)", "(2,1)", False),
        (r"2\sqrt{2}", r"\sqrt{8}", False),  # symbolic equality is out of scope
        (r"\pi", r"\pi", True),
        ("x", "y", False),
    ],
)
def test_answers_match(predicted, gold, expected):
    assert answers_match(predicted, gold) is expected


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('touch {marker}')",
        "eval(\"open('{marker}', 'w')\")",
        "2**10**10**10",
        "9" * 100_000,
        "1/" + "9" * 50_000,
        r"\frac{" * 30_000 + "1" + "}" * 30_000,
        r"\text{" * 30_000,
    ],
    ids=["import-os", "eval", "power-tower", "huge-int", "huge-fraction", "deep-frac", "deep-text"],
)
def test_answers_are_never_evaluated(hostile, tmp_path):
    marker = tmp_path / "pwned"
    answer = hostile.replace("{marker}", str(marker))
    start = time.perf_counter()
    assert answers_match(answer, "1024") is False
    assert math_reward(rf"\boxed{{{answer}}}", Question("q", "?", ("1024",), "t")) == 0.0
    assert time.perf_counter() - start < 1.0
    assert not marker.exists()


def test_answers_match_is_thread_safe():
    pairs = [("0.5", r"\frac{1}{2}", True), ("3", "4", False), ("1,000", "1000", True)] * 200
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda p: answers_match(p[0], p[1]), pairs))
    assert results == [expected for _, _, expected in pairs]


# --------------------------------------------------------------------------------------
# math_reward
# --------------------------------------------------------------------------------------

EIGHTY_FIVE = Question("q0", "What is 37 + 48?", ("85",), "arithmetic-2d")


@pytest.mark.parametrize(
    ("final_text", "question", "expected"),
    [
        (r"37 + 48 = \boxed{85}", EIGHTY_FIVE, 1.0),
        (r"\boxed{85.0}", EIGHTY_FIVE, 1.0),
        (r"\boxed{84}", EIGHTY_FIVE, 0.0),
        (r"\boxed{85} no wait \boxed{86}", EIGHTY_FIVE, 0.0),  # the last box counts
        (r"<think>\boxed{85}</think> 86", EIGHTY_FIVE, 0.0),  # no box after the thoughts
        ("85", EIGHTY_FIVE, 0.0),  # unboxed answers score nothing
        ("", EIGHTY_FIVE, 0.0),
        (None, EIGHTY_FIVE, 0.0),
        (r"\boxed{}", Question("q", "?", ("0",), "t"), 0.0),
        (r"\boxed{0.5}", Question("q", "?", ("2", r"\frac{1}{2}"), "t"), 1.0),  # any gold
        (r"\boxed{0.5}", Question("q", "?", (r"\boxed{\frac12}",), "t"), 1.0),  # boxed gold
    ],
)
def test_math_reward(final_text, question, expected):
    assert math_reward(final_text, question) == expected


# --------------------------------------------------------------------------------------
# generate_arithmetic
# --------------------------------------------------------------------------------------

PROBLEM = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


def _problem(question: Question) -> tuple[int, str, int]:
    match = PROBLEM.fullmatch(question.question)
    assert match, question.question
    return int(match.group(1)), match.group(2), int(match.group(3))


def _available(split: str, max_digits: int) -> int:
    """How many problems a split holds, read from the error that asking for too many gives."""
    with pytest.raises(DataError, match=r"only \d+ distinct") as error:
        generate_arithmetic(10**6, split, 0, max_digits)
    return int(re.search(r"only (\d+) distinct", str(error.value)).group(1))


def test_generated_questions_are_right_and_well_formed():
    questions = generate_arithmetic(300, "train", seed=3)
    assert [q.qid for q in questions] == [f"arith-train-{i}" for i in range(300)]
    for question in questions:
        a, op, b = _problem(question)
        assert question.answers == (str(a + b if op == "+" else a - b),)
        assert int(question.answers[0]) >= 0
        digits = len(str(a))
        assert len(str(b)) == digits
        assert question.data_source == f"arithmetic-{digits}d"
    assert len({q.question for q in questions}) == 300  # distinct


def test_generated_sets_are_deterministic_and_depend_on_the_seed():
    assert generate_arithmetic(50, "eval", seed=1) == generate_arithmetic(50, "eval", seed=1)
    assert generate_arithmetic(50, "eval", seed=1) != generate_arithmetic(50, "eval", seed=2)


def test_generated_levels_are_balanced():
    # 4 levels (1 and 2 digits, + and -); the smallest train level (1-digit differences,
    # about 4/5 of 55) holds more than 40, so 160 questions are 40 per level.
    questions = generate_arithmetic(160, "train", seed=0)
    levels = Counter((q.data_source, _problem(q)[1]) for q in questions)
    assert levels == {
        ("arithmetic-1d", "+"): 40,
        ("arithmetic-1d", "-"): 40,
        ("arithmetic-2d", "+"): 40,
        ("arithmetic-2d", "-"): 40,
    }
    three = Counter(q.data_source for q in generate_arithmetic(60, "eval", seed=0, max_digits=3))
    assert three == {"arithmetic-1d": 20, "arithmetic-2d": 20, "arithmetic-3d": 20}


def test_train_and_eval_splits_are_disjoint_and_cover_every_problem():
    # One digit: 10 * 10 sums and 10 * 11 / 2 = 55 differences with a >= b.
    n_train, n_eval = _available("train", 1), _available("eval", 1)
    assert n_train + n_eval == 155
    assert 0 < n_eval < n_train
    train = {_problem(q) for q in generate_arithmetic(n_train, "train", seed=0, max_digits=1)}
    evals = {_problem(q) for q in generate_arithmetic(n_eval, "eval", seed=0, max_digits=1)}
    assert not train & evals
    every = {(a, "+", b) for a in range(10) for b in range(10)}
    every |= {(a, "-", b) for a in range(10) for b in range(a + 1)}
    assert train | evals == every


def test_splits_stay_disjoint_across_seeds_and_sizes():
    train = {q.question for q in generate_arithmetic(3000, "train", seed=0)}
    evals = {q.question for q in generate_arithmetic(1000, "eval", seed=99)}
    assert not train & evals


def test_a_small_level_that_runs_out_leaves_its_share_to_the_others():
    every_one_digit = generate_arithmetic(_available("train", 1), "train", seed=0, max_digits=1)
    small = Counter(_problem(q)[1] for q in every_one_digit)  # ~80 sums, ~44 differences
    # 400 over 4 levels is 100 each; the 1-digit levels are smaller, so they are emptied
    # and the 2-digit levels split what is left.
    questions = generate_arithmetic(400, "train", seed=0)
    levels = Counter((q.data_source, _problem(q)[1]) for q in questions)
    assert levels["arithmetic-1d", "+"] == small["+"] < 100
    assert levels["arithmetic-1d", "-"] == small["-"] < 100
    rest = 400 - small["+"] - small["-"]
    assert levels["arithmetic-2d", "+"] == (rest + 1) // 2
    assert levels["arithmetic-2d", "-"] == rest // 2


def test_asking_for_more_than_exists_names_both_numbers():
    n_train = _available("train", 1)
    assert len(generate_arithmetic(n_train, "train", seed=0, max_digits=1)) == n_train
    expected = rf"{n_train + 1} train questions asked for, but only {n_train} distinct"
    with pytest.raises(DataError, match=expected):
        generate_arithmetic(n_train + 1, "train", seed=0, max_digits=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_digits": 0}, "max_digits"),
        ({"max_digits": 4}, "max_digits"),
        ({"split": "test"}, "split"),
        ({"count": -1}, "count"),
    ],
)
def test_generate_arithmetic_rejects_bad_arguments(kwargs, message):
    arguments = {"count": 5, "split": "train", "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_arithmetic(**arguments)


# --------------------------------------------------------------------------------------
# load_math_questions: formats
# --------------------------------------------------------------------------------------


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_generated_spec_uses_the_configured_sizes():
    data = DataConfig(generated_train_size=30, generated_eval_size=7)
    train = load_math_questions("generated:arithmetic", "train", data, seed=0)
    evals = load_math_questions("generated:arithmetic", "eval", data, seed=0)
    assert (len(train), len(evals)) == (30, 7)
    assert train == generate_arithmetic(30, "train", 0)
    assert evals[0].qid == "arith-eval-0"


def test_unknown_generated_set_lists_the_known_ones():
    expected = r"generated:algebra: unknown generated set 'algebra'; known: arithmetic"
    with pytest.raises(DataError, match=expected):
        load_math_questions("generated:algebra", "train", DataConfig(), seed=0)


def test_gsm8k_jsonl_keeps_the_number_after_the_marks(tmp_path):
    spec = _jsonl(
        tmp_path / "gsm8k.jsonl",
        [
            {"question": "Natalia sold 48 clips...", "answer": "48 / 2 = <<48/2=24>>24\n#### 72"},
            {"question": "Big sum?", "answer": "lots of work\n#### 1,072"},
        ],
    )
    questions = load_math_questions(spec, "train", DataConfig(), seed=0)
    assert questions == [
        Question("0", "Natalia sold 48 clips...", ("72",), "gsm8k", "48 / 2 = <<48/2=24>>24\n#### 72"),
        Question("1", "Big sum?", ("1072",), "gsm8k", "lots of work\n#### 1,072"),
    ]


def test_math_parquet_with_solutions_keeps_the_last_boxed_answer(tmp_path):
    path = tmp_path / "math500.parquet"
    pq.write_table(
        pa.table(
            {
                "problem": ["Compute $1/2$.", "Solve $x+1=3$."],
                "solution": [
                    r"Half is $\boxed{\frac{1}{2}}$.",
                    r"First \boxed{1}? No: $x=\boxed{2}$.",
                ],
                "id": ["test/algebra/1.json", "test/algebra/2.json"],
                "data_source": ["math500", None],
            }
        ),
        path,
    )
    data = DataConfig(question_field="problem", answer_field="solution")
    questions = load_math_questions(str(path), "eval", data, seed=0)
    assert questions == [
        Question(
            "test/algebra/1.json", "Compute $1/2$.", (r"\frac{1}{2}",), "math500", r"Half is $\boxed{\frac{1}{2}}$."
        ),
        Question(  # data_source: the file's stem by default
            "test/algebra/2.json", "Solve $x+1=3$.", ("2",), "math500", r"First \boxed{1}? No: $x=\boxed{2}$."
        ),
    ]


def test_math500_json_list_with_an_answer_column(tmp_path):
    path = tmp_path / "m.json"
    row = {"problem": "p", "answer": r"\frac{\sqrt{3}}{2}", "solution": "s"}
    path.write_text(json.dumps([row]))
    data = DataConfig(question_field="problem")
    [question] = load_math_questions(str(path), "eval", data, seed=0)
    assert question.answers == (r"\frac{\sqrt{3}}{2}",)


def _dapo_rows():
    return [
        {
            "data_source": "math_dapo",
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 6 * 7?"},
            ],
            "reward_model": {"ground_truth": "42", "style": "rule"},
            "extra_info": {"index": "a1"},
        },
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": "What is 1/4 + 1/4?"}],
            "reward_model": {"ground_truth": r"\frac{1}{2}", "style": "rule"},
            "extra_info": {"index": "a2"},
        },
    ]


@pytest.mark.parametrize("answer_field", ["reward_model.ground_truth", "reward_model"])
def test_dapo_parquet_with_nested_ground_truth(tmp_path, answer_field):
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(_dapo_rows()), path)
    data = DataConfig(question_field="prompt", answer_field=answer_field)
    questions = load_math_questions(str(path), "train", data, seed=0)
    assert questions == [
        Question("0", "What is 6 * 7?", ("42",), "math_dapo"),
        Question("1", "What is 1/4 + 1/4?", (r"\frac{1}{2}",), "math_dapo"),
    ]


def test_dotted_question_field(tmp_path):
    spec = _jsonl(tmp_path / "r.jsonl", [{"env_kwargs": {"question": "Q?", "ground_truth": "5"}}])
    data = DataConfig(question_field="env_kwargs.question", answer_field="env_kwargs.ground_truth")
    assert load_math_questions(spec, "train", data, 0) == [Question("0", "Q?", ("5",), "r")]


def test_answers_may_be_lists_and_numbers(tmp_path):
    spec = _jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"question": "a", "answer": ["1/2", "0.5"]},
            {"question": "b", "answer": 42},
            {"question": "c", "answer": 2.5},
            {"question": "d", "answer": [3, "three"]},
        ],
    )
    questions = load_math_questions(spec, "train", DataConfig(), seed=0)
    assert [q.answers for q in questions] == [("1/2", "0.5"), ("42",), ("2.5",), ("3", "three")]
    assert math_reward(r"\boxed{\frac{1}{2}}", questions[0]) == 1.0


def test_blank_jsonl_lines_are_skipped_and_ids_are_kept(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"id": 7, "question": "a", "answer": "1"}\n\n{"id": 9, "question": "b", "answer": "2"}\n')
    assert [q.qid for q in load_math_questions(str(path), "train", DataConfig(), 0)] == ["7", "9"]


# --------------------------------------------------------------------------------------
# load_math_questions: errors (the file reader's own: tests/test_tasks.py)
# --------------------------------------------------------------------------------------


def _error(spec: str, data: DataConfig | None = None) -> str:
    with pytest.raises(DataError) as error:
        load_math_questions(spec, "train", data or DataConfig(), seed=0)
    return str(error.value)


@pytest.mark.parametrize("answer", ["", [], ["1", ""], None, {"style": "rule"}, True])
def test_row_with_an_empty_answer(tmp_path, answer):
    rows = [{"question": "a", "answer": "1"}, {"question": "b", "answer": answer}]
    spec = _jsonl(tmp_path / "a.jsonl", rows)
    assert _error(spec) == f"{spec}: row 1 (line 2): missing or empty answer ('answer')"
