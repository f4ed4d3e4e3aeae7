"""Tasks: where questions come from and how an episode's final answer is scored.

A task is data and a reward; the agents and the orchestra that drive an episode live in
``drmas.team.agents`` and ``drmas.team.orchestras``. Both shipped tasks share these types.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DataError", "Question"]


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
