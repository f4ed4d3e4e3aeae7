"""The search task: generated world, file loaders, exact match, BM25 retrieval and its cache."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bm25s
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import Stemmer

from drmas.config import DataConfig, load_config
from drmas.infra.store import CorruptArtifact, Store
from drmas.tasks import DataError, Question
from drmas.tasks.search import retrieval
from drmas.tasks.search.answers import exact_match, normalize_answer
from drmas.tasks.search.corpus import corpus_for, load_corpus, load_qa
from drmas.tasks.search.retrieval import INDEX_FORMAT, Retriever, Tokenization, cached_retriever
from drmas.tasks.search.task import SearchTask, format_passages
from drmas.tasks.search.world import generate_fact_world
from drmas.team.orchestras import Passage

SEED = 7
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world() -> tuple[list[Passage], list[Question], list[Question]]:
    return generate_fact_world(SEED)


def _names(passages: list[Passage]) -> dict[str, str]:
    """Every entity of a generated world -> its kind, parsed from the fact sentences."""
    names: dict[str, str] = {}
    patterns = {
        r"The capital of (\w+) is (\w+)\.": ("country", "city"),
        r"(\w+) is a town in (\w+)\.": ("city", "country"),
        r"(\w+) was founded by (\w+ \w+)\.": ("city", "person"),
        r"(\w+ \w+) was born in (\d+)\.": ("person", "year"),
    }
    for passage in passages:
        for pattern, kinds in patterns.items():
            match = re.fullmatch(pattern, passage.text)
            if match:
                for name, kind in zip(match.groups(), kinds, strict=True):
                    if kind != "year":
                        assert names.setdefault(name, kind) == kind, f"{name} is two kinds of thing"
                break
        else:
            raise AssertionError(f"unexpected fact {passage.text!r}")
    return names


# --------------------------------------------------------------------------------------
# The generated world
# --------------------------------------------------------------------------------------


def test_world_is_deterministic_by_seed(world):
    assert generate_fact_world(SEED) == world
    other, _, _ = generate_fact_world(SEED + 1)
    assert {p.text for p in other}.isdisjoint({p.text for p in world[0]})


def test_world_size_follows_entities():
    passages, train, evaluation = generate_fact_world(SEED, entities=20)
    assert len(passages) == 20 * 6
    assert len(train) + len(evaluation) == 20 * 6
    assert len(evaluation) == 2 * 6  # every 10th country is eval
    with pytest.raises(ValueError, match="at least 1"):
        generate_fact_world(SEED, entities=0)


def test_entity_names_are_unique_words_that_nothing_else_uses(world):
    passages, _, _ = world
    names = _names(passages)
    kinds = list(names.values())
    assert kinds.count("country") == 200 and kinds.count("city") == 400
    assert kinds.count("person") == 400  # founders: two per country, full names all distinct
    surnames = [name.split()[1] for name, kind in names.items() if kind == "person"]
    assert len(set(surnames)) == len(surnames)
    places = [name for name, kind in names.items() if kind != "person"]
    first_names = {name.split()[0] for name, kind in names.items() if kind == "person"}
    words = [word.lower() for word in places + surnames] + [n.lower() for n in first_names]
    assert len(set(words)) == len(words), "a name word is shared by two entities"
    template = {"the", "capital", "of", "is", "a", "town", "in", "was", "founded", "by", "born"}
    assert template.isdisjoint(words)


def test_pids_and_qids_are_unique_and_sources_are_labelled(world):
    passages, train, evaluation = world
    assert len({p.pid for p in passages}) == len(passages)
    questions = train + evaluation
    assert len({q.qid for q in questions}) == len(questions)
    assert {q.data_source for q in questions} == {"facts-1hop", "facts-2hop"}
    assert all(len(q.answers) == 1 and q.answers[0] for q in questions)


def test_train_and_eval_share_no_entity(world):
    passages, train, evaluation = world
    names = set(_names(passages))

    def entities(questions: list[Question]) -> set[str]:
        return {
            name for question in questions for name in _grams(" ".join((question.question, *question.answers))) & names
        }

    assert {q.qid for q in train}.isdisjoint(q.qid for q in evaluation)
    assert entities(train).isdisjoint(entities(evaluation))


def test_single_hop_answers_are_retrievable(world):
    """BM25 top-3 over the question text holds the fact with the answer."""
    passages, train, evaluation = world
    single = [q for q in train + evaluation if q.data_source == "facts-1hop"]
    results = Retriever.build(passages).search([q.question for q in single], k=3)
    found = [any(q.answers[0] in _grams(p.text) for p in top) for q, top in zip(single, results, strict=True)]
    rate = sum(found) / len(found)
    assert rate >= 0.8, f"only {rate:.1%} of {len(single)} single-hop answers in the top 3"


def test_two_hop_questions_need_two_facts(world):
    passages, train, evaluation = world
    names = set(_names(passages))
    mentions: dict[str, set[Passage]] = {}
    for passage in passages:
        for gram in _grams(passage.text):
            mentions.setdefault(gram, set()).add(passage)
    double = [q for q in train + evaluation if q.data_source == "facts-2hop"]
    assert double
    for question in double:
        asked = _grams(question.question) & names
        assert len(asked) == 1, question
        about_asked = mentions[next(iter(asked))]
        with_answer = mentions[question.answers[0]]
        assert not about_asked & with_answer, f"one fact answers {question.question!r}"
        bridges = {
            name
            for first in about_asked
            for second in with_answer
            for name in _grams(first.text) & _grams(second.text) & names
        }
        assert bridges, f"no bridge entity links the two facts of {question.question!r}"
    # and searching the question alone rarely finds the answer's fact
    results = Retriever.build(passages).search([q.question for q in double], k=3)
    hits = sum(any(q.answers[0] in _grams(p.text) for p in top) for q, top in zip(double, results, strict=True))
    assert hits / len(double) < 0.1


def _grams(text: str) -> set[str]:
    """The words and word pairs of a text: every name (one or two words) it mentions."""
    words = re.findall(r"\w+", text)
    return set(words) | {f"{a} {b}" for a, b in zip(words, words[1:], strict=False)}


# --------------------------------------------------------------------------------------
# Exact match
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("The  Quick, Brown fox!", "quick brown fox"),
        ("An apple a day", "apple day"),
        ("Theatre", "theatre"),  # articles are whole words only
        ("O'Neil", "oneil"),
        ("\tNew\nYork ", "new york"),
        ("1,834.", "1834"),
        ("The", ""),
    ],
)
def test_normalize_answer(text, normal):
    assert normalize_answer(text) == normal


@pytest.mark.parametrize(
    ("prediction", "answers", "score"),
    [
        ("The Eiffel Tower.", ["eiffel tower"], 1.0),
        ("  Paris ", ["London", "paris"], 1.0),
        ("Mara", ["Mara Voss"], 0.0),  # no partial credit
        ("Mara Voss was born", ["Mara Voss"], 0.0),  # nor substring credit
        ("1834", ["1834"], 1.0),
        (None, ["1834"], 0.0),
        ("anything", [], 0.0),
    ],
)
def test_exact_match(prediction, answers, score):
    assert exact_match(prediction, answers) == score


# --------------------------------------------------------------------------------------
# Corpus files
# --------------------------------------------------------------------------------------


def _jsonl(path: Path, rows: list[object]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_load_corpus_formats(tmp_path):
    path = _jsonl(
        tmp_path / "corpus.jsonl",
        [
            {"id": "d1", "contents": '"Zorbania"\nZorbania is a country.\nIt is small.'},
            {"title": "Quellin", "text": "A city."},
            {"id": 7, "text": " plain "},
            {"contents": "no title line"},
        ],
    )
    assert load_corpus(path) == [
        Passage("d1", "(Title: Zorbania) Zorbania is a country.\nIt is small."),
        Passage("2", "(Title: Quellin) A city."),
        Passage("7", "plain"),
        Passage("4", "no title line"),
    ]


def test_load_corpus_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "three"}\n', encoding="utf-8")
    assert [p.pid for p in load_corpus(str(path))] == ["1", "3"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "no passages (the file is empty)"),
        (b"\n  \n", "no passages (the file is empty)"),
        (b'{"text": "a"}\n{"text": \n', "line 2: invalid JSON"),
        (b'["text"]\n', "line 1: expected a JSON object, got list"),
        (
            b'{"id": 1, "body": "a"}\n',
            "line 1: no passage text (expected a non-empty 'contents' or 'text' string; keys: body, id)",
        ),
        (b'{"text": "   "}\n', "line 1: no passage text"),
        (b'{"text": "a"}\n{"text": "caf\xe9"}\n', "not UTF-8 text (bad byte at offset 27) on line 2"),
        (
            b'{"id": "a", "text": "x"}\n{"text": "y"}\n{"id": "a", "text": "z"}\n',
            "line 3: duplicate id 'a' (first on line 1)",
        ),
        (
            b'{"text": "x"}\n{"id": "1", "text": "y"}\n',
            "line 2: duplicate id '1' (first on line 1)",
        ),
    ],
)
def test_load_corpus_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as error:
        load_corpus(str(path))
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)


def test_load_corpus_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nothere\.jsonl: file not found"):
        load_corpus(str(tmp_path / "nothere.jsonl"))


# --------------------------------------------------------------------------------------
# Question files and the generated set
# --------------------------------------------------------------------------------------


def test_load_qa_jsonl_search_r1_format(tmp_path):
    path = _jsonl(
        tmp_path / "nq.jsonl",
        [
            {
                "id": "q1",
                "question": " who wrote it? ",
                "golden_answers": ["Ann", "Ann Lee"],
                "data_source": "nq",
            },
            {"id": "q2", "question": "when?", "golden_answers": ["1901", ""], "data_source": "hq"},
        ],
    )
    data = DataConfig(answer_field="golden_answers")
    assert load_qa(path, "train", data, SEED) == [
        Question("q1", "who wrote it?", ("Ann", "Ann Lee"), "nq"),
        Question("q2", "when?", ("1901",), "hq"),
    ]


def _reference_search_row(question: str, targets: list[str], source: str, ground_truth_key: str = "target") -> dict:
    """A row as the reference's drmas_search.py preprocessing writes it: a system + user
    chat, the gold answers nested in reward_model.ground_truth.target (and in env_kwargs),
    no golden_answers column."""
    return {
        "data_source": source,
        "prompt": [
            {"role": "system", "content": "You are a helpful and harmless assistant."},
            {"role": "user", "content": question},
        ],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {ground_truth_key: targets}},
        "extra_info": {"index": 0, "split": "train", "question": question},
        "env_kwargs": {"ground_truth": {ground_truth_key: targets}, "question": question, "data_source": source},
    }


def test_the_search_recipe_reads_the_references_preprocessed_parquet(tmp_path):
    """The recipe's data fields against the nested layout (Arrow structs and lists, as
    pandas and pyarrow write it): the answers from reward_model.ground_truth.target, the
    question from the chat's user message, the source per row."""
    path = tmp_path / "train.parquet"
    rows = [_reference_search_row("who wrote hamlet?", ["Shakespeare", "William Shakespeare"], "nq")]
    rows.append(_reference_search_row("when did it open?", ["1901"], "hotpotqa"))
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert pa.types.is_struct(pq.read_schema(path).field("reward_model").type)
    data = load_config(ROOT / "configs" / "search_qwen25_7b_gpu.yaml").data
    assert data.answer_field == "reward_model.ground_truth.target"
    assert load_qa(str(path), "train", data, SEED) == [
        Question("0", "who wrote hamlet?", ("Shakespeare", "William Shakespeare"), "nq"),
        Question("1", "when did it open?", ("1901",), "hotpotqa"),
    ]


