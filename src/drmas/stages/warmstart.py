"""The warm-start stage: supervised fine-tuning on generated demonstrations of each role.

    warmstart(config, store, run_id) -> {wg: PolicyRef}

A model initialised at random rewards nothing, so RL has nothing to reinforce. The warm
start teaches each worker group its agents' roles from demonstrations that are
deliberately imperfect: ``warmstart.wrong_fraction`` of the final answers are wrong and
``warmstart.verdict_noise`` of the verdicts too. The team then starts well above zero and
well below perfect, where RL has room to show what it does.

- math (``generated:arithmetic``): the Solver writes its working digit by digit and boxes
  the answer (computed, never sampled); the Verifier approves or rejects.
- search (``generated:facts``): each episode is played out against the real retriever.
  The Verifier says "no" until every hop's passage is in the history, the Search agent
  writes the hop's query, the Answer agent copies the answer from the passages.

Loss: cross-entropy on the response tokens only.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from drmas.team.agents import AnswerAgent, MathVerifierAgent, RouterAgent, SearchAgent, SolverAgent, verifier_context
from drmas.config import DrmasConfig
from drmas.team.episodes import Episode
from drmas.infra.layout import run_path
from drmas.models import load_model, load_tokenizer
from drmas.stages.rollout import task_questions, task_tools
from drmas.infra.store import Store
from drmas.tasks import DataError, Question
from drmas.training.batching import collate, token_logprobs
from drmas.generation.workers import PolicyRef, truncate_prompt

if TYPE_CHECKING:
    from drmas.tasks.search import Retriever

__all__ = ["column_working", "math_demonstrations", "search_demonstrations", "warmstart", "warmstart_path"]

ARITHMETIC = re.compile(r"^What is (\d+) ([+-]) (\d+)\?$")


def warmstart_path(config: DrmasConfig, run_id: str, wg: str) -> str:
    return f"{run_path(config.experiment.name, run_id)}/warmstart/policy/{wg}"


def column_working(a: int, op: str, b: int) -> str:
    """Digit-by-digit working, right to left, one step per column, then the boxed result.

    37 + 48 -> "7+8=15, 3+4+1=8. \\boxed{85}";  52 - 17 -> "12-7=5, 5-1-1=3. \\boxed{35}".
    """
    steps, carry = [], 0
    top, bottom = str(a)[::-1], str(b)[::-1]
    for column in range(len(top)):
        x = int(top[column])
        y = int(bottom[column]) if column < len(bottom) else 0
        if op == "+":
            total = x + y + carry
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
            carry = total // 10
        else:
            borrow_in = carry
            take = x - y - borrow_in
            carry = int(take < 0)
            x_shown = x + 10 * carry
            steps.append(f"{x_shown}-{y}" + (f"-{borrow_in}" if borrow_in else "") + f"={x_shown - y - borrow_in}")
    if op == "+" and carry:
        steps.append(f"carry {carry}")
    result = a + b if op == "+" else a - b
    return f"{', '.join(steps)}. \\boxed{{{result}}}"


def math_demonstrations(questions: list[Question], config: DrmasConfig, rng: np.random.Generator) -> dict[str, list[tuple[str, str]]]:
    """(prompt, response) pairs per agent: first solves, verdicts, and second solves."""
    solver, verifier = SolverAgent(), MathVerifierAgent()
    warm = config.warmstart
    demos: dict[str, list[tuple[str, str]]] = {"solver": [], "verifier": []}
    for question in questions:
        match = ARITHMETIC.match(question.question)
        if match is None:
            raise DataError(f"warm start: no demonstration for {question.question!r} (only generated:arithmetic has them)")
        a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
        right = column_working(a, op, b)
        wrong_value = (a + b if op == "+" else a - b) + int(rng.choice([-10, -1, 1, 10]))
        attempt = right if rng.random() >= warm.wrong_fraction else right.rsplit("\\boxed", 1)[0] + f"\\boxed{{{wrong_value}}}"
        episode = Episode("u", "t", 0, question)
        demos["solver"].append((solver.prompt(episode, 1), attempt))
        episode.team_context.append(f"Solver: {attempt}")
        correct = attempt == right
        verdict_right = rng.random() >= warm.verdict_noise
        approve = correct if verdict_right else not correct
        response = f"<verify>{'approve' if approve else 'reject'}</verify>"
        demos["verifier"].append((verifier.prompt(episode, 1), response))
        if not approve:  # the second attempt, after a rejection, is right
            episode.team_context.append(verifier_context(response))
            demos["solver"].append((solver.prompt(episode, 1), right))
    return demos


def search_demonstrations(questions: list[Question], config: DrmasConfig, retriever: Retriever, rng: np.random.Generator) -> dict[str, list[tuple[str, str]]]:
    """(prompt, response) pairs per agent, from episodes played out with the real retriever.

    A verdict is "yes" once every hop of the question's plan is in the history, flipped
    with probability ``verdict_noise`` (answering too early, or searching once too often,
    which on the last turn leaves the episode without an answer; ``hesitation``, when set,
    is the probability of the second mistake). A query after the plan
    ran out repeats the last hop's. The answer is the gold one when the passages hold it,
    else (and with probability ``wrong_fraction``) another name from the passages or the
    question: the mistake of copying the wrong entity.
    """
    from drmas.tasks.search import demonstration_queries, format_passages  # noqa: PLC0415 - bm25s: search runs only

    task, warm = config.task, config.warmstart
    plans = demonstration_queries(config.data, config.experiment.seed)
    router, searcher, answerer = (cls(history_length=task.history_length) for cls in (RouterAgent, SearchAgent, AnswerAgent))
    demos: dict[str, list[tuple[str, str]]] = {"verifier": [], "search": [], "answer": []}
    for question in questions:
        plan = plans.get(question.qid)
        if plan is None:
            raise DataError(f"warm start: no demonstration for question {question.qid!r} (only generated:facts has them)")
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
    others = sorted({name for name in NAME_OR_YEAR.findall(text) if name != gold and name not in {"Doc", "The", "What", "Who", "In"}})
    return str(rng.choice(others)) if others else "unknown"


def warmstart(config: DrmasConfig, store: Store, run_id: str, init: dict[str, PolicyRef]) -> dict[str, PolicyRef]:
    """Fine-tune every worker group on its agents' demonstrations (once per run).

    Worker groups train at the same time, one process each with an equal share of the
    cores: the groups are independent, and on CPU two single-threaded trainings finish
    sooner than two two-threaded ones in turn. Each group draws its batches from its own
    seeded stream, so the result does not depend on which finishes first.
    """
    demos = _demonstrations(config, store)
    result, todo = {}, []
    for index, group in enumerate(config.worker_groups()):
        path = warmstart_path(config, run_id, group.name)
        result[group.name] = PolicyRef(path)
        if not store.exists(path):
            pairs = [pair for agent in group.agents for pair in demos.get(agent, [])]
            todo.append((config.to_json(), store.settings().model_dump(), group.name, index, init[group.name], path, pairs))
    if len(todo) == 1:
        _warm_one(*todo[0], threads=torch.get_num_threads())
    elif todo:
        threads = max(1, (os.cpu_count() or 1) // len(todo))
        with ProcessPoolExecutor(max_workers=len(todo), mp_context=multiprocessing.get_context("spawn")) as workers:
            for done in [workers.submit(_warm_one, *job, threads=threads) for job in todo]:
                done.result()  # re-raises a group's failure here
    return result


def _demonstrations(config: DrmasConfig, store: Store) -> dict[str, list[tuple[str, str]]]:
    """The task's demonstrations of every agent, drawn from the training questions."""
    questions, rng = task_questions(config, "train"), np.random.default_rng([config.experiment.seed, 17])
    if config.task.name == "math":
        return math_demonstrations(questions, config, rng)
    retriever = task_tools(config, store).retriever
    return search_demonstrations(questions, config, retriever, rng)


