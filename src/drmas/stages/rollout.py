"""The rollout stage: prompts -> the team plays every episode -> trajectories.parquet.

    rollout(config, store, run_id, iteration, policies, pool) -> RolloutResult

1. Draw ``rollout.prompts_per_iteration`` questions (a fresh permutation every epoch,
   seeded; an epoch's last partial batch dropped), and make ``rollout.group_size``
   episodes of each (one ``uid`` per question).
2. Point every worker group at its policy version (actors reload only on change).
3. The orchestra plays all episodes; every agent call at every step is ONE batched
   generate on the agent's worker group, with that agent's sampling settings.
4. Score each episode (the task's reward), copy it onto its calls, and write one row per
   call to the store, manifest last. Same inputs and seed, same file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from drmas.config import DrmasConfig, SamplingConfig
from drmas.generation.workers import GenerationResult
from drmas.infra.layout import PolicyRef, StageResult, stage_path
from drmas.infra.progress import Progress
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store
from drmas.registry import load_orchestra
from drmas.tasks import Question, Split, Tools, task_for
from drmas.team.agents import Parsed
from drmas.team.episodes import Call, Episode, episodes_to_table

__all__ = [
    "GeneratePool",
    "TeamOnPool",
    "agent_call_metrics",
    "draw_questions",
    "rollout",
    "task_questions",
    "task_tools",
]


class GeneratePool(Protocol):
    """What the rollout needs from a pool (``drmas.generation.pool.RayPool``, or a test double)."""

    def load(self, policies: dict[str, PolicyRef]) -> None: ...

    def generate(self, wg: str, messages: list[str], sampling: SamplingConfig, seed: int) -> list[GenerationResult]: ...


@dataclass
class TeamOnPool:
    """The orchestra's ``Team``: one batched generate per call, every call recorded."""

    agents: dict[str, Any]
    agent_wg: dict[str, str]
    sampling: dict[str, SamplingConfig]
    pool: GeneratePool
    seed: int
    generate_calls: int = 0
    tokens: int = 0
    calls_per_agent: dict[str, int] = field(default_factory=dict)
    progress: Progress | None = None
    """Counts the agent calls answered (``play`` sets it)."""

    def call(self, agent: str, episodes: list[Episode], step: int) -> list[Parsed]:
        if not episodes:
            return []
        role = self.agents[agent]
        prompts = [role.prompt(episode, step) for episode in episodes]
        seed = int(np.random.SeedSequence([self.seed, self.generate_calls]).generate_state(1)[0])
        results = self.pool.generate(self.agent_wg[agent], prompts, self.sampling[agent], seed)
        self.generate_calls += 1
        self.calls_per_agent[agent] = self.calls_per_agent.get(agent, 0) + 1
        parsed = []
        for episode, result in zip(episodes, results, strict=True):
            reading = role.parse(result.text)
            episode.calls.append(
                Call(
                    agent=agent,
                    wg=self.agent_wg[agent],
                    env_step=step,
                    prompt_ids=result.prompt_ids,
                    response_ids=result.response_ids,
                    logprobs=result.logprobs,
                    response_text=result.text,
                    is_valid=reading.is_valid,
                    finish_reason=result.finish_reason,
                )
            )
            self.tokens += len(result.response_ids)
            parsed.append(reading)
        if self.progress is not None:
            self.progress.update(len(episodes), agent=agent)
        return parsed


def task_questions(config: DrmasConfig, split: Split) -> list[Question]:
    """The task's questions for ``split`` ('train' or 'eval')."""
    return task_for(config).questions(config, split)


def task_tools(config: DrmasConfig, store: Store) -> Tools:
    """The task's environment tools (search: a BM25 retriever, cached in the store)."""
    return task_for(config).tools(config, store)


