"""The memory plan of a run: what one pool slot (one accelerator and its share of the
host) holds in each phase, and whether that fits (``drmas plan CONFIG``;
docs/architecture.md §7).

Every worker group runs on all ``ray.pool_size`` slots, time-shared. On a slot it has one
worker with its rollout engine and its training shard, and the two never hold device memory
at the same time: engines release theirs before an update, and the training state is
offloaded to the host after it. So a slot's device has three peaks:

- **rollout**: the ``ray.max_resident`` largest engines resident at once. SGLang takes
  ``mem_fraction_static`` of the device memory free when it starts for its weights and KV
  cache (the KV cache is what the weights leave of that share);
- **update** (one worker group at a time): its training state by ZeRO stage and offload,
  DeepSpeed's resident buffers, the activations of one micro-batch, and its logits with
  their gradients;
- **hand-over**, right after an update: the training state still resident, the engine's
  weights mapped back and one bucket of the push.

And its host share has one peak per phase: every group's training state kept offloaded
between updates, the engines' weight backups, the process baselines and Ray's /dev/shm
(rollout); the training group's offloaded optimizer, a ZeRO-3 hand-over's host copies and
an optimizer save, each rank its own shard (update); the model loaded on the host (whole, or under ZeRO-3 one
tensor's partition at a time), the optimizer state read back (cold update).

Both count the CUDA contexts of the processes on the slot (every group's worker and, with
SGLang, its engine's scheduler). The numbers are upper bounds for the configured lengths:
a micro-batch is sized for rows of ``rollout.max_prompt_tokens`` + ``max_new_tokens``
tokens, as one long row would make it. Pure: reads the config and, for a model given by
path or hub id, its ``config.json`` (a local folder, the local Hugging Face cache, or the
built-in table below); never the network. tests/test_plan_measured.py holds the host
figures to peaks measured on a 20M-parameter model.

Sources of the formulas (and where they are adapted) are on each function; the units are
bytes, printed in GB (10^9 bytes).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from drmas.config import DrmasConfig, ModelSpec, WorkerGroup
from drmas.generation.engines.sglang import MEM_FRACTION_STATIC, PUSH_BUCKET_BYTES

__all__ = [
    "DEEPSPEED_REDUCE_BUCKET",
    "RAY_LOG_BYTES",
    "STORE_CHUNK_BYTES",
    "KNOWN_ARCHITECTURES",
    "Architecture",
    "GroupPlan",
    "MemoryPlan",
    "PlanError",
    "PodSize",
    "architecture_of",
    "parse_size",
    "plan_memory",
]

GB = 10**9
"""The plan's unit. An "80 GB" H100 or A100 holds 80 GiB = 85.9 GB, part of which the
driver keeps: planning against 80 GB leaves that margin."""
CUDA_CONTEXT_BYTES = GB
"""An allowance per process that uses the device: the CUDA context with its kernels, the
caching allocator's slack and a worker's NCCL communicator buffers (the GPU review of
2026-12-03, §2, estimates about 2 GB per DeepSpeed actor with its buckets, which
``deepspeed_buffers`` counts apart); not measured here."""
HOST_PROCESS_BYTES = 2 * GB
"""An allowance per process on the slot for its host memory beyond the tensors counted: the
Python interpreter with torch, transformers, DeepSpeed and Ray loaded (and for SGLang its
scheduler with its tokenizer); not measured here."""
SHM_ALLOWANCE_BYTES = 2 * GB
"""Ray's object store in /dev/shm (a memory-backed volume on KubeRay, counted in the pod's
memory): the batches of rows, their results and the metrics that stages pass through it.
An allowance per slot; a ZeRO-3 hand-over adds its host copies (``handover_host``)."""
LOGIT_FP32_COPIES = 4
"""fp32 [tokens, vocab] tensors alive at the peak of ``drmas.training.batching.token_logprobs``
in an update: the temperature-scaled logits, their log-softmax, its exp and the entropy
product. The backward adds the gradient of one of them at a time (``_logit_bytes``)."""
REFERENCE_LOGIT_FP32_COPIES = 2
"""The frozen reference model's scaled logits and log-softmax (``algorithm.kl_coef`` > 0),
computed while the policy's are held."""
DEEPSPEED_REDUCE_BUCKET = 500_000_000
"""Elements of DeepSpeed's gradient reduction bucket (``reduce_bucket_size``, DeepSpeed
0.19.8 runtime/zero/config.py:113; drmas leaves it at its default). ZeRO-1/2 allocate it
once per micro-batch's backward (stage_1_and_2.py:3260-3270, ``contiguous_gradients`` on by
default, config.py:102; one buffer, ``overlap_comm`` being off below ZeRO-3,
config.py:384-386), ZeRO-3 once (stage3.py:780-784)."""
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000
"""The most parameters ZeRO-3 keeps gathered whole at once (``stage3_max_live_parameters``,
config.py:245)."""
RAY_LOG_BYTES = 10 * GB
"""Disk for Ray's logs in a worker pod (/tmp/ray): an allowance, not measured."""
STORE_CHUNK_BYTES = 8 * 2**20
"""The store moves a file to and from local disk in chunks of this size
(``drmas.infra.store.CHUNK_BYTES``; tests/test_plan.py holds the two equal)."""
SAVE_UPLOAD_CHUNKS = 3
"""Chunks of host memory an optimizer save holds for its upload: each rank writes its shard
to local disk one piece at a time (``drmas.training.shards.write_shard``) and streams the
file up in chunks, hashed as they go. The 20M-parameter runs of
tests/test_plan_measured.py measure a save at 17.3 MB on every ZeRO stage, a few hundred
kB above two chunks (the one read and the one sent): the plan counts a third."""
RESTORE_DOWNLOAD_CHUNKS = 2
"""Chunks a restore holds while it downloads the shards that hold its ranges (the one read
and the one written to disk)."""


class PlanError(ValueError):
    """A model whose architecture the plan cannot find, or a bad size; the message names
    the model (or the text) and how to supply the numbers."""


