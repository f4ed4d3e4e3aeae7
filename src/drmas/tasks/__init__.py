"""Tasks: what the team is asked, with which tools, and how its final answer is scored.

A task is one class implementing ``Task``, and everything that depends on the task goes
through it: the rollout and evaluation draw its questions and build its tools, a scratch
tokenizer learns its texts, the warm start imitates its demonstrations, and its orchestras
score episodes with its reward. ``task_for(config)`` finds the task that ``task.name``
names: a built-in one (math, search) or an import path ``package.module:ClassName``, so
a new task lives in one module of its own (docs/tasks.md has a complete example).

The agents and orchestras that drive an episode live in ``drmas.agents`` and
``drmas.orchestras``; question files are read by ``drmas.tasks.files``.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from drmas.config import DrmasConfig
    from drmas.store import Store

__all__ = ["BUILTIN_TASKS", "DataError", "Demonstrations", "Question", "Split", "Task", "Tools", "get_task", "task_for"]

Split = Literal["train", "eval"]
Demonstrations = dict[str, list[tuple[str, str]]]
"""Agent name -> (prompt, response) pairs that the warm start fine-tunes on."""


@dataclass(frozen=True)
class Question:
    """One prompt of a data set, with every accepted gold answer."""

    qid: str
    """Stable id within its data set (row index or the file's id column)."""
    question: str
    answers: tuple[str, ...]
    """Accepted answers; the reward compares the final answer against each."""
    data_source: str
    """Where the question comes from (metrics are also reported per source)."""


class DataError(ValueError):
    """Bad input data; the message names the file, and the row or column, and the problem."""


@dataclass
class Tools:
    """Environment tools that a task builds (``Task.tools``) and its orchestras use: the
    search task's retriever."""

    retriever: Any = None


@runtime_checkable
class Task(Protocol):
    """One task. Instantiated once, without arguments: it holds no state of its own."""

    default_data: str
    """The question set used when ``data.train`` / ``data.eval`` are unset
    (``generated:NAME``; its split picks the half)."""
    default_orchestra: str
    """The orchestra used when ``task.orchestra`` is unset: a built-in name or an import path."""

    def questions(self, config: DrmasConfig, split: Split) -> list[Question]:
        """The questions of ``config.data_spec(split)``: a generated set or a file (read
        with ``drmas.tasks.files.read_questions``). Raises DataError for bad data."""

    def tools(self, config: DrmasConfig, store: Store) -> Tools:
        """The environment tools its orchestras use (search: a BM25 retriever, cached in the
        store); ``Tools()`` when there are none."""

    def corpus(self, config: DrmasConfig) -> list[str]:
        """Texts of the task beyond its questions (search: the passages it retrieves), []
        if none. A scratch tokenizer learns them; ``drmas`` reads them before a run starts,
        so that a bad corpus file fails early."""

    def demonstrations(self, config: DrmasConfig, questions: list[Question], tools: Tools, rng: np.random.Generator) -> Demonstrations:
        """(prompt, response) pairs per agent, for the warm start; DataError for a question
        it has no demonstration of."""

    def reward(self, final_answer: str | None, question: Question) -> float:
        """The reward of an episode's final answer (None: the team never answered)."""


BUILTIN_TASKS: dict[str, str] = {
    "math": "drmas.tasks.math:MathTask",  # Solver <-> Verifier on arithmetic, GSM8K, MATH, DAPO
    "search": "drmas.tasks.search:SearchTask",  # Verifier routes to Search or Answer over BM25
}
"""Import paths, so that naming a task imports only its own module (search needs bm25s)."""


@functools.cache
def get_task(name: str) -> Task:
    """The task of a built-in name or an import path, or a ValueError that lists the names."""
    path = BUILTIN_TASKS.get(name, name)
    if ":" not in path:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise ValueError(f"unknown task {name!r}: use one of {known}, or an import path 'package.module:ClassName'")
    module_name, _, attribute = path.partition(":")
    try:
        task_class = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import task {name!r}: {error}") from None
    return task_class()


def task_for(config: DrmasConfig) -> Task:
    """The task that ``config.task.name`` names."""
    return get_task(config.task.name)
