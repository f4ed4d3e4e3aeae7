"""The SGLang engine (GPU image only): offline engine with memory release and resume.

Imported only when ``rollout.engine: sglang``; SGLang pins a CUDA torch and GPU kernels
and cannot be installed on CPU machines. Not yet verified on a GPU by the test suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drmas.config import SamplingConfig
from drmas.generation.engines import Generation


class SGLangEngine:
    """One ``sglang.Engine`` per worker group, token ids in and out (no tokenizer inside)."""

    def __init__(self, dtype: str = "bfloat16", mem_fraction_static: float = 0.5) -> None:
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
        self.engine: Any = None
        self.policy_dir: Path | None = None
        self.resident = False

    def load(self, policy_dir: Path) -> None:
        self.policy_dir = Path(policy_dir)
        if self.engine is None:
            self.engine = self._sglang.Engine(
                model_path=str(self.policy_dir),
                dtype=self.dtype,
                skip_tokenizer_init=True,
                enable_memory_saver=True,
                mem_fraction_static=self.mem_fraction_static,
            )
            self.resident = True
            return
        self.resume()
        self.engine.update_weights_from_disk(str(self.policy_dir))

    def offload(self) -> None:
        if self.engine is not None and self.resident:
            self.engine.release_memory_occupation()
            self.resident = False

    def resume(self) -> None:
        if self.engine is None:
            raise RuntimeError("resume() before load(): no policy to make resident")
        if not self.resident:
            self.engine.resume_memory_occupation()
            self.resident = True

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, stop_ids: list[int], seed: int
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
            "sampling_seed": seed,
        }
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return [
            Generation(
                response_ids=list(out["output_ids"]),
                logprobs=[float(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                finish_reason="stop" if out["meta_info"]["finish_reason"]["type"] == "stop" else "length",
            )
            for out in outputs
        ]