def test_a_nested_answer_field_that_is_not_there_names_the_field_and_the_file(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.Table.from_pylist([_reference_search_row("q?", ["a"], "nq", ground_truth_key="answers")]), path)
    data = DataConfig(answer_field="reward_model.ground_truth.target")
    with pytest.raises(DataError) as error:
        load_qa(str(path), "train", data, SEED)
    assert str(error.value) == (
        f"{path}: no answer column 'reward_model.ground_truth.target' (set data.answer_field); columns: ability, "
        "data_source, env_kwargs, extra_info, prompt, reward_model; reward_model.ground_truth holds: answers"
    )


def test_load_qa_parquet_with_plain_answers_and_own_field_names(tmp_path):
    path = tmp_path / "bamboogle.parquet"
    pq.write_table(pa.table({"q": ["a?", "b?"], "gold": ["x", "y"]}), path)
    data = DataConfig(question_field="q", answer_field="gold")
    assert load_qa(str(path), "eval", data, SEED) == [
        Question("0", "a?", ("x",), "bamboogle"),  # no source column: the file stem
        Question("1", "b?", ("y",), "bamboogle"),
    ]


def test_load_qa_an_empty_list_of_answers_is_no_answer(tmp_path):
    """The reader's own errors, the same for every task, are in tests/test_tasks.py."""
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": "a?", "answer": []}])
    with pytest.raises(DataError) as error:
        load_qa(path, "train", DataConfig(), SEED)
    assert str(error.value) == f"{path}: row 0 (line 1): missing or empty answer ('answer')"


