"""The math task: its questions (files or a generated arithmetic set) and its reward.

The reward follows the reference (DeepScaleR/rLLM grader as used by Dr. MAS): the final
answer is the content of the last ``\\boxed{}`` after any ``</think>``, and it is correct when
it equals a gold answer after Hendrycks-MATH normalisation. Where the reference then asks
sympy whether ``gold - pred`` simplifies to 0, this module only compares exact rational
numbers with a small parser of its own: model text is never evaluated as code (no eval,
no sympify), and every check is linear in the input, so a hostile or huge answer costs
nothing. So ``0.5 == \\frac{1}{2} == 1/2`` and ``85 == 85.0``, but equivalent symbolic
forms (``2\\sqrt{2}`` vs ``\\sqrt{8}``) only match when their normalised text is equal.

Data files: JSONL, JSON (a list of objects) or Parquet, with the question and answer columns
named in ``DataConfig``; GSM8K, MATH/MATH-500 and DAPO rows load as published.
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from drmas.tasks import DataError, Question

if TYPE_CHECKING:
    from drmas.config import DataConfig

__all__ = [
    "answers_match",
    "extract_boxed",
    "generate_arithmetic",
    "load_math_questions",
    "math_reward",
    "normalize_answer",
]

# --------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN = re.compile(r"[^\s${}]+")
"""``\\boxed 5``: the argument is the run of text up to a space, a ``$`` or a brace."""


def _closing_brace(text: str, open_at: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_at``, or None if it never closes.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` (set braces) are content,
    not grouping.
    """
    depth = 0
    i = open_at
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _box_argument(text: str, start: int) -> str | None:
    """The argument of a box command whose name ends at ``start``."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] == "{":
        close = _closing_brace(text, i)
        return None if close is None else text[i + 1 : close]
    token = _BARE_TOKEN.match(text, i)
    return token.group() if token else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``), or None.

    Only the text after the last ``</think>`` counts: reasoning drafts are not answers. The
    last box decides even when it is unclosed (None): a response cut off while writing its
    answer gets no credit for an earlier draft, as in the reference.
    """
    tail = text.rpartition("</think>")[2]
    boxes = list(_BOX.finditer(tail))
    return _box_argument(tail, boxes[-1].end()) if boxes else None


# --------------------------------------------------------------------------------------
# Normalisation and equivalence
# --------------------------------------------------------------------------------------

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\s*\{")
_SPACING = re.compile(r"\\[!,;: ]")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_DROPPED = ("\\$", "$", "\\%", "%", "^{\\circ}", "^\\circ")
_ASSIGNMENT = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)=([^=]+)")
_FRAC_TWO_TOKENS = re.compile(r"\\frac(\w)(\w)")
_FRAC_BARE_NUMERATOR = re.compile(r"\\frac(\w)\{")
_FRAC_BARE_DENOMINATOR = re.compile(r"(\\frac\{[^{}]*\})(\w)")
_SQRT_BARE = re.compile(r"\\sqrt(\w)")
_THOUSANDS = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")


def _unwrap_text_commands(text: str) -> str:
    """Drop ``\\text{`` and friends with their closing brace, keeping the content.

    One pass with a stack of "keep this closing brace?" flags, so nested braces inside the
    wrapper survive and the cost stays linear.
    """
    if not _TEXT_WRAPPER.search(text):
        return text
    out: list[str] = []
    keep_closing: list[bool] = []
    i = 0
    while i < len(text):
        char = text[i]
        wrapper = _TEXT_WRAPPER.match(text, i) if char == "\\" else None
        if wrapper:
            keep_closing.append(False)
            i = wrapper.end()
            continue
        if char == "\\":
            out.append(text[i : i + 2])
            i += 2
            continue
        if char == "{":
            keep_closing.append(True)
        elif char == "}" and keep_closing and not keep_closing.pop():
            i += 1
            continue
        out.append(char)
        i += 1
    return "".join(out)


