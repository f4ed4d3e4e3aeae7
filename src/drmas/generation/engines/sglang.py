"""The SGLang engine (GPU image only): offline engine with memory release and resume.

Imported only when ``rollout.engine: sglang``; SGLang pins a CUDA torch and GPU kernels
and cannot be installed on CPU machines. Written against SGLang 0.5.x's offline
``sglang.Engine`` as its source defines it (0.5.18-0.5.21, the releases that pin torch
2.13); ``tests/test_sglang_engine.py`` drives it through a scripted stand-in with the same
signatures and return values. Not yet run on a GPU. What the source says and this follows:

- ``release_memory_occupation`` frees the weights' and the KV cache's memory and throws
  their content away, unless ``enable_weights_cpu_backup`` (below), which this engine sets.
- Releasing asserts, inside the engine, that it is idle: ``flush_cache()`` reports that
  (``success``) without raising, so it is checked first.
- ``update_weights_from_disk`` returns ``(success, message, num_paused_requests)``; a
  failure is returned, not raised.
- A per-request ``sampling_seed`` is honoured only with ``enable_deterministic_inference``;
  without it, sampling depends on how requests are batched.
- ``update_weights_from_tensor`` (an update's weights, in memory) returns ``(success,
  message)``; from 0.5.21 it runs only inside ``begin_weight_update()`` /
  ``end_weight_update()`` (older releases have neither: feature-detected), and a session
  takes several calls (``managers/scheduler_components/weight_updater.py``).
- ``enable_weights_cpu_backup`` (``arg_groups/fields/exec_.py``): a release copies the
  weights to host memory and a resume copies them back, so a released engine keeps its
  weights. The engine is started with it, as veRL starts its colocated SGLang: an update's
  weights are pushed once, right after the update, and no reference to them is kept (a kept
  hand-over held views of DeepSpeed's flat bf16 buffer on the GPU, which its
  ``offload_states`` could then never free: every group's whole weights, for good).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.config import SamplingConfig
from drmas.generation.engines.base import Generation

if TYPE_CHECKING:
    import torch

__all__ = ["MEM_FRACTION_STATIC", "PUSH_BUCKET_BYTES", "SGLangEngine", "weight_buckets"]

MEM_FRACTION_STATIC = 0.5
"""Share of the device an engine takes for its weights and KV cache, the reference's math
recipe's ``gpu_memory_utilization``; ``drmas plan`` sizes the rollout with it."""

PUSH_BUCKET_BYTES = 512 * 2**20
"""An update's weights go to the engine in calls of at most this many bytes (one tensor
larger than this goes alone): the scheduler copies what one call carries to the GPU before
loading it, so a bucket bounds that transient copy (veRL pushes in buckets likewise)."""


