"""The SGLang engine against a scripted stand-in of ``sglang.Engine``.

A stand-in, because SGLang needs a CUDA GPU and cannot be installed here. It keeps the
signatures and return values of SGLang 0.5.x's offline engine as its source defines them
(``sglang/srt/entrypoints/engine.py``, 0.5.18-0.5.21): ``release_memory_occupation(tags=None)``
and ``resume_memory_occupation(tags=None)`` return None; ``update_weights_from_disk(model_path,
load_format=None)`` returns ``(success, message, num_paused_requests)``; ``flush_cache()``
returns an object with ``success`` and ``message``; ``update_weights_from_tensor(named_tensors,
load_format=None, flush_cache=True)`` returns ``(success, message)`` and, from 0.5.21, runs
only between ``begin_weight_update()`` and ``end_weight_update()`` (each ``(success,
message)``); ``generate(input_ids=..., sampling_params=
[one dict per request], return_logprob=True)`` returns one dict per request, in order. It
records every call and, as SGLang does, throws the weights away on release unless it was
started with ``enable_weights_cpu_backup`` (then a release keeps them, in host memory). It
refuses to load weights whose memory is released (SGLang would write into unmapped memory)
and to generate with any memory released.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from drmas.config import SamplingConfig
from drmas.generation.engines import request_seeds

pytestmark = pytest.mark.standin

GARBAGE = "garbage"
ALL_MEMORY = ("kv_cache", "weights", "cuda_graph")


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class ScriptedEngine:
    """Records calls; generates from whichever weights it holds (so garbage shows)."""

    instances: list[ScriptedEngine] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[str, Any]] = [("init", kwargs["model_path"])]
        self.weights = kwargs["model_path"]
        self.busy = False
        self.refuse_weights = False
        self.released: set[str] = set()
        ScriptedEngine.instances.append(self)

    def flush_cache(self) -> FlushCacheReqOutput:
        self.calls.append(("flush_cache", None))
        return FlushCacheReqOutput(not self.busy, "not idle" if self.busy else "")

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("release", tags))
        self.released |= set(tags or ALL_MEMORY)
        if "weights" in (tags or ALL_MEMORY) and not self.kwargs.get("enable_weights_cpu_backup"):
            self.weights = GARBAGE  # torch_memory_saver frees the memory; the content is gone

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("resume", tags))
        self.released -= set(tags or ALL_MEMORY)

    def _weights_unmapped(self) -> tuple[bool, str] | None:
        return (False, "the weights' memory is released") if "weights" in self.released else None

    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        self.calls.append(("begin_weight_update", selector))
        self.session = True
        return True, ""

    def end_weight_update(self) -> tuple[bool, str]:
        self.calls.append(("end_weight_update", None))
        self.session = False
        return True, ""

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        self.calls.append(("update_weights_from_tensor", [name for name, _ in named_tensors]))
        if not getattr(self, "session", False):
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if self.refuse_weights:
            return False, "shape mismatch"
        if refused := self._weights_unmapped():
            return refused
        values = [f"{x:g}" for _, tensor in named_tensors for x in tensor.flatten().tolist()]
        self.weights = "tensors:" + ",".join(values)
        return True, "Succeeded to update model weights."

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        self.calls.append(("update_weights_from_disk", model_path))
        if self.refuse_weights:
            return False, f"Failed to load {model_path}: shape mismatch", 0
        if refused := self._weights_unmapped():
            return (*refused, 0)
        self.weights = model_path
        return True, "Succeeded to update model weights.", 0

    def generate(
        self,
        prompt: Any = None,
        sampling_params: list[dict] | dict | None = None,
        input_ids: list[list[int]] | None = None,
        return_logprob: bool = False,
        **kwargs: Any,
    ) -> list[dict]:
        self.calls.append(("generate", self.weights))
        assert not self.released, f"generating with {sorted(self.released)} released"
        assert isinstance(sampling_params, list) and len(sampling_params) == len(input_ids)
        return [
            {
                "output_ids": [params["sampling_seed"] % 100, 7],
                "meta_info": {
                    "finish_reason": {"type": "stop"},
                    "output_token_logprobs": [(-0.5, params["sampling_seed"] % 100, None), (-0.25, 7, None)],
                    "weights": self.weights,
                },
            }
            for params in sampling_params
        ]


@pytest.fixture
def sglang(monkeypatch):
    """``import sglang`` finds the stand-in."""
    ScriptedEngine.instances = []
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=ScriptedEngine))
    from drmas.generation.engines.sglang import SGLangEngine

    return SGLangEngine


SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8)


def scalars(**values: float) -> dict[str, torch.Tensor]:
    """Weights of one number each, which the stand-in's generations show."""
    return {name: torch.tensor(float(value)) for name, value in values.items()}


