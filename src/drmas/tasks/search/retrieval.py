"""Retrieval over a passage corpus, BM25 here, and any method's index cached in the store.

A retrieval method (``IndexMethod``) turns passages into a searchable index
(``SearchIndex``) and says what identifies that index: BM25 terms (``Tokenization``, this
module) or dense embeddings (``drmas.tasks.search.dense.Encoder``). Both are cached alike by
``cached_retriever``, under ``{method's cache prefix}/{corpus_hash}``, the hash holding the
method's settings, and loaded without unpickling anything.

BM25 (``bm25s``) scores lower-cased word tokens, split as bm25s's tokenizer does, with its
English stop words removed and no stemming unless ``task.retrieval_stemmer: english``
(Snowball, through PyStemmer) or ``task.retrieval_stopwords: none`` say otherwise
(``Tokenization``). An index is built once per corpus and tokenisation and cached in the
artifact store under ``_cache/bm25/{corpus_hash}``.

Its own module because two sides use it: the search task retrieves in process with it, and
the retrieval service (``drmas.tasks.search.service``) serves the same index over HTTP.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import bm25s
import Stemmer
from bm25s.stopwords import STOPWORDS_EN

from drmas.infra.store import Artifact, ArtifactExists, ArtifactWriter, CorruptArtifact, Store
from drmas.team.orchestras import Passage

if TYPE_CHECKING:
    from drmas.config import TaskConfig

__all__ = [
    "CACHE_PREFIX",
    "INDEX_DIR",
    "INDEX_FORMAT",
    "PASSAGES_FILE",
    "STOPWORDS",
    "TOKEN_PATTERN",
    "IndexMethod",
    "Retriever",
    "SearchIndex",
    "Tokenization",
    "cached_retriever",
    "corpus_hash",
    "read_passages",
    "write_passages",
]

logger = logging.getLogger(__name__)

INDEX_FORMAT = "drmas.bm25/1"
"""Part of the corpus hash: a change of tokenisation or layout must miss old caches."""
CACHE_PREFIX = "_cache/bm25"
PASSAGES_FILE = "passages.jsonl"
INDEX_DIR = "index"
TOKEN_PATTERN = r"\w+"
"""Every word, a one-letter or one-digit word too (bm25s's default pattern drops those)."""
_WORD = re.compile(TOKEN_PATTERN)
STOPWORDS = frozenset(STOPWORDS_EN)
"""bm25s's English stop words: never indexed unless ``task.retrieval_stopwords: none``."""


class SearchIndex(Protocol):
    """A corpus made searchable: ``Retriever`` (BM25) or ``DenseRetriever`` (dense)."""

    passages: list[Passage]

    @property
    def method(self) -> IndexMethod:
        """How it was built: what its corpus hash holds."""
        ...

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """The best ``k`` passages for each query, best first."""
        ...

    def save_to(self, writer: ArtifactWriter) -> None:
        """Its passages and index, as ``method.load`` reads them back."""
        ...


class IndexMethod(Protocol):
    """How passages become a ``SearchIndex``, and what identifies one (``task.retrieval_method``)."""

    name: ClassVar[str]
    """bm25 or dense, as ``task.retrieval_method`` names it."""
    label: ClassVar[str]
    """The method as messages name it: BM25, dense."""
    format: ClassVar[str]
    """The index's format: part of the corpus hash, so a change of layout misses old caches."""
    cache_prefix: ClassVar[str]
    """Where the store caches this method's indexes, under their corpus hash."""

    def hashed(self) -> bytes:
        """What the corpus hash holds of the settings besides the format."""
        ...

    def describe(self) -> dict[str, Any]:
        """The settings, as the cache's meta and the service's /health report them."""
        ...

    def build(self, passages: list[Passage]) -> SearchIndex: ...

    def load(self, artifact: Artifact) -> SearchIndex:
        """An index that ``SearchIndex.save_to`` wrote; CorruptArtifact if it cannot be one."""
        ...


@dataclass(frozen=True)
class Tokenization:
    """How passages and queries become BM25 terms: lower case, ``TOKEN_PATTERN`` words,
    bm25s's English stop words dropped, optionally stemmed (Snowball, PyStemmer), as
    bm25s's own tokenizer does it.

    An index answers only queries tokenised as its passages were (a stemmed index knows
    "run", not "running"), so the tokenisation is part of the corpus hash: a cached index
    is reused, and a retrieval service accepted, only for the same one.
    """

    name: ClassVar[str] = "bm25"
    label: ClassVar[str] = "BM25"
    format: ClassVar[str] = INDEX_FORMAT
    cache_prefix: ClassVar[str] = CACHE_PREFIX

    stemmer: Literal["none", "english"] = "none"
    stopwords: Literal["none", "english"] = "english"

    @classmethod
    def of(cls, task: TaskConfig) -> Tokenization:
        """The config's (``task.retrieval_stemmer``, ``task.retrieval_stopwords``)."""
        return cls(task.retrieval_stemmer, task.retrieval_stopwords)

    def tokens(self, texts: list[str]) -> list[list[str]]:
        """Each text's terms: what ``bm25s.tokenize(texts, token_pattern=TOKEN_PATTERN,
        stopwords=..., stemmer=...)`` returns as strings (a test holds them equal), by its
        method (each distinct word stemmed once, by PyStemmer's ``stemWords``), in a plain
        loop that takes less time (bm25s rebuilds its stop-word set per text; 1.1-1.7x in
        ``bench/retrieval.py``)."""
        stop = STOPWORDS if self.stopwords == "english" else frozenset()
        words = [[word for word in _WORD.findall(text.lower()) if word not in stop] for text in texts]
        if self.stemmer == "none":
            return words
        distinct = list({word for text_words in words for word in text_words})
        stems = dict(zip(distinct, _stemmer().stemWords(distinct), strict=True))
        return [[stems[word] for word in text_words] for text_words in words]

    def hashed(self) -> bytes:
        """What the corpus hash holds of it: nothing for the default, so that indexes
        cached and hashes pinned before stemming was an option stay valid."""
        return b"" if self == Tokenization() else json.dumps([self.stemmer, self.stopwords]).encode()

    def describe(self) -> dict[str, Any]:
        return {"stemmer": self.stemmer, "stopwords": self.stopwords}

    def build(self, passages: list[Passage]) -> Retriever:
        return Retriever.build(passages, self)

    def load(self, artifact: Artifact) -> Retriever:
        return Retriever.load_from(artifact, self)


_THREAD_STEMMERS = threading.local()


def _stemmer() -> Stemmer.Stemmer:
    """This thread's English stemmer: a PyStemmer object has state and must not be called
    from two threads at once (the retrieval service answers on many)."""
    if not hasattr(_THREAD_STEMMERS, "english"):
        _THREAD_STEMMERS.english = Stemmer.Stemmer("english")
    return _THREAD_STEMMERS.english


class Retriever:
    """BM25 over a fixed list of passages.

    A passage that shares no term with a query is never returned for it: BM25 scores it 0,
    and an unrelated passage would only teach the agent that search results are noise.
    """

    def __init__(self, index: bm25s.BM25, passages: list[Passage], tokenization: Tokenization = Tokenization()) -> None:
        self.index = index
        self.passages = passages
        self.tokenization = tokenization

    @property
    def method(self) -> Tokenization:
        return self.tokenization

    @classmethod
    def build(cls, passages: list[Passage], tokenization: Tokenization = Tokenization()) -> Retriever:
        """Index the passages (numpy backend: no JIT warm-up, same results everywhere)."""
        if not passages:
            raise ValueError("cannot build a retriever over an empty corpus")
        index = bm25s.BM25(backend="numpy")
        index.index(tokenization.tokens([passage.text for passage in passages]), show_progress=False)
        return cls(index, passages, tokenization)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """The best ``k`` passages for each query, best first, in one batched call.

        A query with no indexed term (empty, whitespace, only stopwords or unknown words)
        gets []; ``k`` beyond the corpus size is clamped to it.
        """
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        vocabulary = self.index.vocab_dict
        tokens = [[token for token in terms if token in vocabulary] for terms in self.tokenization.tokens(queries)]
        asked = [position for position, query_tokens in enumerate(tokens) if query_tokens]
        results: list[list[Passage]] = [[] for _ in queries]
        if not asked:
            return results
        found, scores = self.index.retrieve(
            [tokens[position] for position in asked],
            k=min(k, len(self.passages)),
            show_progress=False,
            n_threads=0,
            backend_selection="numpy",
        )
        for position, row, row_scores in zip(asked, found, scores, strict=True):
            hits = zip(row.tolist(), row_scores.tolist(), strict=True)
            results[position] = [self.passages[i] for i, score in hits if score > 0]
        return results

    @staticmethod
    def corpus_hash(passages: Iterable[Passage], tokenization: Tokenization = Tokenization()) -> str:
        """``corpus_hash`` of the passages tokenised as ``tokenization``."""
        return corpus_hash(passages, tokenization)

    def save_to(self, writer: ArtifactWriter) -> None:
        """The passages and every file bm25s writes (numpy arrays without pickle, JSON)."""
        write_passages(writer, self.passages)
        with tempfile.TemporaryDirectory() as folder:
            self.index.save(folder, show_progress=False, allow_pickle=False)
            writer.put_dir(folder, INDEX_DIR)

    @classmethod
    def load_from(cls, artifact: Artifact, tokenization: Tokenization = Tokenization()) -> Retriever:
        """A retriever saved by ``save_to`` from passages tokenised as ``tokenization``
        (the cache path's hash says so); CorruptArtifact if its files do not make one.

        Arrays are loaded with ``allow_pickle=False``: a store is input, and unpickling
        input runs arbitrary code.
        """
        passages = read_passages(artifact)
        with tempfile.TemporaryDirectory() as folder:
            artifact.download(folder, prefix=INDEX_DIR)
            try:
                index = bm25s.BM25.load(folder, allow_pickle=False, mmap=False)
            except (ValueError, OSError, KeyError, TypeError) as error:
                raise CorruptArtifact(f"{artifact.uri}: not a loadable BM25 index ({error})") from None
        if index.scores["num_docs"] != len(passages):
            raise CorruptArtifact(
                f"{artifact.uri}: the index has {index.scores['num_docs']} documents "
                f"but {PASSAGES_FILE} has {len(passages)}"
            )
        return cls(index, passages, tokenization)


def corpus_hash(passages: Iterable[Passage], method: IndexMethod) -> str:
    """sha256 of the method's index format and settings and of every (id, text), in order:
    the cache key, and what a retrieval service reports, so that a client can tell that it
    serves its corpus, indexed as the client's config says. BM25's default tokenisation adds
    nothing to the format, so hashes pinned before the other settings existed stay valid."""
    digest = hashlib.sha256(method.format.encode() + method.hashed())
    for passage in passages:
        line = json.dumps([passage.pid, passage.text], ensure_ascii=False) + "\n"
        digest.update(line.encode())
    return digest.hexdigest()


def write_passages(writer: ArtifactWriter, passages: list[Passage]) -> None:
    """The passages as JSON lines: what every index is saved with, and ``read_passages`` reads."""
    lines = [json.dumps({"id": p.pid, "text": p.text}, ensure_ascii=False) for p in passages]
    writer.write_bytes(PASSAGES_FILE, "".join(line + "\n" for line in lines).encode())


def read_passages(artifact: Artifact) -> list[Passage]:
    """The passages ``write_passages`` wrote; CorruptArtifact naming the file if unreadable."""
    try:
        lines = artifact.read_bytes(PASSAGES_FILE).decode("utf-8").splitlines()
        return [Passage(str(row["id"]), str(row["text"])) for row in map(json.loads, lines)]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        location = artifact.store.uri(artifact.path, PASSAGES_FILE)
        raise CorruptArtifact(f"{location}: unreadable ({error})") from None


def cached_retriever(passages: list[Passage], store: Store, method: IndexMethod = Tokenization()) -> SearchIndex:
    """The index of this corpus by this method (BM25 tokenised as ``Tokenization`` says, by
    default), built once and then loaded from the store, under ``method.cache_prefix`` and
    the corpus hash: an index built otherwise is another entry.

    A cache that cannot be read (a file modified, truncated or missing) is derived data:
    it is rebuilt and replaced, with a warning, rather than failing the run. When another
    process finishes the same cache first, its copy is loaded.
    """
    path = f"{method.cache_prefix}/{corpus_hash(passages, method)}"
    if store.exists(path):
        try:
            return method.load(store.open(path))
        except CorruptArtifact as error:
            logger.warning("rebuilding the %s cache: %s", method.label, error)
    index = method.build(passages)
    try:
        meta = {"format": method.format, "passages": len(passages), **method.describe()}
        with store.writer(path, overwrite=store.exists(path), meta=meta) as writer:
            index.save_to(writer)
    except ArtifactExists:
        return method.load(store.open(path))
    return index
