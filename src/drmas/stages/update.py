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
5. Write the new policy (HF layout, safetensors) and, every ``checkpoint.every``-th
   iteration and after the last, the optimizer, scheduler and RNG state (safetensors +
   JSON, never pickle; each rank stores the part it holds, ``drmas.training.shards``) as
   two artifacts, manifests last. A LoRA group
   (``models.NAME.lora``) trains adapters on its frozen base and stores only them (PEFT
   layout) with a reference to the base (``drmas.generation.lora``); its KL reference is
   the base, the same model with the adapter switched off.
6. Hand the new weights to the worker's inference engine in memory (a LoRA group's
   merged into its base): the next rollout generates from them without reading the store.
7. The worker keeps the training state (engine, optimizer, reference model), offloaded to
   host memory: the next update of the group continues from it (onloaded) without reading
   the store or building an engine. A worker without it (a new or rebuilt pool, a policy
   rewritten since) starts from the stored policy and optimizer state.

Where it runs: on the pool (``pool`` given: the runner and the Kubeflow task), every worker
of the group runs ``update_rank`` as one rank of the group's process group (data-parallel
over the group's slots); without a pool, this process is the only rank (or one of
``torchrun``'s). Each rank takes every world-size-th micro-batch (and empty ones, so that all
ranks run as many) and the gradients are summed across ranks; the loss is normalised by the
mini-batch's global token (or micro-batch) count, so 2 ranks compute the same update as 1.
Backends: plain torch (AdamW), or DeepSpeed (ZeRO 0-3 from config, the same torch
optimizer, optionally offloaded to host memory; gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc

from drmas.config import DrmasConfig, PolicyError, WorkerGroup
from drmas.generation.pool import RayPool
from drmas.generation.workers import WorkerGroupRuntime
from drmas.infra.layout import (
    PolicyRef,
    StageResult,
    optim_path,
    policy_path,
    split_iteration_path,
    stage_path,
    stored_versions,
    version_number,
    versioned,
)
from drmas.infra.schema import BATCH_SCHEMA
from drmas.infra.store import ArtifactNotFound, CorruptArtifact, Store, StoreSettings

# torch, transformers and the training code are imported where a rank trains: the driver
# that calls ``update`` (a Kubeflow task, a thin Ray driver) starts in a second, not six.
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from drmas.training.engines import TrainEngine

__all__ = ["HeldTraining", "OptimizerStateLost", "update", "update_rank"]


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
    pool: RayPool | None = None,
) -> StageResult:
    """Update one worker group on the pool's workers of ``wg`` (or, without a pool, in
    this process); write its policy and optimizer state (rank 0 writes)."""
    args = (config, store.settings(), run_id, iteration, wg, policy, optim, reference, overwrite, cache_key)
    if pool is not None:
        return pool.train(wg, update_rank, *args)
    return update_rank(None, *args)


class OptimizerStateLost(RuntimeError):
    """The optimizer state an update continues from is neither held by the pool nor
    stored (``checkpoint.every`` > 1 and the pool was lost): the run goes back to the last
    iteration whose state was stored (``drmas.stages.checkpoint.resume_point``)."""


@dataclass
class HeldTraining:
    """One rank's training state, kept by its pool worker from one update to the next
    (offloaded to host memory in between): the next update continues from it instead of
    reading the policy and optimizer state from the store and building a new engine.

    It continues only the update it came from: ``policy`` (what that update wrote, with its
    manifest's fingerprint: a policy rewritten since is read from the store) and ``optim``
    (the optimizer state's path, whether or not it was stored)."""

    engine: TrainEngine
    model: PreTrainedModel
    tokenizer: Any
    reference: PolicyRef | None
    ref_model: torch.nn.Module | None
    policy: PolicyRef
    policy_manifest: str
    optim: PolicyRef | None
    rng: torch.Tensor
    lora_base: dict[str, Any] | None = None
    """A LoRA group's base policy (``drmas.generation.lora.BASE_POLICY``): the model is a
    PeftModel over it, and the update stores the adapter with this record."""

    def continues(self, store: Store, policy: PolicyRef, optim: PolicyRef | None, reference: PolicyRef | None) -> bool:
        if (policy, optim, reference) != (self.policy, self.optim, self.reference):
            return False
        try:
            return store.fingerprint(policy.artifact) == self.policy_manifest
        except ArtifactNotFound:
            return False

    def offload(self) -> None:
        self.engine.offload()
        if self.ref_model is not None:
            self.ref_model.to("cpu")

    def onload(self) -> None:
        import torch  # noqa: PLC0415

        self.engine.onload()
        if self.ref_model is not None:
            self.ref_model.to(self.engine.device)
        torch.set_rng_state(self.rng)


