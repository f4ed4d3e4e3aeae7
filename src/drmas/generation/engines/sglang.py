"""The SGLang engine (GPU image only): offline engine with memory release and resume.

Imported only when ``rollout.engine: sglang``; SGLang pins a CUDA torch and GPU kernels
and cannot be installed on CPU machines. Written against SGLang 0.5.x's offline
``sglang.Engine`` as its source defines it (0.5.18-0.5.21, the releases that pin torch
2.13); ``tests/test_sglang_engine.py`` drives it through a scripted stand-in with the same
signatures and return values. Not yet run on a GPU. What the source says and this follows:

- ``release_memory_occupation`` frees the weights' and the KV cache's memory and throws
  their content away (unless ``enable_weights_cpu_backup``): after a release, the weights
  are loaded again before anything is generated, never just resumed.
- Releasing asserts, inside the engine, that it is idle: ``flush_cache()`` reports that
  (``success``) without raising, so it is checked first.
- ``update_weights_from_disk`` returns ``(success, message, num_paused_requests)``; a
  failure is returned, not raised.
- A per-request ``sampling_seed`` is honoured only with ``enable_deterministic_inference``;
  without it, sampling depends on how requests are batched.
- ``update_weights_from_tensor`` (an update's weights, in memory) returns ``(success,
  message)``; from 0.5.21 it runs only inside ``begin_weight_update()`` /
  ``end_weight_update()`` (older releases have neither: feature-detected).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.config import SamplingConfig
from drmas.generation.engines import Generation

if TYPE_CHECKING:
    import torch

__all__ = ["MEM_FRACTION_STATIC", "SGLangEngine"]

MEM_FRACTION_STATIC = 0.5
"""Share of the device an engine takes for its weights and KV cache, the reference's math
recipe's ``gpu_memory_utilization``; ``drmas plan`` sizes the rollout with it."""

RESIDENT_AFTER_WEIGHTS = ["kv_cache", "cuda_graph"]
"""What ``resume_memory_occupation`` maps back once the weights are in again."""


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
        self.handed_over: dict[str, torch.Tensor] | None = None
        """The last update's weights, handed over in memory (``set_weights``): the engine's
        weights until the next ``load``. A release throws the engine's weights away and the
        policy folder it loaded is older, so they are pushed again at every resume."""
        self.resident = False

    def load(self, policy_dir: Path) -> None:
        """Start the engine on this policy, or put the policy's weights into it."""
        self.policy_dir = Path(policy_dir)
        self.handed_over = None
        if self.engine is None:
            self.engine = self._sglang.Engine(
                model_path=str(self.policy_dir),
                dtype=self.dtype,
                skip_tokenizer_init=True,
                enable_memory_saver=True,  # without it, release and resume free nothing
                mem_fraction_static=self.mem_fraction_static,
                tp_size=1,
                base_gpu_id=0,  # the actor's one GPU (Ray sets CUDA_VISIBLE_DEVICES)
                random_seed=self.seed,
                enable_deterministic_inference=True,  # per-request seeds
            )
            self.resident = True
            return
        if self.resident:
            self._load_weights(self.policy_dir)
        else:
            self.resume()  # maps the memory back and loads the new policy's weights into it

    def offload(self) -> None:
        if self.engine is not None and self.resident:
            flushed = self.engine.flush_cache()
            if not flushed.success:
                raise RuntimeError(f"SGLang engine is busy, cannot release its memory: {flushed.message}")
            self.engine.release_memory_occupation()
            self.resident = False

    def resume(self) -> None:
        """Map the memory back and load the last policy's weights again (a release threw
        them away), then the KV cache and CUDA graphs."""
        if self.engine is None or self.policy_dir is None:
            raise RuntimeError("resume() before load(): no policy to make resident")
        if self.resident:
            return
        self.engine.resume_memory_occupation(tags=["weights"])
        if self.handed_over is not None:
            self._push_weights(self.handed_over)
        else:
            self._load_weights(self.policy_dir)
        self.engine.resume_memory_occupation(tags=RESIDENT_AFTER_WEIGHTS)
        self.resident = True

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Put an update's weights into the engine: now if its memory is mapped, and again
        at every resume until the next ``load`` (a release throws the weights away; loading
        the policy folder again would roll the engine back to an older policy)."""
        if self.engine is None:
            raise RuntimeError("set_weights() before load(): no engine to put the weights into")
        self.handed_over = weights
        if self.resident:
            self._push_weights(weights)

    def _push_weights(self, weights: dict[str, torch.Tensor]) -> None:
        session = hasattr(self.engine, "begin_weight_update")  # 0.5.21+: updates run in a session
        if session:
            _check(self.engine.begin_weight_update(), "open a weight-update session")
        _check(self.engine.update_weights_from_tensor(list(weights.items()), flush_cache=False), "take the weights")
        if session:
            _check(self.engine.end_weight_update(), "close the weight-update session")
        flushed = self.engine.flush_cache()
        if not flushed.success:
            raise RuntimeError(f"SGLang could not flush its cache after a weight update: {flushed.message}")

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
