"""The search task: questions, a passage corpus, a BM25 retriever and the exact-match reward.

Data comes in two forms. Real data is Search-R1's: a JSONL corpus of passages (FlashRAG
``contents`` whose first line is the title, or ``text`` with an optional ``title``) and
NQ/HotpotQA-style question files (``question`` and ``golden_answers``). The generated form,
``generated:facts``, is a world of made-up countries, towns and people, so that no
pretrained knowledge helps: the only way to answer is to search its corpus. Every fact is
one short passage, and questions are single-hop (one fact answers them) or two-hop (the
first fact names a bridge entity that the second fact needs).

Retrieval is BM25 (``bm25s``) over lower-cased word tokens, split as bm25s's tokenizer does,
with its English stop words removed and no stemming unless ``task.retrieval_stemmer: english``
(Snowball, through PyStemmer) or ``task.retrieval_stopwords: none`` say otherwise
(``Tokenization``). An index is built once per corpus and tokenisation and cached in the
artifact store under ``_cache/bm25/{corpus_hash}``; loading it never unpickles anything. At wiki
scale the index lives in a retrieval service instead (``drmas.tasks.retrieval_service``,
named by ``task.retrieval_url``): the same BM25, the same results, one index shared by
every rollout and evaluation.

The reward is Search-R1's exact match: SQuAD normalisation, then equality with any gold
answer. The warm start's demonstrations play each generated question out against the real
retriever, one hop's query at a time (``SearchTask.demonstrations``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import random
import re
import string
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import bm25s
import numpy as np
import Stemmer
from bm25s.stopwords import STOPWORDS_EN

from drmas.config import TaskConfig
from drmas.infra.store import Artifact, ArtifactExists, ArtifactWriter, CorruptArtifact, Store
from drmas.tasks import DataError, Demonstrations, Question, Split, Tools
from drmas.tasks.files import read_jsonl, read_questions
from drmas.tasks.retrieval_client import RetrievalClient
from drmas.team.agents import AnswerAgent, RouterAgent, SearchAgent, verifier_context
from drmas.team.episodes import Episode
from drmas.team.orchestras import Passage, Searcher, Team, verdict_passes

if TYPE_CHECKING:
    from drmas.config import DataConfig, DrmasConfig, StoreConfig

__all__ = [
    "Retriever",
    "SearchOrchestra",
    "SearchTask",
    "Tokenization",
    "cached_retriever",
    "corpus_for",
    "corpus_hash_for",
    "demonstration_queries",
    "exact_match",
    "format_passages",
    "generate_fact_world",
    "generated_facts",
    "iter_corpus",
    "load_corpus",
    "load_qa",
    "normalize_answer",
    "retrieval_client",
    "search_demonstrations",
]

logger = logging.getLogger(__name__)

GENERATED_PREFIX = "generated:"
GENERATED_FACTS = "facts"
DEFAULT_COUNTRIES = 200
"""Countries in a generated world unless the configured question counts need more."""
QUESTIONS_PER_COUNTRY = 6
EVAL_EVERY = 10
"""Every 10th country (and all its facts' questions) is held out for evaluation."""
MAX_COUNTRIES = 20_000
"""A bound on generated worlds (120,000 passages), so a typo in a size fails fast."""
INDEX_FORMAT = "drmas.bm25/1"
"""Part of the corpus hash: a change of tokenisation or layout must miss old caches."""
CACHE_PREFIX = "_cache/bm25"
PASSAGES_FILE = "passages.jsonl"
INDEX_DIR = "index"
TOKEN_PATTERN = r"\w+"
"""Every word, a one-letter or one-digit word too (bm25s's default pattern drops those)."""
_WORD = re.compile(TOKEN_PATTERN)
_STOPWORDS = frozenset(STOPWORDS_EN)


@dataclass(frozen=True)
class Tokenization:
    """How passages and queries become BM25 terms: lower case, ``TOKEN_PATTERN`` words,
    bm25s's English stop words dropped, optionally stemmed (Snowball, PyStemmer), as
    bm25s's own tokenizer does it.

    An index answers only queries tokenised as its passages were (a stemmed index knows
    "run", not "running"), so the tokenisation is part of the corpus hash: a cached index
    is reused, and a retrieval service accepted, only for the same one.
    """

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
        stop = _STOPWORDS if self.stopwords == "english" else frozenset()
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

    def describe(self) -> dict[str, str]:
        return {"stemmer": self.stemmer, "stopwords": self.stopwords}


_THREAD_STEMMERS = threading.local()


def _stemmer() -> Stemmer.Stemmer:
    """This thread's English stemmer: a PyStemmer object has state and must not be called
    from two threads at once (the retrieval service answers on many)."""
    if not hasattr(_THREAD_STEMMERS, "english"):
        _THREAD_STEMMERS.english = Stemmer.Stemmer("english")
    return _THREAD_STEMMERS.english


# --------------------------------------------------------------------------------------
# The generated world
# --------------------------------------------------------------------------------------

_ONSETS = (
    "b",
    "br",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "sh",
    "st",
    "t",
    "th",
    "v",
    "z",
)
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s")
_COUNTRY_ENDINGS = ("nia", "ria", "via", "land")
_CITY_ENDINGS = ("in", "or", "eth", "os", "holm")
_FIRST_NAME_ENDINGS = ("a", "o", "en", "")
FIRST_NAMES = 64
"""People share first names (as in life); surnames, and all place names, are unique."""
_RESERVED = _STOPWORDS | {"capital", "town", "country", "founded", "born", "year", "what", "which"}
"""Words that no name may be: a stopword is never indexed, a template word is in every fact."""


@dataclass(frozen=True)
class _Country:
    """One country's facts: a capital and a town, each with a founder and a birth year."""

    index: int
    name: str
    capital: str
    town: str
    capital_founder: str
    capital_founder_born: int
    town_founder: str
    town_founder_born: int


class _Namer:
    """Draws made-up names that are unique across every entity of a world.

    Every name is one word token, so a name in a question matches exactly the facts
    about that entity, and no two entities can be confused by the retriever.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set(_RESERVED)

    def draw(self, endings: Sequence[str]) -> str:
        while True:
            root = "".join(
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS) for _ in range(2)
            )
            name = (root + self.rng.choice(endings)).capitalize()
            if name.lower() not in self.used:
                self.used.add(name.lower())
                return name


def _countries(seed: int, count: int) -> list[_Country]:
    """Countries drawn one after another, so a smaller world is a prefix of a bigger one.

    That keeps the first countries (and hence the eval questions) the same when only the
    requested training size changes.
    """
    rng = random.Random(seed)
    namer = _Namer(rng)
    first_names = [namer.draw(_FIRST_NAME_ENDINGS) for _ in range(FIRST_NAMES)]

    def person() -> str:
        return f"{rng.choice(first_names)} {namer.draw(('',))}"

    return [
        _Country(
            index=index,
            name=namer.draw(_COUNTRY_ENDINGS),
            capital=namer.draw(_CITY_ENDINGS),
            town=namer.draw(_CITY_ENDINGS),
            capital_founder=person(),
            capital_founder_born=rng.randint(1500, 1950),
            town_founder=person(),
            town_founder_born=rng.randint(1500, 1950),
        )
        for index in range(count)
    ]


def _facts(country: _Country) -> list[Passage]:
    """One short passage per fact."""
    c = country
    facts = [
        ("capital", f"The capital of {c.name} is {c.capital}."),
        ("town", f"{c.town} is a town in {c.name}."),
        ("capital-founder", f"{c.capital} was founded by {c.capital_founder}."),
        ("town-founder", f"{c.town} was founded by {c.town_founder}."),
        ("capital-founder-born", f"{c.capital_founder} was born in {c.capital_founder_born}."),
        ("town-founder-born", f"{c.town_founder} was born in {c.town_founder_born}."),
    ]
    return [Passage(f"facts-{c.index:05d}-{kind}", text) for kind, text in facts]


def _questions(country: _Country) -> list[Question]:
    """Four single-hop and two two-hop questions; a two-hop question names neither the
    bridge entity nor anything in the fact that holds its answer."""
    c = country
    one, two = "facts-1hop", "facts-2hop"
    items = [
        ("capital", one, f"What is the capital of {c.name}?", c.capital),
        ("town-founder", one, f"Who founded {c.town}?", c.town_founder),
        ("born", one, f"In what year was {c.capital_founder} born?", str(c.capital_founder_born)),
        ("country", one, f"In which country is {c.town}?", c.name),
        ("capital-founder", two, f"Who founded the capital of {c.name}?", c.capital_founder),
        (
            "town-founder-born",
            two,
            f"In what year was the founder of {c.town} born?",
            str(c.town_founder_born),
        ),
    ]
    return [Question(f"facts-{c.index:05d}-{kind}", text, (answer,), source) for kind, source, text, answer in items]


def generate_fact_world(
    seed: int, entities: int = DEFAULT_COUNTRIES
) -> tuple[list[Passage], list[Question], list[Question]]:
    """A corpus of made-up facts and its (train, eval) questions, the same for the same seed.

    ``entities`` is the number of countries; each brings a capital, a town and their two
    founders (six facts, six questions). Every ``EVAL_EVERY``-th country is eval, so the
    splits share no entity: an eval answer can only be found by searching, never recalled
    from training.
    """
    if entities < 1:
        raise ValueError(f"entities must be at least 1, got {entities}")
    passages: list[Passage] = []
    train: list[Question] = []
    evaluation: list[Question] = []
    for country in _countries(seed, entities):
        passages += _facts(country)
        split = evaluation if country.index % EVAL_EVERY == EVAL_EVERY - 1 else train
        split += _questions(country)
    return passages, train, evaluation


def _countries_needed(train_size: int, eval_size: int) -> int:
    """The smallest world (at least the default) whose splits hold the requested sizes."""
    train_countries = math.ceil(train_size / QUESTIONS_PER_COUNTRY)
    eval_countries = math.ceil(eval_size / QUESTIONS_PER_COUNTRY)
    count = max(DEFAULT_COUNTRIES, EVAL_EVERY * eval_countries, train_countries)
    while count - count // EVAL_EVERY < train_countries:
        count += 1
    return count


def generated_facts(data: DataConfig, seed: int) -> tuple[list[Passage], list[Question], list[Question]]:
    """The world that ``generated:facts`` names for this data config and seed.

    Its size depends on both configured sizes (never on the split asked for), so the train
    questions, the eval questions and the corpus a run searches all come from one world.
    """
    count = _countries_needed(data.generated_train_size, data.generated_eval_size)
    if count > MAX_COUNTRIES:
        most_eval = MAX_COUNTRIES // EVAL_EVERY * QUESTIONS_PER_COUNTRY
        most_train = MAX_COUNTRIES * QUESTIONS_PER_COUNTRY - most_eval
        raise DataError(
            f"{GENERATED_PREFIX}{GENERATED_FACTS}: at most {most_train} train and {most_eval} eval "
            f"questions exist; asked for generated_train_size={data.generated_train_size}, "
            f"generated_eval_size={data.generated_eval_size}"
        )
    passages, train, evaluation = generate_fact_world(seed, count)
    return passages, train[: data.generated_train_size], evaluation[: data.generated_eval_size]


def demonstration_queries(data: DataConfig, seed: int) -> dict[str, tuple[str, ...]]:
    """For every question of the generated world, by id: the queries that find its answer,
    one per hop.

    Only a generated world has them, since only there the bridge of a two-hop question is
    known. A first hop names the entity the question names; a second hop names the bridge
    entity the first hop's passage revealed, so a searcher that learns these demonstrations
    learns to read the retrieved passages, not to recall facts.
    """
    count = _countries_needed(data.generated_train_size, data.generated_eval_size)
    plans: dict[str, tuple[str, ...]] = {}
    for c in _countries(seed, min(count, MAX_COUNTRIES)):
        capital, town_founder = f"capital of {c.name}", f"{c.town} founded"
        for kind, queries in (
            ("capital", (capital,)),
            ("town-founder", (town_founder,)),
            ("born", (f"{c.capital_founder} born",)),
            ("country", (f"{c.town} town",)),
            ("capital-founder", (capital, f"{c.capital} founded")),
            ("town-founder-born", (town_founder, f"{c.town_founder} born")),
        ):
            plans[f"facts-{c.index:05d}-{kind}"] = queries
    return plans


def corpus_for(data: DataConfig, seed: int, store: StoreConfig | Store | None = None) -> list[Passage]:
    """The passages a search run retrieves from: ``data.corpus``, or the generated world's.
    ``store``: the S3 endpoint and region of an ``s3://`` corpus (``load_corpus``)."""
    if data.corpus:
        return load_corpus(data.corpus, store)
    return generated_facts(data, seed)[0]


def corpus_hash_for(
    data: DataConfig,
    seed: int,
    store: StoreConfig | Store | None = None,
    tokenization: Tokenization = Tokenization(),
) -> str:
    """``Retriever.corpus_hash`` of ``corpus_for(data, seed, store)`` tokenised as
    ``tokenization``; a corpus file is streamed, never held whole (a wiki-scale corpus does
    not fit a rollout driver's memory). The hash is of the passages, not of where they are:
    the same file hashes the same, local or on S3."""
    if data.corpus:
        passages = iter_corpus(data.corpus, store)
        first = next(passages, None)
        if first is None:
            raise DataError(f"{data.corpus}: no passages (the file is empty)")
        return Retriever.corpus_hash(itertools.chain([first], passages), tokenization)
    return Retriever.corpus_hash(generated_facts(data, seed)[0], tokenization)


# --------------------------------------------------------------------------------------
# Files: corpus and questions
# --------------------------------------------------------------------------------------


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


def load_corpus(path: str, store: StoreConfig | Store | None = None) -> list[Passage]:
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


def iter_corpus(path: str, store: StoreConfig | Store | None = None) -> Iterator[Passage]:
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
    store: StoreConfig | Store | None = None,
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


# --------------------------------------------------------------------------------------
# Reward
# --------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, as Search-R1 scores: lower case, no punctuation, no articles,
    single spaces; so "The Eiffel Tower." matches "eiffel tower"."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str | None, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0.

    No answer (None) scores 0, as an episode that never answered does; so does an answer
    that normalises to nothing ("", "the", "."), which would otherwise match a gold answer
    that does too.
    """
    if prediction is None:
        return 0.0
    guess = normalize_answer(prediction)
    return float(bool(guess) and any(guess == normalize_answer(answer) for answer in answers))


# --------------------------------------------------------------------------------------
# Retrieval
# --------------------------------------------------------------------------------------


class Retriever:
    """BM25 over a fixed list of passages.

    A passage that shares no term with a query is never returned for it: BM25 scores it 0,
    and an unrelated passage would only teach the agent that search results are noise.
    """

    def __init__(self, index: bm25s.BM25, passages: list[Passage], tokenization: Tokenization = Tokenization()) -> None:
        self.index = index
        self.passages = passages
        self.tokenization = tokenization

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
        """sha256 of the index format, the tokenisation and every (id, text), in order: the
        cache key (and what a retrieval service reports, so that a client can tell it
        serves its corpus, tokenised as the client's config says)."""
        digest = hashlib.sha256(INDEX_FORMAT.encode() + tokenization.hashed())
        for passage in passages:
            line = json.dumps([passage.pid, passage.text], ensure_ascii=False) + "\n"
            digest.update(line.encode())
        return digest.hexdigest()

    def save_to(self, writer: ArtifactWriter) -> None:
        """The passages and every file bm25s writes (numpy arrays without pickle, JSON)."""
        lines = [json.dumps({"id": p.pid, "text": p.text}, ensure_ascii=False) for p in self.passages]
        writer.write_bytes(PASSAGES_FILE, "".join(line + "\n" for line in lines).encode())
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
        passages = _read_passages(artifact)
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


def _read_passages(artifact: Artifact) -> list[Passage]:
    try:
        lines = artifact.read_bytes(PASSAGES_FILE).decode("utf-8").splitlines()
        return [Passage(str(row["id"]), str(row["text"])) for row in map(json.loads, lines)]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        location = artifact.store.uri(artifact.path, PASSAGES_FILE)
        raise CorruptArtifact(f"{location}: unreadable ({error})") from None


def cached_retriever(passages: list[Passage], store: Store, tokenization: Tokenization = Tokenization()) -> Retriever:
    """The retriever for this corpus and tokenisation, built once and then loaded from the
    store (under their corpus hash: an index tokenised otherwise is another entry).

    A cache that cannot be read (a file modified, truncated or missing) is derived data:
    it is rebuilt and replaced, with a warning, rather than failing the run. When another
    process finishes the same cache first, its copy is loaded.
    """
    path = f"{CACHE_PREFIX}/{Retriever.corpus_hash(passages, tokenization)}"
    if store.exists(path):
        try:
            return Retriever.load_from(store.open(path), tokenization)
        except CorruptArtifact as error:
            logger.warning("rebuilding the BM25 cache: %s", error)
    retriever = Retriever.build(passages, tokenization)
    try:
        meta = {"format": INDEX_FORMAT, "passages": len(passages), **tokenization.describe()}
        with store.writer(path, overwrite=store.exists(path), meta=meta) as writer:
            retriever.save_to(writer)
    except ArtifactExists:
        return Retriever.load_from(store.open(path), tokenization)
    return retriever


def format_passages(passages: list[Passage]) -> str:
    """The body of an ``<information>`` block, numbered as Search-R1 shows results.

    Newlines inside a passage become spaces so that each document stays on its line.
    """
    return "\n".join(f"Doc {rank}: {' '.join(passage.text.split())}" for rank, passage in enumerate(passages, start=1))


# --------------------------------------------------------------------------------------
# Warm-start demonstrations
# --------------------------------------------------------------------------------------


def search_demonstrations(
    questions: list[Question], config: DrmasConfig, retriever: Searcher, rng: np.random.Generator
) -> Demonstrations:
    """(prompt, response) pairs per agent, from episodes played out with the real retriever.

    A verdict is "yes" once every hop of the question's plan is in the history, flipped
    with probability ``verdict_noise`` (answering too early, or searching once too often,
    which on the last turn leaves the episode without an answer; ``hesitation``, when set,
    is the probability of the second mistake). A query after the plan
    ran out repeats the last hop's. The answer is the gold one when the passages hold it,
    else (and with probability ``wrong_fraction``) another name from the passages or the
    question: the mistake of copying the wrong entity.
    """
    task, warm = config.task, config.warmstart
    plans = demonstration_queries(config.data, config.experiment.seed)
    router, searcher, answerer = (
        cls(history_length=task.history_length, prompts=task.prompts) for cls in (RouterAgent, SearchAgent, AnswerAgent)
    )
    demos: Demonstrations = {"verifier": [], "search": [], "answer": []}
    for question in questions:
        plan = plans.get(question.qid)
        if plan is None:
            raise DataError(
                f"warm start: no demonstration for question {question.qid!r} (only generated:facts has them)"
            )
        episode = Episode("u", "t", 0, question)
        for step in range(1, task.max_turns + 1):
            complete = len(episode.history) >= len(plan)
            noise = warm.hesitation if complete and warm.hesitation is not None else warm.verdict_noise
            enough = complete != (rng.random() < noise)
            episode.team_context = []
            route = f"<verify>{'yes' if enough else 'no'}</verify>"
            demos["verifier"].append((router.prompt(episode, step), route))
            episode.team_context.append(verifier_context(route))
            # A hesitant router's Answer agent still learns at every state it could answer
            # from: the hesitation is the router's, not a lack of answers to copy.
            if enough or (complete and warm.hesitation is not None):
                answer = _demonstrated_answer(episode, rng, warm.wrong_fraction)
                demos["answer"].append((answerer.prompt(episode, step), f"<think></think><answer>{answer}</answer>"))
            if enough:
                break
            if step < task.max_turns:
                query = plan[min(len(episode.history), len(plan) - 1)]
                demos["search"].append((searcher.prompt(episode, step), f"<think></think><search>{query}</search>"))
                found = retriever.search([query], task.retrieval_top_k)[0]
                episode.history.append((query, format_passages(found)))
    return demos


NAME_OR_YEAR = re.compile(r"\b(?:[A-Z][a-z]+(?: [A-Z][a-z]+)?|\d{4})\b")
"""What a generated answer looks like: a place, a person ("First Last") or a year."""


def _demonstrated_answer(episode: Episode, rng: np.random.Generator, wrong_fraction: float) -> str:
    """The gold answer if the passages show it (1 - wrong_fraction of the time), else a
    wrong entity from the passages or the question."""
    gold = episode.question.answers[0]
    seen = " ".join(info for _, info in episode.history)
    if gold in seen and rng.random() >= wrong_fraction:
        return gold
    text = seen or episode.question.question
    others = sorted(
        {
            name
            for name in NAME_OR_YEAR.findall(text)
            if name != gold and name not in {"Doc", "The", "What", "Who", "In"}
        }
    )
    return str(rng.choice(others)) if others else "unknown"


# --------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------


def retrieval_client(config: DrmasConfig) -> RetrievalClient:
    """The client of ``task.retrieval_url`` with the config's timeout and retries, checking
    that the service serves the corpus the config names, tokenised as it says
    (``task.retrieval_corpus_hash`` if pinned)."""
    task = config.task
    if task.retrieval_url is None:
        raise ValueError("task.retrieval_url is not set: the search task retrieves in process")
    expected: str | Callable[[], str] = task.retrieval_corpus_hash or (
        lambda: corpus_hash_for(config.data, config.experiment.seed, config.store, Tokenization.of(task))
    )
    return RetrievalClient(
        task.retrieval_url,
        timeout_s=task.retrieval_timeout_s,
        retries=task.retrieval_retries,
        backoff_s=task.retrieval_backoff_s,
        expected_hash=expected,
    )


class SearchTask:
    """Questions answered from a corpus through BM25 search; reward exact match."""

    default_data = f"{GENERATED_PREFIX}{GENERATED_FACTS}"
    default_orchestra = "search"

    def questions(self, config: DrmasConfig, split: Split) -> list[Question]:
        return load_qa(config.data_spec(split), split, config.data, config.experiment.seed, config.store)

    def tools(self, config: DrmasConfig, store: Store) -> Tools:
        """The in-process BM25 retriever (cached in the store), or, when
        ``task.retrieval_url`` is set, a client of that retrieval service (checked on first
        use to serve the corpus this config names)."""
        if config.task.retrieval_url:
            return Tools(retriever=retrieval_client(config))
        passages = corpus_for(config.data, config.experiment.seed, config.store)
        return Tools(retriever=cached_retriever(passages, store, Tokenization.of(config.task)))

    def corpus(self, config: DrmasConfig) -> list[str]:
        return [passage.text for passage in corpus_for(config.data, config.experiment.seed, config.store)]

    def demonstrations(
        self, config: DrmasConfig, questions: list[Question], tools: Tools, rng: np.random.Generator
    ) -> Demonstrations:
        return search_demonstrations(questions, config, tools.retriever, rng)

    def reward(self, final_answer: str | None, question: Question) -> float:
        return exact_match(final_answer, question.answers)


class SearchOrchestra:
    """Each turn the Verifier routes: 'no' runs the Search agent (its query is answered
    with the top-k passages, shown in the next turn's history; the Search agent reads the
    Verifier's whole response), 'yes' runs the Answer agent, whose tagged answer ends the
    episode (an output without <answer> tags is an empty action: the episode goes on, as
    in the reference). On the last turn no search is allowed: an episode still routed to
    search, or still without an answer, ends with none (reward 0). A malformed route
    counts as 'yes' unless ``task.malformed_verdict_passes`` is False."""

    agents = {"verifier": RouterAgent, "search": SearchAgent, "answer": AnswerAgent}

    def __init__(self, task: TaskConfig, tools: Tools) -> None:
        if tools.retriever is None:
            raise ValueError("the search orchestra needs a retriever (Tools.retriever)")
        self.max_turns = task.max_turns
        self.top_k = task.retrieval_top_k
        self.malformed_passes = task.malformed_verdict_passes
        self.retriever = tools.retriever
        self.agent_objects = {
            name: cls(history_length=task.history_length, prompts=task.prompts) for name, cls in self.agents.items()
        }

    def run(self, episodes: list[Episode], team: Team) -> None:
        for step in range(1, self.max_turns + 1):
            active = [episode for episode in episodes if not episode.done]
            if not active:
                break
            for episode in active:
                episode.team_context = []
            routes = team.call("verifier", active, step)
            to_search, to_answer = [], []
            for episode, route in zip(active, routes, strict=True):
                episode.team_context.append(verifier_context(route.text))
                enough = verdict_passes(route, "yes", "no", self.malformed_passes)
                (to_answer if enough else to_search).append(episode)
            if step < self.max_turns and to_search:
                queries = team.call("search", to_search, step)
                passages = self.retriever.search([q.text for q in queries], self.top_k)
                for episode, query, found in zip(to_search, queries, passages, strict=True):
                    episode.history.append((query.text, format_passages(found)))
            for episode, answer in zip(to_answer, team.call("answer", to_answer, step), strict=True):
                if answer.acted:  # untagged output: an empty action, the episode goes on
                    episode.final_answer, episode.done = answer.text, True
        for episode in episodes:
            episode.done = True

    def reward(self, episode: Episode) -> float:
        return exact_match(episode.final_answer, episode.question.answers)