def test_the_engine_starts_for_colocation_and_seeds_every_request(sglang):
    engine = sglang("bfloat16", mem_fraction_static=0.4, seed=3)
    engine.load(Path("/policies/v0"))
    [scripted] = ScriptedEngine.instances
    assert scripted.kwargs | {"model_path": "-"} == {
        "model_path": "-",
        "dtype": "bfloat16",
        "skip_tokenizer_init": True,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
        "mem_fraction_static": 0.4,
        "tp_size": 1,
        "base_gpu_id": 0,
        "random_seed": 3,
        "enable_deterministic_inference": True,
    }
    first = engine.generate([[1, 2], [3], [4]], SAMPLING, stop_ids=[7], seeds=request_seeds(11, 0, 3))
    # The same requests split over two engines of a data-parallel group (requests 0 and
    # 1-2): one seed per request, the same wherever it runs, so the same samples.
    head = engine.generate([[1, 2]], SAMPLING, stop_ids=[7], seeds=request_seeds(11, 0, 1))
    tail = engine.generate([[3], [4]], SAMPLING, stop_ids=[7], seeds=request_seeds(11, 1, 2))
    assert [g.response_ids for g in head + tail] == [g.response_ids for g in first]
    assert len({tuple(g.response_ids) for g in first}) == 3
    assert first[0].logprobs == [-0.5, -0.25] and first[0].finish_reason == "stop"


def test_after_a_release_the_weights_come_back_from_the_host_backup(sglang):
    """Started with ``enable_weights_cpu_backup``, a released engine keeps its weights: a
    resume maps everything back and nothing is read from disk again."""
    engine = sglang()
    engine.load(Path("/policies/v0"))
    engine.offload()
    engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])
    scripted = ScriptedEngine.instances[0]
    assert scripted.calls == [
        ("init", "/policies/v0"),
        ("flush_cache", None),
        ("release", None),
        ("resume", None),
        ("generate", "/policies/v0"),
    ]


def test_without_the_backup_a_release_would_lose_the_weights(sglang, monkeypatch):
    """The stand-in's own check: without ``enable_weights_cpu_backup`` SGLang throws the
    released weights away, and the engine would generate from garbage."""
    original = ScriptedEngine.__init__

    def without_backup(self, **kwargs):
        original(self, **(kwargs | {"enable_weights_cpu_backup": False}))

    monkeypatch.setattr(ScriptedEngine, "__init__", without_backup)
    engine = sglang()
    engine.load(Path("/policies/v0"))
    engine.offload()
    assert engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])
    assert ScriptedEngine.instances[0].calls[-1] == ("generate", GARBAGE)


def test_a_new_policy_goes_in_once_whether_or_not_the_engine_was_released(sglang):
    engine = sglang()
    engine.load(Path("/policies/v0"))
    engine.load(Path("/policies/v1"))  # resident: one update
    engine.offload()
    engine.load(Path("/policies/v2"))  # released: resume, then the new weights, once
    engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])
    calls = ScriptedEngine.instances[0].calls
    assert [c for c in calls if c[0] == "update_weights_from_disk"] == [
        ("update_weights_from_disk", "/policies/v1"),
        ("update_weights_from_disk", "/policies/v2"),
    ]
    assert calls[-1] == ("generate", "/policies/v2")


def test_a_failed_weight_update_raises_with_the_engines_message(sglang):
    engine = sglang()
    engine.load(Path("/policies/v0"))
    ScriptedEngine.instances[0].refuse_weights = True
    with pytest.raises(RuntimeError, match=r"could not load the weights of /policies/v1: Failed to load .* shape"):
        engine.load(Path("/policies/v1"))


def test_a_busy_engine_is_not_released(sglang):
    """SGLang asserts idleness inside its scheduler on release (a crash there kills the
    actor): the engine asks ``flush_cache`` first and raises on a busy engine."""
    engine = sglang()
    engine.load(Path("/policies/v0"))
    ScriptedEngine.instances[0].busy = True
    with pytest.raises(RuntimeError, match="busy, cannot release its memory: not idle"):
        engine.offload()
    assert ("release", None) not in ScriptedEngine.instances[0].calls and engine.resident


def test_an_aborted_request_is_an_error_not_an_empty_response(sglang, monkeypatch):
    engine = sglang()
    engine.load(Path("/policies/v0"))
    scripted = ScriptedEngine.instances[0]
    original = scripted.generate

    def aborting(**kwargs):
        outputs = original(**kwargs)
        outputs[0]["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory"}
        return outputs

    monkeypatch.setattr(scripted, "generate", aborting)
    with pytest.raises(RuntimeError, match="aborted a request.*out of memory"):
        engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])


def test_an_updates_weights_go_in_from_memory_in_a_weight_update_session(sglang):
    """Resident: the weights go in at once, inside SGLang 0.5.21's session, the cache
    flushed after; nothing is read from disk."""
    engine = sglang()
    engine.load(Path("/policies/v0"))
    engine.set_weights(scalars(w=1, b=2))
    engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])
    calls = ScriptedEngine.instances[0].calls
    assert calls[1:] == [
        ("begin_weight_update", "all"),
        ("update_weights_from_tensor", ["w", "b"]),
        ("end_weight_update", None),
        ("flush_cache", None),
        ("generate", "tensors:1,2"),
    ]


