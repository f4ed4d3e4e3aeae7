"""The math task: its questions (files or a generated arithmetic set), its reward, and the
warm start's demonstrations of the Solver and the Verifier.

The reward is 1 when the final answer (the last ``\\boxed{}`` after any ``</think>``, or a
last line ``Answer: ...`` as DAPO's prompt asks) is right for a gold answer, by
``drmas.tasks.grading.grade_answer``: an exact path (normalised text, exact rationals),
then math-verify for equivalent forms (``2\\sqrt{2}`` and ``\\sqrt{8}``, ``3, 5`` and
``5, 3``). Model text is never evaluated as code and every call is bounded in time; see
that module.

Data files: JSONL, JSON or Parquet (read by ``drmas.tasks.files``), with the question and
answer columns named in ``DataConfig``; GSM8K, MATH/MATH-500 and DAPO rows load as published.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from drmas.config import TaskConfig
from drmas.tasks import DataError, Demonstrations, Question, Split, Tools
from drmas.tasks.files import read_questions
from drmas.tasks.grading import answers_match, grade_answer, normalize_answer, start_in_background
from drmas.tasks.reference_grading import grade_answer_reference
from drmas.tasks.word_problems import generate_word_problems
from drmas.team.agents import (
    MathVerifierAgent,
    ParsingRules,
    SolverAgent,
    extract_boxed,
    math_answer,
    verifier_context,
)
from drmas.team.episodes import Episode
from drmas.team.orchestras import Team, verdict_passes

if TYPE_CHECKING:
    from drmas.config import DataConfig, DrmasConfig
    from drmas.infra.store import Store, StoreLocation

__all__ = [
    "MathOrchestra",
    "MathTask",
    "SoloOrchestra",
    "answers_match",
    "column_working",
    "generate_arithmetic",
    "load_math_questions",
    "math_demonstrations",
    "math_reward",
    "normalize_answer",
    "solution_demonstration",
]

# --------------------------------------------------------------------------------------
# The reward (the grader itself is drmas.tasks.grading)
# --------------------------------------------------------------------------------------

Grader = Literal["drmas", "reference"]
"""How a final answer is graded (``task.grader``)."""


def math_reward(
    final_text: str | None, question: Question, parsing: ParsingRules = "drmas", grader: Grader = "drmas"
) -> float:
    """1.0 when the final answer of ``final_text`` (``math_answer``: by drmas's rules the last
    box or a last line ``Answer: ...``, by the reference's the last box only) is right for a
    gold answer (``task.grader``: ``grade_answer``, or the reference's rules,
    ``grade_answer_reference``), else 0.0.

    A gold answer that is itself boxed is unboxed first, as in the reference.
    """
    predicted = math_answer(final_text, parsing) if final_text else None
    if predicted is None:
        return 0.0
    grade = grade_answer_reference if grader == "reference" else grade_answer
    golds = (_unboxed(answer) for answer in question.answers)
    return 1.0 if any(grade(predicted, gold) for gold in golds) else 0.0


def _unboxed(answer: str) -> str:
    boxed = extract_boxed(answer)
    return answer if boxed is None else boxed


# --------------------------------------------------------------------------------------
# Generated arithmetic
# --------------------------------------------------------------------------------------

ARITHMETIC_MAX_DIGITS = 3
"""Every problem of a level is enumerated (810k for 3-digit sums); 4 digits would be 81M."""
_EVAL_ONE_IN = 5
"""One problem in five belongs to the eval split."""
_OPERATIONS = ("+", "-")


def _in_eval_split(a: np.ndarray, b: np.ndarray, op_code: int) -> np.ndarray:
    """Which problems belong to the eval split: a fixed hash of (a, op, b), seed-independent.

    A problem's split never changes, so no train set overlaps any eval set, whatever the
    seeds or sizes. The hash is the splitmix64 finaliser (uint64 arithmetic wraps).
    """
    x = (a.astype(np.uint64) << np.uint64(32)) | (b.astype(np.uint64) << np.uint64(1))
    x = x | np.uint64(op_code)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x % np.uint64(_EVAL_ONE_IN) == 0


def _level_problems(digits: int, op: str, split: str) -> np.ndarray:
    """All (a, b) pairs of one level in one split, in a fixed order; shape (n, 2).

    Both operands have exactly ``digits`` digits (0 counts as a 1-digit number); for a
    difference a >= b, so no result is negative.
    """
    low = 0 if digits == 1 else 10 ** (digits - 1)
    values = np.arange(low, 10**digits, dtype=np.int64)
    a, b = (grid.ravel() for grid in np.meshgrid(values, values, indexing="ij"))
    keep = _in_eval_split(a, b, _OPERATIONS.index(op)) == (split == "eval")
    if op == "-":
        keep &= a >= b
    return np.stack([a[keep], b[keep]], axis=1)


def _even_quotas(count: int, sizes: list[int]) -> list[int]:
    """Split ``count`` as evenly as possible over levels, none above its size.

    Each round gives every open level an equal share; a level that fills up closes and its
    unused share goes to the others in the next round. Requires count <= sum(sizes).
    """
    quotas = [0] * len(sizes)
    remaining = count
    open_levels = [i for i, size in enumerate(sizes) if size > 0]
    while remaining:
        share, extra = divmod(remaining, len(open_levels))
        for rank, level in enumerate(open_levels):
            take = min(sizes[level] - quotas[level], share + (rank < extra))
            quotas[level] += take
            remaining -= take
        open_levels = [i for i in open_levels if quotas[i] < sizes[i]]
    return quotas


def generate_arithmetic(count: int, split: Literal["train", "eval"], seed: int, max_digits: int = 2) -> list[Question]:
    """``count`` distinct problems such as "What is 37 + 48?", deterministic given the seed.

    Difficulty levels are (digits, operation) for 1..``max_digits`` digits and + or -; the
    problems are spread evenly over the levels (a small level that runs out leaves its share
    to the others) and shuffled together. Results are never negative (the larger operand
    comes first in a difference). Each problem belongs to one split by a fixed hash, so the
    train and eval sets are disjoint for any seeds. ``data_source`` is ``arithmetic-{d}d``.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    if not 1 <= max_digits <= ARITHMETIC_MAX_DIGITS:
        raise ValueError(f"max_digits must be 1..{ARITHMETIC_MAX_DIGITS}, not {max_digits}")
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    levels = [(digits, op) for digits in range(1, max_digits + 1) for op in _OPERATIONS]
    pools = [_level_problems(digits, op, split) for digits, op in levels]
    available = sum(len(pool) for pool in pools)
    if count > available:
        raise DataError(
            f"generated:arithmetic: {count} {split} questions asked for, but only {available} "
            f"distinct {split} problems exist with max_digits={max_digits}"
        )
    rng = random.Random(f"arithmetic-{split}-{seed}")
    quotas = _even_quotas(count, [len(pool) for pool in pools])
    chosen = [
        (digits, op, int(pool[row, 0]), int(pool[row, 1]))
        for (digits, op), pool, quota in zip(levels, pools, quotas, strict=True)
        for row in rng.sample(range(len(pool)), quota)
    ]
    rng.shuffle(chosen)
    return [
        Question(
            qid=f"arith-{split}-{i}",
            question=f"What is {a} {op} {b}?",
            answers=(str(a + b if op == "+" else a - b),),
            data_source=f"arithmetic-{digits}d",
        )
        for i, (digits, op, a, b) in enumerate(chosen)
    ]


# --------------------------------------------------------------------------------------
# Data files
# --------------------------------------------------------------------------------------

GENERATED_SETS = ("arithmetic", "word_problems")
_GSM8K_MARK = "####"


def _gold_answer(value: Any) -> str:
    """One gold answer as the reward compares it; "" when there is none.

    GSM8K keeps what follows ``####`` (without thousands commas); a MATH solution keeps its
    last boxed (or ``\\fbox``-ed) answer, and a box that does not close is no answer; an
    integer (AIME's ``Answer``) or other number becomes its decimal text.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return ""
    text = str(value)
    if _GSM8K_MARK in text:
        return text.rpartition(_GSM8K_MARK)[2].replace(",", "").strip()
    boxed = extract_boxed(text)
    if boxed is None and ("\\boxed" in text or "\\fbox" in text):
        return ""  # a box that does not close: a gold answer that could never match
    return (text if boxed is None else boxed).strip()


def _worked_solution(value: Any) -> str:
    """The answer field's worked solution: GSM8K's steps and ``#### N``, or a MATH
    solution with its box; "" for a bare answer (a number, a list, a short text)."""
    if not isinstance(value, str):
        return ""
    if _GSM8K_MARK in value:
        return value.strip() if value.partition(_GSM8K_MARK)[0].strip() else ""
    boxed = extract_boxed(value)
    besides_box = value.replace(f"\\boxed{{{boxed}}}", "").strip() if boxed is not None else ""
    return value.strip() if besides_box else ""


def _gold_answers(value: Any) -> tuple[str, ...]:
    """Every accepted answer: a value, a list of values, or a dict with ``ground_truth``."""
    if isinstance(value, dict):
        value = value.get("ground_truth")
    values = value if isinstance(value, list) else [value]
    answers = tuple(_gold_answer(item) for item in values)
    return answers if answers and all(answers) else ()


def load_math_questions(
    spec: str,
    split: Literal["train", "eval"],
    data: DataConfig,
    seed: int,
    store: StoreLocation | Store | None = None,
) -> list[Question]:
    """The questions of ``data.train`` or ``data.eval``, in file order.

    ``spec`` is ``generated:arithmetic`` (its ``split`` part, sized by
    ``data.generated_{train,eval}_size``, drawn with ``seed``) or a ``.jsonl``, ``.json``
    or ``.parquet`` file or a dataset folder (its ``data.{split}_split``), local or
    ``s3://bucket/key`` (read with ``store``'s S3 endpoint and region:
    ``drmas.tasks.files.read_rows``). GSM8K, MATH, MATH-500, DAPO and AIME load as
    published, their columns recognised while ``data.question_field``/``answer_field`` are
    left at their defaults. Fields may be dotted paths into nested columns
    (``reward_model.ground_truth``); ``data_source`` defaults to the file's stem or the
    folder's name (MATH's subjects: ``data.data_source_field: type``), the qid is the ``id``
    column or else the row index. Any bad input raises DataError naming the file and the
    row or column.
    """
    name = spec.removeprefix("generated:")
    if name == spec:
        return read_questions(spec, data, _gold_answers, store=store, split=split, worked_solution=_worked_solution)
    if name not in GENERATED_SETS:
        known = ", ".join(GENERATED_SETS)
        raise DataError(f"{spec}: unknown generated set {name!r}; known: {known}")
    size = data.generated_train_size if split == "train" else data.generated_eval_size
    if name == "word_problems":
        return generate_word_problems(size, split, seed)
    return generate_arithmetic(size, split, seed)


# --------------------------------------------------------------------------------------
# Warm-start demonstrations
# --------------------------------------------------------------------------------------

ARITHMETIC = re.compile(r"^What is (\d+) ([+-]) (\d+)\?$")


def column_working(a: int, op: str, b: int) -> str:
    """Digit-by-digit working, right to left, one step per column, then the boxed result.

    37 + 48 -> "7+8=15, 3+4+1=8. \\boxed{85}";  52 - 17 -> "12-7=5, 5-1-1=3. \\boxed{35}".
    """
    steps, carry = [], 0
    top, bottom = str(a)[::-1], str(b)[::-1]
    for column in range(len(top)):
        x = int(top[column])
        y = int(bottom[column]) if column < len(bottom) else 0
        if op == "+":
            total = x + y + carry
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
            carry = total // 10
        else:
            borrow_in = carry
            take = x - y - borrow_in
            carry = int(take < 0)
            x_shown = x + 10 * carry
            steps.append(f"{x_shown}-{y}" + (f"-{borrow_in}" if borrow_in else "") + f"={x_shown - y - borrow_in}")
    if op == "+" and carry:
        steps.append(f"carry {carry}")
    result = a + b if op == "+" else a - b
    return f"{', '.join(steps)}. \\boxed{{{result}}}"


def solution_demonstration(question: Question) -> tuple[str, int | None]:
    """The Solver's demonstrated answer to ``question`` in the asked format, and its answer
    as an integer when it is one (so a wrong attempt can change it).

    Arithmetic ("What is 37 + 48?"): digit-by-digit working (``column_working``). A worked
    solution in GSM8K's form: its steps without the ``<<...>>`` calculator notes, then
    "The answer is \\boxed{N}." A MATH-style solution: as written (it ends in its box).
    """
    match = ARITHMETIC.match(question.question)
    if match is not None:
        a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
        return column_working(a, op, b), a + b if op == "+" else a - b
    if not question.solution:
        raise DataError(
            f"warm start: no demonstration for {question.question!r}: it has no worked solution "
            "(generated:arithmetic, generated:word_problems and GSM8K- or MATH-style answer fields have them)"
        )
    answer = question.answers[0]
    value = int(answer) if re.fullmatch(r"-?\d+", answer) else None
    if _GSM8K_MARK in question.solution:
        steps = _CALCULATOR_NOTE.sub("", question.solution.rpartition(_GSM8K_MARK)[0]).strip()
        return f"{steps}\nThe answer is \\boxed{{{answer}}}.", value
    return question.solution, value


_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")


def _with_answer(demonstration: str, value: int) -> str:
    """The demonstration with ``value`` in its last box instead."""
    head, _, tail = demonstration.rpartition("\\boxed{")
    return f"{head}\\boxed{{{value}}}{tail.partition('}')[2]}"


def math_demonstrations(questions: list[Question], config: DrmasConfig, rng: np.random.Generator) -> Demonstrations:
    """(prompt, response) pairs per agent: first solves, verdicts, and second solves.

    The Solver's answers are ``solution_demonstration``'s (computed or written, never
    sampled); ``warmstart.wrong_fraction`` of the first attempts box a wrong number (when the
    answer is an integer), and ``warmstart.verdict_noise`` of the Verifier's verdicts are
    wrong.
    """
    solver, verifier = SolverAgent(config.task.prompts), MathVerifierAgent(config.task.prompts)
    warm = config.warmstart
    demos: Demonstrations = {"solver": [], "verifier": []}
    for question in questions:
        right, value = solution_demonstration(question)
        offset = int(rng.choice([-10, -1, 1, 10]))
        wrong = rng.random() < warm.wrong_fraction and value is not None
        attempt = _with_answer(right, value + offset) if wrong and value is not None else right
        episode = Episode("u", "t", 0, question)
        demos["solver"].append((solver.prompt(episode, 1), attempt))
        episode.team_context.append(f"Solver: {attempt}")
        verdict_right = rng.random() >= warm.verdict_noise
        approve = not wrong if verdict_right else wrong
        response = f"<verify>{'approve' if approve else 'reject'}</verify>"
        demos["verifier"].append((verifier.prompt(episode, 1), response))
        if not approve:  # the second attempt, after a rejection, is right
            episode.team_context.append(verifier_context(response))
            demos["solver"].append((solver.prompt(episode, 1), right))
    return demos


# --------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------


class MathTask:
    """Math problems, no tools, reward 1/0 by the answer grader (``drmas.tasks.grading``)."""

    default_data = "generated:arithmetic"
    default_orchestra = "math"

    def questions(self, config: DrmasConfig, split: Split) -> list[Question]:
        return load_math_questions(config.data_spec(split), split, config.data, config.data_seed, config.store)

    def tools(self, config: DrmasConfig, store: Store) -> Tools:
        return Tools()

    def corpus(self, config: DrmasConfig) -> list[str]:
        return []

    def demonstrations(
        self, config: DrmasConfig, questions: list[Question], tools: Tools, rng: np.random.Generator
    ) -> Demonstrations:
        return math_demonstrations(questions, config, rng)

    def reward(self, final_answer: str | None, question: Question) -> float:
        return math_reward(final_answer, question)


class MathOrchestra:
    """Solver then Verifier, up to ``task.max_loops`` Solver calls per episode.

    No verification after the last solve; an approved episode is not solved again; the
    final answer is the last Solver output (its last \\boxed{} or ``Answer:`` line); a missing or malformed
    verdict counts as approve unless ``task.malformed_verdict_passes`` is False.
    """

    agents = {"solver": SolverAgent, "verifier": MathVerifierAgent}

    def __init__(self, task: TaskConfig, tools: Tools) -> None:
        self.max_loops = task.max_loops
        self.malformed_passes = task.malformed_verdict_passes
        self.parsing, self.grader = task.parsing, task.grader
        self.agent_objects = {
            name: cls(prompts=task.prompts, parsing=task.parsing) for name, cls in self.agents.items()
        }
        start_in_background()  # the grader's import overlaps the first generations

    def run(self, episodes: list[Episode], team: Team) -> None:
        pending = list(episodes)
        for loop in range(self.max_loops):
            solutions = team.call("solver", pending, step=1)
            for episode, solution in zip(pending, solutions, strict=True):
                episode.team_context.append(f"Solver: {solution.text}")
                episode.final_answer = solution.text
            if loop == self.max_loops - 1:
                break
            verdicts = team.call("verifier", pending, step=1)
            still_pending = []
            for episode, verdict in zip(pending, verdicts, strict=True):
                episode.team_context.append(verifier_context(verdict.text))
                if not verdict_passes(verdict, "approve", "reject", self.malformed_passes):
                    still_pending.append(episode)
            pending = still_pending
            if not pending:
                break
        for episode in episodes:
            episode.done = True

    def reward(self, episode: Episode) -> float:
        return math_reward(episode.final_answer, episode.question, self.parsing, self.grader)


class SoloOrchestra:
    """One Solver call per episode, nothing else: single-agent GRPO on the math task.

    The baseline a multi-agent run is compared with, and the setting in which drmas is
    benchmarked against single-agent trainers (with ``algorithm.advantage: grpo`` the two
    advantage modes coincide: one agent has one set of reward statistics).
    """

    agents = {"solver": SolverAgent}

    def __init__(self, task: TaskConfig, tools: Tools) -> None:
        self.parsing, self.grader = task.parsing, task.grader
        self.agent_objects = {"solver": SolverAgent(prompts=task.prompts, parsing=task.parsing)}
        start_in_background()

    def run(self, episodes: list[Episode], team: Team) -> None:
        for episode, solution in zip(episodes, team.call("solver", episodes, step=1), strict=True):
            episode.final_answer, episode.done = solution.text, True

    def reward(self, episode: Episode) -> float:
        return math_reward(episode.final_answer, episode.question, self.parsing, self.grader)
