"""The update stage: one worker group's policy-gradient step on its rows of the batch.

    update(config, store, run_id, iteration, wg, policy, optim) -> StageResult

1. Read the iteration's batch and keep this worker group's rows (all its agents' calls).
2. Split them into ``train.updates_per_iteration`` mini-batches (a fixed number of
   optimizer steps whatever the row count: the reference's adaptive mini-batch), each into
   micro-batches by ``train.micro_batch_size`` rows and ``train.max_tokens_per_micro_batch``.
3. Per micro-batch: the current policy's log-probs of the response tokens, the clipped loss
   of ``drmas.algos.policy_loss`` with the row's advantage on every response token (old
   log-probs from the rollout, or recomputed), optional KL to the frozen initial policy
   and entropy bonus; gradients accumulate over the mini-batch. ``token-mean`` weighs
   every token of the mini-batch alike; ``token-mean-per-micro-batch`` averages the
   micro-batches' token means (veRL's). ``train.gradient_checkpointing`` recomputes the
   decoder layers' activations in the backward pass.
4. Clip the gradient norm; a non-finite norm skips the step (counted, never checkpointed).
   With ``diagnostics.per_agent_grad_norm``, before each step the norm of the gradient of
   each agent's share of the loss, from a side pass that leaves the update unchanged.
5. Write the new policy (HF layout, safetensors) and the optimizer, scheduler and RNG state
   (safetensors + JSON, never pickle) as two artifacts, manifests last.

Data-parallel: under ``torchrun`` each rank takes every world-size-th micro-batch (and
empty ones, so that all ranks run as many) and the gradients are summed across ranks; the
loss is normalised by the mini-batch's global token (or micro-batch) count, so 2 processes
compute the same update as 1. Backends: plain torch (AdamW), or DeepSpeed (ZeRO 0-3 from
config, the same torch optimizer, optionally offloaded to host memory; gloo on CPU, nccl
on GPU).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist

from drmas.algos import LossAggregation, aggregate_loss, policy_loss
from drmas.config import DrmasConfig, WorkerGroup
from drmas.layout import StageResult, optim_path, policy_path, stage_path
from drmas.models import load_model, load_tokenizer
from drmas.schema import BATCH_SCHEMA
from drmas.store import CorruptArtifact, Store
from drmas.workers import PolicyRef

__all__ = ["MicroBatch", "TrainState", "micro_batches", "update"]


# --------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """Rows packed for one forward/backward; right-padded prompt + response sequences."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1]: 1 where the next token is a response token
    old_logprobs: torch.Tensor  # [B, L-1], zero outside the response
    rollout_logprobs: torch.Tensor  # [B, L-1], the engine's (equal to old unless recomputed)
    advantages: torch.Tensor  # [B]
    agents: list[str]


def micro_batches(rows: list[dict[str, Any]], max_rows: int, max_tokens: int | None) -> list[list[int]]:
    """Row indices packed in order: at most ``max_rows`` rows and ``max_tokens`` padded
    tokens (rows x longest sequence) per micro-batch; a longer row gets one to itself."""
    packs: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, row in enumerate(rows):
        length = len(row["prompt_ids"]) + len(row["response_ids"])
        grown = max(longest, length) * (len(current) + 1)
        if current and (len(current) >= max_rows or (max_tokens is not None and grown > max_tokens)):
            packs.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        packs.append(current)
    return packs


def collate(rows: list[dict[str, Any]], pad_id: int) -> MicroBatch:
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    response = torch.zeros((len(rows), width - 1))
    old = torch.zeros((len(rows), width - 1))
    engine = torch.zeros((len(rows), width - 1))
    for b, row in enumerate(rows):
        prompt, answer = row["prompt_ids"], row["response_ids"]
        ids[b, : lengths[b]] = torch.tensor(prompt + answer, dtype=torch.long)
        attention[b, : lengths[b]] = 1
        # Token t+1 is predicted at position t: response token j sits at P+j, predicted at P+j-1.
        start, end = len(prompt) - 1, len(prompt) - 1 + len(answer)
        response[b, start:end] = 1.0
        engine[b, start:end] = torch.tensor(row["rollout_logprobs"], dtype=torch.float32)
        old[b, start:end] = torch.tensor(row.get("old_logprobs", row["rollout_logprobs"]), dtype=torch.float32)
    return MicroBatch(
        input_ids=ids,
        attention_mask=attention,
        response_mask=response,
        old_logprobs=old,
        rollout_logprobs=engine,
        advantages=torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
        agents=[r["agent"] for r in rows],
    )