def update_rank(
    worker: WorkerGroupRuntime | None,
    config: DrmasConfig,
    store_settings: StoreSettings,
    run_id: str,
    iteration: int,
    wg: str,
    policy: PolicyRef,
    optim: PolicyRef | None,
    reference: PolicyRef | None,
    overwrite: bool,
    cache_key: str,
) -> StageResult:
    """One rank's share of the update (every rank of the group's process group runs it);
    ``worker``: the pool worker it runs in, whose engine takes the new weights and which
    keeps this rank's training state for the next update."""
    import torch  # noqa: PLC0415

    from drmas.generation.lora import merge_lora  # noqa: PLC0415
    from drmas.stages.optimizer_store import store_shards  # noqa: PLC0415
    from drmas.training.engines import ALONE_WAIT_S, rank_and_world, wait_for_all  # noqa: PLC0415
    from drmas.training.loop import train_worker_group  # noqa: PLC0415
    from drmas.training.lora import adapter_config, split_weights  # noqa: PLC0415

    started = time.perf_counter()
    store = Store.from_config(store_settings)
    rank, world = rank_and_world()
    group = next(g for g in config.worker_groups() if g.name == wg)
    experiment = config.experiment.name
    rows = _worker_group_rows(store, stage_path(experiment, run_id, iteration, "advantage"), wg)
    out_policy, out_optim = _new_version(store, experiment, run_id, iteration, wg)
    held = worker.take_training() if worker is not None else None
    with tempfile.TemporaryDirectory() as scratch:
        if held is not None and held.continues(store, policy, optim, reference):
            held.onload()
        else:
            del held  # another update's state: its memory goes before a new engine is built
            held = _start_training(config, store, group, policy, optim, reference, Path(scratch))
        engine, model, tokenizer = held.engine, held.model, held.tokenizer
        metrics = train_worker_group(
            config, group, engine, model, held.ref_model, rows, tokenizer.pad_token_id, iteration, rank, world
        )
        metrics[f"wg/{wg}/time"] = time.perf_counter() - started
        metrics[f"wg/{wg}/tokens_per_s"] = metrics[f"wg/{wg}/tokens"] / max(metrics[f"wg/{wg}/time"], 1e-9)
        metrics[f"wg/{wg}/policy_version"] = float(version_number(out_policy))
        # Every rank takes part in gathering partitioned weights; each rank stores the part of
        # the optimizer state it holds, one tensor at a time, and rank 0 commits the artifact.
        weights = engine.full_weights()
        saved = Path(scratch) / "out"
        meta = {"stage": "update", "iteration": iteration, "wg": wg, "cache_key": cache_key}
        if config.stores_optimizer(iteration):
            store_shards(engine.shard_stream(), store, out_optim, overwrite, meta, saved / "optim", ALONE_WAIT_S)
        if held.lora_base is not None and worker is not None:  # its engine takes the merged weights
            weights = merge_lora(*split_weights(model), adapter_config(model))
        if rank == 0:
            if held.lora_base is not None:
                _save_adapter(model, held.lora_base, saved / "policy")
            else:
                # A copy: save_pretrained empties the state dict it is handed (a model built
                # under zero.Init), and the engine takes these weights next.
                given = dict(weights) if weights is not None else None
                model.save_pretrained(saved / "policy", safe_serialization=True, state_dict=given)
            tokenizer.save_pretrained(saved / "policy")
            with store.writer(out_policy, overwrite=overwrite, meta=meta) as out:
                out.put_dir(saved / "policy", "")
                out.write_json("metrics.json", metrics)
        if world > 1:  # every rank returns the artifact: it exists once they do
            wait_for_all(ALONE_WAIT_S)
        if worker is not None:
            worker.adopt(weights if weights is not None else model.state_dict(), PolicyRef(out_policy))
            held.policy, held.optim = PolicyRef(out_policy), PolicyRef(out_optim)
            held.policy_manifest, held.rng = store.fingerprint(out_policy), torch.get_rng_state()
            held.offload()
            worker.keep_training(held)
    return StageResult(out_policy, metrics)


