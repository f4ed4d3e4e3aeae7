"""The torch engine: plain torch AdamW, gradients summed across data-parallel ranks, a bf16
model trained in mixed precision against fp32 master weights.

This module's name is the engine's, as ``generation/engines/hf.py`` is its engine's; its
``import torch`` is absolute, so it is the real torch."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from functools import partial

import torch
import torch.distributed as dist

from drmas.config import DrmasConfig, WorkerGroup
from drmas.training.engines.base import (
    adamw,
    gradient_norm,
    move_module_and_optimizer,
    rank_and_world,
    rng_untouched,
    trainable_parameters,
    training_device,
)
from drmas.training.shards import ShardStream, replicated_stream
from drmas.training.state import StateStream, TrainState, collect, restore_state, stream_state

__all__ = ["TorchEngine"]


def _fp32_masters(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.nn.Parameter]:
    """What the optimizer steps for each parameter: an fp32 one itself; for a bf16 one an
    fp32 master copy, into whose gradient each backward's bf16 gradient is added at once
    (a post-accumulate hook; the bf16 gradient is dropped), so that gradients accumulate
    over micro-batches in fp32 (and are summed across ranks in fp32), as DeepSpeed's ZeRO-2
    and -3 and its ZeRO-1 with offload do under ``deepspeed_config``; DeepSpeed's ZeRO-0 and
    ZeRO-1 without offload accumulate in bf16."""
    masters = {}
    for name, param in params.items():
        if param.dtype == torch.float32:
            masters[name] = param
            continue
        master = torch.nn.Parameter(param.detach().float().clone())
        param.register_post_accumulate_grad_hook(partial(_into_master, master=master))
        masters[name] = master
    return masters


def _into_master(param: torch.Tensor, master: torch.Tensor) -> None:
    if param.grad is None:
        return
    grad = param.grad.float()
    master.grad = grad if master.grad is None else master.grad.add_(grad)
    param.grad = None


class TorchEngine:
    """AdamW with linear warm-up; gradients summed across data-parallel ranks.

    A bf16 model trains in mixed precision, as DeepSpeed's bf16 does: it computes in bf16
    (the model that is stored and rolled out is the one that trains, so trainer and engine
    see the same weights), while AdamW steps fp32 master weights with fp32 gradients
    (accumulated over the micro-batches and summed across ranks in fp32: ``_fp32_masters``)
    and moments, and the model takes the masters, rounded, after each step. An update below
    half a bf16 ulp of a weight (lr 1e-5 on a weight of 1: bf16 keeps 8 bits) adds up in the
    master instead of being rounded away at every step. Chosen over fp32 weights under
    ``torch.autocast``: that keeps 4 bytes a weight resident plus autocast's bf16 copies,
    and computes norms and residuals in fp32, unlike the bf16 model the rollout runs.
    The masters are saved with the optimizer state, so a resume continues from them."""

    def __init__(self, model: torch.nn.Module, group: WorkerGroup, config: DrmasConfig) -> None:
        self.device = training_device()
        self.model = model.to(self.device)
        self.forward_model: torch.nn.Module = self.model
        trainable = trainable_parameters(model)
        self.params = list(trainable.values())
        self.masters = _fp32_masters(trainable)
        self.optimizer, self.scheduler = adamw(list(self.masters.values()), group, config)
        self.grad_clip = config.train.grad_clip

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def grad_norm(self) -> float:
        self._all_reduce()
        return gradient_norm(list(self.masters.values()))

    def step(self, norm: float) -> tuple[bool, float]:
        stepped = math.isfinite(norm)
        if stepped:
            scale = min(1.0, self.grad_clip / (norm + 1e-6))
            for master in self.masters.values():
                if master.grad is not None:
                    master.grad.mul_(scale)
            self.optimizer.step()
            self.scheduler.step()
            with torch.no_grad():
                for param, master in zip(self.params, self.masters.values(), strict=True):
                    if master is not param:
                        param.copy_(master)
        self.optimizer.zero_grad(set_to_none=True)
        return stepped, norm

    def state_stream(self) -> StateStream:
        return stream_state(self.model, self.optimizer, self.scheduler, self._separate_masters())

    def shard_stream(self) -> ShardStream:
        """Every rank holds the whole state: each writes an even share of it."""
        return replicated_stream(
            self.model, self.optimizer, self.scheduler, self._separate_masters(), *rank_and_world()
        )

    def export_state(self) -> TrainState:
        return collect(self.state_stream())

    def import_state(self, state: TrainState) -> None:
        restore_state(state, self.model, self.optimizer, self.scheduler, self._separate_masters())
        with torch.no_grad():
            for param, master in zip(self.params, self.masters.values(), strict=True):
                param.copy_(master)

    def _separate_masters(self) -> dict[str, torch.Tensor] | None:
        """The fp32 masters by name when they are not the parameters themselves (bf16)."""
        mixed = any(master is not param for param, master in zip(self.params, self.masters.values(), strict=True))
        return dict(self.masters) if mixed else None

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def side_pass(self) -> AbstractContextManager[None]:
        return rng_untouched()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        return None

    def offload(self) -> None:
        self._move(torch.device("cpu"))

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device: torch.device) -> None:
        move_module_and_optimizer(self.model, self.optimizer, device)
        for param, master in zip(self.params, self.masters.values(), strict=True):
            if master is not param:
                master.data = master.data.to(device)

    def _all_reduce(self) -> None:
        if rank_and_world()[1] > 1:
            for p in self.masters.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
