"""Tasks: what the team is asked, with which tools, and how its final answer is scored.

A task is one class implementing ``Task``, and everything that depends on the task goes
through it: the rollout and evaluation draw its questions and build its tools, a scratch
tokenizer learns its texts, the warm start imitates its demonstrations, and its orchestras
score episodes with its reward. ``task_for(config)`` finds the task that ``task.name``
names: a built-in one (math, search) or an import path ``package.module:ClassName``, so
a new task lives in one module of its own (docs/tasks.md has a complete example).

The agents and orchestras that drive an episode live in ``drmas.team.agents`` and
``drmas.team.orchestras``; question files are read by ``drmas.tasks.files``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from drmas.registry import get_task
from drmas.team.episodes import Question
from drmas.team.orchestras import Tools

if TYPE_CHECKING:
    import numpy as np

    from drmas.config import DrmasConfig
    from drmas.infra.store import Store

__all__ = ["DataError", "Demonstrations", "Question", "Split", "Task", "Tools", "run_length", "task_for"]

Split = Literal["train", "eval"]
Demonstrations = dict[str, list[tuple[str, str]]]
"""Agent name -> (prompt, response) pairs that the warm start fine-tunes on."""


class DataError(ValueError):
    """Bad input data; the message names the file, and the row or column, and the problem."""


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

    def demonstrations(
        self, config: DrmasConfig, questions: list[Question], tools: Tools, rng: np.random.Generator
    ) -> Demonstrations:
        """(prompt, response) pairs per agent, for the warm start; DataError for a question
        it has no demonstration of."""

    def reward(self, final_answer: str | None, question: Question) -> float:
        """The reward of an episode's final answer (None: the team never answered)."""


def task_for(config: DrmasConfig) -> Task:
    """The task that ``config.task.name`` names (``drmas.registry``)."""
    return get_task(config.task.name)


def run_length(config: DrmasConfig) -> DrmasConfig:
    """``config`` with ``experiment.epochs`` resolved into iterations against its training
    set (read here, with the config's task: ``DrmasConfig.with_epochs_resolved``); unchanged
    without epochs. A training set that cannot be read is a ConfigError naming the field
    and the file."""
    from drmas.config import ConfigError  # noqa: PLC0415 - loading a config loads the tasks

    if config.experiment.epochs is None:
        return config
    try:
        questions = task_for(config).questions(config, "train")
    except DataError as error:
        raise ConfigError([f"experiment.epochs: cannot count the training set: {error}"]) from None
    return config.with_epochs_resolved(len(questions))