def _new_version(store: Store, experiment: str, run_id: str, iteration: int, wg: str) -> tuple[str, str]:
    """Where this update writes its policy and optimizer state: the first version, or, when
    the update was computed before (a resubmitted part recomputes the updates since the last
    stored optimizer state), the next one beside it, never over it (``infra.layout``).
    Every rank asks before any of them writes, so all agree."""
    policy, optim = policy_path(experiment, run_id, iteration, wg), optim_path(experiment, run_id, iteration, wg)
    number = max(stored_versions(store, policy) + stored_versions(store, optim), default=0) + 1
    return versioned(policy, number), versioned(optim, number)


def _start_training(
    config: DrmasConfig,
    store: Store,
    group: WorkerGroup,
    policy: PolicyRef,
    optim: PolicyRef | None,
    reference: PolicyRef | None,
    scratch: Path,
) -> HeldTraining:
    """A training state built from the store: the policy, a new engine, the optimizer
    state stored at ``optim`` (None: a fresh optimizer) and the KL reference.

    A LoRA group (``models.NAME.lora``) trains adapters on a frozen base: a whole policy
    (the run's initial or warm-started one) becomes the base of fresh adapters; a LoRA
    policy (an earlier update's) brings its adapter and names its base. Its KL reference
    is that base, the same model with the adapter switched off."""
    import torch  # noqa: PLC0415

    from drmas.generation.lora import lora_base, read_adapter  # noqa: PLC0415
    from drmas.models import load_tokenizer  # noqa: PLC0415
    from drmas.training.engines import ALONE_WAIT_S, make_engine, wait_for_all  # noqa: PLC0415
    from drmas.training.lora import BaseReference, with_lora  # noqa: PLC0415

    local = store.open(policy.artifact).download(scratch / "policy", prefix=policy.prefix)
    dtype = group.spec.dtype if group.spec is not None else "float32"
    lora = group.spec.lora if group.spec is not None else None
    base = lora_base(store, policy)
    if base is not None and lora is None:
        raise PolicyError(f"{store.uri(policy.artifact)}: a LoRA policy, but models.{group.model}.lora is not set")
    whole = local if base is None else store.open(base.artifact).download(scratch / "base", prefix=base.prefix)
    # Each rank downloads at the store's pace (a 7B policy: 15 GB): the ranks meet on a group
    # with a long timeout of its own, not in the first collective, which times out after 10
    # minutes (ZeRO-3's partitioned load is one).
    wait_for_all(ALONE_WAIT_S)
    model = load_training_model(whole, group, config)
    prepare_for_training(model, config.train.gradient_checkpointing)
    record = None
    if lora is not None:
        seed = zlib.crc32(f"{config.experiment.seed}/{group.name}/lora".encode())
        model = with_lora(model, lora, seed, saved=read_adapter(local)[0] if base is not None else None)
        model.train()
        record = _base_record(store, group, base or policy)
    tokenizer = load_tokenizer(local)
    engine = make_engine(model, group, config)
    if optim is not None:
        import_stored_state(engine, store, optim, scratch / "optim")
        wait_for_all(ALONE_WAIT_S)  # each rank downloaded its shards at the store's pace
    else:  # the first update: its RNG (saved with the state) must not depend on the process's past
        torch.manual_seed(zlib.crc32(f"{config.experiment.seed}/{group.name}".encode()))
    if record is not None and config.algorithm.kl_coef:
        _check_lora_reference(reference, record)
        ref_model: torch.nn.Module | None = BaseReference(model)
    else:
        ref_model = _reference(config, store, reference, scratch, dtype, engine.device)
    rng = torch.get_rng_state()
    return HeldTraining(engine, model, tokenizer, reference, ref_model, policy, "", optim, rng, record)


