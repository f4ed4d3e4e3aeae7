"""A worker of the pool: one worker group on one slot, its engine and its training shard.

``WorkerGroupRuntime`` runs inside a Ray actor (one per worker group and slot) or
in-process. For the rollout it turns agent prompts (text) into chat-formatted token ids
with ITS OWN tokenizer, its model's chat-template variables and system message, so a
heterogeneous team (different models, different tokenizers, Qwen3 with thinking off beside
a model without that switch) just works; an over-long prompt is cut as
``rollout.truncation`` says. It reloads weights only when asked for a policy version other
than the one it holds: the store is the source of truth, the actor a cache.

For the update it is one rank of its worker group's process group (``join_group``): the
pool runs the update's per-rank function in it (``run``), and that function hands the new
weights to the engine in memory (``adopt``), so the next rollout generates from them
without reading the store.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from drmas.config import PolicyError, SamplingConfig, TemplateVariables
from drmas.generation.engines import make_engine, request_seeds
from drmas.generation.lora import ADAPTER_CONFIG, lora_base, merge_lora, read_adapter
from drmas.generation.named_pool import free_pool
from drmas.infra.cpus import cpu_threads
from drmas.infra.layout import PolicyRef
from drmas.infra.memory import return_freed_memory
from drmas.infra.progress import relay_progress, relayed
from drmas.infra.store import Artifact, Store, StoreLocation

if TYPE_CHECKING:
    import torch

__all__ = [
    "GenerationResult",
    "PolicyMismatch",
    "PolicyNotLoaded",
    "WorkerGroupRuntime",
    "slot_threads",
    "stop_token_ids",
    "truncate_prompt",
]


def slot_threads(slot_resource: str | None) -> int:
    """The torch threads of a pool actor told no count: its container's CPUs (on a cluster
    its pod's limit, which the driver's pod cannot know; not the ``OMP_NUM_THREADS=1`` Ray
    sets in an actor that asks for no CPU), divided among the pool slots its node
    advertises (``slot_resource``): a pod with all of a node's 8 GPUs runs 8 slots' workers,
    whose offloaded optimizer steps would otherwise each take every core."""
    cpus = cpu_threads(environment=False)
    if slot_resource is None:
        return cpus
    import ray  # noqa: PLC0415 - only inside an actor

    node = ray.get_runtime_context().get_node_id()
    slots = next((n["Resources"].get(slot_resource, 1.0) for n in ray.nodes() if n["NodeID"] == node), 1.0)
    return max(1, cpus // max(1, round(slots)))


@dataclass(frozen=True)
class GenerationResult:
    """One generated response with the ids it was generated from."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class PolicyNotLoaded(RuntimeError):
    """Asked to generate or resume before any policy was loaded: in a pool, the sign of an
    actor that Ray restarted (it starts empty), which the pool answers by reloading."""


class PolicyMismatch(RuntimeError):
    """Asked to generate from a policy other than the one held: another driver of the pool
    changed it in between (the pool's lease and the pipelines' pool edges prevent that), so
    the caller's stage would mix two policies. Refused, never answered."""


