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

A new task (its data, tools, reward and default orchestra) is a ``drmas.tasks.Task``; see
docs/tasks.md.
"""

from __future__ import annotations

from typing import Protocol

from drmas.agents import (
    Agent,
    AnswerAgent,
    MathVerifierAgent,
    Parsed,
    RouterAgent,
    SearchAgent,
    SolverAgent,
    verifier_context,
)
from drmas.config import TaskConfig
from drmas.episodes import Episode
from drmas.tasks import Tools, get_task

__all__ = ["MathOrchestra", "Orchestra", "SearchOrchestra", "SoloOrchestra", "Team", "Tools"]


class Team(Protocol):
    """What an orchestra calls agents through (the rollout stage provides it)."""

    def call(self, agent: str, episodes: list[Episode], step: int) -> list[Parsed]:
        """Call ``agent`` once for each episode, as one batched generate; record the calls."""


class Orchestra(Protocol):
    agents: dict[str, type]
    agent_objects: dict[str, Agent]

    def run(self, episodes: list[Episode], team: Team) -> None: ...

    def reward(self, episode: Episode) -> float: ...


def _passes(verdict: Parsed, yes: str, no: str, malformed_passes: bool) -> bool:
    """A verifier's verdict as a decision; a missing or malformed one follows the setting."""
    return verdict.verdict == yes if verdict.verdict in (yes, no) else malformed_passes


class MathOrchestra:
    """Solver then Verifier, up to ``task.max_loops`` Solver calls per episode.

    No verification after the last solve; an approved episode is not solved again; the
    final answer is the last Solver output (its last \\boxed{}); a missing or malformed
    verdict counts as approve unless ``task.malformed_verdict_passes`` is False.
    """

    agents = {"solver": SolverAgent, "verifier": MathVerifierAgent}

    def __init__(self, task: TaskConfig, tools: Tools) -> None:
        self.max_loops = task.max_loops
        self.malformed_passes = task.malformed_verdict_passes
        self.agent_objects = {name: cls() for name, cls in self.agents.items()}

    def run(self, episodes: list[Episode], team: Team) -> None:
        pending = list(episodes)
        for loop in range(self.max_loops):
            solutions = team.call("solver", pending, step=1)
            for episode, solution in zip(pending, solutions, strict=True):
                episode.team_context.append(f"Solver: {solution.text}")
                episode.final_answer = solution.text
            if loop == self.max_loops - 1:
                break
            verdicts = team.call("verifier", pending, step=1)
            still_pending = []
            for episode, verdict in zip(pending, verdicts, strict=True):
                episode.team_context.append(verifier_context(verdict.text))
                if not _passes(verdict, "approve", "reject", self.malformed_passes):
                    still_pending.append(episode)
            pending = still_pending
            if not pending:
                break
        for episode in episodes:
            episode.done = True

    def reward(self, episode: Episode) -> float:
        return get_task("math").reward(episode.final_answer, episode.question)


class SoloOrchestra:
    """One Solver call per episode, nothing else: single-agent GRPO on the math task.

    The baseline a multi-agent run is compared with, and the setting in which drmas is
    benchmarked against single-agent trainers (with ``algorithm.advantage: grpo`` the two
    advantage modes coincide: one agent has one set of reward statistics).
    """

    agents = {"solver": SolverAgent}

    def __init__(self, task: TaskConfig, tools: Tools) -> None:
        self.agent_objects = {"solver": SolverAgent()}

    def run(self, episodes: list[Episode], team: Team) -> None:
        for episode, solution in zip(episodes, team.call("solver", episodes, step=1), strict=True):
            episode.final_answer, episode.done = solution.text, True

    def reward(self, episode: Episode) -> float:
        return get_task("math").reward(episode.final_answer, episode.question)


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
            name: cls(history_length=task.history_length) for name, cls in self.agents.items()
        }

    def run(self, episodes: list[Episode], team: Team) -> None:
        from drmas.tasks.search import format_passages  # noqa: PLC0415

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
                enough = _passes(route, "yes", "no", self.malformed_passes)
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
        return get_task("search").reward(episode.final_answer, episode.question)