def test_load_qa_knows_only_its_generated_set():
    message = "generated:arithmetic: no such generated set for the search task (available: generated:facts)"
    with pytest.raises(DataError, match=re.escape(message)):
        load_qa("generated:arithmetic", "train", DataConfig(), SEED)


def test_generated_facts_meets_the_configured_sizes():
    data = DataConfig(generated_train_size=2000, generated_eval_size=200)
    train = load_qa("generated:facts", "train", data, SEED)
    evaluation = load_qa("generated:facts", "eval", data, SEED)
    assert (len(train), len(evaluation)) == (2000, 200)
    assert {q.qid for q in train}.isdisjoint(q.qid for q in evaluation)
    small = DataConfig(generated_train_size=30, generated_eval_size=12)
    assert len(load_qa("generated:facts", "train", small, SEED)) == 30


def test_generated_eval_set_does_not_change_with_the_train_size():
    small = DataConfig(generated_train_size=10, generated_eval_size=50)
    large = DataConfig(generated_train_size=3000, generated_eval_size=50)
    evaluation = load_qa("generated:facts", "eval", small, SEED)
    assert evaluation == load_qa("generated:facts", "eval", large, SEED)


def test_generated_facts_too_many_questions_says_how_many_exist():
    data = DataConfig(generated_train_size=10_000_000)
    message = r"generated:facts: at most 108000 train and 12000 eval questions exist"
    with pytest.raises(DataError, match=message):
        load_qa("generated:facts", "train", data, SEED)


