"""The search task and its orchestra: questions answered from a corpus through search.

A Verifier routes each turn to a Search agent, whose query is answered with the top-k
passages (``SearchOrchestra``), or to an Answer agent; the reward is exact match
(``drmas.tasks.search.answers``). The task retrieves in process, with BM25
(``drmas.tasks.search.retrieval``) or a dense encoder (``drmas.tasks.search.dense``) as
``task.retrieval_method`` says, its index cached in the store, or, when
``task.retrieval_url`` is set, through a retrieval service's client
(``drmas.tasks.search.client``). The warm start's demonstrations play each generated
question out against the real retriever, one hop's query at a time
(``search_demonstrations``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from drmas.tasks import DataError, Demonstrations, Split
from drmas.tasks.search.answers import exact_match
from drmas.tasks.search.client import RetrievalClient
from drmas.tasks.search.corpus import corpus_for, corpus_hash_for, load_qa
from drmas.tasks.search.dense import DenseEncoding
from drmas.tasks.search.retrieval import IndexMethod, Tokenization, cached_retriever
from drmas.tasks.search.world import GENERATED_FACTS, GENERATED_PREFIX, demonstration_queries
from drmas.team.agents import AnswerAgent, RouterAgent, SearchAgent, verifier_context
from drmas.team.episodes import Episode, Question
from drmas.team.orchestras import Passage, Searcher, Team, Tools, verdict_passes

if TYPE_CHECKING:
    import numpy as np

    from drmas.config import DrmasConfig, TaskConfig
    from drmas.infra.store import Store

__all__ = [
    "SearchOrchestra",
    "SearchTask",
    "format_passages",
    "index_method",
    "retrieval_client",
    "search_demonstrations",
]


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
    plans = demonstration_queries(config.data, config.data_seed)
    router, searcher, answerer = (
        cls(history_length=task.history_length, prompts=task.prompts, parsing=task.parsing)
        for cls in (RouterAgent, SearchAgent, AnswerAgent)
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


def index_method(task: TaskConfig) -> IndexMethod:
    """How the config's corpus is indexed (``task.retrieval_method``): BM25 tokenised as
    ``task.retrieval_stemmer``/``retrieval_stopwords`` say, or the dense encoder, loaded."""
    if task.retrieval_method == "dense":
        return DenseEncoding.of(task).load()
    return Tokenization.of(task)


def retrieval_client(config: DrmasConfig) -> RetrievalClient:
    """The client of ``task.retrieval_url`` with the config's timeout and retries, checking
    that the service retrieves as the config says from the corpus it names, indexed with its
    settings (``task.retrieval_corpus_hash`` if pinned; otherwise computed on first use,
    which for dense retrieval loads the encoder)."""
    task = config.task
    if task.retrieval_url is None:
        raise ValueError("task.retrieval_url is not set: the search task retrieves in process")
    expected: str | Callable[[], str] = task.retrieval_corpus_hash or (
        lambda: corpus_hash_for(config.data, config.data_seed, config.store, index_method(task))
    )
    settings = DenseEncoding.of(task) if task.retrieval_method == "dense" else Tokenization.of(task)
    return RetrievalClient(
        task.retrieval_url,
        timeout_s=task.retrieval_timeout_s,
        retries=task.retrieval_retries,
        backoff_s=task.retrieval_backoff_s,
        expected_hash=expected,
        expected_method=task.retrieval_method,
        expected_settings=settings.describe(),
    )


class SearchTask:
    """Questions answered from a corpus through search (BM25 or dense); reward exact match."""

    default_data = f"{GENERATED_PREFIX}{GENERATED_FACTS}"
    default_orchestra = "search"

    def questions(self, config: DrmasConfig, split: Split) -> list[Question]:
        return load_qa(config.data_spec(split), split, config.data, config.data_seed, config.store)

    def tools(self, config: DrmasConfig, store: Store) -> Tools:
        """The in-process retriever of ``task.retrieval_method`` (its index cached in the
        store), or, when ``task.retrieval_url`` is set, a client of that retrieval service
        (checked on first use to serve the corpus this config names, indexed alike)."""
        if config.task.retrieval_url:
            return Tools(retriever=retrieval_client(config))
        passages = corpus_for(config.data, config.data_seed, config.store)
        return Tools(retriever=cached_retriever(passages, store, index_method(config.task)))

    def corpus(self, config: DrmasConfig) -> list[str]:
        return [passage.text for passage in corpus_for(config.data, config.data_seed, config.store)]

    def demonstrations(
        self, config: DrmasConfig, questions: list[Question], tools: Tools, rng: np.random.Generator
    ) -> Demonstrations:
        if tools.retriever is None:
            raise ValueError("the search task's demonstrations need a retriever (Tools.retriever)")
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
            name: cls(history_length=task.history_length, prompts=task.prompts, parsing=task.parsing)
            for name, cls in self.agents.items()
        }

    def run(self, episodes: list[Episode], team: Team) -> None:
        for step in range(1, self.max_turns + 1):
            active = [episode for episode in episodes if not episode.done]
            if not active:
                break
            for episode in active:
                episode.team_context = []
            routes = team.call("verifier", active, step)
            to_search: list[Episode] = []
            to_answer: list[Episode] = []
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