def load_training_model(folder: Path, group: WorkerGroup, config: DrmasConfig) -> PreTrainedModel:
    """The policy at ``folder`` as ``group``'s engine will train it: under DeepSpeed ZeRO-3
    partitioned from the start (``drmas.models.load_model_partitioned``), so that no rank
    holds the whole model; else whole, on the host, for the engine to move."""
    from drmas.models import load_model, load_model_partitioned  # noqa: PLC0415
    from drmas.training.engines import zero3_load_config  # noqa: PLC0415

    dtype = group.spec.dtype if group.spec is not None else "float32"
    if config.train.backend == "deepspeed" and config.train.zero_stage == 3:
        return load_model_partitioned(folder, dtype, zero3_load_config(group, config))
    return load_model(folder, dtype)


def _base_record(store: Store, group: WorkerGroup, base: PolicyRef) -> dict[str, Any]:
    """What a LoRA policy says of its base (``BASE_POLICY``): where it is stored and its
    manifest (the adapter is refused on other weights), and where it came from."""
    spec = group.spec
    return {
        "artifact": base.artifact,
        "prefix": base.prefix,
        "manifest": store.fingerprint(base.artifact),
        "uri": store.uri(base.artifact, base.prefix or None),
        "source": spec.source if spec is not None else group.model,
        "revision": spec.revision if spec is not None else None,
    }


def _check_lora_reference(reference: PolicyRef | None, base: dict[str, Any]) -> None:
    """A LoRA group's KL reference is its base with the adapter switched off: a reference
    other than the base cannot be had that way, and is refused naming both."""
    if reference is None:
        raise ValueError("algorithm.kl_coef > 0 needs a reference policy (the run's initial policy)")
    if (reference.artifact, reference.prefix) != (base["artifact"], base["prefix"]):
        raise ValueError(
            f"the KL reference {reference.artifact} is not the LoRA policy's base {base['artifact']}: a LoRA "
            "group's reference is its base with the adapter switched off"
        )


def _save_adapter(model, base: dict[str, Any], folder: Path) -> None:
    """The adapter in PEFT layout (safetensors) and ``BASE_POLICY``; the adapter config's
    ``base_model_name_or_path`` is the base's store URI (a local store's is a folder that
    transformers and peft load)."""
    from drmas.generation.lora import BASE_POLICY  # noqa: PLC0415
    from drmas.training.lora import ADAPTER  # noqa: PLC0415

    model.peft_config[ADAPTER].base_model_name_or_path = base["uri"]
    model.save_pretrained(folder, safe_serialization=True)
    (folder / BASE_POLICY).write_text(json.dumps(base, sort_keys=True, indent=1))