def token_logprobs(model: torch.nn.Module, batch: MicroBatch, want_entropy: bool, temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(next token) [B, L-1] under ``model``, and the per-token entropy if asked;
    with ``temperature`` ([B], see ``sampling_temperatures``) of the logits divided by it."""
    # No KV cache: it is for generation, costs memory here and cannot be checkpointed.
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1].float()
    if temperature is not None:
        logits = logits / temperature[:, None, None]
    log_probs = torch.log_softmax(logits, dim=-1)  # [B, L-1, V]
    taken = log_probs.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if want_entropy else None  # [B, L-1]
    return taken, entropy


def sampling_temperatures(config: DrmasConfig, agents: list[str]) -> torch.Tensor:
    """Each row's rollout sampling temperature ([B]; greedy counts as 1, as the engines do).

    The rollout log-probs are of the distribution the engine sampled from, logits / T: the
    trainer's must be too, or at T != 1 the PPO ratio starts away from 1 and clips updates
    that should not be clipped (veRL divides the same way)."""
    return torch.tensor([config.agent_sampling(agent).temperature or 1.0 for agent in agents], dtype=torch.float32)


# --------------------------------------------------------------------------------------
# Training engines
# --------------------------------------------------------------------------------------


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TorchEngine:
    """AdamW with linear warm-up; gradients summed across data-parallel ranks."""

    def __init__(self, model: torch.nn.Module, group: WorkerGroup, config: DrmasConfig) -> None:
        self.model = model
        self.forward_model: torch.nn.Module = model
        """What the update's forward passes go through (DeepSpeed: its engine)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=group.lr, weight_decay=config.train.weight_decay)
        warmup = group.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.grad_clip = config.train.grad_clip

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def grad_norm(self) -> float:
        """Global L2 norm of the summed gradient, before clipping."""
        self._all_reduce()
        return self._local_norm()

    def _local_norm(self) -> float:
        norms = [p.grad.detach().norm(2) for p in self.params if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def step(self, norm: float) -> tuple[bool, float]:
        """Clip and step; skip (and clear) on a non-finite norm. Returns (stepped, norm)."""
        stepped = math.isfinite(norm)
        if stepped:
            scale = min(1.0, self.grad_clip / (norm + 1e-6))
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped, norm

    def export_state(self) -> TrainState:
        return capture_state(self.model, self.optimizer, self.scheduler)

    def import_state(self, state: TrainState) -> None:
        restore_state(state, self.model, self.optimizer, self.scheduler)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @contextmanager
    def side_pass(self) -> Iterator[None]:
        """Around a forward/backward that must leave no trace on the update (diagnostics):
        the RNG is restored afterwards, so dropout draws the same masks in the real pass."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            yield

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights for rank 0 to save, or None when the model's own parameters are whole."""
        return None

    def _all_reduce(self) -> None:
        if _world()[1] > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


class DeepSpeedEngine(TorchEngine):
    """DeepSpeed (ZeRO 0-3) around the same torch AdamW; DeepSpeed clips and steps.

    DeepSpeed averages gradients over ranks; the loss is scaled by the world size so that
    the result is the same sum as the torch engine's. The model is loaded whole and
    ``deepspeed.initialize`` partitions it for ZeRO-3 (``zero.Init`` would only spare the
    peak of loading it whole).
    """

    def __init__(self, model: torch.nn.Module, group: WorkerGroup, config: DrmasConfig) -> None:
        super().__init__(model, group, config)
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        import deepspeed  # noqa: PLC0415

        _ensure_process_group()
        _, world = _world()
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=deepspeed_config(config, group, world)
        )
        # DeepSpeed's forward does per-micro-batch bookkeeping: without it ZeRO-3 overwrites
        # the accumulated gradient with each micro-batch's instead of adding to it.
        self.forward_model = self.engine
        self.world = world
        self.zero_stage = config.train.zero_stage

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss * self.world)

    def grad_norm(self) -> float:
        """ZeRO-0 leaves the reduced gradients on the parameters: measure them before the
        step, so that a non-finite norm skips it. ZeRO-1/2/3 partition them: DeepSpeed
        reports the norm while it steps (and the skip is DeepSpeed's to make)."""
        return self._local_norm() if self.zero_stage == 0 else float("nan")

    def step(self, norm: float) -> tuple[bool, float]:
        if self.zero_stage == 0 and not math.isfinite(norm):
            self.engine.zero_grad()
            return False, norm
        self.engine.step()
        if self.zero_stage == 0:
            return True, norm
        reported = self.engine.get_global_grad_norm()
        return True, float(reported) if reported is not None else float("nan")

    @contextmanager
    def side_pass(self) -> Iterator[None]:
        """ZeRO-3 gathers each module's parameters for its backward and DeepSpeed's own
        backward partitions the leftovers at its end (from a gradient hook, which a side
        pass never fires): partition them here, as its public ``empty_partition_cache``
        does (a no-op below stage 3)."""
        with super().side_pass():
            yield
        self.engine.empty_partition_cache()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """ZeRO-3 keeps each parameter partitioned across ranks: gather one at a time (every
        rank takes part) and keep a copy on rank 0, so no rank holds the whole model at once."""
        if self.zero_stage < 3:
            return None
        from deepspeed.runtime.zero import GatheredParameters  # noqa: PLC0415

        rank, _ = _world()
        weights: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            with GatheredParameters([param]):
                if rank == 0:
                    weights[name] = param.detach().cpu().clone()
        return weights if rank == 0 else None

    def export_state(self) -> TrainState:
        """ZeRO-1/2/3 keep Adam's moments in flat partitions: gather them per parameter (a
        collective: every rank calls this), so the saved state has one layout whatever the
        stage and the number of ranks."""
        if self.zero_stage == 0:
            return super().export_state()
        from deepspeed.utils import safe_get_full_optimizer_state  # noqa: PLC0415

        tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
        for name, param in self.model.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"optim/{name}/{key}"] = safe_get_full_optimizer_state(param, key).detach().cpu().contiguous()
        step = self._base_step()
        meta = {"scheduler": _scheduler_state(self.scheduler), "steps": {name: step for name, _ in self.model.named_parameters()}}
        return TrainState(tensors, meta)

    def import_state(self, state: TrainState) -> None:
        if self.zero_stage == 0:
            super().import_state(state)
            return
        from deepspeed.utils import safe_set_full_optimizer_state  # noqa: PLC0415

        shapes = {name: _full_shape(param) for name, param in self.model.named_parameters()}
        if problem := _state_mismatch(state, shapes):
            raise ValueError(problem)
        # AdamW creates its moments at the first step: create them as it would (zeros) on
        # the flat partitions. ZeRO-1/2 link per-parameter views of them only then: link
        # them with DeepSpeed's own lazy hook (0.19); ZeRO-3 reads the flat state directly.
        base = self.engine.optimizer.optimizer
        for flat in self._flat_partitions():
            base.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
        if self.zero_stage < 3:
            self.engine.optimizer._lazy_init_hp_params_optimizer_state()
        for name, param in self.model.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(param, state.tensors[f"optim/{name}/{key}"].clone(), key)
        step = next(iter(state.meta["steps"].values()), 0.0)
        for slot in base.state.values():
            slot["step"] = torch.tensor(step)
        _restore_scheduler(self.scheduler, self.engine.optimizer, state.meta)
        torch.set_rng_state(state.tensors["rng/torch"])

    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 partitions, which the torch AdamW steps and keys its state by
        (ZeRO-3 puts them in its param groups only while it steps)."""
        wrapper = self.engine.optimizer
        if self.zero_stage == 3:
            return list(wrapper.fp32_partitioned_groups_flat)
        return [flat for group in wrapper.optimizer.param_groups for flat in group["params"]]

    def _base_step(self) -> float:
        slots = list(self.engine.optimizer.optimizer.state.values())
        return float(slots[0]["step"]) if slots and "step" in slots[0] else 0.0


def deepspeed_config(config: DrmasConfig, group: WorkerGroup, world: int) -> dict[str, Any]:
    """DeepSpeed's config for this worker group: one backward per ``engine.backward`` and
    boundary (drmas accumulates micro-batches itself), clipping, ZeRO stage, bf16 and,
    with ``train.offload_optimizer``, Adam's state and step in host memory (ZeRO >= 1).

    Offloading keeps the torch AdamW: DeepSpeed refuses a client optimizer there unless
    ``zero_force_ds_cpu_optimizer`` is off (its CPU Adam compiles for a minute on CPU)."""
    train = config.train
    zero: dict[str, Any] = {"stage": train.zero_stage}
    if train.offload_optimizer:  # the config refuses it with ZeRO-0 (no partition to offload)
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": group.spec is not None and group.spec.dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _full_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's whole shape, also under ZeRO-3 (whose ``param.shape`` is empty
    outside its module's forward and backward)."""
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape


def _ensure_process_group() -> None:
    """DeepSpeed needs a process group even alone: a one-process gloo group whose
    rendezvous is an in-memory store (a TCPStore would listen on every interface)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed checks that a launcher set it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def make_engine(model: torch.nn.Module, group: WorkerGroup, config: DrmasConfig) -> TorchEngine:
    if config.train.backend == "deepspeed":
        return DeepSpeedEngine(model, group, config)
    return TorchEngine(model, group, config)


# --------------------------------------------------------------------------------------
# State: optimizer, scheduler, RNG (safetensors + JSON, never pickle)
# --------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """Everything besides the weights that an exact resume needs."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def capture_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> TrainState:
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
    steps: dict[str, float] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"optim/{names[id(param)]}/{key}"] = value.detach().cpu().contiguous()
                elif key == "step":
                    steps[names[id(param)]] = float(value)
    return TrainState(tensors, {"scheduler": _scheduler_state(scheduler), "steps": steps})


def _scheduler_state(scheduler: Any) -> dict[str, Any]:
    """The scheduler's counters; its lambdas are code, rebuilt from the config."""
    state = scheduler.state_dict() if scheduler is not None else {}
    return {key: value for key, value in state.items() if key != "lr_lambdas"}


def _restore_scheduler(scheduler: Any, optimizer: Any, meta: dict[str, Any]) -> None:
    if scheduler is not None and meta.get("scheduler"):
        scheduler.load_state_dict({**scheduler.state_dict(), **meta["scheduler"]})
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr


