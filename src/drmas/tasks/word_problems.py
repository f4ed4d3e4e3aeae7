"""Generated GSM8K-style word problems of one and two steps, with worked solutions.

    generate_word_problems(count, split, seed) -> [Question]   (data: generated:word_problems)

For a small pretrained chat model (SmolLM2-135M): GSM8K itself is far beyond it, and bare
sums ("What is 37 + 48?") teach nothing about reading a problem. These are the kind of
problem GSM8K's easiest rows are: a person, a count of things, one or two operations (+, -,
x, /), small numbers, a whole-number answer. Each question carries its worked solution in
GSM8K's own form (one line per step with the ``<<a+b=c>>`` calculator note, then
``#### answer``), so the warm start can teach the asked answer format from it exactly as it
would from GSM8K's training file (``drmas.tasks.math.math_demonstrations``).

Train and eval are disjoint for any seeds and sizes: a problem belongs to one split by a
fixed hash of its template and numbers (not of the names and things, which vary freely), so
no eval problem's arithmetic is ever seen in training under other names.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from drmas.tasks import DataError
from drmas.team.episodes import Question

__all__ = ["WORD_PROBLEM_TEMPLATES", "generate_word_problems"]

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jack", "Kim", "Leo", "Mia", "Noah", "Sam")
THINGS = ("apples", "pens", "stickers", "marbles", "books", "cookies", "shells", "cards", "eggs", "coins")
_EVAL_ONE_IN = 5
"""One problem in five belongs to the eval split."""
_MAX_MISSES = 5000
"""Draws in a row that bring no new problem before the split is declared exhausted (it holds
about 44k train and 11k eval problems)."""


@dataclass(frozen=True)
class _Problem:
    question: str
    steps: tuple[tuple[str, int], ...]
    """(expression, value) per step, in order; the last value is the answer."""
    unit: str


@dataclass(frozen=True)
class Template:
    """One kind of problem: how many numbers it draws, from which range, and its text."""

    name: str
    ranges: tuple[tuple[int, int], ...]
    """Inclusive (low, high) of each drawn number."""
    make: Callable[[str, str, tuple[int, ...]], _Problem | None]
    """(name, things, numbers) -> the problem, or None when the numbers do not fit (a
    negative or fractional step)."""


def _add(n: str, t: str, x: tuple[int, ...]) -> _Problem:
    a, b = x
    return _Problem(f"{n} has {a} {t} and buys {b} more. How many {t} does {n} have now?", ((f"{a}+{b}", a + b),), t)


def _take(n: str, t: str, x: tuple[int, ...]) -> _Problem | None:
    a, b = x
    if b >= a:
        return None
    return _Problem(
        f"{n} had {a} {t} and gave {b} to a friend. How many {t} does {n} have left?", ((f"{a}-{b}", a - b),), t
    )


def _times(n: str, t: str, x: tuple[int, ...]) -> _Problem:
    a, b = x
    return _Problem(
        f"{n} buys {a} bags with {b} {t} in each bag. How many {t} does {n} buy?", ((f"{a}*{b}", a * b),), t
    )


def _share(n: str, t: str, x: tuple[int, ...]) -> _Problem:
    a, b = x
    return _Problem(
        f"{n} shares {a * b} {t} equally among {a} friends. How many {t} does each friend get?",
        ((f"{a * b}/{a}", b),),
        t,
    )


def _add_take(n: str, t: str, x: tuple[int, ...]) -> _Problem | None:
    a, b, c = x
    if c > a + b:
        return None
    return _Problem(
        f"{n} has {a} {t}, buys {b} more, then gives {c} away. How many {t} does {n} have now?",
        ((f"{a}+{b}", a + b), (f"{a + b}-{c}", a + b - c)),
        t,
    )


def _times_add(n: str, t: str, x: tuple[int, ...]) -> _Problem:
    a, b, c = x
    return _Problem(
        f"{n} buys {a} boxes with {b} {t} in each box and finds {c} more. How many {t} does {n} have?",
        ((f"{a}*{b}", a * b), (f"{a * b}+{c}", a * b + c)),
        t,
    )


def _take_twice(n: str, t: str, x: tuple[int, ...]) -> _Problem | None:
    a, b, c = x
    if b + c >= a:
        return None
    return _Problem(
        f"{n} had {a} {t}, lost {b} on Monday and {c} on Tuesday. How many {t} does {n} have left?",
        ((f"{a}-{b}", a - b), (f"{a - b}-{c}", a - b - c)),
        t,
    )


def _more_than(n: str, t: str, x: tuple[int, ...]) -> _Problem:
    a, b = x
    friend = NAMES[(NAMES.index(n) + 1) % len(NAMES)]
    return _Problem(
        f"{n} has {a} {t}. {friend} has {b} more {t} than {n}. How many {t} do they have together?",
        ((f"{a}+{b}", a + b), (f"{a}+{a + b}", 2 * a + b)),
        t,
    )


def _change(n: str, t: str, x: tuple[int, ...]) -> _Problem | None:
    price, count, paid = x
    if price * count > paid:
        return None
    return _Problem(
        f"A pack of {t} costs {price} dollars. {n} buys {count} packs and pays with {paid} dollars. "
        f"How many dollars of change does {n} get?",
        ((f"{price}*{count}", price * count), (f"{paid}-{price * count}", paid - price * count)),
        "dollars",
    )


WORD_PROBLEM_TEMPLATES: tuple[Template, ...] = (
    Template("add", ((2, 50), (2, 50)), _add),
    Template("take", ((5, 60), (1, 40)), _take),
    Template("times", ((2, 9), (2, 9)), _times),
    Template("share", ((2, 9), (2, 9)), _share),
    Template("add-take", ((2, 30), (2, 30), (1, 30)), _add_take),
    Template("times-add", ((2, 9), (2, 9), (1, 20)), _times_add),
    Template("take-twice", ((10, 60), (1, 20), (1, 20)), _take_twice),
    Template("more-than", ((2, 30), (1, 20)), _more_than),
    Template("change", ((2, 9), (2, 5), (20, 60)), _change),
)
"""Four one-step kinds and five two-step kinds."""


def _in_eval_split(template: str, numbers: tuple[int, ...]) -> bool:
    """A fixed, seed-independent hash of the template and its numbers decides the split."""
    key = f"{template}:{','.join(map(str, numbers))}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % _EVAL_ONE_IN == 0


def worked_solution(problem: _Problem) -> str:
    """GSM8K's form: a line per step with its calculator note, then ``#### answer``."""
    lines = []
    for expression, value in problem.steps:
        shown = expression.replace("*", " x ").replace("/", " / ").replace("+", " + ").replace("-", " - ")
        lines.append(f"{shown} = <<{expression}={value}>>{value} {problem.unit}.")
    return "\n".join(lines) + f"\n#### {problem.steps[-1][1]}"