class WorkerGroupRuntime:
    """Tokenise, generate, detokenise for one worker group; load, offload, resume."""

    def __init__(
        self,
        name: str,
        store: StoreLocation,
        engine: str = "hf",
        dtype: str = "float32",
        max_prompt_tokens: int = 1024,
        cache_dir: str | None = None,
        cache_scope: str = "",
        slot_resource: str | None = None,
        threads: int | None = None,
        truncation: Literal["middle", "left"] = "middle",
        chat_template_kwargs: TemplateVariables | None = None,
        system_prompt: str | None = None,
        relay: bool = False,
    ) -> None:
        """``relay``: this runtime is a pool's actor, whose output nobody watches: the
        progress of its work is kept for ``progress()`` (the pool shows it on its console).
        ``cache_scope``: a folder of the policy cache that only this pool's workers use (its
        name), so that pruning it never removes what another pool's engine reads.
        ``slot_resource``: the Ray resource of a pool slot, by which a pool actor told no
        thread count shares its node's CPUs (``slot_threads``)."""
        if relay:
            relay_progress()
        if threads or relay:
            import torch  # noqa: PLC0415 - only where a runtime is made: the rollout driver never needs it

            torch.set_num_threads(threads or slot_threads(slot_resource if relay else None))
        self.name = name
        self.store_location = store
        self.engine = make_engine(engine, dtype)
        self.dtype = dtype
        self.max_prompt_tokens = max_prompt_tokens
        self.truncation = truncation
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.system_prompt = system_prompt
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "drmas" / "policies") / cache_scope
        self.version: str | None = None
        self.policy: PolicyRef | None = None
        """The stored policy whose weights the engine holds (loaded, or adopted in memory)."""
        self.tokenizer = None
        self.stop_ids: list[int] = []
        self.rank, self.world = 0, 1
        self.training: Any = None
        self.last_used = time.monotonic()
        self.busy = False

    @contextmanager
    def _in_use(self) -> Iterator[None]:
        """Marks a call: an idle pool frees itself (``watch_idle``), a busy one never."""
        self.busy = True
        try:
            yield
        finally:
            self.busy, self.last_used = False, time.monotonic()

    def watch_idle(self, timeout_s: float, experiment: str, run_id: str) -> None:
        """Free the run's whole pool (every worker, the placement group) once this worker
        has had no call for ``timeout_s``: a pool that outlives its stages must not outlive
        its run forever (a failed pipeline, a killed runner). Every worker of a run is
        called in every iteration, so the first to notice speaks for all."""

        def watch() -> None:
            while True:
                time.sleep(min(timeout_s / 4, 30.0))
                if not self.busy and time.monotonic() - self.last_used > timeout_s:
                    import ray  # noqa: PLC0415 - only inside an actor

                    free_pool(experiment, run_id, keep=ray.get_runtime_context().current_actor)
                    return

        threading.Thread(target=watch, name="drmas-idle-watch", daemon=True).start()

    # -- policy versions -----------------------------------------------------------------

    def load_policy(self, policy: PolicyRef) -> bool:
        """Make ``policy`` the held version; returns False when it already was (no reload)."""
        with self._in_use():
            return self._load_policy(policy)

    def _load_policy(self, policy: PolicyRef) -> bool:
        artifact, version = self._version_of(policy)
        if version == self.version:
            self.policy = policy  # the same weights, stored under another name
            return False
        local = self._download(artifact, policy.prefix, version)
        base = lora_base(Store.from_config(self.store_location), policy)
        from drmas.models import load_tokenizer  # noqa: PLC0415 - transformers: in the actor only

        try:
            self.tokenizer = load_tokenizer(local)
            self.engine.load(local if base is None else self._merged(local, base))
        except PolicyError as error:  # it names the local cache: say where the policy is stored
            raise PolicyError(f"{artifact.uri}: {str(error).removeprefix(f'{local}: ')}") from None
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.version, self.policy = version, policy
        self._prune_cache(local, base)
        return True

    def _prune_cache(self, local: Path, base: PolicyRef | None) -> None:
        """Remove this worker group's other cached versions: the cache would otherwise keep
        every version ever loaded on the node (tens of GB each at the recipes' sizes) until
        the pod's disk fills. Kept: the version just loaded (SGLang's engine reloads from its
        folder after releasing memory), its merged weights and its LoRA base. The group's
        workers on a node load versions together (the pool waits for all of them), so none
        still reads a version pruned here; another worker's download in progress (a
        ``.tmp-`` folder) is left alone."""
        keep = {local.name, f"{local.name}-merged"}
        if base is not None:
            keep.add(f"{self.name}-{self._version_of(base)[1]}")
        version_folder = re.compile(rf"{re.escape(self.name)}-[0-9a-f]{{16}}(-merged)?")
        for folder in self.cache_dir.iterdir():
            if version_folder.fullmatch(folder.name) and folder.name not in keep:
                shutil.rmtree(folder, ignore_errors=True)

    def _download(self, artifact: Artifact, prefix: str, version: str) -> Path:
        """The policy's files in the local cache, downloaded once per version."""
        local = self.cache_dir / f"{self.name}-{version}"
        if not local.is_dir():  # renamed into place whole: a folder there is complete
            staging = local.with_name(local.name + f".tmp-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            artifact.download(staging, prefix=prefix)
            staging.rename(local)
        return local

    def _merged(self, adapter_dir: Path, base: PolicyRef) -> Path:
        """A LoRA policy's merged weights as a whole policy folder in the local cache (once
        per version), which either engine loads, and reloads after releasing its memory,
        like any policy (``drmas.generation.lora``)."""
        from drmas.models import load_model  # noqa: PLC0415

        merged = adapter_dir.with_name(adapter_dir.name + "-merged")
        if not merged.is_dir():
            base_artifact, base_version = self._version_of(base)
            model = load_model(self._download(base_artifact, base.prefix, base_version), self.dtype)
            adapter, config = read_adapter(adapter_dir)
            model.load_state_dict(merge_lora(model.state_dict(), adapter, config))
            staging = merged.with_name(merged.name + f".tmp-{os.getpid()}")
            shutil.rmtree(staging, ignore_errors=True)
            model.save_pretrained(staging, safe_serialization=True)
            staging.rename(merged)
        return merged

    def adopt(self, weights: dict[str, torch.Tensor], policy: PolicyRef) -> None:
        """Generate from ``weights`` from now on: the policy that an update just stored at
        ``policy`` (whose version it becomes), handed over in memory. A worker that holds
        no policy yet (an update rerun alone) keeps none: it reads the store when asked."""
        if self.tokenizer is None:
            return
        _, version = self._version_of(policy)
        self.engine.set_weights(weights)
        self.version, self.policy = version, policy

    def _version_of(self, policy: PolicyRef) -> tuple[Artifact, str]:
        """The stored policy's artifact and version (a digest of its files' digests)."""
        artifact = Store.from_config(self.store_location).open(policy.artifact)
        prefix = policy.prefix.rstrip("/") + "/" if policy.prefix else ""
        entries = sorted((n, e.sha256) for n, e in artifact.files.items() if n.startswith(prefix))
        if not any(name in (f"{prefix}config.json", f"{prefix}{ADAPTER_CONFIG}") for name, _ in entries):
            raise FileNotFoundError(f"{artifact.uri} has no policy (config.json or {ADAPTER_CONFIG}) under '{prefix}'")
        return artifact, hashlib.sha256(repr(entries).encode()).hexdigest()[:16]

    # -- the worker group's process group (data-parallel update) -------------------------

    def rendezvous(self) -> dict[str, Any]:
        """Where this worker is (node and address), a free port on it and its temporary
        folder (``RAY_TMPDIR``, else the system's; made if missing): rank 0's answer is where
        its group's process group meets, by TCP or, on one node, by a file in that folder.
        The folder is the worker's own: a driver's RAY_TMPDIR may not exist where the workers
        run, and a rendezvous file in a missing folder waited for its whole timeout."""
        import ray  # noqa: PLC0415 - only inside an actor

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        folder = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        node = ray.get_runtime_context().get_node_id()
        return {"node": node, "ip": ray.util.get_node_ip_address(), "port": port, "folder": str(folder)}

    def join_group(self, init_method: str, rank: int, world: int, timeout_s: float) -> None:
        """Become rank ``rank`` of a ``world``-process group (gloo on CPU; gloo for CPU
        tensors and nccl for GPU tensors on a GPU), leaving any group joined before."""
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        self.leave_group()
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed checks that a launcher set it; Ray gives one GPU
        self.rank, self.world = rank, world

    def leave_group(self) -> None:
        """Leave the process group; the training state kept for it goes too (its engine
        is bound to the group)."""
        import torch.distributed as dist  # noqa: PLC0415

        self.training = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.rank, self.world = 0, 1

    def keep_training(self, state: Any) -> None:
        """Keep an update's training state (``drmas.stages.update.HeldTraining``, offloaded)
        for the group's next update."""
        self.training = state

    def take_training(self) -> Any:
        """The kept training state (None if there is none); the worker no longer holds it."""
        state, self.training = self.training, None
        return state

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self, *args)``: a stage's per-rank work (the update) in this worker, with
        its engine and its process group at hand; the memory it used is returned after."""
        try:
            with self._in_use():
                return fn(self, *args)
        finally:
            gc.collect()
            _empty_device_cache()
            return_freed_memory()  # the host's: glibc would keep the update's peak for the run

    # -- lifecycle ---------------------------------------------------------------------

    def offload(self) -> None:
        self.engine.offload()

    def resume(self) -> None:
        if self.version is None:
            raise PolicyNotLoaded(f"worker group {self.name!r}: resume() before load_policy()")
        self.engine.resume()

    def progress(self) -> list[dict[str, Any]]:
        """How far the work running in this worker is (``drmas.infra.progress.relayed``):
        the pool asks in a concurrency group of its own while ``run`` trains. Not a call
        that keeps the pool alive (``watch_idle``)."""
        return relayed()

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "version": self.version,
            "policy": self.policy.artifact if self.policy is not None else None,
            "resident": self.engine.resident,
            "pid": os.getpid(),
            "rank": self.rank,
            "world": self.world,
            "training": self.training.policy.artifact if self.training is not None else None,
        }

    # -- generation --------------------------------------------------------------------

    def generate(
        self,
        messages: list[str],
        sampling: SamplingConfig,
        seed: int,
        first: int = 0,
        policy: PolicyRef | None = None,
    ) -> list[GenerationResult]:
        """One batched generate: every message is one user turn, chat-formatted; the
        messages are requests ``first..`` of a call seeded ``seed`` (one seed per request).
        ``policy``: the policy the caller expects to generate from; another is refused."""
        if self.tokenizer is None:
            raise PolicyNotLoaded(f"worker group {self.name!r}: generate() before load_policy()")
        if policy is not None and policy != self.policy:
            held = self.policy.artifact if self.policy is not None else "none"
            raise PolicyMismatch(
                f"worker group {self.name!r}: asked to generate from {policy.artifact}, but it holds {held}: "
                "another driver used the run's pool in between; this stage stopped rather than mix two policies"
            )
        prompts = [self._encode(message) for message in messages]
        with self._in_use():
            generations = self.engine.generate(
                prompts, sampling, self.stop_ids, request_seeds(seed, first, len(prompts))
            )
        return_freed_memory()  # a large call's KV room, which glibc would keep
        return [
            GenerationResult(
                prompt_ids=prompt,
                response_ids=g.response_ids,
                logprobs=g.logprobs,
                text=self.tokenizer.decode(g.response_ids, skip_special_tokens=True),
                finish_reason=g.finish_reason,
            )
            for prompt, g in zip(prompts, generations, strict=True)
        ]

    def _encode(self, message: str) -> list[int]:
        from drmas.models import chat_prompt  # noqa: PLC0415 - transformers: in the actor only

        text = chat_prompt(self.tokenizer, message, self.system_prompt, self.chat_template_kwargs)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return truncate_prompt(ids, self.max_prompt_tokens, self.truncation)


def truncate_prompt(ids: list[int], max_tokens: int, truncation: Literal["middle", "left"]) -> list[int]:
    """At most ``max_tokens`` of ``ids``, cut as the reference's ``data.truncation`` cuts:
    'middle' keeps the first half and the last (the task statement at the start and the
    agent's role and generation prompt at the end both survive), 'left' keeps the end (the
    latest turns of a long multi-turn context, and the generation prompt)."""
    if len(ids) <= max_tokens:
        return ids
    if truncation == "left":
        return ids[len(ids) - max_tokens :]
    if truncation == "middle":
        half = max_tokens // 2
        return ids[:half] + ids[len(ids) - (max_tokens - half) :]
    raise ValueError(f"unknown truncation {truncation!r}; expected 'middle' or 'left'")


def _empty_device_cache() -> None:
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stop_token_ids(tokenizer) -> list[int]:
    """End-of-turn and end-of-text tokens: generation stops at any of them."""
    candidates = [tokenizer.eos_token_id]
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            candidates.append(token_id)
    return sorted({c for c in candidates if c is not None})