def _warm_one(config_json: str, store_settings: dict, wg: str, index: int, init: PolicyRef, path: str, pairs: list[tuple[str, str]], threads: int) -> None:
    """Fine-tune one worker group and write its policy artifact (manifest last)."""
    from drmas.config import StoreConfig  # noqa: PLC0415

    torch.set_num_threads(threads)
    config = DrmasConfig.from_json(config_json)
    store = Store.from_config(StoreConfig(**store_settings))
    rng = np.random.default_rng([config.experiment.seed, 17, index])
    with tempfile.TemporaryDirectory() as scratch:
        local = store.open(init.artifact).download(Path(scratch) / "init", prefix=init.prefix)
        metrics = _fine_tune(config, local, pairs, rng, Path(scratch) / "out", label=wg)
        with store.writer(path, meta={"stage": "warmstart", "wg": wg}) as out:
            out.put_dir(Path(scratch) / "out", "")
            out.write_json("metrics.json", metrics)


SFT_LENGTH_BUCKETS = 2
"""A drawn batch is cut into this many length buckets (shortest rows first), one forward
each: padding every row to the batch's longest one (a second attempt, with the first one
and the verdict in its prompt) wasted about a third of the compute."""


def _by_length(rows: list[dict], parts: int) -> list[list[dict]]:
    ordered = sorted(rows, key=lambda row: len(row["prompt_ids"]) + len(row["response_ids"]))
    size = -(-len(ordered) // parts)
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


def _fine_tune(config: DrmasConfig, folder: Path, pairs: list[tuple[str, str]], rng: np.random.Generator, out: Path, label: str) -> dict[str, float]:
    """Cross-entropy on response tokens, AdamW with cosine decay, fixed steps."""
    warm = config.warmstart
    tokenizer, model = load_tokenizer(folder), load_model(folder)
    model.train()
    rows = []
    for prompt, response in pairs:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False, **config.worker_group(label).chat_template_kwargs)
        prompt_ids = truncate_prompt(tokenizer(chat, add_special_tokens=False)["input_ids"], config.rollout.max_prompt_tokens, config.rollout.truncation)
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"prompt_ids": prompt_ids, "response_ids": response_ids, "rollout_logprobs": [0.0] * len(response_ids), "advantage": 0.0, "agent": ""})
    optimizer = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, warm.steps) / warm.steps)))
    started, losses = time.perf_counter(), []
    for _ in tqdm(range(warm.steps), desc=f"warm start {label}", unit="step", leave=False, disable=None):
        drawn = [rows[i] for i in rng.integers(0, len(rows), size=warm.batch_size)]
        tokens = sum(len(row["response_ids"]) for row in drawn)
        loss_sum = 0.0
        for part in _by_length(drawn, parts=SFT_LENGTH_BUCKETS):
            batch = collate(part, tokenizer.pad_token_id)
            logprobs, _ = token_logprobs(model, batch, want_entropy=False)
            loss = -(logprobs * batch.response_mask).sum() / tokens
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tail = losses[-max(1, len(losses) // 10) :]
    return {"warmstart/loss": float(np.mean(tail)), "warmstart/seconds": time.perf_counter() - started, "warmstart/demonstrations": float(len(rows))}
