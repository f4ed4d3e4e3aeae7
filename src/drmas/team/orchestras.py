"""Orchestras: who speaks when, for a whole batch of episodes at once.

An orchestra runs every episode of a batch to the end. At each step it asks the team to
call one agent on all the episodes that need it (``team.call(agent, episodes, step)``:
ONE batched generate per agent per step, never one call per episode), reads the parsed
outputs, and moves the episodes on. At the end it sets each episode's reward.

Write your own (sequential, hierarchical, conditional) with the same shape and name it in
the config as ``task.orchestra: my_package.my_module:PlanThenCode``:

    class PlanThenCode:
        agents = {"planner": PlannerAgent, "coder": CoderAgent}   # name -> agent class

        def __init__(self, task: TaskConfig, tools: Tools) -> None:
            self.agent_objects = {name: cls() for name, cls in self.agents.items()}

        def run(self, episodes: list[Episode], team: Team) -> None:
            plans = team.call("planner", episodes, step=1)
            for episode, plan in zip(episodes, plans):
                episode.team_context.append(f"Planner: {plan.text}")
            code = team.call("coder", episodes, step=1)
            for episode, out in zip(episodes, code):
                episode.final_answer, episode.done = out.text, True

        def reward(self, episode: Episode) -> float:   # the task's reward, or a checker of its own
            return get_task("math").reward(episode.final_answer, episode.question)

The built-in orchestras live with their tasks (``drmas.tasks.math``: MathOrchestra,
SoloOrchestra; ``drmas.tasks.search.task``: SearchOrchestra); this module holds what every
orchestra shares: the ``Team`` it calls agents through, the ``Tools`` its task gives it (a
retriever is any ``Searcher`` of ``Passage``s, so that ``Tools`` can name its type) and how a
verifier's verdict decides.

A new task (its data, tools, reward and default orchestra) is a ``drmas.tasks.Task``; see
docs/tasks.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from drmas.team.agents import Agent, Parsed
from drmas.team.episodes import Episode

__all__ = ["Orchestra", "Passage", "Searcher", "Team", "Tools", "verdict_passes"]


class Team(Protocol):
    """What an orchestra calls agents through (the rollout stage provides it)."""

    def call(self, agent: str, episodes: list[Episode], step: int) -> list[Parsed]:
        """Call ``agent`` once for each episode, as one batched generate; record the calls."""


@dataclass(frozen=True)
class Passage:
    """One retrievable text with a stable id (the corpus file's id, or its line number)."""

    pid: str
    text: str


class Searcher(Protocol):
    """What the search orchestra and the warm start retrieve through: the in-process
    ``drmas.tasks.search.retrieval.Retriever``, or
    ``drmas.tasks.search.client.RetrievalClient`` for a served one."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """The best ``k`` passages for each query, best first."""
        ...


@dataclass
class Tools:
    """Environment tools that a task builds (``Task.tools``) and its orchestras use: the
    search task's retriever."""

    retriever: Searcher | None = None


class Orchestra(Protocol):
    agents: dict[str, type]
    agent_objects: dict[str, Agent]

    def run(self, episodes: list[Episode], team: Team) -> None: ...

    def reward(self, episode: Episode) -> float: ...


def verdict_passes(verdict: Parsed, yes: str, no: str, malformed_passes: bool) -> bool:
    """A verifier's verdict as a decision; a missing or malformed one follows the setting."""
    return verdict.verdict == yes if verdict.verdict in (yes, no) else malformed_passes
