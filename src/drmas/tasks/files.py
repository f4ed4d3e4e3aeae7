"""The one reader of question files (and of JSON Lines corpora) that every task uses.

A question file is JSON Lines (``.jsonl``), JSON (``.json``: a list of objects, or JSON
Lines under a ``.json`` name, as Search-R1 ships them) or Parquet, with the question, answer
and data-source columns named in ``DataConfig``. A field may be a dotted path into a nested
column (``reward_model.ground_truth``). What counts as a gold answer is the task's business
(a GSM8K solution, a list of aliases): the task passes its own ``gold_answers``.

A file is local, or an object on S3 named ``s3://bucket/key``, read with the store's S3
settings (``store.endpoint``, else ``$DRMAS_S3_ENDPOINT``, then ``$AWS_ENDPOINT_URL``;
``store.region``; credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` only) and
its retries (``drmas.infra.store``). JSON Lines are streamed from S3 in ranged reads of
``S3_CHUNK_BYTES``, never held whole; a JSON or Parquet file is read whole. A file reads the
same, byte for byte, from either place.

Every problem raises ``DataError`` naming the file, then the line or row, then the problem:
``data/qa.jsonl: row 3 (line 5): missing or empty answer ('answer')``; on S3 the file is its
URI (``s3://bucket/qa.jsonl: file not found``), and S3 failures are the store's messages,
which never hold credentials.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from drmas.infra.store import Store, StoreError
from drmas.tasks import DataError, Question

if TYPE_CHECKING:
    from drmas.config import DataConfig, StoreConfig

__all__ = ["DataFile", "field_value", "local_file", "open_data", "read_jsonl", "read_questions", "read_rows"]

FILE_TYPES = (".jsonl", ".json", ".parquet")
BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark, which some editors write first: skipped."""
MISSING = object()
"""What ``field_value`` returns for an absent or null field."""
S3_CHUNK_BYTES = 8 << 20
"""Bytes per ranged read when JSON Lines are streamed from S3 (each read retried whole)."""
_S3_OBJECT = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,62})/(.*[^/])$")
"""``s3://bucket/key``: a valid bucket name, and a key that names an object (not a folder)."""


@dataclass(frozen=True)
class DataFile:
    """A question or corpus file that exists: a local file, or an object on S3.

    ``name`` is how messages name it: the local ``Path``, or the ``s3://`` URI.
    """

    name: Path | str
    path: Path | None = None
    """The local file; None on S3."""
    s3: Store | None = None
    """On S3: a store rooted at the object's bucket (its filesystem, retries and messages)."""
    key: str = ""
    """On S3: ``bucket/key``, as the store's filesystem names the object."""
    size: int = 0
    """On S3: the object's size in bytes."""

    def lines(self) -> Iterator[bytes]:
        """Every line with its line ending (``\\n``), streamed."""
        if self.path is not None:
            with self.path.open("rb") as handle:
                yield from handle
            return
        yield from _split_lines(self._chunks())

    def read_bytes(self) -> bytes:
        """The whole file."""
        if self.path is not None:
            return self.path.read_bytes()
        assert self.s3 is not None
        try:
            return self.s3._read(self.key)
        except FileNotFoundError:
            raise DataError(f"{self.name}: file not found") from None
        except StoreError as error:
            raise DataError(f"{self.name}: {error}") from None

    def _chunks(self) -> Iterator[bytes]:
        """The object in ranged reads of S3_CHUNK_BYTES, each retried as the store retries
        a whole read (a read at an offset is idempotent)."""
        assert self.s3 is not None
        s3, offset = self.s3, 0
        try:
            with s3._call(s3.fs.open_input_file, self.key) as handle:
                while offset < self.size:
                    chunk = s3._call(_read_at, self.key, handle, min(S3_CHUNK_BYTES, self.size - offset), offset)
                    if not chunk:
                        raise DataError(f"{self.name}: ended at byte {offset} of {self.size} (changed while read?)")
                    offset += len(chunk)
                    yield chunk
        except FileNotFoundError:
            raise DataError(f"{self.name}: file not found") from None
        except StoreError as error:
            raise DataError(f"{self.name}: {error}") from None


def _read_at(key: str, handle: pa.NativeFile, size: int, offset: int) -> bytes:
    """``size`` bytes of ``handle`` from ``offset`` (``key`` names it in the store's messages)."""
    return handle.read_at(size, offset)


