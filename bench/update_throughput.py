"""Update throughput of a worker group, against the CPU's matmul peak.

    .venv/bin/python bench/update_throughput.py [--rows 64] [--steps 2]
    .venv/bin/python bench/update_throughput.py --model .cache/models/smollm2-135m-instruct \
        --prompt-tokens 300 --response-tokens 90 --rows 32 --micro-batch 8 --cases torch-fp32

In one process: the peak is measured with a large torch matmul (fp32 and bf16); then the
same optimizer steps (same rows, same micro-batches) run through the plain torch engine in
fp32 and bf16 and through DeepSpeed ZeRO-0/1/2 (fp32), and once more through plain torch
in fp32 with every position's logits computed (the update before it asked the model for
the response positions' alone: the baseline of the ratios). The model is a ~20M-parameter
one built from a config, or a pretrained folder (``--model``). Prints training tokens/s
(prompt + response tokens through forward and backward), the fraction of the matmul peak
reached (6 x params FLOPs per token), and each case's speed as a ratio to the baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from drmas.config import load_config
from drmas.models import build_scratch_policy, load_model
from drmas.training import batching
from drmas.training.engines import make_engine
from drmas.training.loop import train_worker_group

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import MODEL_20M


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul: the practical peak of this CPU for ``dtype``."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - started)


def synthetic_rows(count: int, vocab: int, prompt: int = 48, response: int = 48) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(count):
        rows.append(
            {
                "agent": "solver" if index % 2 else "verifier",
                "prompt_ids": torch.randint(3, vocab, (prompt,), generator=generator).tolist(),
                "response_ids": torch.randint(3, vocab, (response,), generator=generator).tolist(),
                "rollout_logprobs": [-5.0] * response,
                "advantage": float(torch.randn((), generator=generator)),
            }
        )
    return rows


CASES = {
    "torch-fp32-all-positions": (["train.backend=torch"], "float32"),
    "torch-fp32": (["train.backend=torch"], "float32"),
    "torch-bf16": (["train.backend=torch", "models.tiny.dtype=bfloat16"], "bfloat16"),
    "deepspeed-zero0": (["train.backend=deepspeed", "train.zero_stage=0"], "float32"),
    "deepspeed-zero1": (["train.backend=deepspeed", "train.zero_stage=1"], "float32"),
    "deepspeed-zero2": (["train.backend=deepspeed", "train.zero_stage=2"], "float32"),
}
BASELINE = "torch-fp32-all-positions"


def model_folder(model: str | None, group, scratch: Path) -> Path:
    """The pretrained folder given, or a scratch model built once from the group's spec."""
    if model:
        return Path(model)
    folder = scratch / "scratch"
    if not folder.exists():
        texts = [f"What is {a} + {b}? \\boxed{{{a + b}}}" for a in range(60) for b in range(60)]
        build_scratch_policy(group.spec, texts, folder, seed=0)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", help="a pretrained model folder (default: a ~20M model built from a config)")
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--response-tokens", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--cases", default=",".join(CASES), help=f"among {', '.join(CASES)} ({BASELINE} always runs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peaks = {"float32": matmul_peak(torch.float32), "bfloat16": matmul_peak(torch.bfloat16)}
    print(
        f"matmul peak: fp32 {peaks['float32'] / 1e9:.1f} GFLOP/s, "
        f"bf16 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s ({args.threads} threads)"
    )
    chosen = [BASELINE, *(case for case in args.cases.split(",") if case != BASELINE)]
    settings = [*MODEL_20M, "workers.sharing=by_model", f"train.micro_batch_size={args.micro_batch}"]
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label in chosen:
            overrides, dtype = CASES[label]
            config = load_config(
                ROOT / "configs" / "math_tiny.yaml",
                [*settings, *overrides, f"train.updates_per_iteration={args.steps}"],
            )
            group = config.worker_groups()[0]
            model = load_model(model_folder(args.model, group, Path(scratch)), dtype)
            model.train()
            rows = synthetic_rows(args.rows, model.config.vocab_size, args.prompt_tokens, args.response_tokens)
            engine = make_engine(model, group, config)
            params = sum(p.numel() for p in model.parameters())
            tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
            every_position = mock.patch.object(batching, "first_response_position", lambda mask: 0)
            with every_position if label == BASELINE else contextlib.nullcontext():
                train_worker_group(config, group, engine, model, None, rows[:8], 0, 0, 0, 1)  # warm-up
                started = time.perf_counter()
                train_worker_group(config, group, engine, model, None, rows, 0, 1, 0, 1)
                seconds = time.perf_counter() - started
            rate = tokens / seconds
            results[label] = rate
            mfu = rate * 6 * params / peaks[dtype]
            print(
                f"{label:26} {params / 1e6:6.1f}M params {rate:8.0f} train tok/s  "
                f"{100 * mfu:5.1f}% of the {dtype} matmul peak"
            )
    base = results[BASELINE]
    print(f"ratios to {BASELINE}: " + ", ".join(f"{label} {rate / base:.2f}x" for label, rate in results.items()))


if __name__ == "__main__":
    main()
