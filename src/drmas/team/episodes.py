"""Episodes and agent calls: the state an orchestra works on, and the rows it produces.

One ``Call`` is one LLM call by one agent and becomes one row of ``trajectories.parquet``
(docs/architecture.md §4); the episode's reward and success are copied onto each of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from drmas.infra.schema import TRAJECTORY_SCHEMA

__all__ = ["Call", "Episode", "Question", "episodes_to_table"]


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
    solution: str = ""
    """A worked solution ending in the answer, in the data's own form (GSM8K's steps and
    ``#### N``, MATH's boxed solution); "" when the data has none. The warm start can teach
    from it (``drmas.tasks.math.math_demonstrations``)."""


@dataclass(frozen=True)
class Call:
    """One agent call: what was asked, what came back, and whether it was well-formed."""

    agent: str
    wg: str
    env_step: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    response_text: str
    is_valid: bool
    finish_reason: str


@dataclass
class Episode:
    """One rollout of one question by the team (a trajectory, key ``traj_uid``)."""

    uid: str
    """The prompt group: the ``group_size`` episodes of one question share it."""
    traj_uid: str
    sample_idx: int
    question: Question
    calls: list[Call] = field(default_factory=list)
    team_context: list[str] = field(default_factory=list)
    """Teammates' outputs in the current step, as 'Role: text' lines."""
    history: list[tuple[str, str]] = field(default_factory=list)
    """search: (query, retrieved passages) of every past turn."""
    final_answer: str | None = None
    """The text the reward is computed on (the last Solver output, the Answer agent's answer)."""
    done: bool = False
    reward: float = 0.0
    success: bool = False


def episodes_to_table(episodes: list[Episode], run_id: str, iteration: int) -> pa.Table:
    """One row per call of every episode, in the trajectory schema."""
    rows = [(episode, index, call) for episode in episodes for index, call in enumerate(episode.calls)]

    def column(values, kind):
        return pa.array(values, type=kind)

    def ints(values):
        return np.array(values, dtype=np.int32)

    return pa.table(
        {
            "run_id": column([run_id] * len(rows), pa.string()),
            "iteration": ints([iteration] * len(rows)),
            "uid": column([e.uid for e, _, _ in rows], pa.string()),
            "traj_uid": column([e.traj_uid for e, _, _ in rows], pa.string()),
            "sample_idx": ints([e.sample_idx for e, _, _ in rows]),
            "data_source": column([e.question.data_source for e, _, _ in rows], pa.string()),
            "env_step": ints([c.env_step for _, _, c in rows]),
            "call_idx": ints([i for _, i, _ in rows]),
            "agent": column([c.agent for _, _, c in rows], pa.string()),
            "wg": column([c.wg for _, _, c in rows], pa.string()),
            "prompt_ids": column([c.prompt_ids for _, _, c in rows], pa.list_(pa.int32())),
            "response_ids": column([c.response_ids for _, _, c in rows], pa.list_(pa.int32())),
            "rollout_logprobs": column([c.logprobs for _, _, c in rows], pa.list_(pa.float32())),
            "response_text": column([c.response_text for _, _, c in rows], pa.string()),
            "is_valid": column([c.is_valid for _, _, c in rows], pa.bool_()),
            "finish_reason": column([c.finish_reason for _, _, c in rows], pa.string()),
            "reward": column([e.reward for e, _, _ in rows], pa.float32()),
            "success": column([e.success for e, _, _ in rows], pa.bool_()),
        },
        schema=TRAJECTORY_SCHEMA,
    )
