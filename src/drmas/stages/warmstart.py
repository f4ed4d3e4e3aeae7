"""The warm-start stage: supervised fine-tuning on generated demonstrations of each role.

    warmstart(config, store, run_id) -> {wg: PolicyRef}

A model initialised at random rewards nothing, so RL has nothing to reinforce. The warm
start teaches each worker group its agents' roles from demonstrations that are
deliberately imperfect: ``warmstart.wrong_fraction`` of the final answers are wrong and
``warmstart.verdict_noise`` of the verdicts too. The team then starts well above zero and
well below perfect, where RL has room to show what it does.

Each task makes its own demonstrations (``Task.demonstrations``):
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
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from drmas.config import DrmasConfig
from drmas.generation.workers import truncate_prompt
from drmas.infra.cpus import cpu_threads
from drmas.infra.layout import PolicyRef
from drmas.infra.memory import return_freed_memory
from drmas.infra.progress import Progress
from drmas.infra.store import Store, StoreSettings
from drmas.models import chat_prompt, load_model, load_tokenizer
from drmas.stages.contracts import WarmstartContract, cache_key, starting_point_reusable
from drmas.tasks import Demonstrations, task_for
from drmas.training.batching import collate, token_logprobs

__all__ = ["warmstart"]


def warmstart(config: DrmasConfig, store: Store, run_id: str, init: dict[str, PolicyRef]) -> dict[str, PolicyRef]:
    """Fine-tune every worker group on its agents' demonstrations (once per run: one stored
    is kept while its contract's key is the same, ``starting_point_reusable``).

    Worker groups train at the same time, one process each with an equal share of the
    cores: the groups are independent, and on CPU two single-threaded trainings finish
    sooner than two two-threaded ones in turn. Each group draws its batches from its own
    seeded stream, so the result does not depend on which finishes first. A warm start of
    at most ``IN_PROCESS_STEPS`` steps trains the groups in this process, one after the
    other with the same share of the cores each, so with the same weights.
    """
    demos = _demonstrations(config, store)
    result, todo = {}, []
    for index, group in enumerate(config.worker_groups()):
        contract = WarmstartContract(run_id, group.name, init[group.name])
        path = contract.output(config)
        result[group.name] = PolicyRef(path)
        if not starting_point_reusable(config, store, contract, run_id):
            pairs = [pair for agent in group.agents for pair in demos.get(agent, [])]
            key = cache_key(config, store, contract)
            todo.append(
                (config.to_json(), store.settings().as_dict(), group.name, index, init[group.name], path, pairs, key)
            )
    if len(todo) == 1:
        _warm_one(*todo[0], threads=torch.get_num_threads())
        return_freed_memory()  # the training's peak, which this process would keep for the run
    elif todo and config.warmstart.steps <= IN_PROCESS_STEPS:
        _warm_in_turn(todo, threads=_thread_share(len(todo)))
        return_freed_memory()
    elif todo:
        with ProcessPoolExecutor(max_workers=len(todo), mp_context=multiprocessing.get_context("spawn")) as workers:
            share = _thread_share(len(todo))
            for done in [workers.submit(_warm_one, *job, threads=share, position=n) for n, job in enumerate(todo)]:
                done.result()  # re-raises a group's failure here
    return result


IN_PROCESS_STEPS = 20
"""Up to this many steps, the worker groups warm-start in this process, in turn: a spawned
process costs several seconds of start-up (importing torch and transformers), more than
a few steps of a small model's training; a smoke run or a test would mostly wait for it."""


def _thread_share(groups: int) -> int:
    """Each group's share of the cores when the groups train at the same time."""
    return max(1, cpu_threads() // groups)


def _warm_in_turn(todo: list[tuple], threads: int) -> None:
    """The groups' warm starts one after the other in this process, each on ``threads``
    threads as in its own process (the same thread count gives the same weights)."""
    before = torch.get_num_threads()
    try:
        for job in todo:
            _warm_one(*job, threads=threads)
    finally:
        torch.set_num_threads(before)


def _demonstrations(config: DrmasConfig, store: Store) -> Demonstrations:
    """The task's demonstrations of every agent, drawn from the training questions."""
    task, rng = task_for(config), np.random.default_rng([config.experiment.seed, 17])
    return task.demonstrations(config, task.questions(config, "train"), task.tools(config, store), rng)


def _warm_one(
    config_json: str,
    store_settings: dict,
    wg: str,
    index: int,
    init: PolicyRef,
    path: str,
    pairs: list[tuple[str, str]],
    key: str,
    threads: int,
    position: int | None = None,
) -> None:
    """Fine-tune one worker group and write its policy artifact (manifest last);
    ``position``: its progress bar's line, when groups train in processes side by side."""
    torch.set_num_threads(threads)
    config = DrmasConfig.from_json(config_json)
    store = Store.from_config(StoreSettings(**store_settings))
    rng = np.random.default_rng([config.experiment.seed, 17, index])
    with tempfile.TemporaryDirectory() as scratch:
        local = store.open(init.artifact).download(Path(scratch) / "init", prefix=init.prefix)
        metrics = _fine_tune(config, local, pairs, rng, Path(scratch) / "out", label=wg, position=position)
        with store.writer(path, overwrite=True, meta={"stage": "warmstart", "wg": wg, "cache_key": key}) as out:
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


def _fine_tune(
    config: DrmasConfig,
    folder: Path,
    pairs: list[tuple[str, str]],
    rng: np.random.Generator,
    out: Path,
    label: str,
    position: int | None = None,
) -> dict[str, float]:
    """Cross-entropy on response tokens, AdamW with cosine decay, fixed steps. A bfloat16
    group computes in bf16 under ``torch.autocast`` over fp32 weights (1.4-1.6x float32's
    speed on a CPU with native bf16); the weights it stores stay fp32, and the rollout
    loads them as its dtype says."""
    warm = config.warmstart
    tokenizer, model = load_tokenizer(folder), load_model(folder)
    model.train()
    group = config.worker_group(label)
    bf16 = group.spec is not None and group.spec.dtype == "bfloat16"
    rows = []
    for prompt, response in pairs:
        chat = chat_prompt(tokenizer, prompt, group.system_prompt, group.chat_template_kwargs)
        prompt_ids = truncate_prompt(
            tokenizer(chat, add_special_tokens=False)["input_ids"],
            config.rollout.max_prompt_tokens,
            config.rollout.truncation,
        )
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(
            {
                "prompt_ids": prompt_ids,
                "response_ids": response_ids,
                "rollout_logprobs": [0.0] * len(response_ids),
                "advantage": 0.0,
                "agent": "",
            }
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=warm.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, warm.steps) / warm.steps))
    )
    started, losses = time.perf_counter(), []
    progress = Progress(warm.steps, f"warm start {label}", unit="step", position=position)
    for _ in range(warm.steps):
        drawn = [rows[i] for i in rng.integers(0, len(rows), size=warm.batch_size)]
        tokens = sum(len(row["response_ids"]) for row in drawn)
        loss_sum = 0.0
        for part in _by_length(drawn, parts=SFT_LENGTH_BUCKETS):
            batch = collate(part, tokenizer.pad_token_id)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logprobs, _ = token_logprobs(model, batch, want_entropy=False)
            loss = -(logprobs * batch.response_mask).sum() / tokens
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)
        progress.update(loss=f"{np.mean(losses[-20:]):.3f}")
    progress.close()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "warmstart/loss": float(np.mean(tail)),
        "warmstart/seconds": time.perf_counter() - started,
        "warmstart/demonstrations": float(len(rows)),
    }