def prepare_for_training(model: PreTrainedModel, checkpointing: bool) -> None:
    """Training mode and, if asked, activation checkpointing of every decoder layer.

    Non-reentrant checkpointing: the reentrant kind does not support ``torch.autograd.grad``
    (the per-agent diagnostic). The KV cache, which cannot be checkpointed, is off in
    every training forward (``token_logprobs``), not in the saved config.

    transformers 5.24 names it ``activation_checkpointing_enable`` (and keeps the old name
    as a deprecated alias); 5.12.1, which the GPU image installs (SGLang 0.5.21 pins it),
    has only ``gradient_checkpointing_enable``: the name is looked up, not assumed."""
    model.train()
    if not checkpointing:
        return
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _worker_group_rows(store: Store, batch_path: str, wg: str) -> list[dict[str, Any]]:
    table = store.open(batch_path).read_table("batch.parquet", BATCH_SCHEMA)
    mine = table.filter(pc.equal(table["wg"], wg))
    if mine.num_rows == 0:
        raise ValueError(f"{store.uri(batch_path)}: no rows for worker group {wg!r}")
    columns = ["agent", "prompt_ids", "response_ids", "rollout_logprobs", "advantage"]
    return mine.select(columns).to_pylist()


def _reference(
    config: DrmasConfig, store: Store, reference: PolicyRef | None, scratch: Path, dtype: str, device: torch.device
):
    """The frozen reference policy for the KL term, on the training engine's device (its
    inputs are the update's batches), or None when there is no KL term."""
    if config.algorithm.kl_coef == 0.0:
        return None
    if reference is None:
        raise ValueError("algorithm.kl_coef > 0 needs a reference policy (the run's initial policy)")
    from drmas.models import load_model  # noqa: PLC0415

    local = store.open(reference.artifact).download(scratch / "reference", prefix=reference.prefix)
    model: torch.nn.Module = load_model(local, dtype)
    model.to(device)
    model.requires_grad_(False)
    return model


def import_stored_state(engine: TrainEngine, store: Store, optim: PolicyRef, scratch: Path) -> None:
    """Give ``engine`` the optimizer state stored at ``optim``; a state that cannot be read,
    or that belongs to another model, is refused with its URI (CorruptArtifact); one that
    was never stored (held by a pool that is gone) raises OptimizerStateLost."""
    from drmas.training.shards import is_shard_file, load_optimizer_state  # noqa: PLC0415

    where = store.uri(optim.artifact, optim.prefix or None)
    try:
        artifact = store.open(optim.artifact)
    except ArtifactNotFound:
        raise OptimizerStateLost(
            f"{where}: the optimizer state this update continues from is not stored (checkpoint.every "
            f"stores it every N-th iteration; the pool that held it in between is gone); {_last_stored(store, optim)}"
        ) from None
    try:
        # Per-rank shards are downloaded when a range this rank holds first needs one.
        local = artifact.download(scratch, prefix=optim.prefix, only=lambda name: not is_shard_file(name))
        engine.import_state(load_optimizer_state(local, lambda name: artifact.download_file(name, local, optim.prefix)))
    except (ValueError, KeyError, RuntimeError) as error:
        raise CorruptArtifact(f"{where}: cannot resume the optimizer from it: {error}") from None


def _last_stored(store: Store, optim: PolicyRef) -> str:
    """Where a run that lost ``optim`` (``{run}/iter-{i}/optim/{wg}``) can continue from:
    after the latest stored optimizer state of the same worker group before it."""
    lost = split_iteration_path(optim.artifact)
    if lost is None:
        return f"{optim.artifact} is not an iteration's optimizer state"
    run, iteration, what = lost
    stored = sorted(
        found[1]
        for found in map(split_iteration_path, store.list(run))
        if found is not None and found[2].split("@")[0] == what.split("@")[0] and found[1] < iteration
    )
    if not stored:
        return "no earlier state is stored: the run starts again from its start"
    return (
        f"the last stored is iteration {stored[-1]}'s: continue from iteration {stored[-1] + 1} "
        f"(--start-iteration {stored[-1] + 1})"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m drmas.stages.update`` (or under ``torchrun``): one worker group's update.

    Under torchrun every rank runs this; ranks share the work and rank 0 writes.
    """
    import argparse  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from drmas.training.engines import rank_and_world  # noqa: PLC0415

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
    if rank_and_world()[0] == 0:
        print(json.dumps({"artifact": result.artifact, "metrics": result.metrics}, sort_keys=True))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