def restore_state(state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Load ``state`` into the optimizer; a state of another model (parameters this model
    does not have, or shapes other than its own) is refused before anything is applied."""
    params = dict(model.named_parameters())
    if problem := _state_mismatch(state, {name: param.shape for name, param in params.items()}):
        raise ValueError(problem)
    for name, param in params.items():
        if name not in state.meta["steps"]:
            continue
        slot = optimizer.state[param]
        slot["step"] = torch.tensor(state.meta["steps"][name])
        for key in ("exp_avg", "exp_avg_sq"):
            slot[key] = state.tensors[f"optim/{name}/{key}"].clone()
    _restore_scheduler(scheduler, optimizer, state.meta)
    torch.set_rng_state(state.tensors["rng/torch"])


def _state_mismatch(state: TrainState, shapes: dict[str, torch.Size]) -> str | None:
    """How a saved optimizer state fails to fit parameters of these shapes, or None."""
    foreign = sorted(set(state.meta["steps"]) - set(shapes))
    if foreign:
        return (
            f"it holds state for {len(foreign)} parameter(s) this model does not have "
            f"(e.g. {foreign[0]!r}): the optimizer state of another model"
        )
    for name in state.meta["steps"]:
        for key in ("exp_avg", "exp_avg_sq"):
            saved = state.tensors.get(f"optim/{name}/{key}")
            if saved is None or saved.shape != shapes[name]:
                found = "missing" if saved is None else f"of shape {tuple(saved.shape)}"
                return f"the state for {name}.{key} is {found}, but the parameter has shape {tuple(shapes[name])}"
    return None


def save_state(state: TrainState, folder: Path) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    save_file(state.tensors, str(folder / "optimizer.safetensors"))
    (folder / "state.json").write_text(json.dumps(state.meta, sort_keys=True))


def load_state(folder: Path) -> TrainState:
    """The state ``save_state`` wrote; ValueError (naming the file) for anything else.

    Tensors come from safetensors and the rest from JSON: nothing is unpickled, so a
    pickle planted in their place is refused, never run.
    """
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    try:
        tensors = load_file(str(folder / "optimizer.safetensors"))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"optimizer.safetensors is not a safetensors file ({error})") from None
    try:
        meta = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"state.json is not readable JSON ({error})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("steps"), dict) or "rng/torch" not in tensors:
        raise ValueError("not an optimizer state drmas wrote (state.json without 'steps' or no RNG state)")
    return TrainState(tensors, meta)


def _import_stored_state(engine: TorchEngine, store: Store, optim: PolicyRef, scratch: Path) -> None:
    """Give ``engine`` the optimizer state stored at ``optim``; a state that cannot be read,
    or that belongs to another model, is refused with its URI (CorruptArtifact)."""
    artifact = store.open(optim.artifact)
    where = store.uri(optim.artifact, optim.prefix or None)
    try:
        engine.import_state(load_state(artifact.download(scratch, prefix=optim.prefix)))
    except (ValueError, KeyError, RuntimeError) as error:
        raise CorruptArtifact(f"{where}: cannot resume the optimizer from it: {error}") from None


# --------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------


def update(
    config: DrmasConfig,
    store: Store,
    run_id: str,
    iteration: int,
    wg: str,
    policy: PolicyRef,
    optim: PolicyRef | None,
    reference: PolicyRef | None = None,
    overwrite: bool = False,
    cache_key: str = "",
) -> StageResult:
    """Update one worker group; write its policy and optimizer state (rank 0 writes)."""
    started = time.perf_counter()
    rank, world = _world()
    group = next(g for g in config.worker_groups() if g.name == wg)
    experiment = config.experiment.name
    rows = _worker_group_rows(store, stage_path(experiment, run_id, iteration, "advantage"), wg)
    with tempfile.TemporaryDirectory() as scratch:
        local = store.open(policy.artifact).download(Path(scratch) / "policy", prefix=policy.prefix)
        dtype = group.spec.dtype if group.spec is not None else "float32"
        model = load_model(local, dtype)
        _prepare_for_training(model, config.train.gradient_checkpointing)
        tokenizer = load_tokenizer(local)
        engine = make_engine(model, group, config)
        if optim is not None:
            _import_stored_state(engine, store, optim, Path(scratch) / "optim")
        else:  # the first update: its RNG (saved with the state) must not depend on the process's past
            torch.manual_seed(zlib.crc32(f"{config.experiment.seed}/{wg}".encode()))
        ref_model = _reference(config, store, reference, Path(scratch), dtype)
        metrics = _train(config, group, engine, model, ref_model, rows, tokenizer.pad_token_id, iteration, rank, world)
        metrics[f"wg/{wg}/time"] = time.perf_counter() - started
        metrics[f"wg/{wg}/tokens_per_s"] = metrics[f"wg/{wg}/tokens"] / max(metrics[f"wg/{wg}/time"], 1e-9)
        out_policy = policy_path(experiment, run_id, iteration, wg)
        # Every rank takes part in gathering partitioned weights and optimizer state.
        weights, state = engine.full_weights(), engine.export_state()
        if rank == 0:
            saved = Path(scratch) / "out"
            model.save_pretrained(saved / "policy", safe_serialization=True, state_dict=weights)
            tokenizer.save_pretrained(saved / "policy")
            save_state(state, saved / "optim")
            meta = {"stage": "update", "iteration": iteration, "wg": wg, "cache_key": cache_key}
            with store.writer(optim_path(experiment, run_id, iteration, wg), overwrite=overwrite, meta=meta) as out:
                out.put_dir(saved / "optim", "")
            with store.writer(out_policy, overwrite=overwrite, meta=meta) as out:
                out.put_dir(saved / "policy", "")
                out.write_json("metrics.json", metrics)
        if world > 1:  # every rank returns the artifact: it exists once they do
            dist.barrier()
    return StageResult(out_policy, metrics)


def _prepare_for_training(model: torch.nn.Module, checkpointing: bool) -> None:
    """Training mode and, if asked, activation checkpointing of every decoder layer.

    Non-reentrant checkpointing: the reentrant kind does not support ``torch.autograd.grad``
    (the per-agent diagnostic). The KV cache, which cannot be checkpointed, is off in
    every training forward (``token_logprobs``), not in the saved config."""
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _worker_group_rows(store: Store, batch_path: str, wg: str) -> list[dict[str, Any]]:
    table = store.open(batch_path).read_table("batch.parquet", BATCH_SCHEMA)
    mine = table.filter(pc.equal(table["wg"], wg))
    if mine.num_rows == 0:
        raise ValueError(f"{store.uri(batch_path)}: no rows for worker group {wg!r}")
    columns = ["agent", "prompt_ids", "response_ids", "rollout_logprobs", "advantage"]
    return mine.select(columns).to_pylist()


def _reference(config: DrmasConfig, store: Store, reference: PolicyRef | None, scratch: Path, dtype: str):
    if config.algorithm.kl_coef == 0.0:
        return None
    if reference is None:
        raise ValueError("algorithm.kl_coef > 0 needs a reference policy (the run's initial policy)")
    local = store.open(reference.artifact).download(scratch / "reference", prefix=reference.prefix)
    model = load_model(local, dtype)
    model.requires_grad_(False)
    return model


@dataclass(frozen=True)
class MiniBatchSize:
    """The whole mini-batch (all ranks), which every micro-batch's loss is normalised by."""

    tokens: int  # response tokens
    rows: int
    micro_batches: int


def _train(config, group, engine, model, ref_model, rows, pad_id, iteration, rank, world) -> dict[str, float]:
    """``updates_per_iteration`` optimizer steps over the rows; returns the wg's metrics."""
    train, algorithm = config.train, config.algorithm
    order = np.random.default_rng([config.experiment.seed, iteration, len(rows)]).permutation(len(rows))
    steps = min(train.updates_per_iteration, len(rows))
    totals: dict[str, float] = {"loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "entropy": 0.0, "kl": 0.0, "logprob_gap": 0.0}
    norms, skipped, tokens = [], 0, 0
    agent_norms: dict[str, list[float]] = {}
    if train.recompute_old_logprobs:
        _recompute_old_logprobs(model, rows, pad_id, group.micro_batch_size, train.max_tokens_per_micro_batch, config)
    for step_index, mini in enumerate(np.array_split(order, steps)):
        mini_rows = [rows[i] for i in mini]
        packs = micro_batches(mini_rows, group.micro_batch_size, train.max_tokens_per_micro_batch)
        size = MiniBatchSize(sum(len(r["response_ids"]) for r in mini_rows), len(mini_rows), len(packs))
        batches = _rank_batches(mini_rows, packs, pad_id, rank, world)
        if config.diagnostics.per_agent_grad_norm:
            agents = sorted({row["agent"] for row in mini_rows})
            for agent, norm in _agent_grad_norms(engine, model, ref_model, agents, batches, size, config, world).items():
                agent_norms.setdefault(agent, []).append(norm)
        for index, batch in enumerate(batches):
            loss, stats = _micro_loss(engine.forward_model, ref_model, batch, size, config, want_entropy=True)
            engine.backward(loss, boundary=index == len(batches) - 1)
            totals["loss"] += loss.item() / steps
            weight = batch.response_mask.sum().item() / max(size.tokens, 1)
            for key, value in stats.items():
                if key == "logprob_gap":  # rollout engine vs trainer: only before any step
                    totals[key] += value * weight if step_index == 0 else 0.0
                else:
                    totals[key] += value * weight / steps
        stepped, norm = engine.step(engine.grad_norm())
        skipped += int(not stepped or not math.isfinite(norm))
        norms.append(norm)
        tokens += size.tokens
    if world > 1:  # each rank saw its share of the micro-batches: sum the shares
        shares = torch.tensor(list(totals.values()), dtype=torch.float64)
        dist.all_reduce(shares, op=dist.ReduceOp.SUM)
        totals = dict(zip(totals, shares.tolist(), strict=True))
    prefix = f"wg/{group.name}"
    metrics = {f"{prefix}/{key}": value for key, value in totals.items()}
    metrics |= {
        f"{prefix}/grad_norm": float(np.mean(norms)),
        f"{prefix}/grad_norm_max": float(np.max(norms)),
        f"{prefix}/skipped": float(skipped),
        f"{prefix}/steps": float(steps),
        f"{prefix}/tokens": float(tokens),
        f"{prefix}/rows": float(len(rows)),
        f"{prefix}/lr": engine.lr(),
    }
    for agent, values in agent_norms.items():
        metrics[f"agent/{agent}/grad_norm"] = float(np.mean(values))
    if algorithm.kl_coef == 0.0:
        metrics.pop(f"{prefix}/kl")
    return metrics


def _rank_batches(rows: list[dict[str, Any]], packs: list[list[int]], pad_id: int, rank: int, world: int) -> list[MicroBatch]:
    """This rank's micro-batches: every world-th pack, then empty ones (the last pack with
    its response mask zeroed: no loss, no gradient) up to the busiest rank's count. ZeRO's
    collectives in each forward and backward must line up across ranks: with one rank a
    micro-batch short, ZeRO-2 aborts and ZeRO-3 hangs."""
    batches = [collate([rows[i] for i in pack], pad_id) for pack in packs[rank::world]]
    busiest = -(-len(packs) // world)
    if len(batches) < busiest:
        last = collate([rows[i] for i in packs[-1]], pad_id)
        empty = replace(last, response_mask=torch.zeros_like(last.response_mask))
        batches += [empty] * (busiest - len(batches))
    return batches


def _agent_grad_norms(engine: TorchEngine, model, ref_model, agents: list[str], batches: list[MicroBatch], size: MiniBatchSize, config: DrmasConfig, world: int) -> dict[str, float]:
    """Per agent of the mini-batch (``agents``, the same list on every rank), the L2 norm
    of the gradient of its share of the loss: its rows' terms, normalised as in the update,
    summed over this rank's micro-batches and then over ranks. The agents' gradients add
    up to the update's (before clipping).

    The gradients come from ``torch.autograd.grad`` into a buffer of their own: they never
    reach ``p.grad``, DeepSpeed's gradient hooks or ZeRO's partitioned buffers, so the
    update is the same with the diagnostic on or off. ZeRO-3 gathers each module's
    parameters for its backward as usual, so the gradients are whole on every rank. Costs
    one forward and backward per agent and micro-batch, and one gradient-sized fp32 buffer.
    """
    norms = {}
    with engine.side_pass():
        for agent in agents:
            losses = (_micro_loss(model, ref_model, batch, size, config, want_entropy=False, only_agent=agent)[0] for batch in batches)
            gradient = _gradient_sum(engine.params, losses)
            if world > 1:
                dist.all_reduce(gradient, op=dist.ReduceOp.SUM)
            norms[agent] = float(torch.linalg.vector_norm(gradient))
    return norms


def _gradient_sum(params: list[torch.nn.Parameter], losses: Iterable[torch.Tensor]) -> torch.Tensor:
    """The gradient of the sum of ``losses`` w.r.t. ``params``, flat and in fp32, one loss
    (one graph) at a time; ``p.grad`` and every gradient hook stay untouched."""
    sizes = [math.prod(_full_shape(p)) for p in params]
    total = torch.zeros(sum(sizes), dtype=torch.float32, device=params[0].device)
    parts = total.split(sizes)
    for loss in losses:
        for part, grad in zip(parts, torch.autograd.grad(loss, params, allow_unused=True), strict=True):
            if grad is not None:  # a parameter this loss does not use contributes nothing
                part.add_(grad.reshape(-1))
    return total


def _recompute_old_logprobs(model, rows, pad_id, max_rows, max_tokens, config: DrmasConfig) -> None:
    """The old policy's log-probs by the trainer itself, before any step (one no-grad pass),
    instead of the rollout engine's: removes engine/trainer numerical mismatch."""
    with torch.no_grad():
        for pack in micro_batches(rows, max_rows, max_tokens):
            batch = collate([rows[i] for i in pack], pad_id)
            logprobs, _ = token_logprobs(model, batch, want_entropy=False, temperature=sampling_temperatures(config, batch.agents))
            for b, index in enumerate(pack):
                rows[index]["old_logprobs"] = logprobs[b][batch.response_mask[b] > 0].tolist()


def _micro_loss(model, ref_model, batch: MicroBatch, size: MiniBatchSize, config: DrmasConfig, want_entropy: bool, only_agent: str | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's share of the mini-batch loss (the shares add up to it) and its
    token-mean metrics; with ``only_agent``, the share of that agent's rows alone,
    normalised the same way, so that the agents' shares add up to the micro-batch's."""
    algorithm = config.algorithm
    mask = batch.response_mask
    if only_agent is not None:
        keep = torch.tensor([agent == only_agent for agent in batch.agents], dtype=mask.dtype)
        mask = mask * keep.unsqueeze(-1)
    temperature = sampling_temperatures(config, batch.agents)
    logprobs, entropy = token_logprobs(model, batch, want_entropy or algorithm.entropy_coef > 0, temperature)
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref, _ = token_logprobs(ref_model, batch, want_entropy=False, temperature=temperature)
    aggregation, num_tokens, factor = _normalisation(algorithm.loss_aggregation, batch, size)
    loss, stats = policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        mask,
        clip_ratio_low=algorithm.clip_ratio_low,
        clip_ratio_high=algorithm.clip_ratio_high,
        clip_ratio_c=algorithm.clip_ratio_c,
        aggregation=aggregation,
        num_tokens=num_tokens,
        ref_logprobs=ref,
        kl_coef=algorithm.kl_coef,
        entropy=entropy if algorithm.entropy_coef > 0 else None,
        entropy_coef=algorithm.entropy_coef,
    )
    with torch.no_grad():
        result = {
            "clipfrac": stats["clipfrac"],
            "approx_kl": stats["approx_kl"],
            "logprob_gap": aggregate_loss((logprobs.detach() - batch.rollout_logprobs).abs(), mask).item(),
        }
        if entropy is not None:
            result["entropy"] = aggregate_loss(entropy.detach(), mask).item()
        if "kl" in stats:
            result["kl"] = stats["kl"]
    return loss * factor, result


def _normalisation(mode: LossAggregation, batch: MicroBatch, size: MiniBatchSize) -> tuple[LossAggregation, int | None, float]:
    """(aggregation, num_tokens, factor) that make ``policy_loss`` x factor a micro-batch's
    share of the mini-batch's loss.

    token-mean: every response token of the mini-batch weighs 1 / its token count.
    token-mean-per-micro-batch: the micro-batch's token mean over the number of
    micro-batches of the mini-batch, all ranks together (veRL's gradient accumulation); its
    denominator is the micro-batch's whole token count, also for one agent's share.
    seq-mean-*: the mean over the micro-batch's rows, weighted by its share of the rows.
    """
    if mode == "token-mean":
        return mode, size.tokens, 1.0
    if mode == "token-mean-per-micro-batch":
        return "token-mean", int(batch.response_mask.sum().item()), 1.0 / size.micro_batches
    return mode, None, len(batch.agents) / size.rows


def main(argv: list[str] | None = None) -> int:
    """``python -m drmas.update`` (or under ``torchrun``): one worker group's update.

    Under torchrun every rank runs this; ranks share the work and rank 0 writes.
    """
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(description="update one worker group")
    parser.add_argument("--config", required=True, help="resolved config (JSON file)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--iteration", type=int, required=True)
    parser.add_argument("--wg", required=True)
    parser.add_argument("--policy", required=True, help="policy artifact path in the store")
    parser.add_argument("--optim", help="optimizer-state artifact path in the store")
    parser.add_argument("--reference", help="reference policy artifact (for the KL term)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    config = DrmasConfig.from_json(Path(args.config).read_text())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = update(
        config,
        Store.from_config(config.store),
        args.run_id,
        args.iteration,
        args.wg,
        PolicyRef(args.policy),
        PolicyRef(args.optim) if args.optim else None,
        PolicyRef(args.reference) if args.reference else None,
        overwrite=args.overwrite,
    )
    if _world()[0] == 0:
        print(json.dumps({"artifact": result.artifact, "metrics": result.metrics}, sort_keys=True))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
