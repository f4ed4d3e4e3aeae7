"""The one reader of question files (and of JSON Lines corpora) that every task uses.

A question file is JSON Lines (``.jsonl``), JSON (``.json``: a list of objects, or JSON
Lines under a ``.json`` name, as Search-R1 ships them) or Parquet, with the question, answer
and data-source columns named in ``DataConfig``. A field may be a dotted path into a nested
column (``reward_model.ground_truth``). What counts as a gold answer is the task's business
(a GSM8K solution, a list of aliases): the task passes its own ``gold_answers``.

A dataset folder is read too, as the hub and ``datasets`` ship them:

- a ``datasets`` ``save_to_disk`` folder, read without the ``datasets`` package:
  ``state.json`` lists its ``data-0000i-of-0000n.arrow`` files (Arrow IPC streams), in
  order; a DatasetDict's ``dataset_dict.json`` names its splits, one subfolder each;
- a folder of data files (searched recursively), such as a hub repository's
  ``data/train-00000-of-00002.parquet``: a file's split is the name before its
  ``-0000i-of-0000n`` shard number, else its stem (``test.jsonl``).

A folder that holds one split is read whatever its name; else the split is
``data.train_split`` or ``data.eval_split``, and a split that is missing, in several
folders (``main/`` and ``socratic/``) or short of a shard fails naming what is there.

The question and answer columns are ``DataConfig``'s; while one of them is left at its
default and no row has it, the published forms are recognised: the question in
``problem`` (MATH), ``Problem`` (AIME) or a ``prompt`` chat (DAPO), the answer in
``Answer`` (AIME), ``golden_answers`` (NQ/HotpotQA), ``reward_model.ground_truth`` (DAPO)
or ``solution`` (MATH). A row's qid is its ``id``; its data source is its
``data_source``, else the file's stem or the folder's name (the folder above when that
names a split or a hub config: ``gsm8k/main/`` and ``gsm8k/test.jsonl`` are ``gsm8k``).

A file is local, or an object on S3 named ``s3://bucket/key``, read with the store's S3
settings (``store.endpoint``, else ``$DRMAS_S3_ENDPOINT``, then ``$AWS_ENDPOINT_URL``;
``store.region``; credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` only) and
its retries (``drmas.infra.store``). A folder is a local one or every object under an
``s3://bucket/prefix``. JSON Lines are streamed from S3 in ranged reads of
``S3_CHUNK_BYTES``, never held whole; a JSON, Parquet or Arrow file is read whole. A file
reads the same, byte for byte, from either place.

Every problem raises ``DataError`` naming the file, then the line or row, then the problem:
``data/qa.jsonl: row 3 (line 5): missing or empty answer ('answer')``; on S3 the file is its
URI (``s3://bucket/qa.jsonl: file not found``), and S3 failures are the store's messages,
which never hold credentials.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as paipc
import pyarrow.parquet as pq

from drmas.infra.store import Store, StoreError
from drmas.tasks import DataError, Question, Split

if TYPE_CHECKING:
    from drmas.config import DataConfig
    from drmas.infra.store import StoreLocation

__all__ = [
    "ANSWER_FORMS",
    "QUESTION_FORMS",
    "DataFile",
    "DataFolder",
    "FolderSplit",
    "Rows",
    "field_value",
    "local_file",
    "open_data",
    "read_jsonl",
    "read_questions",
    "read_rows",
]

logger = logging.getLogger(__name__)

FILE_TYPES = (".jsonl", ".json", ".parquet")
BOM = b"\xef\xbb\xbf"
"""A UTF-8 byte-order mark, which some editors write first: skipped."""
MISSING = object()
"""What ``field_value`` returns for an absent or null field."""
S3_CHUNK_BYTES = 8 << 20
"""Bytes per ranged read when JSON Lines are streamed from S3 (each read retried whole)."""
_S3_OBJECT = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,62})/(.*[^/])$")
"""``s3://bucket/key``: a valid bucket name, and a key that names an object (not a folder)."""
DATASET_STATE = "state.json"
"""What ``datasets``' ``save_to_disk`` writes beside a Dataset's Arrow files: their list."""
DATASET_DICT = "dataset_dict.json"
"""What it writes for a DatasetDict: ``{"splits": [...]}``, one subfolder per split."""
METADATA = frozenset({"dataset_info.json", "dataset_infos.json", DATASET_STATE, DATASET_DICT})
"""JSON files in a dataset folder that describe it and hold no rows (``dataset_infos.json``
sits at the root of many hub repositories)."""
_HUB_SHARD = re.compile(r"^(.+?)-(\d{5})-of-(\d{5})(?:-[0-9a-f]{16})?$")
"""A shard's stem as the hub and ``datasets`` name it: ``train-00000-of-00002``, with the
content hash that older hub conversions append (``-7320a6f3aba8ebd2``)."""
QUESTION_FORMS = ("problem", "Problem", "prompt")
"""Where published sets keep the question when there is no ``question`` column: MATH and
MATH-500, AIME 2024, and DAPO/veRL's chat ``prompt`` (recognised only as a chat: a plain
``prompt`` string is often already templated text, not a question)."""
ANSWER_FORMS = ("Answer", "golden_answers", "reward_model.ground_truth", "solution")
"""Where they keep the gold answer when there is no ``answer`` column: AIME 2024,
Search-R1's NQ/HotpotQA, DAPO/veRL, and MATH's worked solution (its last ``\\boxed{}``)."""


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
            return self.s3.read_object(self.key)
        except FileNotFoundError:
            raise DataError(f"{self.name}: file not found") from None
        except StoreError as error:
            raise DataError(f"{self.name}: {error}") from None

    def _chunks(self) -> Iterator[bytes]:
        """The object in ranged reads of S3_CHUNK_BYTES, each retried as the store retries
        a whole read (a read at an offset is idempotent)."""
        assert self.s3 is not None
        offset = 0
        try:
            for chunk in self.s3.object_chunks(self.key, self.size, S3_CHUNK_BYTES):
                offset += len(chunk)
                yield chunk
            if offset < self.size:
                raise DataError(f"{self.name}: ended at byte {offset} of {self.size} (changed while read?)")
        except FileNotFoundError:
            raise DataError(f"{self.name}: file not found") from None
        except StoreError as error:
            raise DataError(f"{self.name}: {error}") from None