def normalize_answer(text: str) -> str:
    """Hendrycks-MATH normalisation, so that notation differences do not count as errors.

    Removes whitespace, ``$``, ``\\text{}`` wrappers (keeping their content), ``\\left`` and
    ``\\right``, spacing commands, a trailing period, degrees and percent signs, a leading
    single-variable assignment (``x = 5`` -> ``5``) and thousands separators of plain numbers;
    writes ``\\dfrac``/``\\tfrac`` as ``\\frac`` and ``\\frac12``/``\\sqrt2`` with braces.
    Unlike the original it keeps ``0.5`` as it is: numbers are compared as rationals later.
    """
    s = _unwrap_text_commands(text)
    s = _SPACING.sub("", s)
    s = _LEFT_RIGHT.sub("", s)
    s = "".join(s.split())
    for dropped in _DROPPED:
        s = s.replace(dropped, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.removesuffix(".")
    assignment = _ASSIGNMENT.fullmatch(s)
    if assignment:
        s = assignment.group(1)
    s = _FRAC_TWO_TOKENS.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_BARE_NUMERATOR.sub(r"\\frac{\1}{", s)
    s = _FRAC_BARE_DENOMINATOR.sub(r"\1{\2}", s)
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
"""ASCII digits only: Fraction would read other scripts' digits (fullwidth ８５ as 85), which
the reference's checker does not, and which a person may not see as a different text."""
_DECIMAL = re.compile(_NUMBER)
_SLASH = re.compile(rf"({_NUMBER})/({_NUMBER})")
_LATEX_FRAC = re.compile(rf"([+-]?)\\frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}")
_MAX_NUMBER_CHARS = 100
"""Longer strings are not parsed as numbers (they can still match as text); this also
keeps clear of int()'s digit limit."""


def _ratio(numerator: str, denominator: str) -> Fraction | None:
    """numerator / denominator, or None for a zero denominator (never an exception)."""
    bottom = Fraction(denominator)
    return None if bottom == 0 else Fraction(numerator) / bottom


def _parse_rational(s: str) -> Fraction | None:
    """The exact value of a normalised number (``-3``, ``0.25``, ``1/4``, ``-\\frac{1}{4}``).

    A whitelist of forms matched by regular expressions and built with ``Fraction``: nothing
    is evaluated, so no input can run code or take long.
    """
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    slash = _SLASH.fullmatch(s)
    if slash:
        return _ratio(slash.group(1), slash.group(2))
    frac = _LATEX_FRAC.fullmatch(s)
    if frac:
        value = _ratio(frac.group(2), frac.group(3))
        return -value if value is not None and frac.group(1) == "-" else value
    return None


def answers_match(predicted: str, gold: str) -> bool:
    """Whether a predicted answer equals a gold one: same normalised text or same rational.

    Pure and thread-safe (no signals, no global state); an empty answer never matches.
    """
    pred, truth = normalize_answer(predicted), normalize_answer(gold)
    if not pred or not truth:
        return False
    if pred == truth:
        return True
    value = _parse_rational(pred)
    return value is not None and value == _parse_rational(truth)


def math_reward(final_text: str | None, question: Question) -> float:
    """1.0 when the last boxed answer of ``final_text`` matches a gold answer, else 0.0.

    A gold answer that is itself boxed is unboxed first, as in the reference.
    """
    predicted = extract_boxed(final_text) if final_text else None
    if predicted is None:
        return 0.0
    golds = (_unboxed(answer) for answer in question.answers)
    return 1.0 if any(answers_match(predicted, gold) for gold in golds) else 0.0


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


def generate_arithmetic(
    count: int, split: Literal["train", "eval"], seed: int, max_digits: int = 2
) -> list[Question]:
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
        for (digits, op), pool, quota in zip(levels, pools, quotas)
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

GENERATED_SETS = ("arithmetic",)
_GSM8K_MARK = "####"
_MISSING = object()


def _decode(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text (bad byte at offset {error.start})") from None


def _read_jsonl(path: Path) -> tuple[list[Any], list[str]]:
    """Rows and their labels (``row 0 (line 1)``); blank lines are skipped."""
    rows, labels = [], []
    for number, line in enumerate(_decode(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise DataError(f"{path}: line {number}: invalid JSON ({error.msg})") from None
        labels.append(f"row {len(labels)} (line {number})")
    return rows, labels


def _read_json(path: Path) -> tuple[list[Any], list[str]]:
    try:
        rows = json.loads(_decode(path))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: line {error.lineno}: invalid JSON ({error.msg})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
    return rows, [f"row {i}" for i in range(len(rows))]


def _read_parquet(path: Path) -> tuple[list[Any], list[str]]:
    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None
    return rows, [f"row {i}" for i in range(len(rows))]


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def _read_rows(spec: str) -> tuple[Path, list[dict[str, Any]], list[str]]:
    """The file's rows (each a dict) with a label per row for messages."""
    if "://" in spec:
        raise DataError(f"{spec}: only local files are supported for math data for now")
    path = Path(spec)
    suffix = path.suffix.lower()
    if suffix not in _READERS:
        raise DataError(
            f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(_READERS)}"
        )
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    rows, labels = _READERS[suffix](path)
    if not rows:
        raise DataError(f"{path}: no rows")
    for row, label in zip(rows, labels):
        if not isinstance(row, dict):
            raise DataError(f"{path}: {label}: expected an object, got {type(row).__name__}")
    return path, rows, labels


def _lookup(row: dict[str, Any], field: str) -> Any:
    """The value at a dotted field (``reward_model.ground_truth``), or _MISSING."""
    value: Any = row
    for key in field.split("."):
        if not isinstance(value, dict) or value.get(key) is None:
            return _MISSING
        value = value[key]
    return value


def _require_column(path: Path, rows: list[dict[str, Any]], field: str, role: str) -> None:
    """Fail once for a column no row has, rather than once per row."""
    if all(_lookup(row, field) is _MISSING for row in rows):
        columns = sorted({key for row in rows for key in row})
        raise DataError(
            f"{path}: no {role} column {field!r} (set data.{role}_field); "
            f"columns: {', '.join(columns)}"
        )


def _question_text(value: Any) -> str:
    """The question: a string, or the last user message of a chat (DAPO's ``prompt``)."""
    if isinstance(value, list):
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        value = users[-1] if users else None
    return value.strip() if isinstance(value, str) else ""


def _gold_answer(value: Any) -> str:
    """One gold answer as the reward compares it; "" when there is none.

    GSM8K keeps what follows ``####`` (without thousands commas); a MATH solution keeps its
    last boxed answer; numbers become their decimal text.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return ""
    text = str(value)
    if _GSM8K_MARK in text:
        return text.rpartition(_GSM8K_MARK)[2].replace(",", "").strip()
    boxed = extract_boxed(text)
    return (text if boxed is None else boxed).strip()


def _gold_answers(value: Any) -> tuple[str, ...]:
    """Every accepted answer: a value, a list of values, or a dict with ``ground_truth``."""
    if isinstance(value, dict):
        value = value.get("ground_truth")
    values = value if isinstance(value, list) else [value]
    answers = tuple(_gold_answer(item) for item in values)
    return answers if answers and all(answers) else ()


def _row_question(
    row: dict[str, Any], index: int, label: str, path: Path, data: DataConfig
) -> Question:
    raw_question = _lookup(row, data.question_field)
    question = _question_text(raw_question)
    if not question:
        raise DataError(f"{path}: {label}: empty or missing question ({data.question_field!r}{_not_text(raw_question)})")
    answers = _gold_answers(_lookup(row, data.answer_field))
    if not answers:
        raise DataError(f"{path}: {label}: missing or empty answer ({data.answer_field!r})")
    source = _lookup(row, data.data_source_field)
    qid = row.get("id")
    return Question(
        qid=str(index) if qid is None else str(qid),
        question=question,
        answers=answers,
        data_source=source if isinstance(source, str) and source else path.stem,
    )


def _not_text(value: Any) -> str:
    """``: a number, not text`` for a question of the wrong type (the type and a short
    repr), so that the message does not call a present value missing; else nothing."""
    if value is _MISSING or isinstance(value, (str, list)):
        return ""
    shown = repr(value)
    return f": {type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}, not text"


def _load_file(spec: str, data: DataConfig) -> list[Question]:
    path, rows, labels = _read_rows(spec)
    _require_column(path, rows, data.question_field, "question")
    _require_column(path, rows, data.answer_field, "answer")
    questions = [
        _row_question(row, index, label, path, data)
        for index, (row, label) in enumerate(zip(rows, labels))
    ]
    first_row_of: dict[str, int] = {}
    for index, question in enumerate(questions):
        if question.qid in first_row_of:
            raise DataError(
                f"{path}: duplicated id {question.qid!r} ({labels[first_row_of[question.qid]]} "
                f"and {labels[index]})"
            )
        first_row_of[question.qid] = index
    return questions


def load_math_questions(
    spec: str, split: Literal["train", "eval"], data: DataConfig, seed: int
) -> list[Question]:
    """The questions of ``data.train`` or ``data.eval``, in file order.

    ``spec`` is ``generated:arithmetic`` (its ``split`` part, sized by
    ``data.generated_{train,eval}_size``, drawn with ``seed``) or a local ``.jsonl``,
    ``.json`` or ``.parquet`` file. Fields may be dotted paths into nested columns
    (``reward_model.ground_truth``); ``data_source`` defaults to the file's stem, the qid is
    the ``id`` column or else the row index. Any bad input raises DataError naming the file
    and the row or column.
    """
    name = spec.removeprefix("generated:")
    if name == spec:
        return _load_file(spec, data)
    if name not in GENERATED_SETS:
        known = ", ".join(GENERATED_SETS)
        raise DataError(f"{spec}: unknown generated set {name!r}; known: {known}")
    size = data.generated_train_size if split == "train" else data.generated_eval_size
    return generate_arithmetic(size, split, seed)
