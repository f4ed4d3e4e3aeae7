"""The search task's data: its passage corpus and its question files, or the generated world's.

Real data is Search-R1's: a JSONL corpus of passages (FlashRAG ``contents`` whose first line
is the title, or ``text`` with an optional ``title``) and NQ/HotpotQA-style question files
(``question`` and ``golden_answers``), local or on S3. ``generated:facts`` names the
generated world (``drmas.tasks.search.world``) instead. The corpus hash that a cached index
and a retrieval service are keyed by is computed here from the corpus a config names,
streamed, so that a wiki-scale corpus need not fit in memory to be checked.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from drmas.tasks import DataError
from drmas.tasks.files import read_jsonl, read_questions
from drmas.tasks.search.retrieval import IndexMethod, Tokenization, corpus_hash
from drmas.tasks.search.world import GENERATED_FACTS, GENERATED_PREFIX, generated_facts
from drmas.team.orchestras import Passage

if TYPE_CHECKING:
    from drmas.config import DataConfig
    from drmas.infra.store import Store, StoreLocation
    from drmas.team.episodes import Question

__all__ = ["corpus_for", "corpus_hash_for", "iter_corpus", "load_corpus", "load_qa"]


def corpus_for(data: DataConfig, seed: int, store: StoreLocation | Store | None = None) -> list[Passage]:
    """The passages a search run retrieves from: ``data.corpus``, or the generated world's.
    ``store``: the S3 endpoint and region of an ``s3://`` corpus (``load_corpus``)."""
    if data.corpus:
        return load_corpus(data.corpus, store)
    return generated_facts(data, seed)[0]


def corpus_hash_for(
    data: DataConfig,
    seed: int,
    store: StoreLocation | Store | None = None,
    method: IndexMethod = Tokenization(),
) -> str:
    """``corpus_hash`` of ``corpus_for(data, seed, store)`` indexed by ``method`` (by
    default BM25, tokenised as ``Tokenization()`` says); a corpus file is streamed, never
    held whole (a wiki-scale corpus does not fit a rollout driver's memory). The hash is of
    the passages, not of where they are: the same file hashes the same, local or on S3."""
    if data.corpus:
        passages = iter_corpus(data.corpus, store)
        first = next(passages, None)
        if first is None:
            raise DataError(f"{data.corpus}: no passages (the file is empty)")
        return corpus_hash(itertools.chain([first], passages), method)
    return corpus_hash(generated_facts(data, seed)[0], method)


def _passage_text(row: dict[str, Any]) -> str | None:
    """The passage text: FlashRAG ``contents`` (title on its first line) or ``text``.

    A title is kept, Search-R1 style, as ``(Title: ...)`` before the body: it often holds
    the very entity that a query names.
    """
    if isinstance(row.get("contents"), str):
        title, newline, body = row["contents"].strip().partition("\n")
        title, body = (title.strip().strip('"'), body.strip()) if newline else ("", title)
    elif isinstance(row.get("text"), str):
        title, body = str(row.get("title") or "").strip(), row["text"].strip()
    else:
        return None
    if not body:
        return None
    return f"(Title: {title}) {body}" if title else body


def load_corpus(path: str, store: StoreLocation | Store | None = None) -> list[Passage]:
    """A JSONL corpus; each line has ``contents`` or ``text``, and an optional ``id``.

    A line without an id gets its line number, so ids stay stable when the file is read
    again. Ids must be unique: a search result is reported by id. ``path`` is a local file
    or ``s3://bucket/key``, read with ``store``'s S3 endpoint and region (the config's
    ``store`` section or an open Store; unset: the endpoint from the environment), as
    ``drmas.tasks.files.open_data`` reads it.
    """
    passages = list(iter_corpus(path, store))
    if not passages:
        raise DataError(f"{path}: no passages (the file is empty)")
    return passages


def iter_corpus(path: str, store: StoreLocation | Store | None = None) -> Iterator[Passage]:
    """The passages of ``load_corpus``, streamed (from S3 too): what hashing a corpus too
    large to hold needs (``corpus_hash_for``). An empty file yields nothing."""
    first_line: dict[str, int] = {}
    for number, row in read_jsonl(path, store):
        text = _passage_text(row)
        if text is None:
            keys = ", ".join(sorted(row)) or "none"
            raise DataError(
                f"{path}: line {number}: no passage text (expected a non-empty 'contents' or "
                f"'text' string; keys: {keys})"
            )
        pid = str(row["id"]) if row.get("id") is not None else str(number)
        if pid in first_line:
            raise DataError(f"{path}: line {number}: duplicate id {pid!r} (first on line {first_line[pid]})")
        first_line[pid] = number
        yield Passage(pid, text)


def _answers(value: Any) -> tuple[str, ...]:
    """Accepted answers from a list (Search-R1's ``golden_answers``) or a single value."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(
        str(item).strip()
        for item in values
        if isinstance(item, (str, int, float)) and not isinstance(item, bool) and str(item).strip()
    )


def load_qa(
    spec: str,
    split: Literal["train", "eval"],
    data: DataConfig,
    seed: int,
    store: StoreLocation | Store | None = None,
) -> list[Question]:
    """The questions of one split: ``generated:facts``, or a JSONL, JSON or Parquet file or
    a dataset folder (local, or ``s3://bucket/key`` read with ``store``'s S3 endpoint and
    region).

    A file is the split itself (``split`` picks the half of a generated set, or the
    ``data.{split}_split`` of a folder), read by ``drmas.tasks.files.read_questions``; its
    answer column holds one answer or a list of them (Search-R1's ``golden_answers``), and
    empty ones are dropped.
    """
    if spec.startswith(GENERATED_PREFIX):
        name = spec[len(GENERATED_PREFIX) :]
        if name != GENERATED_FACTS:
            raise DataError(
                f"{spec}: no such generated set for the search task (available: {GENERATED_PREFIX}{GENERATED_FACTS})"
            )
        _, train, evaluation = generated_facts(data, seed)
        return train if split == "train" else evaluation
    return read_questions(spec, data, _answers, store=store, split=split)