def test_the_corpus_holds_the_generated_answers(tmp_path):
    data = DataConfig(generated_train_size=500, generated_eval_size=60)
    passages = corpus_for(data, SEED)
    text = " ".join(p.text for p in passages)
    for split in ("train", "eval"):
        assert all(q.answers[0] in text for q in load_qa("generated:facts", split, data, SEED))
    path = _jsonl(tmp_path / "c.jsonl", [{"text": "one"}])
    assert corpus_for(DataConfig(corpus=path), SEED) == [Passage("1", "one")]


# --------------------------------------------------------------------------------------
# Retrieval
# --------------------------------------------------------------------------------------

RIVERS = [
    Passage("p1", "The Vell river flows through Quellin."),
    Passage("p2", "Quellin was founded by Mara Voss."),
    Passage("p3", "Mara Voss was born in 1834 near the Vell river."),
]


def test_search_is_batched_and_keeps_query_order(monkeypatch):
    retriever = Retriever.build(RIVERS)
    calls = []
    original = bm25s.BM25.retrieve

    def counting(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(bm25s.BM25, "retrieve", counting)
    results = retriever.search(["who founded Quellin", "born 1834", "Vell river Quellin"], k=1)
    assert len(calls) == 1
    assert [[p.pid for p in top] for top in results] == [["p2"], ["p3"], ["p1"]]


def test_search_ranks_best_first():
    top = Retriever.build(RIVERS).search(["Mara Voss born"], k=3)[0]
    assert [p.pid for p in top] == ["p3", "p2"]  # p1 shares no term: not returned


@pytest.mark.parametrize("query", ["", "   \n", "the of a", "Zorbania xylophone"])
def test_query_without_indexed_terms_returns_nothing(query):
    results = Retriever.build(RIVERS).search([query, "Quellin"], k=3)
    assert results[0] == []
    assert {p.pid for p in results[1]} == {"p1", "p2"}


def test_k_is_clamped_to_the_corpus_and_must_be_positive():
    retriever = Retriever.build(RIVERS)
    assert len(retriever.search(["Quellin Vell Mara"], k=50)[0]) == 3
    assert retriever.search([], k=3) == []
    with pytest.raises(ValueError, match="k must be at least 1"):
        retriever.search(["Quellin"], k=0)
    with pytest.raises(ValueError, match="empty corpus"):
        Retriever.build([])


# --------------------------------------------------------------------------------------
# Tokenisation: stemming and stop words
# --------------------------------------------------------------------------------------

RUNNERS = [
    Passage("r1", "The fox runs across the cities."),
    Passage("r2", "A cat sleeps in the old city."),
    Passage("r3", "Running water was found in 1834."),
]
STEMMED = Tokenization(stemmer="english")


def test_default_tokens_are_lower_case_words_without_stopwords():
    """Hand-derived: lower case, every \\w+ word (one letter or digit too), bm25s's English
    stop words ("the", "a", "was", "in") dropped, nothing stemmed."""
    tokens = Tokenization().tokens(["The Vell river: X was born in 1834, a b 7."])
    assert tokens == [["vell", "river", "x", "born", "1834", "b", "7"]]
    assert Tokenization(stopwords="none").tokens(["The cat"]) == [["the", "cat"]]
    assert STEMMED.tokens(["Running runs cities city"]) == [["run", "run", "citi", "citi"]]


@pytest.mark.parametrize("stemmer", ["none", "english"])
@pytest.mark.parametrize("stopwords", ["none", "english"])
def test_tokens_are_bm25s_own(stemmer, stopwords):
    """The terms are bm25s.tokenize's, with the same stop words and PyStemmer stemmer, on
    text with case, digits, punctuation, non-ASCII words and an empty text."""
    texts = [
        "The Runners RAN; running runs 1834 times!",
        "",
        "Cafés of Zürich: generalizations, generously generated.",
        "a b c d x y z the of and",
        "connection connected connecting CONNECTS",
    ]
    expected = bm25s.tokenize(
        texts,
        token_pattern=retrieval.TOKEN_PATTERN,
        stopwords="en" if stopwords == "english" else None,
        stemmer=Stemmer.Stemmer("english") if stemmer == "english" else None,
        return_ids=False,
        show_progress=False,
    )
    assert Tokenization(stemmer, stopwords).tokens(texts) == expected


def test_stemming_finds_the_other_forms_of_a_word():
    """ "running" finds "runs" and "city" finds "cities" only with the stemmer."""
    plain, stemmed = Retriever.build(RUNNERS), Retriever.build(RUNNERS, STEMMED)
    queries = ["running", "city", "sleeping cats"]
    assert [[p.pid for p in top] for top in plain.search(queries, k=3)] == [["r3"], ["r2"], []]
    found = [{p.pid for p in top} for top in stemmed.search(queries, k=3)]
    assert found == [{"r1", "r3"}, {"r1", "r2"}, {"r2"}]


def test_stop_words_are_searchable_only_when_kept():
    assert Retriever.build(RUNNERS).search(["the"], k=3) == [[]]
    kept = Retriever.build(RUNNERS, Tokenization(stopwords="none")).search(["the"], k=3)[0]
    assert {p.pid for p in kept} == {"r1", "r2"}


def test_each_thread_stems_with_its_own_stemmer():
    """A PyStemmer object has state and must not be called from two threads at once (its
    own docs), and the retrieval service answers on many: each thread gets its own."""
    mine = retrieval._stemmer()
    with ThreadPoolExecutor(2) as threads:
        others = list(threads.map(lambda _: retrieval._stemmer(), range(4)))
    assert retrieval._stemmer() is mine and all(other is not mine for other in others)
    assert len({id(other) for other in others}) <= 2  # one per pool thread, reused


def test_the_config_chooses_the_tokenization_of_the_in_process_retriever(tmp_path):
    config = load_config(
        ROOT / "configs" / "search_tiny.yaml", ["task.retrieval_stemmer=english", "task.retrieval_stopwords=none"]
    )
    retriever = SearchTask().tools(config, Store(str(tmp_path / "store"))).retriever
    assert isinstance(retriever, Retriever)
    assert retriever.tokenization == Tokenization("english", "none")
    assert retriever.index.vocab_dict.keys() >= {"the", "found"}  # "the" kept, "founded" stemmed


def test_corpus_hash_is_stable_and_sees_every_change():
    digest = Retriever.corpus_hash(RIVERS)
    assert digest == Retriever.corpus_hash([Passage(p.pid, p.text) for p in RIVERS])
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert digest != Retriever.corpus_hash(RIVERS[::-1])
    assert digest != Retriever.corpus_hash([*RIVERS[:2], Passage("p3", RIVERS[2].text + " ")])
    boundary = Retriever.corpus_hash([Passage("a", "bc")])
    assert boundary != Retriever.corpus_hash([Passage("ab", "c")])


def test_the_corpus_hash_holds_the_tokenization_but_not_its_default():
    """The default hashes as before the option existed (caches and pinned hashes stay
    valid: a plain sha256 of the format and the passages); any other tokenisation hashes
    otherwise."""
    digest = hashlib.sha256(INDEX_FORMAT.encode())
    for passage in RIVERS:
        digest.update((json.dumps([passage.pid, passage.text]) + "\n").encode())
    assert Retriever.corpus_hash(RIVERS) == digest.hexdigest()
    others = {
        Retriever.corpus_hash(RIVERS, Tokenization(stem, stop))
        for stem in ("none", "english")
        for stop in ("none", "english")
    }
    assert len(others) == 4 and digest.hexdigest() in others


def test_save_and_load_through_the_store(tmp_path):
    store = Store(str(tmp_path / "store"))
    retriever = Retriever.build(RIVERS)
    with store.writer("index") as writer:
        retriever.save_to(writer)
    artifact = store.open("index")
    assert "passages.jsonl" in artifact.files
    assert any(name.startswith("index/") and name.endswith(".npy") for name in artifact.files)
    loaded = Retriever.load_from(artifact)
    assert loaded.passages == RIVERS
    queries = ["Mara Voss", "Vell", "founded"]
    assert loaded.search(queries, k=2) == retriever.search(queries, k=2)


def test_load_refuses_pickled_arrays(tmp_path):
    """A store is input: an index whose arrays need unpickling is refused, not loaded."""
    store = Store(str(tmp_path / "store"))
    folder = tmp_path / "index"
    Retriever.build(RIVERS).index.save(str(folder), show_progress=False)
    np.save(folder / "data.csc.index.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with store.writer("index") as writer:
        lines = [json.dumps({"id": p.pid, "text": p.text}) + "\n" for p in RIVERS]
        writer.write_bytes("passages.jsonl", "".join(lines).encode())
        writer.put_dir(folder, "index")
    with pytest.raises(CorruptArtifact, match="not a loadable BM25 index.*allow_pickle"):
        Retriever.load_from(store.open("index"))


def test_format_passages():
    assert format_passages(RIVERS[:2]) == (
        "Doc 1: The Vell river flows through Quellin.\nDoc 2: Quellin was founded by Mara Voss."
    )
    assert format_passages([Passage("x", "two\nlines")]) == "Doc 1: two lines"
    assert format_passages([]) == ""


# --------------------------------------------------------------------------------------
# The index cache
# --------------------------------------------------------------------------------------


@pytest.fixture
def counted_builds(monkeypatch) -> list[int]:
    """Retriever.build, counting its calls."""
    calls: list[int] = []
    original = Retriever.build.__func__

    def counting(cls, passages, *tokenization):
        calls.append(len(passages))
        return original(cls, passages, *tokenization)

    monkeypatch.setattr(Retriever, "build", classmethod(counting))
    return calls


def test_cache_builds_once_then_loads(tmp_path, counted_builds):
    store = Store(str(tmp_path / "store"))
    path = f"_cache/bm25/{Retriever.corpus_hash(RIVERS)}"
    first = cached_retriever(RIVERS, store)
    assert counted_builds == [3] and store.exists(path)
    second = cached_retriever(list(RIVERS), store)
    assert counted_builds == [3], "the second call rebuilt instead of loading"
    assert second.passages == RIVERS
    assert second.search(["Mara Voss"], k=3) == first.search(["Mara Voss"], k=3)
    cached_retriever(RIVERS[:2], store)  # another corpus, another cache entry
    assert counted_builds == [3, 2]
    assert len(store.list("_cache/bm25")) == 2


def test_an_index_cached_without_stemming_is_not_reused_with_it(tmp_path, counted_builds):
    store = Store(str(tmp_path / "store"))
    plain = cached_retriever(RUNNERS, store)
    stemmed = cached_retriever(RUNNERS, store, STEMMED)
    assert counted_builds == [3, 3] and len(store.list("_cache/bm25")) == 2
    loaded = cached_retriever(RUNNERS, store, STEMMED)
    assert counted_builds == [3, 3], "the stemmed index was rebuilt instead of loaded"
    assert loaded.tokenization == STEMMED
    assert loaded.search(["running"], k=3) == stemmed.search(["running"], k=3) != plain.search(["running"], k=3)
    meta = store.open(f"_cache/bm25/{Retriever.corpus_hash(RUNNERS, STEMMED)}").meta
    assert (meta["stemmer"], meta["stopwords"]) == ("english", "english")


@pytest.mark.parametrize("damage", ["modify", "delete"])
def test_damaged_cache_is_rebuilt_with_a_warning(tmp_path, counted_builds, caplog, damage):
    store = Store(str(tmp_path / "store"))
    cached_retriever(RIVERS, store)
    cache = Path(store.root) / f"_cache/bm25/{Retriever.corpus_hash(RIVERS)}"
    victim = cache / "index" / "vocab.index.json"
    if damage == "modify":
        victim.write_text("{}")
    else:
        victim.unlink()
    with caplog.at_level(logging.WARNING, logger="drmas.tasks.search.retrieval"):
        rebuilt = cached_retriever(RIVERS, store)
    assert counted_builds == [3, 3]
    assert "rebuilding the BM25 cache" in caplog.text and "vocab.index.json" in caplog.text
    assert [p.pid for p in rebuilt.search(["Quellin founded"], k=1)[0]] == ["p2"]
    cached_retriever(RIVERS, store)  # the replaced cache is whole again
    assert counted_builds == [3, 3]