def draw_questions(questions: list[Question], count: int, iteration: int, seed: int) -> list[Question]:
    """Questions for one iteration: consecutive batches of per-epoch seeded permutations.
    An epoch is ``len(questions) // count`` batches, its last partial batch dropped (as
    the reference's data loader does, and as ``experiment.epochs`` counts); a set smaller
    than one batch is drawn from as one stream of permutations instead."""
    if not questions:
        raise ValueError("the training set is empty")
    per_epoch = len(questions) // count
    if per_epoch:
        epoch, batch = divmod(iteration, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(len(questions))
        return [questions[i] for i in order[batch * count : (batch + 1) * count]]
    start = iteration * count
    drawn: list[Question] = []
    while len(drawn) < count:
        epoch, offset = divmod(start + len(drawn), len(questions))
        order = np.random.default_rng([seed, epoch]).permutation(len(questions))
        take = min(count - len(drawn), len(questions) - offset)
        drawn += [questions[i] for i in order[offset : offset + take]]
    return drawn


def build_team(config: DrmasConfig, tools: Tools, pool: GeneratePool, seed: int) -> tuple[Any, TeamOnPool]:
    """The orchestra named in the config and the team it calls agents through."""
    orchestra = load_orchestra(config.task.orchestra_name)(config.task, tools)
    team = TeamOnPool(
        agents=orchestra.agent_objects,
        agent_wg=config.agent_to_worker_group(),
        sampling={agent.name: config.agent_sampling(agent.name) for agent in config.agents},
        pool=pool,
        seed=seed,
    )
    return orchestra, team


def play(
    orchestra: Any, team: TeamOnPool, questions: list[Question], group_size: int, prefix: str, title: str = "play"
) -> list[Episode]:
    """``group_size`` episodes per question, played to the end and scored. How many agent
    calls are answered is shown as they are (``title``: whose): an orchestra plays all
    episodes at once, a batched call per agent and step, and how many calls an episode
    takes is its own affair, so a count and a rate, no share. Lines only when it is slow:
    the iteration's line reports its end."""
    episodes = [
        Episode(uid=f"{prefix}-{q.qid}", traj_uid=f"{prefix}-{q.qid}-s{j}", sample_idx=j, question=q)
        for q in questions
        for j in range(group_size)
    ]
    with Progress(None, f"{title} ({len(episodes)} episodes)", unit="call", final_line=False) as team.progress:
        orchestra.run(episodes, team)
    for episode in episodes:
        episode.reward = float(orchestra.reward(episode))
        episode.success = episode.reward >= 1.0
    return episodes


def rollout(
    config: DrmasConfig,
    store: Store,
    run_id: str,
    iteration: int,
    policies: dict[str, PolicyRef],
    pool: GeneratePool,
    overwrite: bool = False,
    cache_key: str = "",
) -> StageResult:
    """Roll out one iteration and write ``{iteration}/rollout/trajectories.parquet``."""
    started = time.perf_counter()
    seed = config.experiment.seed
    questions = draw_questions(task_questions(config, "train"), config.rollout.prompts_per_iteration, iteration, seed)
    pool.load(policies)
    orchestra, team = build_team(config, task_tools(config, store), pool, seed=seed * 1_000_003 + iteration)
    episodes = play(
        orchestra, team, questions, config.rollout.group_size, prefix=f"i{iteration}", title=f"rollout {iteration}"
    )
    table = episodes_to_table(episodes, run_id, iteration)
    seconds = time.perf_counter() - started
    metrics = rollout_metrics(episodes, team, seconds)
    path = stage_path(config.experiment.name, run_id, iteration, "rollout")
    with store.writer(
        path, overwrite=overwrite, meta={"stage": "rollout", "iteration": iteration, "cache_key": cache_key}
    ) as out:
        out.write_table("trajectories.parquet", table, TRAJECTORY_SCHEMA)
        out.write_json("metrics.json", metrics)
    return StageResult(path, metrics)


def rollout_metrics(episodes: list[Episode], team: TeamOnPool, seconds: float) -> dict[str, float]:
    """Reward, success, per-agent calls and validity, and generation throughput."""
    metrics = {
        "reward/mean": float(np.mean([e.reward for e in episodes])),
        "episode/success_rate": float(np.mean([e.success for e in episodes])),
        "episode/calls_mean": float(np.mean([len(e.calls) for e in episodes])),
        "rollout/generate_calls": float(team.generate_calls),
        "rollout/tokens": float(team.tokens),
        "rollout/tokens_per_s": team.tokens / seconds if seconds > 0 else 0.0,
        "time/rollout": seconds,
    }
    return metrics | agent_call_metrics(episodes, list(team.agents), prefix="agent")


def agent_call_metrics(episodes: list[Episode], agents: list[str], prefix: str) -> dict[str, float]:
    """Per agent: calls, calls per episode and the share of well-formed outputs."""
    calls = [call for episode in episodes for call in episode.calls]
    metrics: dict[str, float] = {}
    for agent in agents:
        mine = [call for call in calls if call.agent == agent]
        metrics[f"{prefix}/{agent}/calls"] = float(len(mine))
        metrics[f"{prefix}/{agent}/calls_per_episode"] = len(mine) / max(len(episodes), 1)
        if mine:
            metrics[f"{prefix}/{agent}/valid_rate"] = float(np.mean([c.is_valid for c in mine]))
    return metrics