@dataclass(frozen=True)
class Architecture:
    """The numbers of a decoder-only transformer (Llama/Qwen family: RMSNorm, grouped-query
    attention, gated SiLU MLP) that its memory depends on, as its ``config.json`` names them."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2 and Qwen2.5)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head (Qwen3)."""

    @property
    def params(self) -> int:
        """Parameter count: embeddings (twice when the LM head is not tied to them), per
        layer the q/k/v/o projections, the three MLP matrices and two norms, a final norm."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attention += 2 * self.head_dim if self.qk_norm else 0
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * layer + h

    @property
    def largest_param(self) -> int:
        """Elements of the largest parameter: the embedding (and an untied LM head of the same
        size) in these models, else an MLP or attention projection."""
        q = self.num_attention_heads * self.head_dim
        return max(self.vocab_size, self.intermediate_size, q) * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache of one token: a key and a value per layer and KV head."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def layer_activation_bytes(self, dtype_bytes: int) -> int:
        """Bytes one decoder layer keeps for its backward, per token.

        Megatron's count for a GPT layer (Korthikanti et al. 2022, "Reducing Activation
        Recomputation in Large Transformer Models", eq. 1: ``sbh(34 + 5as/h)``), adapted:
        no dropout (its masks and outputs go), FlashAttention/SDPA (no ``as^2`` score
        matrices: the ``5as/h`` term goes), grouped-query attention (k and v are
        ``kv_heads * head_dim`` wide), a gated MLP (gate, up, SiLU(gate) and their product,
        each ``intermediate`` wide, instead of GeLU's in and out at 4h), and transformers'
        RMSNorm, which keeps its input in fp32 and its normalised value before the weight.
        With b bytes per element:
            norms        2 x (4h + b·h + b·h + 4)      input in fp32, normalised, output, rsqrt
            attention    b·(2·q + 2·kv) + 4·heads      q, k, v (after RoPE), output, logsumexp
            MLP          b·4·intermediate              gate, up, SiLU(gate), product
            q/k norms    (4 + b)·(q + kv) + 4·(heads + kv_heads)   Qwen3: each head's norm
        With Megatron's fused LayerNorm (input and output only, at b = 2 bytes), multi-head
        attention and a 4h GeLU MLP, the count is its 34·sbh less the two dropout masks.
        tests/test_plan.py checks it against the tensors a transformers layer saves."""
        h, b = self.hidden_size, dtype_bytes
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        q, kv = heads * self.head_dim, kv_heads * self.head_dim
        norms = 2 * (4 * h + 2 * b * h + 4)
        attention = b * (2 * q + 2 * kv) + 4 * heads
        qk_norms = (4 + b) * (q + kv) + 4 * (heads + kv_heads) if self.qk_norm else 0
        return norms + attention + 4 * b * self.intermediate_size + qk_norms

    def activation_bytes(self, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
        """Activations of one micro-batch of ``tokens`` tokens at the peak of its backward.

        Without checkpointing every layer keeps ``layer_activation_bytes``. With it
        (transformers' gradient checkpointing, one checkpoint per decoder layer) each layer
        keeps only its input (b·h per token) and the backward recomputes one layer at a
        time: L·b·h + one layer. Both add the final norm before the LM head."""
        h, layers, layer = self.hidden_size, self.num_hidden_layers, self.layer_activation_bytes(dtype_bytes)
        final_norm = 4 * h + 2 * dtype_bytes * h + 4
        kept = layers * dtype_bytes * h + layer if checkpointing else layers * layer
        return tokens * (kept + final_norm)

    @classmethod
    def from_hf_config(cls, values: dict[str, Any], where: str) -> Architecture:
        """From a Hugging Face ``config.json``; a missing number is a PlanError naming ``where``."""
        needed = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [key for key in needed if not isinstance(values.get(key), int)]
        if missing:
            raise PlanError(f"{where} has no integer {', '.join(missing)}: not a decoder config the plan can size")
        heads = values["num_attention_heads"]
        model_type = str(values.get("model_type", ""))
        return cls(
            hidden_size=values["hidden_size"],
            num_hidden_layers=values["num_hidden_layers"],
            intermediate_size=values["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=values.get("num_key_value_heads") or heads,
            vocab_size=values["vocab_size"],
            tie_word_embeddings=bool(values.get("tie_word_embeddings", True)),  # transformers' default
            head_dim=values.get("head_dim") or values["hidden_size"] // heads,
            qkv_bias=bool(values.get("attention_bias", model_type == "qwen2")),  # Qwen2 has them, unnamed
            qk_norm=model_type.startswith("qwen3"),
        )


QWEN3_4B = Architecture(2560, 36, 9728, 32, 8, 151936, True, 128, qk_norm=True)
"""Qwen/Qwen3-4B's config.json: 4.02B parameters (published: 4.0B, 3.6B non-embedding)."""
QWEN25_7B = Architecture(3584, 28, 18944, 28, 4, 152064, False, 128, qkv_bias=True)
"""Qwen/Qwen2.5-7B's config.json (Qwen2-7B's architecture): 7.62B (published: 7.61B)."""
QWEN25_3B = Architecture(2048, 36, 11008, 16, 2, 151936, True, 128, qkv_bias=True)
"""Qwen/Qwen2.5-3B's config.json: 3.09B (published: 3.09B, 2.77B non-embedding)."""
LLAMA32_3B = Architecture(3072, 28, 8192, 24, 8, 128256, True, 128)
"""meta-llama/Llama-3.2-3B's config.json: 3.21B (published: 3.21B)."""

KNOWN_ARCHITECTURES: dict[str, Architecture] = {
    "Qwen/Qwen3-4B": QWEN3_4B,
    "Qwen/Qwen3-4B-Base": QWEN3_4B,
    "Qwen/Qwen2.5-7B": QWEN25_7B,
    "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B,
    "Qwen/Qwen2.5-3B": QWEN25_3B,
    "Qwen/Qwen2.5-3B-Instruct": QWEN25_3B,
    "meta-llama/Llama-3.2-3B": LLAMA32_3B,
    "meta-llama/Llama-3.2-3B-Instruct": LLAMA32_3B,
}
"""The models that the recipes and the reference's README name, for machines without
their config.json (CI has no hub access); docs/architecture.md §7 cites where the values
were checked. A post-trained variant shares its base model's architecture."""


def architecture_of(model: str, spec: ModelSpec | None) -> tuple[Architecture, str]:
    """A worker group's architecture and where its numbers came from: the spec of a scratch
    model, a local folder's config.json, the local Hugging Face cache, or the table above."""
    source = spec.source if spec is not None else model
    revision = spec.revision if spec is not None else None
    if source == "scratch" and spec is not None:
        return _scratch_architecture(spec), "scratch spec"
    if source.startswith(("/", "./", "../", "~")):
        path = Path(source).expanduser() / "config.json"
        return _read_hf_config(path), str(path)
    cached = _cached_config(source, revision)
    if cached is not None:
        return _read_hf_config(cached), str(cached)
    if source in KNOWN_ARCHITECTURES:
        return KNOWN_ARCHITECTURES[source], "built-in table"
    at = f" at revision {revision!r}" if revision else ""
    fetch = f"hf download {source} config.json" + (f" --revision {revision}" if revision else "")
    raise PlanError(
        f"cannot size model {source!r}{at}: it is not a local folder, its config.json is not in the local Hugging "
        f"Face cache, and it is not one of drmas's known architectures ({', '.join(sorted(KNOWN_ARCHITECTURES))}); "
        f"fetch its config once ({fetch}) or point the model's source at a local folder holding its config.json"
    )


def _scratch_architecture(spec: ModelSpec) -> Architecture:
    """A scratch model as ``drmas.models`` builds it: tied embeddings, head_dim = hidden /
    heads, Qwen3's q/k norms for the qwen3 architecture."""
    return Architecture(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=True,
        head_dim=spec.hidden_size // spec.num_heads,
        qk_norm=spec.architecture == "qwen3",
    )


def _cached_config(repo_id: str, revision: str | None) -> Path | None:
    """The hub model's config.json at ``revision`` (a branch, tag or commit; unset: main), the
    one its weights load from, if the local Hugging Face cache holds it (no network)."""
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - only for hub ids

    try:
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError:  # not a valid repo id: the caller says what it could not size
        return None
    return Path(found) if isinstance(found, str) else None


def _read_hf_config(path: Path) -> Architecture:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise PlanError(f"cannot read the model config {path}: {error}") from None
    if not isinstance(values, dict):
        raise PlanError(f"{path} is not a JSON object")
    return Architecture.from_hf_config(values.get("text_config", values), str(path))


@dataclass(frozen=True)
class GroupPlan:
    """One worker group's memory on one slot, by phase; bytes."""

    name: str
    model: str
    source: str
    """Where the architecture's numbers came from."""
    params: int
    dtype_bytes: int
    largest_param: int
    """Elements of the model's largest parameter (the embedding): what one step of a
    streamed optimizer save or restore holds, and DeepSpeed's per-parameter buffers."""
    sequence_tokens: int
    """The longest row: rollout.max_prompt_tokens + the group's largest max_new_tokens."""
    micro_batch_tokens: int
    engine_share: int | None
    """SGLang's static share (weights + KV cache), of the device memory free when the engine
    starts; None for the HF engine (transformers: weights only, its KV cache grows per call)
    or an unknown device."""
    engine_weights: int
    kv_cache: int | None
    kv_tokens: int | None
    train_params: int
    train_grads: int
    optimizer: int
    """Optimizer state on the device (fp32 master weights and Adam's moments); 0 when
    offloaded."""
    optimizer_host: int
    """Optimizer state offloaded to host memory, per slot."""
    moments: int
    """Adam's two moments per slot, part of ``optimizer`` or ``optimizer_host``: what a
    restore creates afresh before it fills them."""
    reference_model: int
    deepspeed_buffers: int
    """DeepSpeed's buffers on the device during and after an update, besides the training
    state (``_deepspeed_buffers``)."""
    reduce_bucket: int
    """The gradient reduction bucket, part of ``deepspeed_buffers``: a GPU allocates it
    whole; a model smaller than it fills (and a CPU run touches) only its share."""
    activations: int
    """At the configured ``train.gradient_checkpointing``."""
    activations_checkpointed: int
    activations_full: int
    logits: int
    handover_device: int
    """What the push of the new weights to the engine adds on the device while the training
    state is still there: the engine's weights mapped back and one bucket in flight."""
    contexts: int
    """CUDA contexts of every process on the slot (they stay while a group trains)."""
    offload_buffers_host: int
    """ZeRO-1/2 with optimizer offload: DeepSpeed's pinned host buffers beside the offloaded
    state (a bf16 copy of the rank's weight partition and one parameter's gradient)."""
    engine_host: int
    """The engine's weights in host memory: SGLang's backup of a released engine
    (``enable_weights_cpu_backup``), the HF engine's model moved to the host while released."""
    load_host: int
    """A cold update (a new worker, a restart, another policy) loads the whole model on the
    host on every rank before the engine moves it to the device (``_start_training``).
    ZeRO-3 loads it partitioned from the start (``load_training_model``): its partitions
    are the device's weights, and the host holds the rows of one tensor at a time read from
    the file, bounded by the largest tensor (a CPU run also makes each module's parameters
    whole there for a moment under ``zero.Init``). With a KL term the reference model is
    still loaded whole (``_reference``)."""
    handover_host: int
    """ZeRO-3: the whole weights gathered to host copies on every rank (``full_weights``),
    which the push to SGLang moves into /dev/shm."""
    save_host: int
    """An optimizer save on every rank (each its own shard, ``drmas.training.shards``): one
    piece at a time copied to the host (the rank's range of one tensor: at most the largest
    parameter's fp32 state, its partition of it under ZeRO-3) and the upload's chunks
    (``SAVE_UPLOAD_CHUNKS``)."""
    restore_host: int
    """A restore on every rank: the range of one tensor read from its shard file (at most
    the largest parameter's fp32 state) and the download's chunks
    (``RESTORE_DOWNLOAD_CHUNKS``); the moments it fills are counted where they live."""
    engine_disk: int
    """The engine's policy cache on the node's disk, which the group's workers there share:
    the version it holds and the next one while it downloads (the worker prunes the rest),
    and a LoRA group's base and merged weights."""
    update_disk: int
    """An update's temporary folder on its slot: the policy downloaded (with a LoRA policy's
    base or the KL reference), the optimizer state read back (this rank's shard, or the two
    a resume at another number of ranks overlaps), and before the upload the new policy
    (rank 0) and the rank's own shard of the optimizer state."""

    @property
    def engine(self) -> int:
        """What the engine holds while resident."""
        return self.engine_share if self.engine_share is not None else self.engine_weights

    @property
    def training_resident(self) -> int:
        """The training state on the device while the group trains, with DeepSpeed's buffers
        and the contexts."""
        return (
            self.train_params
            + self.train_grads
            + self.optimizer
            + self.reference_model
            + self.deepspeed_buffers
            + self.contexts
        )

    @property
    def update_fixed(self) -> int:
        """The part of the update peak that does not grow with the micro-batch's tokens."""
        return self.training_resident

    @property
    def update_peak(self) -> int:
        return self.update_fixed + self.activations + self.logits

    @property
    def handover_peak(self) -> int:
        return self.training_resident + self.handover_device

    @property
    def held_host(self) -> int:
        """Host memory for this group's training state, which its worker keeps offloaded
        between updates (weights, gradients, optimizer state, reference model, DeepSpeed's
        pinned offload buffers)."""
        return (
            self.train_params
            + self.train_grads
            + self.optimizer
            + self.optimizer_host
            + self.reference_model
            + self.offload_buffers_host
        )

    @property
    def training_host(self) -> int:
        """What stays on the host while the group trains: the offloaded optimizer."""
        return self.optimizer_host + self.offload_buffers_host


@dataclass(frozen=True)
class PodSize:
    """What a KubeRay GPU worker pod needs (``MemoryPlan.pod``); bytes."""

    gpus: int
    memory: int
    shm: int
    disk: int

    def resources(self) -> dict[str, str]:
        """The figures as Kubernetes quantities, rounded up to whole GiB."""
        return {"memory": _gib(self.memory), "/dev/shm": _gib(self.shm), "ephemeral-storage": _gib(self.disk)}


@dataclass(frozen=True)
class MemoryPlan:
    """Per slot and phase: what each worker group holds, the peaks, and what does not fit."""

    slots: int
    zero_stage: int
    offload_optimizer: bool
    gradient_checkpointing: bool
    engine: str
    max_resident: int
    processes: int
    """Processes on each slot: every group's worker and, with SGLang, its engine's scheduler."""
    device_memory: int | None
    host_memory: int | None
    """The host memory a slot may use (``ray.host_memory_gb``); None: not checked."""
    groups: tuple[GroupPlan, ...]
    problems: tuple[str, ...] = field(default=())

    @property
    def rollout_peak(self) -> int:
        """The ``max_resident`` largest engines at once, and every process's context."""
        engines = sorted((group.engine for group in self.groups), reverse=True)[: self.max_resident]
        return sum(engines) + self.groups[0].contexts

    @property
    def update_peak(self) -> int:
        return max(max(group.update_peak, group.handover_peak) for group in self.groups)

    @property
    def shm(self) -> int:
        """/dev/shm at its peak: Ray's objects and a ZeRO-3 hand-over's host copies."""
        return SHM_ALLOWANCE_BYTES + max(group.handover_host for group in self.groups)

    @property
    def host_between_phases(self) -> int:
        """Host memory a slot holds whatever runs: every group's training state kept
        offloaded, every engine's weights on the host, the processes and Ray's /dev/shm."""
        held = sum(group.held_host + group.engine_host for group in self.groups)
        return held + self.processes * HOST_PROCESS_BYTES + SHM_ALLOWANCE_BYTES

    def host_phases(self) -> dict[str, int]:
        """Host memory per slot at each phase's peak. An update brings its group's state to
        the device, except an offloaded optimizer; at a checkpoint it streams the optimizer
        state out (``save_host``), and under ZeRO-3 it gathers the weights to host copies for
        the engine. A cold update has no state held: it loads the model on the host, builds
        the optimizer (offloaded: on the host) and streams a stored state in. Each sums the
        steps of its phase, an upper bound where the code frees one before the next."""
        base = self.host_between_phases
        phases = {"rollout": base}
        for group in self.groups:
            others = base - group.held_host
            phases[f"update {group.name}"] = others + group.training_host + group.handover_host + group.save_host
            phases[f"cold update {group.name}"] = others + group.load_host + group.training_host + group.restore_host
        return phases

    @property
    def host_peak(self) -> int:
        return max(self.host_phases().values())

    def pod(self, gpus: int) -> PodSize:
        """A KubeRay GPU worker pod of ``gpus`` slots (one pod per node, with all its GPUs, so
        that an update's collectives use the node's GPU links): every slot's host peak (the
        memory-backed /dev/shm counts in the pod's memory), every slot's /dev/shm peak, and
        on its disk every group's policy cache (shared by the node's workers), every slot's
        update folder and Ray's logs."""
        disk = sum(group.engine_disk for group in self.groups) + gpus * max(g.update_disk for g in self.groups)
        return PodSize(gpus, gpus * self.host_peak, gpus * self.shm, disk + RAY_LOG_BYTES)

    @property
    def fits(self) -> bool | None:
        """None without a device or host memory to compare with."""
        return None if self.device_memory is None and self.host_memory is None else not self.problems

    def to_dict(self, pod_gpus: int = 8) -> dict[str, Any]:
        """The plan, bytes; ``pod``: a worker pod of ``pod_gpus`` GPUs."""
        return {
            **{key: value for key, value in asdict(self).items() if key != "groups"},
            "rollout_peak": self.rollout_peak,
            "update_peak": self.update_peak,
            "host_phases": self.host_phases(),
            "host_peak": self.host_peak,
            "shm": self.shm,
            "fits": self.fits,
            "pod": asdict(self.pod(pod_gpus)),
            "groups": [
                {**asdict(group), "update_peak": group.update_peak, "handover_peak": group.handover_peak}
                for group in self.groups
            ],
        }

    def text(self, pod_gpus: int = 8) -> str:
        """The plan as a table: one column per worker group, GB; then the peaks, what a
        worker pod of ``pod_gpus`` GPUs needs, and the verdict."""
        return _render(self, pod_gpus)


def plan_memory(config: DrmasConfig, device_memory: int | None = None, host_memory: int | None = None) -> MemoryPlan:
    """The memory plan of ``config`` on its pool; ``device_memory`` and ``host_memory``
    (bytes) default to ``ray.device_memory_gb`` and ``ray.host_memory_gb``. Raises
    PlanError for a model it cannot size."""
    if device_memory is None and config.ray.device_memory_gb is not None:
        device_memory = round(config.ray.device_memory_gb * GB)
    if host_memory is None and config.ray.host_memory_gb is not None:
        host_memory = round(config.ray.host_memory_gb * GB)
    groups = config.worker_groups()
    processes = len(groups) * (2 if config.rollout.engine == "sglang" else 1)
    plans = tuple(_group_plan(config, group, device_memory, processes * CUDA_CONTEXT_BYTES) for group in groups)
    plan = MemoryPlan(
        slots=config.ray.pool_size,
        zero_stage=_zero_stage(config),
        offload_optimizer=_offloads(config),
        gradient_checkpointing=config.train.gradient_checkpointing,
        engine=config.rollout.engine,
        max_resident=min(config.ray.max_resident, len(groups)),
        processes=processes,
        device_memory=device_memory,
        host_memory=host_memory,
        groups=plans,
    )
    return replace(plan, problems=tuple(_problems(plan)))


def _zero_stage(config: DrmasConfig) -> int:
    """The torch backend replicates everything, as ZeRO-0 does."""
    return config.train.zero_stage if config.train.backend == "deepspeed" else 0


def _offloads(config: DrmasConfig) -> bool:
    return config.train.backend == "deepspeed" and config.train.offload_optimizer


def _group_plan(config: DrmasConfig, group: WorkerGroup, device_memory: int | None, contexts: int) -> GroupPlan:
    architecture, source = architecture_of(group.model, group.spec)
    dtype_bytes = 2 if group.spec is not None and group.spec.dtype == "bfloat16" else 4
    params, largest = architecture.params, architecture.largest_param
    sequence = config.rollout.max_prompt_tokens + max(
        config.agent_sampling(agent).max_new_tokens for agent in group.agents
    )
    tokens = _micro_batch_tokens(group.micro_batch_size, sequence, config.train.max_tokens_per_micro_batch)
    weights = params * dtype_bytes
    sglang = config.rollout.engine == "sglang"
    share = kv = kv_tokens = None
    if sglang and device_memory is not None:
        # SGLang sizes its static share from the memory free when it starts (0.5.21:
        # mem_cache/kv_cache_configurator.py:2177-2229): the contexts are already there.
        share = round(MEM_FRACTION_STATIC * max(device_memory - contexts, 0))
        kv = max(share - weights, 0)
        kv_tokens = kv // architecture.kv_bytes_per_token(dtype_bytes)
    lora = group.spec.lora if group.spec is not None else None
    adapters = _lora_params(architecture, lora.rank, lora.target_modules) if lora is not None else 0
    train_params, grads, optimizer, moments = _training_state(config, params, dtype_bytes, adapters)
    checkpointed = architecture.activation_bytes(tokens, dtype_bytes, checkpointing=True)
    full = architecture.activation_bytes(tokens, dtype_bytes, checkpointing=False)
    reference = config.algorithm.kl_coef > 0
    logit_copies = LOGIT_FP32_COPIES + (REFERENCE_LOGIT_FP32_COPIES if reference else 0)
    offloads, stage = _offloads(config), _zero_stage(config)
    fp32_state = largest * 4
    return GroupPlan(
        name=group.name,
        model=group.spec.source if group.spec is not None else group.model,
        source=source,
        params=params,
        dtype_bytes=dtype_bytes,
        largest_param=largest,
        sequence_tokens=sequence,
        micro_batch_tokens=tokens,
        engine_share=share,
        engine_weights=weights,
        kv_cache=kv,
        kv_tokens=kv_tokens,
        train_params=train_params,
        train_grads=grads,
        optimizer=0 if offloads else optimizer,
        optimizer_host=optimizer if offloads else 0,
        moments=moments,
        reference_model=weights if reference and lora is None else 0,  # LoRA: the base, adapter off
        deepspeed_buffers=_deepspeed_buffers(config, params, largest, dtype_bytes),
        reduce_bucket=_reduce_bucket(config, dtype_bytes),
        activations=checkpointed if config.train.gradient_checkpointing else full,
        activations_checkpointed=checkpointed,
        activations_full=full,
        logits=_logit_bytes(config, tokens, sequence, architecture.vocab_size, dtype_bytes, logit_copies),
        handover_device=weights + max(PUSH_BUCKET_BYTES, largest * dtype_bytes) if sglang else 0,
        contexts=contexts,
        offload_buffers_host=(
            _ceil_div(weights, config.ray.pool_size) + largest * dtype_bytes if offloads and stage in (1, 2) else 0
        ),
        engine_host=weights,
        load_host=largest * dtype_bytes if stage == 3 and not reference else weights,
        handover_host=weights if stage >= 3 else 0,
        engine_disk=weights * (3 if lora is not None else 2),
        update_disk=weights * (3 if reference or lora is not None else 2)
        + 3 * _state_shard(config, group, params, adapters),
        save_host=(_ceil_div(fp32_state, config.ray.pool_size) if stage == 3 else fp32_state)
        + SAVE_UPLOAD_CHUNKS * STORE_CHUNK_BYTES,
        restore_host=fp32_state + RESTORE_DOWNLOAD_CHUNKS * STORE_CHUNK_BYTES,
    )


def _state_shard(config: DrmasConfig, group: WorkerGroup, params: int, adapters: int) -> int:
    """One rank's shard of the saved optimizer state: Adam's two fp32 moments of every
    trainable parameter, and a bf16 group's fp32 master weights (``TrainEngine.state_stream``)."""
    bf16 = group.spec is not None and group.spec.dtype == "bfloat16"
    return _ceil_div((adapters or params) * (12 if bf16 else 8), config.ray.pool_size)


def _reduce_bucket(config: DrmasConfig, dtype_bytes: int) -> int:
    """DeepSpeed's gradient reduction bucket (0.19.8), allocated whole on the device:
    ``DEEPSPEED_REDUCE_BUCKET`` elements at the reduction dtype, fp32 where ZeRO-1
    accumulates in fp32 (stage_1_and_2.py:1253-1254), else the model's. ZeRO-0 and the torch
    backend have none."""
    stage, train = _zero_stage(config), config.train
    if stage == 0:
        return 0
    fp32_accumulation = dtype_bytes == 2 and stage == 1 and train.offload_optimizer
    return DEEPSPEED_REDUCE_BUCKET * (4 if fp32_accumulation else dtype_bytes)


def _deepspeed_buffers(config: DrmasConfig, params: int, largest: int, dtype_bytes: int) -> int:
    """DeepSpeed's buffers on the device beside the training state (0.19.8): the gradient
    reduction bucket (``_reduce_bucket``); ZeRO-1/2 with offload a one-parameter gradient
    buffer (stage_1_and_2.py:659-661); ZeRO-3 the parameters it keeps gathered whole, up to
    ``stage3_max_live_parameters``."""
    stage = _zero_stage(config)
    extra = 0
    if stage == 3:
        extra = min(DEEPSPEED_MAX_LIVE_PARAMETERS, params) * dtype_bytes
    elif stage in (1, 2) and config.train.offload_optimizer:
        extra = largest * dtype_bytes
    return _reduce_bucket(config, dtype_bytes) + extra


def _logit_bytes(config: DrmasConfig, tokens: int, sequence: int, vocab: int, dtype_bytes: int, copies: int) -> int:
    """The update's [positions x vocab] tensors at the peak of the backward.

    Whole (no ``train.logprob_chunk_positions``): the model's logits and their gradient at
    its dtype, ``copies`` fp32 copies and the fp32 gradient flowing back through them.

    In chunks of c positions (``batching.token_logprobs``): each chunk is a view of the whole
    logits, which the non-reentrant checkpoint keeps until the last chunk's backward; every
    chunk's slice backward makes a whole-size zero tensor, and the gradient of the whole
    logits accumulates in another: three whole-size tensors at the model's dtype (the GPU
    review of 2026-12-03, §2.2). Beside them, one recomputed chunk of every row: ``copies``
    fp32 copies and their gradient."""
    chunk = config.train.logprob_chunk_positions
    if chunk is None:
        return tokens * vocab * (2 * dtype_bytes + 4 * (copies + 1))
    chunked = min(tokens, chunk * max(1, tokens // sequence))
    return 3 * tokens * vocab * dtype_bytes + chunked * vocab * 4 * (copies + 1)


def _micro_batch_tokens(rows: int, sequence: int, max_tokens: int | None) -> int:
    """The most padded tokens of one micro-batch, as ``drmas.training.batching.micro_batches``
    packs them: ``rows`` rows of up to ``sequence`` tokens, at most ``max_tokens`` when that
    is set, except that a longer row gets a micro-batch to itself."""
    tokens = rows * sequence
    return tokens if max_tokens is None else min(tokens, max(max_tokens, sequence))


def _lora_params(architecture: Architecture, rank: int, targets: list[str]) -> int:
    """The adapters' parameters: rank x (in + out) per targeted projection and layer."""
    a = architecture
    h, q, kv, mlp = (
        a.hidden_size,
        a.num_attention_heads * a.head_dim,
        a.num_key_value_heads * a.head_dim,
        a.intermediate_size,
    )
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    sizes |= {"gate_proj": h + mlp, "up_proj": h + mlp, "down_proj": mlp + h}
    return a.num_hidden_layers * rank * sum(sizes.get(target, 0) for target in targets)


def _training_state(config: DrmasConfig, params: int, dtype_bytes: int, adapters: int = 0) -> tuple[int, int, int, int]:
    """Per slot: (weights, gradients, optimizer state, Adam's moments within it), standard
    ZeRO accounting (Rajbhandari et al. 2020, "ZeRO", §5): under bf16 mixed precision 2Ψ
    weights, 2Ψ gradients (4Ψ where they accumulate in fp32: the torch engine; DeepSpeed's
    ZeRO-2 and -3, and ZeRO-1 with offload, whose fp32 copy is not partitioned:
    ``drmas.training.engines.deepspeed.deepspeed_config``) and 12Ψ fp32 master weights +
    Adam moments; in float32 weights and gradients at 4 bytes, and Adam's two moments (8Ψ),
    plus 4Ψ of fp32 master partitions under DeepSpeed's ZeRO-1/2/3, which copy them even
    from fp32 weights (stage_1_and_2.py:557-560; stage3.py's ``fp32_partitioned_groups_flat``).
    A LoRA group trains only its adapters' parameters (fp32) beside its frozen base. ZeRO-1
    partitions the optimizer state over the data-parallel slots, ZeRO-2 the gradients too,
    ZeRO-3 the weights too."""
    stage, slots = _zero_stage(config), config.ray.pool_size
    if adapters:  # LoRA: the frozen base at its dtype; fp32 adapters, their gradients and moments
        weights, grads, optimizer = params * dtype_bytes + adapters * 4, adapters * 4, adapters * 8
        moments = adapters * 8
    else:
        mixed = dtype_bytes == 2  # both engines keep fp32 masters
        train = config.train
        fp32_grads = (
            train.backend == "torch"
            or train.zero_stage >= 2
            or (train.zero_stage, train.offload_optimizer) == (1, True)
        )
        weights = params * dtype_bytes
        grads = params * (4 if mixed and fp32_grads else dtype_bytes)
        moments = params * 8
        optimizer = params * 12 if mixed or stage >= 1 else moments
    return (
        _ceil_div(weights, slots) if stage >= 3 else weights,
        _ceil_div(grads, slots) if stage >= 2 else grads,
        _ceil_div(optimizer, slots) if stage >= 1 else optimizer,
        _ceil_div(moments, slots) if stage >= 1 else moments,
    )


def _ceil_div(value: int, parts: int) -> int:
    return -(-value // parts)


def _problems(plan: MemoryPlan) -> list[str]:
    """What does not fit in ``plan.device_memory`` or ``plan.host_memory``, with the numbers
    and the fields to change."""
    problems = _device_problems(plan, plan.device_memory) if plan.device_memory is not None else []
    if plan.host_memory is not None:
        problems += _host_problems(plan, plan.host_memory)
    return problems


def _device_problems(plan: MemoryPlan, device: int) -> list[str]:
    problems = []
    if plan.rollout_peak > device:
        engines = (
            f"SGLang takes mem_fraction_static {MEM_FRACTION_STATIC} of the free device memory per engine"
            if plan.engine == "sglang"
            else "each engine holds its weights"
        )
        problems.append(
            f"rollout: {plan.max_resident} resident engine(s) and the CUDA contexts take {_gb(plan.rollout_peak)} "
            f"per slot, more than {_gb(device)} (ray.max_resident {plan.max_resident}; {engines})"
        )
    for group in plan.groups:
        problems += _engine_problems(group)
        if group.update_peak > device:
            problems.append(_update_problem(plan, group, device))
        if group.handover_peak > device:
            problems.append(
                f"hand-over {group.name}: the training state ({_gb(group.training_resident)}) and the engine's "
                f"weights with one pushed bucket ({_gb(group.handover_device)}) take {_gb(group.handover_peak)} per "
                f"slot, more than {_gb(device)}; raise train.zero_stage or set train.offload_optimizer"
            )
    return problems


def _host_problems(plan: MemoryPlan, host: int) -> list[str]:
    """Each host phase over ``host``, with what the slot holds in it."""
    kept = (
        f"every group's offloaded training state {_gb(sum(g.held_host for g in plan.groups))}, engines' weights "
        f"{_gb(sum(g.engine_host for g in plan.groups))}, {plan.processes} processes "
        f"{_gb(plan.processes * HOST_PROCESS_BYTES)}, /dev/shm {_gb(SHM_ALLOWANCE_BYTES)}"
    )
    hint = (
        "raise ray.pool_size (the state partitions over more slots) or train.zero_stage, unset "
        "train.offload_optimizer, or give each slot more memory"
    )
    phases = plan.host_phases()
    needs = [("rollout", phases["rollout"], kept)]
    for group in plan.groups:
        own = f"{kept}, less {group.name}'s own {_gb(group.held_host)}; offloaded optimizer {_gb(group.training_host)}"
        zero3 = f", ZeRO-3 weights for the engine {_gb(group.handover_host)}" if group.handover_host else ""
        needs.append(
            (
                f"update {group.name}",
                phases[f"update {group.name}"],
                f"{own}{zero3}, optimizer save {_gb(group.save_host)}",
            )
        )
        needs.append(
            (
                f"cold update {group.name}",
                phases[f"cold update {group.name}"],
                f"{own}, model loaded {_gb(group.load_host)}, optimizer restore {_gb(group.restore_host)}",
            )
        )
    return [
        f"host, {phase}: needs {_gb(need)} per slot, more than {_gb(host)} (ray.host_memory_gb) ({items}); {hint}"
        for phase, need, items in needs
        if need > host
    ]


def _engine_problems(group: GroupPlan) -> list[str]:
    if group.engine_share is None or group.kv_tokens is None:
        return []
    if group.engine_weights >= group.engine_share:
        return [
            f"engine {group.name}: the weights of {group.model} ({_gb(group.engine_weights)}) do not fit SGLang's "
            f"share of the device ({MEM_FRACTION_STATIC} x device = {_gb(group.engine_share)})"
        ]
    if group.kv_tokens < group.sequence_tokens:
        return [
            f"engine {group.name}: its KV cache ({_gb(group.kv_cache or 0)}) holds {group.kv_tokens} tokens, less "
            f"than one sequence of {group.sequence_tokens} (rollout.max_prompt_tokens + max_new_tokens)"
        ]
    return []


def _update_problem(plan: MemoryPlan, group: GroupPlan, device: int) -> str:
    """Why the group's update does not fit, item by item, and the largest micro-batch that would."""
    items = (
        f"weights {_gb(group.train_params)}, gradients {_gb(group.train_grads)}, optimizer {_gb(group.optimizer)}, "
        f"activations {_gb(group.activations)}, logits {_gb(group.logits)}"
        + (f", reference model {_gb(group.reference_model)}" if group.reference_model else "")
        + (f", DeepSpeed buffers {_gb(group.deepspeed_buffers)}" if group.deepspeed_buffers else "")
        + f", CUDA contexts {_gb(group.contexts)}"
    )
    per_token = (group.activations + group.logits) / group.micro_batch_tokens
    fitting = int((device - group.update_fixed) // per_token) if device > group.update_fixed else 0
    if fitting >= group.sequence_tokens:
        hint = f"set train.max_tokens_per_micro_batch to at most {fitting} (now {group.micro_batch_tokens} tokens)"
    else:
        hint = (
            f"not even one {group.sequence_tokens}-token row fits: raise train.zero_stage (now {plan.zero_stage}) or "
            "ray.pool_size, set train.offload_optimizer or train.gradient_checkpointing, or shorten "
            "rollout.max_prompt_tokens / max_new_tokens"
        )
    return f"update {group.name}: needs {_gb(group.update_peak)} per slot, more than {_gb(device)} ({items}); {hint}"


def parse_size(text: str) -> int:
    """'80GB', '80 GiB', '81920MiB' or '80' (GB) -> bytes. GB is 10^9 bytes, GiB 2^30."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if match is None or float(match[1]) <= 0:
        raise PlanError(f"device memory {text!r} is not a size such as 80GB, 80GiB or 81920MiB")
    unit = (match[2] or "GB").upper()
    power = "KMGT".index(unit[0]) + 1
    base = 1024 if "I" in unit else 1000
    return round(float(match[1]) * base**power)


def _gb(value: int) -> str:
    """Bytes as GB, or as MB for the small models of CPU runs (where GB would read 0.0)."""
    return f"{value / GB:.1f} GB" if value >= GB // 10 or value == 0 else f"{value / 10**6:.1f} MB"


def _pod_line(pod: PodSize) -> str:
    figures = ", ".join(f"{name} {quantity}" for name, quantity in pod.resources().items())
    return f"KubeRay worker pod of {pod.gpus} GPU(s), one per node: {figures} (manifests/base/raycluster.yaml)"


def _gib(value: int) -> str:
    """Bytes as a Kubernetes quantity of whole GiB, rounded up."""
    return f"{_ceil_div(value, 2**30)}Gi"


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 10**9 else f"{params / 1e6:.2f}M"


def _render(plan: MemoryPlan, pod_gpus: int) -> str:
    """Rows of items, one column per worker group (GB); then the peaks and the verdict."""
    groups = plan.groups
    phases = plan.host_phases()
    rows: list[tuple[str, list[str]]] = [
        ("model", [g.model for g in groups]),
        ("parameters", [_count(g.params) for g in groups]),
        ("sized from", [g.source for g in groups]),
        ("ROLLOUT (engine resident)", ["" for _ in groups]),
        ("engine weights", [_gb(g.engine_weights) for g in groups]),
        ("KV cache", [_gb(g.kv_cache) if g.kv_cache is not None else "-" for g in groups]),
        ("KV cache tokens", [str(g.kv_tokens) if g.kv_tokens is not None else "-" for g in groups]),
        ("UPDATE (engines released)", ["" for _ in groups]),
        ("micro-batch tokens", [str(g.micro_batch_tokens) for g in groups]),
        ("weights", [_gb(g.train_params) for g in groups]),
        ("gradients", [_gb(g.train_grads) for g in groups]),
        ("optimizer on device", [_gb(g.optimizer) for g in groups]),
        *([("optimizer on host", [_gb(g.optimizer_host) for g in groups])] if plan.offload_optimizer else []),
        ("DeepSpeed buffers", [_gb(g.deepspeed_buffers) for g in groups]),
        ("activations, checkpointing", [_gb(g.activations_checkpointed) for g in groups]),
        ("activations, none", [_gb(g.activations_full) for g in groups]),
        ("logits and their gradients", [_gb(g.logits) for g in groups]),
        *(
            [("reference model (KL)", [_gb(g.reference_model) for g in groups])]
            if any(g.reference_model for g in groups)
            else []
        ),
        ("CUDA contexts", [_gb(g.contexts) for g in groups]),
        ("update peak", [_gb(g.update_peak) for g in groups]),
        ("hand-over peak", [_gb(g.handover_peak) for g in groups]),
        ("HOST (per slot)", ["" for _ in groups]),
        ("training state kept", [_gb(g.held_host) for g in groups]),
        ("engine weights kept", [_gb(g.engine_host) for g in groups]),
        ("model load (cold update)", [_gb(g.load_host) for g in groups]),
        *(
            [("ZeRO-3 weights for engine", [_gb(g.handover_host) for g in groups])]
            if any(g.handover_host for g in groups)
            else []
        ),
        ("optimizer save, restore", [f"{_gb(g.save_host)}, {_gb(g.restore_host)}" for g in groups]),
        ("host at update", [_gb(phases[f"update {g.name}"]) for g in groups]),
        ("host at cold update", [_gb(phases[f"cold update {g.name}"]) for g in groups]),
        ("DISK", ["" for _ in groups]),
        ("policy cache (per node)", [_gb(g.engine_disk) for g in groups]),
        ("update folder (per slot)", [_gb(g.update_disk) for g in groups]),
    ]
    names = [g.name for g in groups]
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(name), *(len(values[i]) for _, values in rows)) for i, name in enumerate(names)]

    def line(label: str, values: list[str]) -> str:
        return "  ".join([label.ljust(label_width), *(v.rjust(w) for v, w in zip(values, widths, strict=True))])

    device = _gb(plan.device_memory) if plan.device_memory is not None else "an unknown size"
    header = (
        f"memory per slot: {plan.slots} slot(s) of {device}; ZeRO-{plan.zero_stage}"
        f"{' with optimizer offload' if plan.offload_optimizer else ''}, gradient checkpointing "
        f"{'on' if plan.gradient_checkpointing else 'off'}, rollout engine {plan.engine} "
        f"({plan.max_resident} resident at once)"
    )
    peak_phase = max(phases, key=lambda phase: phases[phase])
    limits = [
        f"{_gb(plan.device_memory)} of device memory" if plan.device_memory is not None else None,
        f"{_gb(plan.host_memory)} of host memory" if plan.host_memory is not None else None,
    ]
    checked = " and ".join(limit for limit in limits if limit is not None)
    unchecked = [
        *(["device (give --device-memory or set ray.device_memory_gb)"] if plan.device_memory is None else []),
        *(["host (set ray.host_memory_gb)"] if plan.host_memory is None else []),
    ]
    verdict = {
        None: "fits: unknown",
        True: f"fits in {checked}",
        False: f"does NOT fit in {checked}:\n" + "\n".join(f"  - {problem}" for problem in plan.problems),
    }[plan.fits]
    return "\n".join(
        [
            header,
            "",
            line("worker group", names),
            *(line(label, values) for label, values in rows),
            "",
            f"device per slot: rollout peak {_gb(plan.rollout_peak)}, update peak {_gb(plan.update_peak)}",
            f"host per slot: peak {_gb(phases[peak_phase])} at {peak_phase}; between updates "
            f"{_gb(plan.host_between_phases)}, of which {plan.processes} processes "
            f"{_gb(plan.processes * HOST_PROCESS_BYTES)} and Ray's /dev/shm {_gb(SHM_ALLOWANCE_BYTES)}; "
            f"/dev/shm at its peak {_gb(plan.shm)}",
            _pod_line(plan.pod(pod_gpus)),
            verdict,
            *([f"not checked: {', '.join(unchecked)}"] if unchecked else []),
        ]
    )
