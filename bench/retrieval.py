"""BM25 with and without stemming: index and query speed, and recall where stemming matters.

    .venv/bin/python bench/retrieval.py [--passages 10000] [--queries 1000] [--repeats 3]

Generates a corpus of ``--passages`` passages of 40-120 words (DPR's passages are 100
words): made-up word roots, each written in several inflections (-s, -ed, -ing, -er,
-ation), between English stop words. Each query is 3-6 roots of one passage written in
another inflection than the passage has ("running" for "runs"), as a question rephrases
its source. Then, for ``drmas.tasks.search.retrieval.Tokenization`` with the stemmer off and on
(same process, same data, best of ``--repeats``, CPU time):
  - tokenising the corpus, and ``Retriever.build`` (tokenising included),
  - one batched ``Retriever.search`` of all queries at k = 3,
  - recall@3: the share of queries whose source passage is among the 3 found,
and prints each time and the stemmed / plain ratios; the tokenising is timed against
``bm25s.tokenize`` giving the same terms (checked), which drmas's loop replaces.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import bm25s
import Stemmer
from bm25s.stopwords import STOPWORDS_EN

from drmas.tasks.search.retrieval import TOKEN_PATTERN, Retriever, Tokenization
from drmas.team.orchestras import Passage

ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kl", "l", "m", "n", "p", "pl", "r", "s", "st", "t", "tr", "v")
VOWELS = ("a", "e", "i", "o", "u")
CODAS = ("k", "l", "m", "n", "p", "r", "t", "v")
ENDINGS = ("", "s", "ed", "ing", "er", "ation")
STOPWORDS = sorted(STOPWORDS_EN)


def corpus(passages: int, queries: int, seed: int = 0) -> tuple[list[Passage], list[tuple[str, int]]]:
    """The passages, and (query, index of its source passage) pairs."""
    rng = random.Random(seed)
    roots = sorted(
        {
            "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 2))) + rng.choice(CODAS)
            for _ in range(6000)
        }
    )
    texts, used = [], []
    for _ in range(passages):
        words, chosen = [], []
        for _ in range(rng.randint(40, 120)):
            if rng.random() < 0.4:
                words.append(rng.choice(STOPWORDS))
            else:
                root, ending = rng.choice(roots), rng.choice(ENDINGS)
                words.append(root + ending)
                chosen.append((root, ending))
        texts.append(" ".join(words).capitalize() + ".")
        used.append(chosen)
    asked = []
    for _ in range(queries):
        source = rng.randrange(passages)
        picks = rng.sample(used[source], min(len(used[source]), rng.randint(3, 6)))
        words = [root + rng.choice([e for e in ENDINGS if e != ending]) for root, ending in picks]
        asked.append((" ".join(words), source))
    return [Passage(str(i), text) for i, text in enumerate(texts)], asked


def best_of(repeats: int, work: Callable[[], object]) -> tuple[float, object]:
    """The shortest of ``repeats`` runs, in CPU seconds of this process (the work is on one
    thread; CPU time stays comparable on a machine that other jobs share), and the last
    result."""
    times, result = [], None
    for _ in range(repeats):
        started = time.process_time()
        result = work()
        times.append(time.process_time() - started)
    return min(times), result


def bm25s_tokens(texts: list[str], tokenization: Tokenization) -> list[list[str]]:
    """The same terms by ``bm25s.tokenize`` itself: the baseline of ``Tokenization.tokens``."""
    stemmer = Stemmer.Stemmer("english") if tokenization.stemmer == "english" else None
    stopwords = "english" if tokenization.stopwords == "english" else None
    return bm25s.tokenize(
        texts, token_pattern=TOKEN_PATTERN, stopwords=stopwords, stemmer=stemmer, return_ids=False, show_progress=False
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    passages, asked = corpus(args.passages, args.queries)
    texts, queries = [p.text for p in passages], [query for query, _ in asked]
    words = sum(len(text.split()) for text in texts)
    print(f"corpus: {len(passages)} passages, {words} words; {len(queries)} queries; CPU time, best of {args.repeats}")
    results: dict[str, dict[str, float]] = {}
    for name, tokenization in (("plain", Tokenization()), ("stemmed", Tokenization(stemmer="english"))):
        tokenize, terms = best_of(args.repeats, lambda t=tokenization: t.tokens(texts))
        baseline, same = best_of(args.repeats, lambda t=tokenization: bm25s_tokens(texts, t))
        assert terms == same, "the terms differ from bm25s.tokenize's"
        build, retriever = best_of(args.repeats, lambda t=tokenization: Retriever.build(passages, t))
        assert isinstance(retriever, Retriever)
        search, found = best_of(args.repeats, lambda r=retriever: r.search(queries, 3))
        assert isinstance(found, list)
        hits = sum(str(source) in {p.pid for p in top} for (_, source), top in zip(asked, found, strict=True))
        results[name] = {
            "tokenize_s": tokenize,
            "bm25s_tokenize_s": baseline,
            "index_s": build,
            "search_s": search,
            "recall_at_3": hits / len(asked),
            "vocabulary": len(retriever.index.vocab_dict),
        }
        print(
            f"{name:8s} tokenise {tokenize:6.3f} s (bm25s.tokenize: {baseline:6.3f} s)  index {build:6.3f} s "
            f"({len(passages) / build:6.0f} passages/s)  search {search:6.3f} s ({len(queries) / search:6.0f} "
            f"queries/s)  recall@3 {hits / len(asked):.3f}  vocabulary {len(retriever.index.vocab_dict)}"
        )
    plain, stemmed = results["plain"], results["stemmed"]
    print(
        f"stemmed / plain: tokenise x{stemmed['tokenize_s'] / plain['tokenize_s']:.2f}, "
        f"index x{stemmed['index_s'] / plain['index_s']:.2f}, "
        f"search x{stemmed['search_s'] / plain['search_s']:.2f}, "
        f"recall@3 {plain['recall_at_3']:.3f} -> {stemmed['recall_at_3']:.3f}"
    )
    for name, times in results.items():
        print(f"{name}: bm25s.tokenize / drmas's loop: x{times['bm25s_tokenize_s'] / times['tokenize_s']:.2f}")


if __name__ == "__main__":
    main()
