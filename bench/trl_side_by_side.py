"""Single-agent GRPO: drmas against TRL's GRPOTrainer, side by side on CPU.

    .venv/bin/python bench/trl_side_by_side.py [--size small|20m|both|smollm2] [--steps N] [--threads 1]
    .venv/bin/python bench/trl_side_by_side.py --steps 5 --size small      # quick look
    .venv/bin/python bench/trl_side_by_side.py --size smollm2 --threads 2 \
        [--model .cache/models/smollm2-135m-instruct | a warm-started policy folder]

Needs TRL: ``pip install -c constraints.txt -e '.[bench]'``.

For each model size, in one process: one policy and tokenizer made by drmas (the scratch
sizes: built and warm-started with ``warmstart.steps``, so that rewards are not all zero;
``smollm2``: the pretrained SmolLM2-135M-Instruct of ``drmas import-gguf``, or whatever
``--model`` names, e.g. a run's warm-started policy); both trainers start from those
weights. The scratch sizes run ``configs/math_solo_tiny.yaml``, ``smollm2`` runs
``configs/math_smollm2_word_problems.yaml`` with its team cut to the one Solver (orchestra
``solo``, ``advantage: grpo``), each through ``run_iteration``: rollout on the Ray pool,
the advantage, the update, the checkpoint, every stage written to the store. TRL runs
``GRPOTrainer`` on the same weights with the same settings:

    prompts       the Solver's prompt of the same questions, in the same order, after the
                  config's system prompt, given as conversations: TRL renders them with the
                  same chat template (checked: the same token ids)
    group         rollout.group_size = num_generations; prompts_per_iteration prompts
    batch         one optimizer step per batch of prompts x group, micro-batches of
                  train.micro_batch_size (= per_device_train_batch_size, the rest by
                  gradient accumulation)
    sampling      per size (the scratch sizes: temperature 1, top_p 1; smollm2: its config's
                  0.7 and 0.95), no top_k; max_new_tokens = max_completion_length;
                  generation stops at the same tokens
    loss          clipped ratio (0.2) with token-mean over the batch (TRL's 'dapo'), no KL
                  (beta 0), no entropy bonus; AdamW, constant lr, no weight decay, gradient
                  clipping at 1.0
    reward        drmas.tasks.math.math_reward on the completion's text

The two alternate: TRL step k, then drmas iteration k (run from TRL's step-end callback,
in their own RNG state), so that load from other processes on the machine hits both
alike. Printed per trainer: completion tokens per second of whole steps (generation,
reward, update; for drmas the whole iteration with the store and Ray), the ratio
drmas / TRL, where the time goes (generation and forward/backward measured by timers
around the engines' calls, the rest), and both reward curves.

The default (both scratch sizes) took about 10 minutes on 2 cores that other jobs kept busy
(load average ~6); ``--threads`` explains why both trainers use one thread by default.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import MODEL_20M, THREADS_HELP, busy, install_timers, read_timings, timer_env

SMOLLM2 = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
"""Where the README's ``drmas import-gguf`` puts SmolLM2-135M-Instruct."""


@dataclass(frozen=True)
class Size:
    """One model size of the comparison: its config and the settings both trainers take."""

    config: str
    overrides: list[str] = field(default_factory=list)
    warmstart_steps: int = 0
    """Both trainers' start (not timed); 0 for a model that already answers."""
    steps: int = 5
    """Optimizer steps per trainer (the first is a warm-up, not timed)."""
    prompts: int = 16
    group: int = 8
    micro_batch: int = 32
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 5e-5


SIZES = {
    # ~1M parameters: 300 warm-start steps lift its reward above zero (~0.1).
    "small": Size("math_solo_tiny.yaml", warmstart_steps=300, steps=20),
    # ~20M: its reward stays ~0 after a warm start that fits the time: this size compares
    # speed, not learning.
    "20m": Size("math_solo_tiny.yaml", MODEL_20M, warmstart_steps=30),
    # SmolLM2-135M-Instruct on the word problems, with that config's rollout settings; in
    # float32 (the config's dtype auto takes bf16 on a CPU with AMX): TRL trains the fp32
    # model it is given (bf16=False).
    "smollm2": Size(
        "math_smollm2_word_problems.yaml",
        ["task.orchestra=solo", "agents=[{name: solver, model: smollm2}]", "models.smollm2.dtype=float32"],
        prompts=8,
        group=4,
        micro_batch=8,
        max_new_tokens=96,
        temperature=0.7,
        top_p=0.95,
        lr=5e-6,
    ),
}
"""The sizes ``--size`` names; every setting can be changed on the command line."""


