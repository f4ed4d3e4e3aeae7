"""The one reader of question files (and of JSON Lines corpora) that every task uses.

A question file is JSON Lines (``.jsonl``), JSON (``.json``: a list of objects, or JSON
Lines under a ``.json`` name, as Search-R1 ships them) or Parquet, with the question, answer
and data-source columns named in ``DataConfig``. A field may be a dotted path into a nested
column (``reward_model.ground_truth``). What counts as a gold answer is the task's business
(a GSM8K solution, a list of aliases): the task passes its own ``gold_answers``.

Every problem raises ``DataError`` naming the file, then the line or row, then the problem:
``data/qa.jsonl: row 3 (line 5): missing or empty answer ('answer')``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from drmas.tasks import DataError, Question

if TYPE_CHECKING:
    from drmas.config import DataConfig

__all__ = ["field_value", "local_file", "read_jsonl", "read_questions", "read_rows"]

FILE_TYPES = (".jsonl", ".json", ".parquet")
BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark, which some editors write first: skipped."""
MISSING = object()
"""What ``field_value`` returns for an absent or null field."""


def local_file(spec: str) -> Path:
    """The local file ``spec`` names, or a DataError saying why it cannot be read."""
    if "://" in spec:
        raise DataError(f"{spec}: only local files are supported; copy the file here first")
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    return path


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line, streamed (a corpus can be large)."""
    with path.open("rb") as handle:
        yield from _json_lines(path, handle)


def _json_lines(path: Path, lines: Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Parse JSON Lines (each line with its line ending); a byte-order mark is ignored."""
    offset = 0
    for number, raw in enumerate(lines, start=1):
        body = raw.removeprefix(BOM) if number == 1 else raw
        line = _text(path, body, offset + len(raw) - len(body), number)
        offset += len(raw)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}: line {number}: invalid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}: line {number}: expected a JSON object, got {type(row).__name__}")
        yield number, row


def _text(path: Path, data: bytes, offset: int, line: int) -> str:
    """``data``, which starts at byte ``offset`` of the file, on line ``line``, as text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_line = line + data[: error.start].count(b"\n")
        raise DataError(
            f"{path}: not UTF-8 text (bad byte at offset {offset + error.start}) on line {bad_line}"
        ) from None


def _json_file(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A ``.json`` file: a JSON list of objects when it starts with ``[``, else JSON Lines."""
    data = path.read_bytes()
    body = data.removeprefix(BOM)
    if not body.lstrip().startswith(b"["):
        rows = _json_lines(path, data.splitlines(keepends=True))
        return [(f"row {index} (line {number})", row) for index, (number, row) in enumerate(rows)]
    try:
        rows = json.loads(_text(path, body, len(data) - len(body), 1))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: line {error.lineno}: invalid JSON ({error.msg})") from None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {index}: expected a JSON object, got {type(row).__name__}")
    return [(f"row {index}", row) for index, row in enumerate(rows)]


def _parquet_file(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None
    return [(f"row {index}", row) for index, row in enumerate(rows)]


def read_rows(spec: str) -> tuple[Path, list[tuple[str, dict[str, Any]]]]:
    """The file's rows, each with the label that messages name it by (``row 2 (line 3)``)."""
    suffix = Path(spec).suffix.lower()
    if suffix not in FILE_TYPES:
        raise DataError(f"{spec}: unsupported file type {suffix or '(none)'!r}; use one of {', '.join(FILE_TYPES)}")
    path = local_file(spec)
    if suffix == ".parquet":
        rows = _parquet_file(path)
    elif suffix == ".json":
        rows = _json_file(path)
    else:
        rows = [(f"row {index} (line {number})", row) for index, (number, row) in enumerate(read_jsonl(path))]
    if not rows:
        raise DataError(f"{path}: no rows")
    return path, rows


def field_value(row: dict[str, Any], field: str) -> Any:
    """The value of ``field`` (a column name, or a dotted path into nested columns), or
    MISSING when it is absent or null. A column whose own name has dots wins over a path."""
    if field in row:
        return MISSING if row[field] is None else row[field]
    value: Any = row
    for key in field.split("."):
        if not isinstance(value, dict) or value.get(key) is None:
            return MISSING
        value = value[key]
    return value


def _require_column(path: Path, rows: list[tuple[str, dict[str, Any]]], field: str, role: str) -> None:
    """Fail once for a column that no row has, rather than once per row."""
    if all(field_value(row, field) is MISSING for _, row in rows):
        columns = sorted({key for _, row in rows for key in row})
        raise DataError(f"{path}: no {role} column {field!r} (set data.{role}_field); columns: {', '.join(columns)}")


def _question_text(value: Any) -> str:
    """The question: a string, or the last user message of a chat (DAPO's ``prompt``)."""
    if isinstance(value, list):
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        value = users[-1] if users else None
    return value.strip() if isinstance(value, str) else ""


def _not_text(value: Any) -> str:
    """``: int 5, not text`` for a question of the wrong type, so that the message does not
    call a present value missing; else nothing."""
    if value is MISSING or isinstance(value, (str, list)):
        return ""
    shown = repr(value)
    return f": {type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}, not text"


def _data_source(value: Any, default: str) -> str:
    """A row's data source: its text or number, else ``default`` (the file's stem)."""
    if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value):
        return str(value)
    return default


def read_questions(spec: str, data: DataConfig, gold_answers: Callable[[Any], tuple[str, ...]]) -> list[Question]:
    """The questions of a file, in file order.

    ``gold_answers`` turns the answer field's value into the accepted answers (empty when
    there is none). The qid is the ``id`` column or else the row index, and must be unique;
    ``data_source`` defaults to the file's stem.
    """
    path, rows = read_rows(spec)
    _require_column(path, rows, data.question_field, "question")
    _require_column(path, rows, data.answer_field, "answer")
    questions, first_label = [], {}
    for index, (label, row) in enumerate(rows):
        raw_question = field_value(row, data.question_field)
        question = _question_text(raw_question)
        if not question:
            raise DataError(
                f"{path}: {label}: empty or missing question ({data.question_field!r}{_not_text(raw_question)})"
            )
        answers = gold_answers(field_value(row, data.answer_field))
        if not answers:
            raise DataError(f"{path}: {label}: missing or empty answer ({data.answer_field!r})")
        qid = str(index) if row.get("id") is None else str(row["id"])
        if qid in first_label:
            raise DataError(f"{path}: duplicated id {qid!r} ({first_label[qid]} and {label})")
        first_label[qid] = label
        source = _data_source(field_value(row, data.data_source_field), path.stem)
        questions.append(Question(qid, question, answers, source))
    return questions
