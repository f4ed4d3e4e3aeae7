"""What both training engines share: the ``TrainEngine`` protocol the update's loop steps
through, this process's rank and device, and the AdamW (and its helpers) that both engines
step. ``drmas.training.engines`` picks an engine (``make_engine``)."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from drmas.config import DrmasConfig, WorkerGroup
from drmas.training.shards import ShardStream
from drmas.training.state import StateStream, TrainState

__all__ = [
    "ALONE_WAIT_S",
    "TrainEngine",
    "adamw",
    "exchange_json",
    "host_group",
    "full_shape",
    "gradient_norm",
    "move_module_and_optimizer",
    "rank_and_world",
    "rng_untouched",
    "trainable_parameters",
    "training_device",
    "wait_for_all",
]


def rank_and_world() -> tuple[int, int]:
    """This process's rank and its group's size; (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


ALONE_WAIT_S = 6 * 3600.0
"""How long ranks wait for one another's work alone, on a group of its own (``wait_for_all``,
``host_group``): a cold update's downloads of the policy and of each rank's optimizer
shards, rank 0's store of the policy, every rank's upload of its shard (56 GB over the
ranks for the math recipe: an hour at 15 MB/s on one). The process group's own
collectives time out after 10 minutes, which aborted them while one rank worked; a rank
that fails makes the pool rebuild the group, which ends the wait sooner."""


def wait_for_all(timeout_s: float) -> None:
    """A barrier of the whole process group with a timeout of its own, on gloo (host
    memory only): for ranks that wait while one rank does long work alone (rank 0 stores the
    update's policy), longer than the group's collectives may take."""
    with host_group(timeout_s) as group:
        if group is not None:
            dist.barrier(group=group)


@contextmanager
def host_group(timeout_s: float) -> Iterator[dist.ProcessGroup | None]:
    """A gloo group of the whole process group with a timeout of its own (``new_group`` is
    itself a barrier, with this timeout), destroyed afterwards: for exchanges that wait on
    long work (uploads to the store). None alone (no group, or a group of one)."""
    if rank_and_world()[1] == 1:
        yield None
        return
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def exchange_json(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank: sent as JSON bytes (never
    pickled, unlike ``all_gather_object``). Alone: ``[value]``."""
    if group is None:
        return [value]
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    longest = int(max(size.item() for size in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    received = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(received, padded, group=group)
    return [json.loads(got[: int(size.item())].numpy().tobytes()) for got, size in zip(received, sizes, strict=True)]


def training_device() -> torch.device:
    """This process's device: its local rank's GPU (``LOCAL_RANK``, set by torchrun and by
    ``ensure_process_group``) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class TrainEngine(Protocol):
    """What the update's loop needs from an engine, whatever does the stepping."""

    device: torch.device
    """Where the model's parameters are: every batch, the reference model and every buffer
    of the update go there."""
    model: torch.nn.Module
    """The policy as loaded: its parameters are what is saved."""
    forward_model: torch.nn.Module
    """What the update's forward passes go through (DeepSpeed: its engine)."""
    params: list[torch.nn.Parameter]

    def backward(self, loss: torch.Tensor, boundary: bool) -> None: ...

    def grad_norm(self) -> float:
        """Global L2 norm of the summed gradient, before clipping (NaN: the step reports it)."""
        ...

    def step(self, norm: float) -> tuple[bool, float]:
        """Clip and step; skip (and clear) on a non-finite norm. Returns (stepped, norm)."""
        ...

    def state_stream(self) -> StateStream:
        """The optimizer state, one tensor at a time (a collective where it is partitioned:
        every rank consumes the whole stream, in order)."""
        ...

    def shard_stream(self) -> ShardStream:
        """What this rank holds of the optimizer state, for the sharded save
        (``drmas.training.shards``); no collective."""
        ...

    def export_state(self) -> TrainState:
        """``state_stream``, held whole in memory."""
        ...

    def import_state(self, state: TrainState) -> None: ...

    def lr(self) -> float: ...

    def side_pass(self) -> AbstractContextManager[None]:
        """Around a forward/backward that must leave no trace on the update (diagnostics)."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole weights on every rank (host copies), or None when the model's own
        parameters are whole."""
        ...

    def offload(self) -> None:
        """Move the training state (weights, gradients, optimizer state) to host memory:
        the engine kept between updates gives the device back to the rollout engine."""
        ...

    def onload(self) -> None:
        """Bring what ``offload`` moved back to ``device`` for the next update."""
        ...


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that train, by name: all of them, or a LoRA policy's adapters (its
    base is frozen, so no optimizer holds state for it)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def adamw(
    params: list[torch.nn.Parameter], group: WorkerGroup, config: DrmasConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its linear warm-up: both engines step this same optimizer."""
    optimizer = torch.optim.AdamW(params, lr=group.lr, weight_decay=config.train.weight_decay)
    warmup = group.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


@contextmanager
def rng_untouched() -> Iterator[None]:
    """The RNG is restored afterwards, so dropout draws the same masks in the real pass."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def gradient_norm(params: list[torch.nn.Parameter]) -> float:
    """The L2 norm of the gradients ``params`` hold, as one vector (0 when none has one)."""
    norms = [p.grad.detach().float().norm(2) for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def move_module_and_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move a module's parameters (and gradients) and its optimizer's tensors to ``device``
    in place: the optimizer keeps its keys (the parameter objects), only their data moves."""
    if next(module.parameters()).device == device:
        return
    module.to(device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                state[key] = value.to(device)


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's whole shape, also under ZeRO-3 (whose ``param.shape`` is empty
    outside its module's forward and backward)."""
    return param.ds_shape if hasattr(param, "ds_shape") else param.shape