@dataclass(frozen=True)
class DataFolder:
    """A folder of data files: a local directory, or every object under an S3 prefix.

    ``name`` is how messages name it: the local ``Path``, or the ``s3://`` URI.
    """

    name: Path | str
    path: Path | None = None
    """The local directory; None on S3."""
    s3: Store | None = None
    """On S3: a store rooted at the prefix's bucket."""
    key: str = ""
    """On S3: ``bucket/prefix``, as the store's filesystem names it."""

    def files(self) -> dict[str, DataFile]:
        """Every file below the folder, by its ``/``-separated path relative to it, sorted;
        hidden files and folders (``.cache/``, ``.gitattributes``) left out."""
        if self.path is not None:
            found = {
                p.relative_to(self.path).as_posix(): DataFile(p, path=p) for p in self.path.rglob("*") if p.is_file()
            }
        else:
            assert self.s3 is not None
            selector = pafs.FileSelector(self.key, recursive=True)
            try:
                infos = self.s3.object_info(selector)
            except StoreError as error:
                raise DataError(f"{self.name}: {error}") from None
            files = (info for info in infos if info.type == pafs.FileType.File)
            found = {
                info.path[len(self.key) + 1 :]: DataFile(
                    f"{self.name}/{info.path[len(self.key) + 1 :]}", s3=self.s3, key=info.path, size=info.size or 0
                )
                for info in files
            }
        visible = (name for name in found if not any(part.startswith(".") for part in name.split("/")))
        return {name: found[name] for name in sorted(visible)}


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


