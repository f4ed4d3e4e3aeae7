"""The DeepSpeed engine: the same torch AdamW as the torch engine, wrapped in DeepSpeed ZeRO
0-3, with the DeepSpeed config it is built from and the one-process group DeepSpeed needs
even alone. DeepSpeed itself is imported when an engine is made: it takes seconds, and the
torch engine and the config builder need none of it.

This module's name is the engine's; its ``import deepspeed`` is absolute, so it is the real
DeepSpeed."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from drmas.config import DrmasConfig, WorkerGroup
from drmas.training.engines.base import (
    adamw,
    full_shape,
    gradient_norm,
    move_module_and_optimizer,
    rank_and_world,
    rng_untouched,
    trainable_parameters,
)
from drmas.training.shards import Piece, ShardStream, replicated_stream
from drmas.training.state import (
    StateStream,
    TrainState,
    collect,
    read_range,
    restore_scheduler,
    restore_state,
    saved_masters,
    scheduler_state,
    state_mismatch,
    stream_state,
)

__all__ = ["DeepSpeedEngine", "deepspeed_config", "ensure_process_group", "zero3_load_config", "zero3_optimizer_homes"]


class DeepSpeedEngine:
    """DeepSpeed (ZeRO 0-3) around the same torch AdamW; DeepSpeed clips and steps.

    DeepSpeed averages gradients over ranks; the loss is scaled by the world size so that
    the result is the same sum as the torch engine's. For ZeRO-3 the update stage loads the
    model partitioned from the start (``zero3_load_config``), which ``deepspeed.initialize``
    takes as it is; a model built whole (ZeRO 0-2, and the tests' in-memory models) it
    partitions itself.

    With bf16 DeepSpeed's optimizer steps fp32 master weights and rounds them into the
    bf16 model after each step: ZeRO-1/2/3 keep them in flat fp32 partitions; ZeRO-0 gets
    DeepSpeed 0.19.8's ``FP16_UnfusedOptimizer`` (its "DDP_BFLOAT16" path: bf16 gradients
    on the model), which keeps one fp32 copy per parameter and steps those, so the AdamW's
    state is keyed by the copies, not by the model's parameters. The masters are saved
    with the optimizer state, as the torch engine's are.
    """

    def __init__(self, model: torch.nn.Module, group: WorkerGroup, config: DrmasConfig) -> None:
        deepspeed = _import_deepspeed()
        ensure_process_group()
        _, world = rank_and_world()
        self.model = model
        self.params = list(trainable_parameters(model).values())
        optimizer, scheduler = adamw(self.params, group, config)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(config, group, world)
        )
        # DeepSpeed puts the module on its accelerator's device for this local rank
        # (``DeepSpeedEngine._configure_distributed_model``): the batches go there too.
        self.device: torch.device = self.engine.device
        # DeepSpeed's forward does per-micro-batch bookkeeping: without it ZeRO-3 overwrites
        # the accumulated gradient with each micro-batch's instead of adding to it.
        self.forward_model: torch.nn.Module = self.engine
        self.world = world
        self.zero_stage = config.train.zero_stage
        self.bf16: bool = self.engine.bfloat16_enabled()

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss * self.world)

    def grad_norm(self) -> float:
        """ZeRO-0 leaves the reduced gradients on the parameters: measure them before the
        step, so that a non-finite norm skips it. ZeRO-1/2/3 partition them: DeepSpeed
        reports the norm while it steps (and the skip is DeepSpeed's to make)."""
        return gradient_norm(self.params) if self.zero_stage == 0 else float("nan")

    def step(self, norm: float) -> tuple[bool, float]:
        """ZeRO-0: skipped here on a non-finite norm (DeepSpeed's bf16 ZeRO-0 optimizer has
        no loss scaler to skip it). ZeRO-1/2/3: DeepSpeed skips a step whose gradient is not
        finite (``deepspeed_config``), counts it in ``skipped_steps`` and reports an
        infinite norm; the step says it was skipped.

        ZeRO-1/2 with offload and fp32 accumulation keep the skipped step's non-finite fp32
        gradient partition (``averaged_gradients``): DeepSpeed 0.19.8 drops it on a skip only
        without offload (runtime/zero/stage_1_and_2.py:3050-3061), and every later step would
        add to it and be skipped too. It is dropped here, as the skip without offload does."""
        if self.zero_stage == 0 and not math.isfinite(norm):
            self.engine.zero_grad()
            return False, norm
        skipped = self.engine.skipped_steps
        self.engine.step()
        if self.zero_stage == 0:
            return True, norm
        stepped = self.engine.skipped_steps == skipped
        if not stepped and self.zero_stage < 3:
            zero = self.engine.optimizer
            for group in zero.averaged_gradients:
                zero.averaged_gradients[group] = None
        reported = self.engine.get_global_grad_norm()
        return stepped, float(reported) if reported is not None else float("nan")

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @contextmanager
    def side_pass(self) -> Iterator[None]:
        """ZeRO-3 gathers each module's parameters for its backward and DeepSpeed's own
        backward partitions the leftovers at its end (from a gradient hook, which a side
        pass never fires): partition them here, as its public ``empty_partition_cache``
        does (a no-op below stage 3)."""
        with rng_untouched():
            yield
        self.engine.empty_partition_cache()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """ZeRO-3 keeps each parameter partitioned across ranks: gather one at a time (every
        rank takes part) and keep a host copy on every rank (rank 0 saves it, and each rank's
        inference engine takes it), so no device holds the whole model at once."""
        if self.zero_stage < 3:
            return None
        from deepspeed.runtime.zero import GatheredParameters  # noqa: PLC0415

        weights: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            with GatheredParameters([param]):
                weights[name] = param.detach().cpu().clone()
        return weights

    def offload(self) -> None:
        """ZeRO-1/2: DeepSpeed's ``offload_states`` (weights, gradients, master weights,
        Adam's moments). ZeRO-3's refuses a client optimizer for the master weights and the
        moments (it asserts FusedAdam): those two move here, the rest with DeepSpeed.
        ZeRO-0 has no ZeRO optimizer: the module, the bf16 masters and the AdamW state move
        as in torch."""
        if self.zero_stage == 0:
            self._move_zero0(torch.device("cpu"))
            return
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum  # noqa: PLC0415

        pin = self.device.type == "cuda"  # DeepSpeed's CPU accelerator cannot pin
        if self.zero_stage < 3:
            self.engine.offload_states(pin_memory=pin)
            return
        zero = self.engine.optimizer
        deepspeeds = [
            OffloadStateTypeEnum.lp_params,
            OffloadStateTypeEnum.lp_grads,
            OffloadStateTypeEnum.contiguous_grad_buffer,
        ]
        self.engine.offload_states(include=deepspeeds, pin_memory=pin)
        host = [torch.device("cpu")] * len(zero.fp32_partitioned_groups_flat)
        _move_master_weights_and_moments(zero.fp32_partitioned_groups_flat, host, zero.optimizer)

    def onload(self) -> None:
        if self.zero_stage == 0:
            self._move_zero0(self.device)
            return
        self.engine.reload_states()
        zero = self.engine.optimizer
        if self.zero_stage == 3:
            homes = zero3_optimizer_homes(zero, self.device)
            _move_master_weights_and_moments(zero.fp32_partitioned_groups_flat, homes, zero.optimizer)
            return
        # ZeRO-1/2's offload drops each parameter's link to its Adam moments, and the reload
        # relinks only the weights (DeepSpeed 0.19.8): relink the moments, or gathering them
        # (``export_state``) fails.
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state  # noqa: PLC0415

        for params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True):
            if flat in zero.optimizer.state:
                lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)

    def state_stream(self) -> StateStream:
        """ZeRO-1/2/3 keep Adam's moments (and with bf16 the fp32 master weights) in flat
        partitions: each is gathered whole per parameter when the stream reaches it (a
        collective: every rank consumes the stream), so the saved state has one layout
        whatever the stage and the number of ranks, and no rank holds more than one
        parameter's state at a time. Before the optimizer's first step (an update whose
        every step was skipped) there are no moments yet: the state says so as the torch
        engine's does (no steps), and DeepSpeed, which cannot gather moments it has not
        made, is not asked for them."""
        if self.zero_stage == 0:
            return stream_state(self.model, self.optimizer, self.scheduler, self._zero0_masters())
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: PLC0415

        rng = torch.get_rng_state()
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = [("rng/torch", rng.dtype, tuple(rng.shape))]
        producers: list[Any] = [lambda: rng]
        trainable = trainable_parameters(self.model)
        stepped = self._stepped()
        for name, param in trainable.items():
            shape = tuple(full_shape(param))
            for key in ("exp_avg", "exp_avg_sq") if stepped else ():
                specs.append((f"optim/{name}/{key}", torch.float32, shape))
                producers.append(partial(safe_get_full_optimizer_state, param, key))
            if self.bf16:
                specs.append((f"master/{name}", torch.float32, shape))
                producers.append(partial(safe_get_full_fp32_param, param))
        steps = dict.fromkeys(trainable, self._base_step()) if stepped else {}
        tensors = (produce().detach().cpu().contiguous() for produce in producers)
        return StateStream(specs, tensors, {"scheduler": scheduler_state(self.scheduler), "steps": steps})

    def export_state(self) -> TrainState:
        return collect(self.state_stream())

    def shard_stream(self) -> ShardStream:
        """What this rank holds of the state, for the sharded save (no collective): ZeRO-1/2/3
        each parameter's range in this rank's flat partitions (``_pieces``); ZeRO-0, whose
        state every rank holds whole, an even split of it."""
        if self.zero_stage == 0:
            return replicated_stream(
                self.model, self.optimizer, self.scheduler, self._zero0_masters(), *rank_and_world()
            )
        stepped = self._stepped()
        steps = dict.fromkeys(trainable_parameters(self.model), self._base_step()) if stepped else {}
        meta = {"scheduler": scheduler_state(self.scheduler), "steps": steps}
        return ShardStream.of(self._pieces(moments=stepped, masters=self.bf16), meta)

    def import_state(self, state: TrainState) -> None:
        """The moments, steps, scheduler and RNG; with bf16 the saved fp32 masters too, then
        rounded into the bf16 weights as DeepSpeed's step does (a state without masters
        keeps the masters DeepSpeed made from the bf16 weights). ZeRO-1/2/3: each rank reads
        only its ranges of the state (``_pieces``), whatever number of ranks saved it."""
        if self.zero_stage == 0:
            if restore_state(state, self.model, self.optimizer, self.scheduler, self._zero0_masters()):
                self._weights_from_masters()
            return
        trainable = trainable_parameters(self.model)
        shapes = {name: full_shape(param) for name, param in trainable.items()}
        if problem := state_mismatch(state, shapes):
            raise ValueError(problem)
        stepped = bool(state.meta["steps"])  # none: saved before the first step, the optimizer stays fresh
        if stepped:
            self._create_moments(next(iter(state.meta["steps"].values())))
        masters = self.bf16 and saved_masters(state, trainable) is not None
        with torch.no_grad():
            for piece in self._pieces(moments=stepped, masters=masters):
                piece.view().copy_(read_range(state.tensors, piece.name, piece.start, piece.stop))
        if masters:
            self._weights_from_masters()
        restore_scheduler(self.scheduler, self.engine.optimizer, state.meta)
        torch.set_rng_state(state.tensors["rng/torch"])

    def _create_moments(self, step: float) -> None:
        """AdamW creates its moments at the first step: create them as it would (zeros) on
        the flat partitions, with the saved step count. ZeRO-1/2 link per-parameter views of
        them only then: link them with DeepSpeed's own lazy hook (0.19); ZeRO-3 reads the
        flat state directly."""
        base = self.engine.optimizer.optimizer
        for flat in self._flat_partitions():
            base.state[flat] = {
                "step": torch.tensor(step),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
        if self.zero_stage < 3:
            self.engine.optimizer._lazy_init_hp_params_optimizer_state()

    def _pieces(self, moments: bool, masters: bool) -> list[Piece]:
        """ZeRO-1/2/3: for every trainable parameter, its moments (``moments``) and fp32
        master (``masters``) as this rank holds them: the range [start, stop) of the
        parameter flattened that this rank's partition holds, and a view of it in the flat
        fp32 partition (what is written at a save, and set at a restore)."""
        pieces = []
        for name, param in trainable_parameters(self.model).items():
            shape = tuple(full_shape(param))
            start, stop = self._held_range(param)
            kinds = [*(("exp_avg", "exp_avg_sq") if moments else ()), *((None,) if masters else ())]
            for key in kinds:
                label = f"optim/{name}/{key}" if key else f"master/{name}"
                view = partial(self._held_view, param, key, stop - start)
                pieces.append(Piece(label, torch.float32, shape, start, stop, view))
        return pieces

    def _held_range(self, param: Any) -> tuple[int, int]:
        """The range of ``param`` flattened that this rank's partition holds (DeepSpeed
        0.19.8). ZeRO-1/2: the fragment ``link_hp_params`` maps it to, ``_hp_mapping``'s
        ``lp_fragment_address`` (utils/tensor_fragment.py:378-401: the overlap of the
        parameter with this rank's slice of its group's flat buffer; None where there is
        none; alignment padding belongs to no parameter). ZeRO-3: every parameter is split
        alone, padded to a multiple of the ranks, ``partition_numel`` elements a rank, rank r
        holding [r * numel, (r + 1) * numel) (runtime/zero/partition_parameters.py:1690-1700,
        1816-1817; stage3.py:3183-3200 sets a whole value the same way), less the padding
        past the parameter's end."""
        if self.zero_stage < 3:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                return 0, 0
            address = mapping.lp_fragment_address
            return address.start, address.start + address.numel
        rank = rank_and_world()[0]
        size = param.partition_numel()
        return min(rank * size, param.ds_numel), min((rank + 1) * size, param.ds_numel)

    def _held_view(self, param: Any, key: str | None, length: int) -> torch.Tensor:
        """The live fp32 view of this rank's range of ``param``: its master weights
        (``key`` None) or moment ``key``. ZeRO-1/2: the fragment's view into the flat
        partition or its state (tensor_fragment.py:36-58). ZeRO-3: the ``narrow`` of the flat
        partition or its state that DeepSpeed's local API reads (stage3.py:3150-3168),
        taken where it lives (the API's ``safe_get_local_*`` copies it to the accelerator,
        stage3.py:3238-3245, and a copy of an offloaded partition would take no restore),
        less its padding."""
        if length == 0:
            return torch.empty(0)
        if self.zero_stage < 3:
            return param._hp_mapping.get_hp_fragment(key)
        local, _ = self.engine.optimizer._get_fp32_opt_state_partition(param, False, key)
        return local.narrow(0, 0, length)

    def _zero0_masters(self) -> dict[str, torch.Tensor] | None:
        """ZeRO-0 with bf16: the fp32 copy that DeepSpeed's ``FP16_UnfusedOptimizer`` keeps
        and steps for each trainable parameter, by name. None in fp32 (the AdamW steps the
        parameters themselves)."""
        if not self.bf16:
            return None
        wrapper = self.engine.optimizer
        copies = {
            id(param): master
            for params, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True)
            for param, master in zip(params, masters, strict=True)
        }
        return {name: copies[id(param)] for name, param in trainable_parameters(self.model).items()}

    def _weights_from_masters(self) -> None:
        """Round the masters into the bf16 weights as DeepSpeed's step does. ZeRO-1/2: its
        ``update_lp_params`` (this rank's partition, then an all-gather). ZeRO-3: the copy
        of each fp32 partition into the bf16 one that ends its step; an engine fresh from
        ``deepspeed.initialize`` (the update stage builds one for every import) has gathered
        no parameter yet, so the next forward gathers them all from the new partitions."""
        zero = self.engine.optimizer
        if self.zero_stage == 0:
            with torch.no_grad():
                for params, masters in zip(zero.fp16_groups, zero.fp32_groups, strict=True):
                    for param, master in zip(params, masters, strict=True):
                        param.copy_(master)
        elif self.zero_stage < 3:
            zero.update_lp_params()
        else:
            for sub_group in range(len(zero.fp16_groups)):
                zero._reassign_or_swap_out_partitioned_parameters(sub_group)

    def _move_zero0(self, device: torch.device) -> None:
        move_module_and_optimizer(self.model, self.optimizer, device)
        for master in (self._zero0_masters() or {}).values():
            master.data = master.data.to(device)

    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 partitions, which the torch AdamW steps and keys its state by
        (ZeRO-3 puts them in its param groups only while it steps)."""
        wrapper = self.engine.optimizer
        if self.zero_stage == 3:
            return list(wrapper.fp32_partitioned_groups_flat)
        return [flat for group in wrapper.optimizer.param_groups for flat in group["params"]]

    def _stepped(self) -> bool:
        """Whether the optimizer has stepped (made its moments) yet."""
        return any(flat in self.engine.optimizer.optimizer.state for flat in self._flat_partitions())

    def _base_step(self) -> float:
        slots = list(self.engine.optimizer.optimizer.state.values())
        return float(slots[0]["step"]) if slots and "step" in slots[0] else 0.0


def zero3_optimizer_homes(zero: Any, device: torch.device) -> list[torch.device]:
    """Where ZeRO-3's step expects each fp32 partition, its moments and its gradient: on
    ``device``, or, for a sub-group whose optimizer DeepSpeed offloads
    (``offload_optimizer``), where DeepSpeed keeps it (``subgroup_to_device``, the host).

    ZeRO-Offload keeps such a partition on the host for good, with a pinned host ``.grad``
    that its step writes into (DeepSpeed 0.19.8, runtime/zero/stage3.py:1100-1108,
    1337-1342): moving the partition and its moments to the GPU and leaving the ``.grad``
    on the host made the next step fail on mixed devices."""
    flats = zero.fp32_partitioned_groups_flat
    if not getattr(zero, "offload_optimizer", False):
        return [device] * len(flats)
    return [torch.device("cpu") if zero.subgroup_to_device[i] == "cpu" else device for i in range(len(flats))]


def _move_master_weights_and_moments(
    flats: list[torch.Tensor], homes: list[torch.device], optimizer: torch.optim.Optimizer
) -> None:
    """ZeRO-3's fp32 partitions (the master weights) and the AdamW moments keyed by them,
    each to its home: the data moves, the tensors (the optimizer's keys) stay the same
    objects. A gradient the partition keeps between steps moves with it."""
    for flat, home in zip(flats, homes, strict=True):
        flat.data = flat.data.to(home)
        if flat.grad is not None and flat.grad.device != flat.device:
            flat.grad.data = flat.grad.data.to(home)
        for key, value in optimizer.state.get(flat, {}).items():
            if key in ("exp_avg", "exp_avg_sq"):
                value.data = value.data.to(home)


def deepspeed_config(config: DrmasConfig, group: WorkerGroup, world: int) -> dict[str, Any]:
    """DeepSpeed's config for this worker group: one backward per ``engine.backward`` and
    boundary (drmas accumulates micro-batches itself), clipping, ZeRO stage, bf16 and,
    with ``train.offload_optimizer``, Adam's state and step in host memory (ZeRO >= 1).

    Offloading keeps the torch AdamW: DeepSpeed refuses a client optimizer there unless
    ``zero_force_ds_cpu_optimizer`` is off (its CPU Adam compiles for a minute on CPU).

    Gradients of a bf16 model (DeepSpeed 0.19.8; each micro-batch's own gradient is bf16,
    as autograd makes it): every stage reduces across ranks in fp32
    (``communication_data_type``; DeepSpeed's default is the model's dtype,
    runtime/engine.py:1718-1730). ZeRO-2 and ZeRO-3, with or without offload, and ZeRO-1
    with offload also accumulate the micro-batches in fp32 (``data_types.grad_accum_dtype``):
    ZeRO-1/2 into an fp32 partition on the device, also under offload, which then bypasses
    the bf16 host buffer of ``async_accumulate_grad_in_cpu_via_gpu``
    (runtime/zero/stage_1_and_2.py:1259-1266, 1324-1326, 2145-2160; ZeRO-1 keeps an fp32
    copy of every gradient, not partitioned, :395-404); ZeRO-3 into its gradient partitions
    (runtime/zero/stage3.py:791-793, 1885-1886, 1943-1944, 2030-2035; on the host with
    offload). Still bf16 (DeepSpeed has no fp32 accumulation there that keeps its ZeRO
    optimizer, runtime/engine.py:2294-2323): ZeRO-0 (its DDP_BFLOAT16 path: gradients add up
    in ``param.grad``; fp32 accumulation is refused as an "unsupported mix") and ZeRO-1
    without offload (fp32 accumulation would swap in DeepSpeed's ``BF16_Optimizer``, whose
    state this engine does not read). There the sum is reduced in fp32 and rounded back to
    bf16. The torch backend accumulates in fp32 with ZeRO-0's layout; ZeRO-2's fp32
    partition (4 bytes a parameter over the ranks) is smaller than ZeRO-1's bf16 gradients
    (2 bytes a parameter) on more than two ranks.

    A step whose gradient is not finite is skipped: ZeRO-1/2 check the gradients for
    inf/NaN (``check_grad_overflow``, set here rather than left to its default) and the
    norm (stage_1_and_2.py:3027-3060), ZeRO-3 the norm (stage3.py:2882-2894); ZeRO-0 is
    checked by ``DeepSpeedEngine.step``."""
    train = config.train
    zero: dict[str, Any] = {"stage": train.zero_stage}
    if train.offload_optimizer:  # the config refuses it with ZeRO-0 (no partition to offload)
        zero["offload_optimizer"] = {"device": "cpu"}
    bf16 = group.spec is not None and group.spec.dtype == "bfloat16"
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "communication_data_type": "fp32",
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if train.zero_stage >= 2 or (train.zero_stage == 1 and train.offload_optimizer):
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    return ds


def ensure_process_group() -> None:
    """DeepSpeed needs a process group even alone: a one-process group whose rendezvous is
    an in-memory store (a TCPStore would listen on every interface); nccl on a GPU (gloo
    has no all-gather or reduce-scatter of CUDA tensors, which ZeRO-3 uses), gloo on CPU."""
    if dist.is_initialized():
        return
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed checks that a launcher set it
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def zero3_load_config(group: WorkerGroup, config: DrmasConfig) -> dict[str, Any]:
    """The DeepSpeed config this group's ZeRO-3 engine is made with, for a model built
    partitioned under ``deepspeed.zero.Init`` (``drmas.models.load_model_partitioned``), so
    that ``deepspeed.initialize`` takes its partitions as they are; with DeepSpeed's
    distributed wrapper ready, as ``zero.Init`` needs it."""
    deepspeed = _import_deepspeed()
    ensure_process_group()
    # zero.Init reads the config's batch size against DeepSpeed's world size, which is 1
    # until DeepSpeed wraps the process group (as deepspeed.initialize does first).
    deepspeed.init_distributed()
    return deepspeed_config(config, group, rank_and_world()[1])


def _import_deepspeed() -> Any:
    """DeepSpeed, on the CPU accelerator where there is no GPU (it picks one when imported);
    seconds to import: only where a DeepSpeed engine or model is made."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed  # noqa: PLC0415

    return deepspeed