def _split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a stream of chunks, each with its ``\\n`` (the last one may lack it),
    split as iterating over a file opened in binary mode splits them."""
    pending: list[bytes] = []
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            pending.append(chunk[start : end + 1])
            yield b"".join(pending)
            pending.clear()
            start = end + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)


def local_file(spec: str) -> Path:
    """The local file ``spec`` names, or a DataError saying why it cannot be read."""
    if "://" in spec:
        raise DataError(f"{spec}: only local files are supported; copy the file here first")
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    return path


def open_data(spec: str, store: StoreConfig | Store | None = None) -> DataFile:
    """The file ``spec`` names: a local path or ``s3://bucket/key``, or a DataError saying
    why it cannot be read.

    ``store`` gives the S3 endpoint and region (the config's ``store`` section or an open
    Store; unset: the endpoint from the environment as the store resolves it, region
    us-east-1). Credentials come from the environment only.
    """
    if spec.startswith("s3://"):
        return _s3_file(spec, store)
    if "://" in spec:
        raise DataError(f"{spec}: only local files and s3:// objects are supported; copy the file here first")
    path = local_file(spec)
    return DataFile(path, path=path)


def _s3_file(spec: str, store: StoreConfig | Store | None) -> DataFile:
    match = _S3_OBJECT.match(spec)
    if not match:
        raise DataError(f"{spec}: not s3://bucket/key (a valid bucket name, then the key of one object)")
    bucket = match.group(1)
    endpoint, region = (store.endpoint, store.region) if store is not None else (None, "us-east-1")
    try:
        s3 = Store(f"s3://{bucket}", endpoint, region)
        info = s3._call(s3.fs.get_file_info, f"{bucket}/{match.group(2)}")
    except StoreError as error:
        raise DataError(f"{spec}: {error}") from None
    if info.type != pafs.FileType.File:
        raise DataError(f"{spec}: file not found")
    return DataFile(spec, s3=s3, key=info.path, size=info.size or 0)


def read_jsonl(path: Path | str, store: StoreConfig | Store | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line, streamed (a corpus can be large).

    ``path`` is a local Path, or a spec (a local path or ``s3://bucket/key``, read as
    ``open_data(path, store)`` reads it, so a missing file is a DataError)."""
    if isinstance(path, Path):
        with path.open("rb") as handle:
            yield from _json_lines(path, handle)
        return
    file = open_data(path, store)
    yield from _json_lines(file.name, file.lines())


def _json_lines(path: Path | str, lines: Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
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


def _text(path: Path | str, data: bytes, offset: int, line: int) -> str:
    """``data``, which starts at byte ``offset`` of the file, on line ``line``, as text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        bad_line = line + data[: error.start].count(b"\n")
        raise DataError(
            f"{path}: not UTF-8 text (bad byte at offset {offset + error.start}) on line {bad_line}"
        ) from None


def _json_file(file: DataFile) -> list[tuple[str, dict[str, Any]]]:
    """A ``.json`` file: a JSON list of objects when it starts with ``[``, else JSON Lines."""
    path, data = file.name, file.read_bytes()
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


def _parquet_file(file: DataFile) -> list[tuple[str, dict[str, Any]]]:
    source = file.path if file.path is not None else pa.BufferReader(file.read_bytes())
    try:
        rows = pq.read_table(source).to_pylist()
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{file.name}: not a readable Parquet file ({error})") from None
    return [(f"row {index}", row) for index, row in enumerate(rows)]


def read_rows(
    spec: str, store: StoreConfig | Store | None = None
) -> tuple[Path | str, list[tuple[str, dict[str, Any]]]]:
    """The file's rows, each with the label that messages name it by (``row 2 (line 3)``),
    and the file's name in messages (its Path, or its ``s3://`` URI). ``store``: as for
    ``open_data``."""
    suffix = Path(spec).suffix.lower()
    if suffix not in FILE_TYPES:
        raise DataError(f"{spec}: unsupported file type {suffix or '(none)'!r}; use one of {', '.join(FILE_TYPES)}")
    file = open_data(spec, store)
    if suffix == ".parquet":
        rows = _parquet_file(file)
    elif suffix == ".json":
        rows = _json_file(file)
    else:
        lines = _json_lines(file.name, file.lines())
        rows = [(f"row {index} (line {number})", row) for index, (number, row) in enumerate(lines)]
    if not rows:
        raise DataError(f"{file.name}: no rows")
    return file.name, rows


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


def _require_column(path: Path | str, rows: list[tuple[str, dict[str, Any]]], field: str, role: str) -> None:
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


def read_questions(
    spec: str,
    data: DataConfig,
    gold_answers: Callable[[Any], tuple[str, ...]],
    *,
    store: StoreConfig | Store | None = None,
) -> list[Question]:
    """The questions of a file (local, or ``s3://bucket/key`` read with ``store``'s S3
    endpoint and region: see ``open_data``), in file order.

    ``gold_answers`` turns the answer field's value into the accepted answers (empty when
    there is none). The qid is the ``id`` column or else the row index, and must be unique;
    ``data_source`` defaults to the file's stem.
    """
    path, rows = read_rows(spec, store)
    _require_column(path, rows, data.question_field, "question")
    _require_column(path, rows, data.answer_field, "answer")
    questions: list[Question] = []
    first_label: dict[str, str] = {}
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
        source = _data_source(field_value(row, data.data_source_field), Path(path).stem)
        questions.append(Question(qid, question, answers, source))
    return questions