def open_data(spec: str, store: StoreLocation | Store | None = None) -> DataFile:
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


def _s3_file(spec: str, store: StoreLocation | Store | None) -> DataFile:
    s3, info = _s3_entry(spec, store)
    if info.type != pafs.FileType.File:
        raise DataError(f"{spec}: file not found")
    return DataFile(spec, s3=s3, key=info.path, size=info.size or 0)


def _s3_entry(spec: str, store: StoreLocation | Store | None) -> tuple[Store, pafs.FileInfo]:
    """The store of ``spec``'s bucket, and what its key names (a file, a folder, nothing)."""
    match = _S3_OBJECT.match(spec)
    if not match:
        raise DataError(f"{spec}: not s3://bucket/key (a valid bucket name, then the key of one object)")
    bucket = match.group(1)
    endpoint, region = (store.endpoint, store.region) if store is not None else (None, "us-east-1")
    try:
        s3 = Store(f"s3://{bucket}", endpoint, region)
        return s3, s3.object_info(f"{bucket}/{match.group(2)}")
    except StoreError as error:
        raise DataError(f"{spec}: {error}") from None


def open_location(spec: str, store: StoreLocation | Store | None = None) -> DataFile | DataFolder:
    """The file or the folder ``spec`` names (local, or on S3 as ``open_data`` reads it)."""
    if spec.startswith("s3://"):
        spec = spec.rstrip("/")
        s3, info = _s3_entry(spec, store)
        if info.type == pafs.FileType.Directory:
            return DataFolder(spec, s3=s3, key=info.path)
        if info.type != pafs.FileType.File:
            raise DataError(f"{spec}: {_not_found(spec)}")
        return DataFile(spec, s3=s3, key=info.path, size=info.size or 0)
    if "://" not in spec and Path(spec).is_dir():
        return DataFolder(Path(spec), path=Path(spec))
    if "://" not in spec and not Path(spec).exists():
        raise DataError(f"{spec}: {_not_found(spec)}")
    return open_data(spec, store)


def _not_found(spec: str) -> str:
    """A spec with a data file's suffix was meant as a file; one without may be a folder."""
    return "file not found" if Path(spec).suffix.lower() in FILE_TYPES else "no such file or folder"