def test_weights_handed_over_while_released_go_in_at_once_into_the_weights_alone(sglang):
    """The update runs while the engine's memory is released: the engine maps only its
    weights back, takes the new ones, and releases them again (the training engine still
    holds the device); the next rollout resumes them from the host backup."""
    engine = sglang()
    engine.load(Path("/policies/v0"))
    engine.offload()
    engine.set_weights(scalars(w=5))
    assert not engine.resident
    engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])
    calls = ScriptedEngine.instances[0].calls
    assert calls[3:] == [
        ("resume", ["weights"]),
        ("begin_weight_update", "all"),
        ("update_weights_from_tensor", ["w"]),
        ("end_weight_update", None),
        ("flush_cache", None),
        ("release", ["weights"]),
        ("resume", None),
        ("generate", "tensors:5"),
    ]
    assert not any(call[0] == "update_weights_from_disk" for call in calls)


def test_the_engine_keeps_no_reference_to_the_weights_it_was_handed(sglang):
    """The hand-over may be views of the training engine's own buffers (DeepSpeed ZeRO-1/2's
    flat bf16 partition): a reference kept by the engine would keep that memory from ever
    being freed. Once pushed, every handed tensor is gone when the caller drops it, whether
    the engine was resident or released."""
    engine = sglang()
    engine.load(Path("/policies/v0"))
    for release_first in (False, True):
        if release_first:
            engine.offload()
        flat = torch.arange(8, dtype=torch.float32)
        handed = {"a": flat[:4], "b": flat[4:]}
        alive = [weakref.ref(flat), *(weakref.ref(t) for t in handed.values())]
        engine.set_weights(handed)
        del flat, handed
        gc.collect()
        assert [ref() for ref in alive] == [None, None, None]


def test_the_weights_go_in_buckets_within_one_session(sglang, monkeypatch):
    """Each ``update_weights_from_tensor`` call carries at most ``PUSH_BUCKET_BYTES`` (the
    scheduler copies a call's tensors to the GPU at once); a larger tensor goes alone."""
    import drmas.generation.engines.sglang as sglang_module

    monkeypatch.setattr(sglang_module, "PUSH_BUCKET_BYTES", 64)
    engine = sglang()
    engine.load(Path("/policies/v0"))
    weights = {name: torch.zeros(n, dtype=torch.float32) for name, n in [("a", 8), ("b", 8), ("c", 40), ("d", 1)]}
    engine.set_weights(weights)
    assert ScriptedEngine.instances[0].calls[1:] == [
        ("begin_weight_update", "all"),
        ("update_weights_from_tensor", ["a", "b"]),
        ("update_weights_from_tensor", ["c"]),
        ("update_weights_from_tensor", ["d"]),
        ("end_weight_update", None),
        ("flush_cache", None),
    ]


def test_weights_handed_over_while_resident_survive_every_later_release(sglang):
    """An update's weights go in while the engine is resident; the engine is then released
    (another group's turn on the slot) and resumed, twice: each resume pushes the update's
    weights again, never the older policy folder the engine started from (that would make
    the next rollout sample from the policy before the update)."""
    engine = sglang()
    engine.load(Path("/policies/v0"))
    engine.set_weights(scalars(w=7))
    for _ in range(2):
        engine.offload()
        engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])
    calls = ScriptedEngine.instances[0].calls
    assert [weights for name, weights in calls if name == "generate"] == ["tensors:7", "tensors:7"]
    assert not any(call[0] == "update_weights_from_disk" for call in calls)
    engine.load(Path("/policies/v1"))  # a stored policy replaces the handed-over weights
    engine.offload()
    engine.generate([[1]], SAMPLING, stop_ids=[], seeds=[0])
    assert ScriptedEngine.instances[0].calls[-1] == ("generate", "/policies/v1")


def test_a_refused_in_memory_weight_update_raises(sglang):
    engine = sglang()
    engine.load(Path("/policies/v0"))
    ScriptedEngine.instances[0].refuse_weights = True
    with pytest.raises(RuntimeError, match="could not take the weights: shape mismatch"):
        engine.set_weights(scalars(w=1))


def test_an_sglang_without_weight_update_sessions_takes_the_weights_directly(sglang, monkeypatch):
    """SGLang before 0.5.21 has no weight-update session: the engine feature-detects it."""
    engine = sglang()
    engine.load(Path("/policies/v0"))
    scripted = ScriptedEngine.instances[0]
    scripted.session = True  # an old release: no session needed, and none offered
    monkeypatch.delattr(ScriptedEngine, "begin_weight_update")
    monkeypatch.delattr(ScriptedEngine, "end_weight_update")
    engine.set_weights(scalars(w=3))
    assert scripted.calls[1:] == [("update_weights_from_tensor", ["w"]), ("flush_cache", None)]