class SGLangEngine:
    """One ``sglang.Engine`` per worker group on its actor's GPU, token ids in and out."""

    def __init__(
        self, dtype: str = "bfloat16", mem_fraction_static: float = MEM_FRACTION_STATIC, seed: int = 0
    ) -> None:
        try:
            import sglang  # noqa: PLC0415
        except ImportError as error:
            raise RuntimeError(
                "rollout.engine is 'sglang' but SGLang is not installed: use the drmas GPU "
                "image or `pip install drmas[gpu]` on a CUDA machine"
            ) from error
        self._sglang = sglang
        self.dtype = dtype
        self.mem_fraction_static = mem_fraction_static
        self.seed = seed
        self.engine: Any = None
        self.policy_dir: Path | None = None
        self.resident = False

    def load(self, policy_dir: Path) -> None:
        """Start the engine on this policy, or put the policy's weights into it."""
        self.policy_dir = Path(policy_dir)
        if self.engine is None:
            self.engine = self._sglang.Engine(
                model_path=str(self.policy_dir),
                dtype=self.dtype,
                skip_tokenizer_init=True,
                enable_memory_saver=True,  # without it, release and resume free nothing
                enable_weights_cpu_backup=True,  # a release keeps the weights (in host memory)
                mem_fraction_static=self.mem_fraction_static,
                tp_size=1,
                base_gpu_id=0,  # the actor's one GPU (Ray sets CUDA_VISIBLE_DEVICES)
                random_seed=self.seed,
                enable_deterministic_inference=True,  # per-request seeds
            )
            self.resident = True
            return
        with self._weights_mapped():
            self._load_weights(self.policy_dir)

    def offload(self) -> None:
        """Release the engine's GPU memory; its weights wait in host memory."""
        if self.engine is not None and self.resident:
            self._flush("release its memory")
            self.engine.release_memory_occupation()
            self.resident = False

    def resume(self) -> None:
        """Map the memory back: the weights from their host backup, then the KV cache and
        CUDA graphs."""
        if self.engine is None or self.policy_dir is None:
            raise RuntimeError("resume() before load(): no policy to make resident")
        if not self.resident:
            self.engine.resume_memory_occupation()
            self.resident = True

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Put an update's weights into the engine now, in buckets, and keep no reference to
        them: a released engine maps only its weights back for the push and releases them
        again (the training engine still holds the device), so a later resume brings these
        weights back from the host backup."""
        if self.engine is None:
            raise RuntimeError("set_weights() before load(): no engine to put the weights into")
        with self._weights_mapped():
            self._push_weights(weights)

    @contextmanager
    def _weights_mapped(self) -> Iterator[None]:
        """The weights' memory mapped for the block; a released engine is released again
        after it (only its weights were mapped)."""
        if self.resident:
            yield
            return
        self.engine.resume_memory_occupation(tags=["weights"])
        try:
            yield
        finally:
            self.engine.release_memory_occupation(tags=["weights"])

    def _push_weights(self, weights: dict[str, torch.Tensor]) -> None:
        session = hasattr(self.engine, "begin_weight_update")  # 0.5.21+: updates run in a session
        if session:
            _check(self.engine.begin_weight_update(), "open a weight-update session")
        for bucket in weight_buckets(weights, PUSH_BUCKET_BYTES):
            _check(self.engine.update_weights_from_tensor(bucket, flush_cache=False), "take the weights")
        if session:
            _check(self.engine.end_weight_update(), "close the weight-update session")
        self._flush("flush its cache after a weight update")

    def _flush(self, what: str) -> None:
        flushed = self.engine.flush_cache()
        if not flushed.success:
            raise RuntimeError(f"SGLang engine is busy, cannot {what}: {flushed.message}")

    def _load_weights(self, policy_dir: Path) -> None:
        success, message, _ = self.engine.update_weights_from_disk(str(policy_dir))
        if not success:
            raise RuntimeError(f"SGLang could not load the weights of {policy_dir}: {message}")

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: list[int], seeds: list[int]
    ) -> list[Generation]:
        if not prompts:
            return []
        self.resume()
        params = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "max_new_tokens": sampling.max_new_tokens,
            "stop_token_ids": stop_ids,
        }
        per_request = [params | {"sampling_seed": seed} for seed in seeds]
        outputs = self.engine.generate(input_ids=prompts, sampling_params=per_request, return_logprob=True)
        return [_generation(out) for out in outputs]


def weight_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``weights`` as (name, tensor) lists of at most ``bucket_bytes`` each, in order."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _check(result: tuple[bool, str], what: str) -> None:
    success, message = result
    if not success:
        raise RuntimeError(f"SGLang could not {what}: {message}")


def _generation(out: dict[str, Any]) -> Generation:
    meta = out["meta_info"]
    reason = meta["finish_reason"]["type"]
    if reason == "abort":
        raise RuntimeError(f"SGLang aborted a request: {meta['finish_reason']}")
    return Generation(
        response_ids=list(out["output_ids"]),
        logprobs=[float(logprob) for logprob, _, _ in meta["output_token_logprobs"]],
        finish_reason="stop" if reason == "stop" else "length",
    )