def read_jsonl(path: Path | str, store: StoreLocation | Store | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
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


def _file_rows(file: DataFile) -> list[tuple[str, dict[str, Any]]]:
    """The rows of one ``.jsonl``, ``.json`` or ``.parquet`` file, each with its label."""
    suffix = Path(str(file.name)).suffix.lower()
    if suffix == ".parquet":
        return _parquet_file(file)
    if suffix == ".json":
        return _json_file(file)
    lines = _json_lines(file.name, file.lines())
    return [(f"row {index} (line {number})", row) for index, (number, row) in enumerate(lines)]


@dataclass(frozen=True)
class FolderSplit:
    """Which split of a dataset folder to read, and the setting that names it (messages
    name the setting, so that a missing split says what to change)."""

    name: str = "train"
    setting: str = "data.train_split"

    @classmethod
    def of(cls, data: DataConfig, split: Split) -> FolderSplit:
        return (
            cls(data.train_split, "data.train_split") if split == "train" else cls(data.eval_split, "data.eval_split")
        )


@dataclass(frozen=True)
class Rows:
    """A file's or folder's rows, each with the label that messages name it by
    (``row 2 (line 3)``, ``data/train-00001-of-00002.parquet: row 4``)."""

    name: Path | str
    """The file or folder as messages name it: its Path, or its ``s3://`` URI."""
    rows: list[tuple[str, dict[str, Any]]]
    source: str
    """The data source of a row without one: the file's stem, the folder's name."""


def read_rows(spec: str, store: StoreLocation | Store | None = None, split: FolderSplit | None = None) -> Rows:
    """The rows of a file or a dataset folder (see the module's docstring); ``store``: as
    for ``open_data``; ``split``: which split of a folder that holds several."""
    location = open_location(spec, store)
    suffix = Path(str(location.name)).suffix.lower()
    if isinstance(location, DataFile) and suffix not in FILE_TYPES:
        raise DataError(
            f"{spec}: unsupported file type {suffix or '(none)'!r}; use one of {', '.join(FILE_TYPES)}, "
            "or a dataset folder"
        )
    if isinstance(location, DataFolder):
        rows = _folder_rows(location, split or FolderSplit())
    else:
        rows = _file_rows(location)
    if not rows:
        raise DataError(f"{location.name}: no rows")
    return Rows(location.name, rows, default_source(str(location.name), folder=isinstance(location, DataFolder)))


GENERIC_NAMES = frozenset({"train", "test", "validation", "valid", "dev", "eval", "data", "main", "default"})
"""File and folder names that say which split or hub config they hold, not which data set:
a row's default source is named by the folder above them (``gsm8k/main/``, ``gsm8k/test.jsonl``)."""
_HUB_REPO = re.compile(r"^datasets--[^/]+--(.+)$")
"""A dataset repository's folder in the Hugging Face cache: ``datasets--ORG--NAME``."""
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def default_source(name: str, folder: bool) -> str:
    """The data source of a row without one: the file's stem or the folder's name, else, when
    that names a split, a shard or a hub config (``test``, ``train-00000-of-00001``,
    ``main``), the nearest folder above that names the set (a cached hub repository's by its
    NAME); the stem itself when none does."""
    _, scheme, path = name.rpartition("://")
    parts = [part for part in path.split("/") if part not in ("", ".", "..")]
    above = parts[1:-1] if scheme else parts[:-1]  # a bucket names no data set
    own = parts[-1] if folder else parts[-1].split(".", 1)[0]
    for part in [own, *reversed(above)]:
        repo = _HUB_REPO.match(part)
        if repo:
            return repo.group(1)
        if _split_of(part).lower() not in GENERIC_NAMES and part != "snapshots" and not _COMMIT.match(part):
            return part
    return own


def _folder_rows(folder: DataFolder, split: FolderSplit) -> list[tuple[str, dict[str, Any]]]:
    """A ``save_to_disk`` Dataset or DatasetDict, else the data files of one split."""
    files = folder.files()
    if DATASET_DICT in files:
        splits = _json_object(files[DATASET_DICT]).get("splits")
        if not isinstance(splits, list) or not splits or not all(isinstance(name, str) for name in splits):
            raise DataError(f"{files[DATASET_DICT].name}: no list of split names under 'splits'")
        chosen = _choose_split(folder, split, {name: [] for name in splits})
        return _arrow_dataset(files, f"{chosen}/")
    if DATASET_STATE in files:
        return _arrow_dataset(files, "")
    data_files = [
        name for name in files if Path(name).suffix.lower() in FILE_TYPES and posixpath.basename(name) not in METADATA
    ]
    if not data_files:
        raise DataError(
            f"{folder.name}: no data files in the folder (.jsonl, .json or .parquet files, or a datasets "
            f"save_to_disk folder with {DATASET_STATE} or {DATASET_DICT}); it holds: {_listing(list(files))}"
        )
    by_split: dict[str, list[str]] = {}
    for name in data_files:
        by_split.setdefault(_split_of(name), []).append(name)
    chosen = by_split[_choose_split(folder, split, by_split)]
    _check_shards(folder, chosen)
    return [(f"{name}: {label}", row) for name in chosen for label, row in _file_rows(files[name])]


def _split_of(name: str) -> str:
    """The split a data file belongs to: the name before its shard number, else its stem."""
    stem = posixpath.basename(name).split(".", 1)[0]
    shard = _HUB_SHARD.match(stem)
    return shard.group(1) if shard else stem


def _choose_split(folder: DataFolder, split: FolderSplit, splits: dict[str, list[str]]) -> str:
    """The one split there is, else the one ``split`` names; a DataError listing the
    splits (and their files, when ``splits`` holds them) when that is not there."""
    if len(splits) == 1:
        [only] = splits
        if only != split.name:
            logger.info("%s: reading its only split %r (%s is %r)", folder.name, only, split.setting, split.name)
        return only
    if split.name in splits:
        return split.name
    listed = "; ".join(f"{name} ({_listing(files)})" for name, files in sorted(splits.items()) if files)
    listed = listed or ", ".join(sorted(splits))
    raise DataError(f"{folder.name}: no split {split.name!r} ({split.setting}); its splits: {listed}")


def _listing(names: list[str], most: int = 6) -> str:
    """Names for a message, the first ``most`` of them and how many more."""
    if not names:
        return "nothing"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _check_shards(folder: DataFolder, names: list[str]) -> None:
    """One folder, and every shard that a ``-of-0000n`` name promises."""
    parents = sorted({posixpath.dirname(name) or "." for name in names})
    if len(parents) > 1:
        raise DataError(
            f"{folder.name}: split {_split_of(names[0])!r} is in several folders ({', '.join(parents)}: "
            f"{_listing(names)}); name the folder to read"
        )
    shards = [match for name in names if (match := _HUB_SHARD.match(posixpath.basename(name).split(".", 1)[0]))]
    for count in sorted({int(shard.group(3)) for shard in shards}):
        present = {int(shard.group(2)) for shard in shards if int(shard.group(3)) == count}
        missing = sorted(set(range(count)) - present)
        if missing:
            names_missing = [f"{_split_of(names[0])}-{index:05d}-of-{count:05d}" for index in missing]
            raise DataError(f"{folder.name}: {len(present)} of {count} shards; missing: {_listing(names_missing)}")


def _json_object(file: DataFile) -> dict[str, Any]:
    """A small JSON file that must hold an object (``state.json``, ``dataset_dict.json``)."""
    try:
        value = json.loads(file.read_bytes())
    except (UnicodeDecodeError, ValueError) as error:
        raise DataError(f"{file.name}: invalid JSON ({error})") from None
    if not isinstance(value, dict):
        raise DataError(f"{file.name}: expected a JSON object, got {type(value).__name__}")
    return value


def _arrow_dataset(files: dict[str, DataFile], prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a ``save_to_disk`` Dataset under ``prefix``: the Arrow files its
    ``state.json`` lists under ``_data_files``, in that order (only files inside the
    folder: a listed ``../x`` is not among ``files``, so it is missing)."""
    state_name = f"{prefix}{DATASET_STATE}"
    if state_name not in files:
        raise DataError(f"{files[DATASET_DICT].name}: names split {prefix[:-1]!r}, but {state_name} is missing")
    state = files[state_name]
    listed = _json_object(state).get("_data_files")
    entries = listed if isinstance(listed, list) else []
    names = [entry.get("filename") if isinstance(entry, dict) else None for entry in entries]
    if not names or not all(isinstance(name, str) and name for name in names):
        raise DataError(
            f"{state.name}: no list of {{'filename': ...}} under '_data_files' (not a save_to_disk folder?)"
        )
    rows: list[tuple[str, dict[str, Any]]] = []
    for name in names:
        if f"{prefix}{name}" not in files:
            raise DataError(f"{state.name}: lists {name}, which is missing")
        arrow = files[f"{prefix}{name}"]
        rows += [(f"{prefix}{name}: row {index}", row) for index, row in enumerate(_arrow_stream(arrow))]
    return rows


def _arrow_stream(file: DataFile) -> list[dict[str, Any]]:
    """The rows of an Arrow IPC stream, the format ``datasets`` writes its tables in."""
    try:
        source = pa.memory_map(str(file.path)) if file.path is not None else pa.BufferReader(file.read_bytes())
        with source, paipc.open_stream(source) as reader:
            return reader.read_all().to_pylist()
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{file.name}: not a readable Arrow stream, as datasets writes ({error})") from None


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


def _column(
    rows: Rows, configured: str, default: str, forms: tuple[str, ...], role: str, usable: Callable[[str, Any], bool]
) -> str:
    """The field to read ``role`` from: ``configured`` when some row has it; while it is
    the default and no row has it, the first of the published ``forms`` that some row has
    a ``usable`` value in. Else one DataError, naming the columns the rows do have."""
    if any(field_value(row, configured) is not MISSING for _, row in rows.rows):
        return configured
    if configured == default:
        for form in forms:
            if any(usable(form, field_value(row, form)) for _, row in rows.rows):
                logger.info(
                    "%s: the %s is in %r (a published form; data.%s_field to choose)", rows.name, role, form, role
                )
                return form
    columns = sorted({key for _, row in rows.rows for key in row})
    tried = f"; nor any of its published forms: {', '.join(forms)}" if configured == default else ""
    raise DataError(
        f"{rows.name}: no {role} column {configured!r} (set data.{role}_field); columns: {', '.join(columns)}"
        f"{_nested_keys(rows, configured)}{tried}"
    )


def _nested_keys(rows: Rows, field: str) -> str:
    """For a dotted ``field`` that is missing: the keys found at the deepest part of its
    path that the rows do have (``; reward_model.ground_truth holds: answers``), else
    nothing."""
    parts = field.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:depth])
        keys = sorted(
            {key for _, row in rows.rows if isinstance(value := field_value(row, prefix), dict) for key in value}
        )
        if keys:
            return f"; {prefix} holds: {', '.join(keys)}"
    return ""


def _default(data: DataConfig, field: str) -> Any:
    return type(data).model_fields[field].default


def _is_question(form: str, value: Any) -> bool:
    """Whether ``value`` is a question in its published ``form``: text, and for
    ``prompt`` a chat only (a plain ``prompt`` string is often templated text)."""
    return bool(_question_text(value)) and (form != "prompt" or isinstance(value, list))


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
    store: StoreLocation | Store | None = None,
    split: Split = "train",
    worked_solution: Callable[[Any], str] | None = None,
) -> list[Question]:
    """The questions of a file or a dataset folder (local, or on S3 read with ``store``'s
    S3 endpoint and region: see ``open_data``), in file order; of a folder with several
    splits, the one ``data.{split}_split`` names.

    ``gold_answers`` turns the answer field's value into the accepted answers (empty when
    there is none); ``worked_solution``, when given, into ``Question.solution``. The qid
    is the ``id`` column or else the row index, and must be unique;
    ``data_source`` defaults to the file's stem or the folder's name.
    """
    found = read_rows(spec, store, FolderSplit.of(data, split))
    path = found.name
    question_field = _column(
        found, data.question_field, _default(data, "question_field"), QUESTION_FORMS, "question", _is_question
    )
    answer_field = _column(
        found,
        data.answer_field,
        _default(data, "answer_field"),
        ANSWER_FORMS,
        "answer",
        lambda _, v: bool(gold_answers(v)),
    )
    questions: list[Question] = []
    first_label: dict[str, str] = {}
    for index, (label, row) in enumerate(found.rows):
        raw_question = field_value(row, question_field)
        question = _question_text(raw_question)
        if not question:
            raise DataError(f"{path}: {label}: empty or missing question ({question_field!r}{_not_text(raw_question)})")
        raw_answer = field_value(row, answer_field)
        answers = gold_answers(raw_answer)
        if not answers:
            raise DataError(f"{path}: {label}: missing or empty answer ({answer_field!r})")
        qid = str(index) if row.get("id") is None else str(row["id"])
        if qid in first_label:
            raise DataError(f"{path}: duplicated id {qid!r} ({first_label[qid]} and {label})")
        first_label[qid] = label
        source = _data_source(field_value(row, data.data_source_field), found.source)
        solution = worked_solution(raw_answer) if worked_solution else ""
        questions.append(Question(qid, question, answers, source, solution))
    return questions