def generate_word_problems(count: int, split: Literal["train", "eval"], seed: int) -> list[Question]:
    """``count`` distinct problems of the ``split``, each of a template drawn uniformly (a
    template whose few problems are all drawn, such as a product of two digits, leaves its
    share to the others), deterministic given the seed; each with its gold answer, its worked
    solution (``Question.solution``) and ``data_source`` ``word-{template}``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    rng = random.Random(f"word-problems-{split}-{seed}")
    seen: set[tuple[str, tuple[int, ...]]] = set()
    questions: list[Question] = []
    misses = 0
    while len(questions) < count:
        misses += 1
        if misses > _MAX_MISSES:
            raise DataError(
                f"generated:word_problems: could not draw {count} distinct {split} problems "
                f"(the split holds about {len(questions)}): ask for fewer"
            )
        template = rng.choice(WORD_PROBLEM_TEMPLATES)
        numbers = tuple(rng.randint(low, high) for low, high in template.ranges)
        name, things = rng.choice(NAMES), rng.choice(THINGS)
        if (template.name, numbers) in seen or _in_eval_split(template.name, numbers) != (split == "eval"):
            continue
        problem = template.make(name, things, numbers)
        if problem is None:
            continue
        seen.add((template.name, numbers))
        misses = 0
        questions.append(
            Question(
                qid=f"word-{split}-{len(questions)}",
                question=problem.question,
                answers=(str(problem.steps[-1][1]),),
                data_source=f"word-{template.name}",
                solution=worked_solution(problem),
            )
        )
    return questions
