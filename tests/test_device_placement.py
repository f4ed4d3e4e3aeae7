"""Where the update puts its tensors: every batch, the reference model and every buffer on
the training engine's device.

On a GPU a tensor left on the CPU makes an op fail ("Expected all tensors to be on the same
device"); here there is no GPU, so the engine's device is a stand-in: ``torch.device("cpu",
0)``, which computes on the CPU but is another device object (``tests/standin_device.py``
tracks which tensors were moved to it and records every op of drmas that mixes moved and
unmoved tensors). What this proves: the ``.to(engine.device)`` calls exist and are used on
every path of the update (micro-batches, the recomputed old log-probs, the per-agent
diagnostic, the reference model, the resumed optimizer state), and the engine's device is
what the model's forward and the loss see. What only a GPU proves: that torch, transformers
and DeepSpeed place their own tensors right (their ops are not checked), CUDA memory and
nccl; ``bench/gpu_smoke.py`` runs that.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import WG, make_run, torch_env
from standin_device import STANDIN, StandInDevice

import drmas.models as models
import drmas.stages.update as update_stage
import drmas.training.batching as batching
import drmas.training.engines as engines
import drmas.training.engines.torch as torch_engine
import drmas.training.loop as loop
from drmas.infra.layout import PolicyRef, optim_path
from drmas.stages.advantage import advantage

pytestmark = pytest.mark.standin

ROOT = Path(__file__).parent.parent
EVERY_PATH = (
    "algorithm.kl_coef=0.1",  # a reference model
    "diagnostics.per_agent_grad_norm=true",
    "train.recompute_old_logprobs=true",
    "train.micro_batch_size=2",
)


def watched_update(tmp_path: Path, monkeypatch, *overrides: str, resume: bool = True) -> dict[str, list]:
    """Two updates (the second resumes the first's optimizer state) with every path on,
    under the stand-in device; what the policy's and the reference's forward and the loss
    received (inputs and the model's own parameters), the engines' devices and the ops
    that mixed devices."""
    seen: dict[str, list] = {"forward": [], "loss": [], "engine": [], "violations": []}
    config, store, policy, _ = make_run(tmp_path, *EVERY_PATH, *overrides)
    advantage(config, store, "run", 0)

    def load_and_watch(*args, **kwargs):
        model = load_model(*args, **kwargs)
        model.register_forward_pre_hook(
            lambda module, args, kwargs: seen["forward"].extend(
                t.device for t in [*args, *kwargs.values(), *module.parameters()] if isinstance(t, torch.Tensor)
            ),
            with_kwargs=True,
        )
        return model

    def loss_and_watch(*args, **kwargs):
        seen["loss"].extend(t.device for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))
        return policy_loss(*args, **kwargs)

    def engine_and_watch(*args, **kwargs):
        engine = make_engine(*args, **kwargs)
        seen["engine"].append(engine.device)
        return engine

    # The update imports these where a rank trains: patched in their modules, it gets the watchers.
    load_model, policy_loss, make_engine = models.load_model, loop.policy_loss, engines.make_engine
    monkeypatch.setattr(models, "load_model", load_and_watch)
    monkeypatch.setattr(engines, "make_engine", engine_and_watch)
    monkeypatch.setattr(loop, "policy_loss", loss_and_watch)
    monkeypatch.setattr(torch_engine, "training_device", lambda: STANDIN)
    with StandInDevice() as device:
        first = update_stage.update(config, store, "run", 0, WG, policy, None, reference=policy)
        if resume:
            optim = PolicyRef(optim_path(config.experiment.name, "run", 0, WG))
            update_stage.update(
                config, store, "run", 0, WG, PolicyRef(first.artifact), optim, reference=policy, overwrite=True
            )
    seen["violations"] = device.violations
    return seen


def test_every_tensor_of_the_update_is_on_the_engines_device(tmp_path, monkeypatch):
    """The torch engine moves the model to its device; the policy's and the reference's
    forwards and the loss get only tensors on it, and no op of drmas mixes devices."""
    seen = watched_update(tmp_path, monkeypatch)
    assert seen["engine"] == [STANDIN, STANDIN]
    assert seen["violations"] == []
    assert len(seen["forward"]) > 20 and set(seen["forward"]) == {STANDIN}
    assert seen["loss"] and set(seen["loss"]) == {STANDIN}


def test_a_batch_left_on_the_cpu_is_caught(tmp_path, monkeypatch):
    """The check itself can fail: with ``MicroBatch.to`` made a no-op (the bug of issue 16:
    batches never moved), the forwards see CPU tensors and the loss mixes devices. Collate
    builds on the CPU."""
    monkeypatch.setattr(batching.MicroBatch, "to", lambda self, device: self)
    seen = watched_update(tmp_path, monkeypatch, resume=False)
    assert torch.device("cpu") in set(seen["forward"])
    assert any("algos.py" in violation or "batching.py" in violation for violation in seen["violations"])


DEEPSPEED_CASE = """
import sys
sys.path.insert(0, sys.argv[1])
import pytest
from deepspeed.accelerator import get_accelerator
from standin_device import STANDIN
from test_device_placement import watched_update

accelerator = get_accelerator()
with pytest.MonkeyPatch.context() as monkeypatch:
    # DeepSpeed's engine takes its device from its accelerator (_set_distributed_vars), and
    # ZeRO-3's partitioned build (zero.Init) gathers onto its current device.
    monkeypatch.setattr(accelerator, "device_name", lambda index=None: str(STANDIN))
    monkeypatch.setattr(accelerator, "current_device_name", lambda: str(STANDIN))
    seen = watched_update(__import__("pathlib").Path(sys.argv[2]), monkeypatch, *sys.argv[3:])
print("ENGINE", sorted({str(d) for d in seen["engine"]}))
print("FORWARD", sorted({str(d) for d in seen["forward"]}), len(seen["forward"]))
print("LOSS", sorted({str(d) for d in seen["loss"]}))
print("VIOLATIONS", seen["violations"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_puts_the_update_on_its_device(tmp_path, stage):
    """DeepSpeed (ZeRO-0 and ZeRO-3, in a process of its own: it keeps a process group)
    puts the module on its accelerator's device, which the engine reports and the update
    uses, also for the reference model and the per-agent diagnostic's buffer."""
    overrides = ["train.backend=deepspeed", f"train.zero_stage={stage}"]
    done = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_CASE, str(Path(__file__).parent), str(tmp_path), *overrides],
        capture_output=True,
        text=True,
        env=torch_env(threads=None),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert lines["ENGINE"] == "['cpu:0']"
    assert lines["FORWARD"].startswith("['cpu:0'] ")
    assert lines["LOSS"] == "['cpu:0']"
    assert lines["VIOLATIONS"] == "[]"