def drmas_config(size: str, args: argparse.Namespace, scratch: Path):
    from drmas.config import load_config

    chosen = SIZES[size]
    model = [f"models.smollm2.source={args.model}"] if size == "smollm2" else []
    return load_config(
        ROOT / "configs" / chosen.config,
        [
            *chosen.overrides,
            *model,
            f"experiment.iterations={args.steps}",
            f"store.root={scratch / 'store'}",
            f"warmstart.steps={args.warmstart_steps}",
            "eval.every=0",
            f"rollout.prompts_per_iteration={args.prompts}",
            f"rollout.group_size={args.group}",
            f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
            f"rollout.sampling.temperature={args.temperature}",
            f"rollout.sampling.top_p={args.top_p}",
            "rollout.sampling.top_k=0",
            "algorithm.advantage=grpo",
            f"train.lr={args.lr}",
            f"train.micro_batch_size={args.micro_batch}",
            "train.updates_per_iteration=1",
            "train.warmup_steps=0",
            "train.weight_decay=0.0",
            "train.grad_clip=1.0",
            "algorithm.kl_coef=0.0",
            "algorithm.entropy_coef=0.0",
            "algorithm.loss_aggregation=token-mean",
        ],
    )


def size_settings(size: str, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every setting the command line left out taken from ``SIZES[size]``."""
    chosen = SIZES[size]
    settings = argparse.Namespace(**vars(args))
    for name in Size.__dataclass_fields__.keys() - {"config", "overrides"}:
        if getattr(settings, name) is None:
            setattr(settings, name, getattr(chosen, name))
    if settings.prompts * settings.group % settings.micro_batch:
        raise SystemExit(
            f"{size}: prompts x group ({settings.prompts} x {settings.group}) "
            f"must be a multiple of the micro-batch ({settings.micro_batch})"
        )
    return settings


DRMAS_PARTS = {
    "generate": "generate",
    "fwd_bwd": "fwd_bwd",
    "optimizer_step": "optimizer_step",
    "rollout_stage": "stage/rollout",
    "policy_reload": "actor/load_policy",
    "advantage_stage": "stage/advantage",
    "update_stage": "stage/update",
    "checkpoint_stage": "stage/checkpoint",
}
"""Parts of a drmas iteration (key -> timer event of bench/common.py)."""


class Clock:
    """Seconds per named block, per step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def new_step(self) -> None:
        self.steps.append({})

    def add(self, name: str, seconds: float) -> None:
        if self.steps:
            self.steps[-1][name] = self.steps[-1].get(name, 0.0) + seconds


def run_size(size: str, args: argparse.Namespace, scratch: Path, timings: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from drmas.generation.pool import PoolOnDemand
    from drmas.generation.workers import stop_token_ids
    from drmas.infra.store import Store
    from drmas.models import chat_prompt, load_model, load_tokenizer
    from drmas.runner import open_run, run_iteration, starting_policies
    from drmas.stages.rollout import draw_questions, task_questions
    from drmas.tasks.math import math_reward
    from drmas.team.agents import SolverAgent
    from drmas.team.episodes import Episode

    args = size_settings(size, args)
    config = drmas_config(size, args, scratch)
    steps = config.experiment.iterations
    store = Store(config.store.root)
    run_id = f"side-by-side-{size}"
    config = open_run(config, store, run_id, resume=False)
    started = time.perf_counter()
    policies = starting_policies(config, store, run_id)  # the model (+ warm start)
    warm_s = time.perf_counter() - started
    [wg] = list(policies)
    start_dir = store.open(policies[wg].artifact).download(scratch / f"start-{size}", prefix=policies[wg].prefix)
    tokenizer = load_tokenizer(start_dir)
    model = load_model(start_dir)
    model.generation_config.eos_token_id = stop_token_ids(tokenizer)  # stop where drmas stops
    params = sum(p.numel() for p in model.parameters())

    # The same questions in the same order: drmas draws them per iteration.
    seed = config.experiment.seed
    train_questions = task_questions(config, "train")
    drawn = [q for i in range(steps) for q in draw_questions(train_questions, args.prompts, i, seed)]
    by_qid = {q.qid: q for q in drawn}
    solver = SolverAgent(prompts=config.task.prompts)
    system = config.models[config.agents[0].model].system_prompt
    head = [{"role": "system", "content": system}] if system else []
    rows = [
        {"prompt": [*head, {"role": "user", "content": solver.prompt(Episode("u", "t", 0, q), 1)}], "qid": q.qid}
        for q in drawn
    ]
    text = chat_prompt(tokenizer, rows[0]["prompt"][-1]["content"], system)  # as the rollout renders it
    drmas_ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # as WorkerGroupRuntime._encode
    trl_ids = tokenizer.apply_chat_template(
        [rows[0]["prompt"]], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    if list(trl_ids) != drmas_ids:
        raise SystemExit(f"prompt tokens differ: drmas {drmas_ids} vs TRL {list(trl_ids)}")

    trl_clock, trl_rewards, trl_tokens = Clock(), [], []

    def reward(prompts, completions, completion_ids, qid, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        values = [math_reward(t, by_qid[q]) for t, q in zip(texts, qid, strict=True)]
        trl_rewards.append(sum(values) / len(values))
        trl_tokens.append(sum(len(ids) for ids in completion_ids))
        return values

    def timed(name: str, method):
        """``method`` of GRPOTrainer, with its seconds added to ``trl_clock`` under ``name``."""

        def clocked(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return method(self, *a, **k)
            finally:
                trl_clock.add(name, time.perf_counter() - t0)

        return clocked

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with clocks around generation, reward, and the whole micro-steps."""

        _generate_single_turn = timed("generate", GRPOTrainer._generate_single_turn)
        _calculate_rewards = timed("reward", GRPOTrainer._calculate_rewards)
        _prepare_inputs = timed("prepare", GRPOTrainer._prepare_inputs)
        training_step = timed("training_step", GRPOTrainer.training_step)

    drmas_steps: list[dict[str, float]] = []

    class Alternate(TrainerCallback):
        """After each TRL optimizer step: one drmas iteration; TRL's clock restarts after it."""

        def __init__(self, pool: PoolOnDemand) -> None:
            self.pool, self.policies, self.optims = pool, dict(policies), {wg: None}
            self.resumed = time.perf_counter()
            self.optimizer_t0 = 0.0

        def on_step_begin(self, args_, state, control, **kw):
            trl_clock.new_step()

        def on_pre_optimizer_step(self, args_, state, control, **kw):
            self.optimizer_t0 = time.perf_counter()

        def on_optimizer_step(self, args_, state, control, **kw):
            trl_clock.add("optimizer_step", time.perf_counter() - self.optimizer_t0)

        def on_step_end(self, args_, state, control, **kw):
            trl_clock.add("wall", time.perf_counter() - self.resumed)
            i = state.global_step - 1
            with torch.random.fork_rng():  # drmas's update restores its own RNG state
                t0, wall0 = time.perf_counter(), time.time()
                result = run_iteration(config, store, run_id, i, self.policies, self.optims, policies, self.pool)
                seconds, wall1 = time.perf_counter() - t0, time.time()
            self.policies, self.optims = result.policies, result.optims
            events = read_timings(timings)
            metrics = result.metrics
            drmas_steps.append(
                {
                    "wall": seconds,
                    "tokens": metrics["rollout/tokens"],
                    "reward": metrics["reward/mean"],
                    **{key: busy(events, name, wall0, wall1) for key, name in DRMAS_PARTS.items()},
                }
            )
            self.resumed = time.perf_counter()

    trl_args = GRPOConfig(
        output_dir=str(scratch / f"trl-{size}"),
        use_cpu=True,
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.prompts * args.group // args.micro_batch,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        bf16=False,
    )
    with PoolOnDemand(config, store, scratch / "cache") as pool:
        pool()  # Ray and the actor start before the clocks: neither trainer pays a start-up
        callback = Alternate(pool)
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=trl_args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[callback],
        )
        trainer.remove_callback(PrinterCallback)  # TRL's per-step log lines: the summary says it
        callback.resumed = time.perf_counter()
        trainer.train()
    trl_steps = [
        {
            "wall": clock["wall"],
            "tokens": tokens,
            "reward": value,
            "generate": clock.get("generate", 0.0),
            "reward_fn": clock.get("reward", 0.0),
            "fwd_bwd": clock.get("training_step", 0.0) - clock.get("prepare", 0.0),
            "optimizer_step": clock.get("optimizer_step", 0.0),
        }
        for clock, tokens, value in zip(trl_clock.steps, trl_tokens, trl_rewards, strict=True)
    ]
    return {
        "params": params,
        "warm_s": warm_s,
        "drmas": drmas_steps,
        "trl": trl_steps,
        "threads": torch.get_num_threads(),
    }


def rate(steps: list[dict]) -> tuple[float, float, float]:
    """Completion tokens, seconds and tokens/s of the steps after the first (warm-up)."""
    timed = steps[1:] if len(steps) > 1 else steps
    tokens, seconds = sum(s["tokens"] for s in timed), sum(s["wall"] for s in timed)
    return tokens, seconds, tokens / seconds


def share(steps: list[dict], key: str) -> float:
    timed = steps[1:] if len(steps) > 1 else steps
    return sum(s.get(key, 0.0) for s in timed) / sum(s["wall"] for s in timed)


def report(size: str, result: dict) -> None:
    drmas, trl = result["drmas"], result["trl"]
    print(
        f"\n== {size}: {result['params'] / 1e6:.2f}M params, warm start {result['warm_s']:.0f} s, "
        f"{len(drmas)} steps each, "
        f"torch threads {result['threads']}"
    )
    print(
        f"{'':6} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'first step s':>12}   share of step time: "
        f"generate / fwd+bwd / optimizer / rest"
    )
    rates = {}
    for name, steps in (("drmas", drmas), ("TRL", trl)):
        tokens, seconds, tok_s = rate(steps)
        rates[name] = tok_s
        gen, fb, opt = share(steps, "generate"), share(steps, "fwd_bwd"), share(steps, "optimizer_step")
        print(
            f"{name:6} {tokens:7.0f} {seconds:8.1f} {tok_s:8.0f} {steps[0]['wall']:12.1f}   "
            f"{gen:5.0%} / {fb:5.0%} / {opt:5.0%} / {1 - gen - fb - opt:5.0%}"
        )
    print(f"ratio drmas / TRL (completion tokens/s, steps 2..{len(drmas)}): {rates['drmas'] / rates['TRL']:.2f}x")
    timed = drmas[1:] if len(drmas) > 1 else drmas
    mean = {k: sum(s[k] for s in timed) / len(timed) for k in ("wall", *DRMAS_PARTS)}
    stages = mean["rollout_stage"] + mean["advantage_stage"] + mean["update_stage"] + mean["checkpoint_stage"]
    print(
        f"drmas per iteration (mean s): wall {mean['wall']:.2f} = rollout stage {mean['rollout_stage']:.2f} "
        f"(generate {mean['generate']:.2f}, policy reload in the actor {mean['policy_reload']:.2f}) + advantage "
        f"{mean['advantage_stage']:.2f} + update stage {mean['update_stage']:.2f} (fwd+bwd {mean['fwd_bwd']:.2f}, "
        f"optimizer {mean['optimizer_step']:.2f}, the rest: load, save policy and optimizer state) + checkpoint "
        f"{mean['checkpoint_stage']:.2f} + between stages {mean['wall'] - stages:.2f}"
    )
    timed = trl[1:] if len(trl) > 1 else trl
    mean = {
        k: sum(s[k] for s in timed) / len(timed) for k in ("wall", "generate", "reward_fn", "fwd_bwd", "optimizer_step")
    }
    print(
        f"TRL per step (mean s): wall {mean['wall']:.2f}, generate {mean['generate']:.2f}, "
        f"reward {mean['reward_fn']:.3f}, "
        f"fwd+bwd {mean['fwd_bwd']:.2f}, optimizer {mean['optimizer_step']:.2f}"
    )
    print("reward per step (mean over the batch):")
    print("  drmas " + " ".join(f"{s['reward']:.2f}" for s in drmas))
    print("  TRL   " + " ".join(f"{s['reward']:.2f}" for s in trl))
    half = max(1, len(drmas) // 2)
    for name, steps in (("drmas", drmas), ("TRL", trl)):
        first = sum(s["reward"] for s in steps[:half]) / half
        last = sum(s["reward"] for s in steps[-half:]) / half
        print(f"  {name:5} first {half} steps {first:.3f} -> last {half} steps {last:.3f} ({last - first:+.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=(*SIZES, "both"), default="both", help="both: small and 20m")
    parser.add_argument("--model", default=str(SMOLLM2), help="--size smollm2: the model both trainers start from")
    defaults = "default: per size (SIZES)"
    parser.add_argument(
        "--steps", type=int, help=f"optimizer steps per trainer (the first, a warm-up, untimed); {defaults}"
    )
    parser.add_argument("--warmstart-steps", type=int, help=defaults)
    parser.add_argument("--prompts", type=int, help=f"prompts per step; {defaults}")
    parser.add_argument("--group", type=int, help=f"samples per prompt (TRL num_generations); {defaults}")
    parser.add_argument("--micro-batch", type=int, help=defaults)
    parser.add_argument("--max-new-tokens", type=int, help=defaults)
    parser.add_argument("--temperature", type=float, help=defaults)
    parser.add_argument("--top-p", type=float, help=defaults)
    parser.add_argument("--lr", type=float, help=defaults)
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # also in the warm start's worker processes
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    scratch = Path(tempfile.mkdtemp(prefix="drmas-trl-"))
    try:
        timings = scratch / "timings.jsonl"
        os.environ.update(timer_env(timings, scratch / "site", args.threads))  # Ray workers inherit it
        install_timers(timings)
        if args.threads > 0:
            import torch

            torch.set_num_threads(args.threads)  # TRL, and drmas's update (in this process)
        print(
            f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores "
            "(other processes on the machine slow both trainers alike: they alternate)"
        )
        for size in ("small", "20m") if args.size == "both" else (args.size,):
            report(size, run_size(size, args, scratch / size, timings))
        print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
