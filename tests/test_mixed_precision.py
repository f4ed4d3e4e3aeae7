"""bf16 mixed precision on the torch engine: bf16 compute, fp32 master weights, gradients
and Adam moments, the bf16 model (what is stored and rolled out) rounded from the masters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import UPDATE_OVERRIDES, WG, make_run
from safetensors.torch import load_file

import drmas.stages.update as U
from drmas.config import load_config
from drmas.generation.workers import WorkerGroupRuntime
from drmas.infra.layout import PolicyRef, optim_path
from drmas.stages.advantage import advantage
from drmas.training.engines.torch import TorchEngine
from drmas.training.shards import load_optimizer_state
from drmas.training.state import load_state, save_state

ROOT = Path(__file__).parent.parent
LR = 1e-4


def tiny_bf16():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = load_config(
        ROOT / "configs" / "math_tiny.yaml", [*UPDATE_OVERRIDES, f"train.lr={LR}", "models.tiny.dtype=bfloat16"]
    )
    shape = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    return config, Qwen3ForCausalLM(shape).to(torch.bfloat16)


def steps(engine: TorchEngine, model, count: int) -> None:
    """``count`` steps of a loss whose gradient is 1 on every RMSNorm weight (all 1.0):
    Adam moves each by -lr a step, far below half a bf16 ulp at 1.0 (2^-9)."""
    for _ in range(count):
        loss = sum(p.float().sum() for n, p in model.named_parameters() if n.endswith("norm.weight"))
        engine.backward(loss, boundary=True)
        engine.step(engine.grad_norm())


def test_updates_lost_in_bf16_rounding_add_up_in_the_fp32_masters(tmp_path):
    config, model = tiny_bf16()
    engine = TorchEngine(model, config.worker_groups()[0], config)
    name = "model.norm.weight"
    param, master = dict(model.named_parameters())[name], engine.masters[name]
    assert param.dtype == torch.bfloat16 and master.dtype == torch.float32
    steps(engine, model, 1)
    assert torch.equal(param, torch.ones_like(param))  # 1 - 1e-4 rounds back to 1 in bf16
    torch.testing.assert_close(master, torch.full_like(master, 1 - LR), rtol=0, atol=1e-6)
    assert all(v.dtype == torch.float32 for s in engine.optimizer.state.values() for v in s.values() if v.dim())
    steps(engine, model, 29)
    # 30 steps: the master is at 1 - 3e-3, past half-way to bf16's 1 - 2^-8: the model moved.
    torch.testing.assert_close(master, torch.full_like(master, 1 - 30 * LR), rtol=0, atol=1e-5)
    assert torch.equal(param, torch.full_like(param, 1 - 2**-8))

    # Plain bf16 AdamW (what the engine did before) loses every one of those steps.
    naive = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    adam = torch.optim.AdamW([naive], lr=LR, weight_decay=0.0)
    for _ in range(30):
        naive.sum().backward()
        adam.step()
        adam.zero_grad()
    assert torch.equal(naive, torch.ones_like(naive))

    # The masters travel with the optimizer state: a fresh engine continues from them.
    save_state(engine.export_state(), tmp_path / "state")
    _, fresh_model = tiny_bf16()
    fresh = TorchEngine(fresh_model, config.worker_groups()[0], config)
    fresh.import_state(load_state(tmp_path / "state"))
    assert torch.equal(fresh.masters[name], master)
    assert torch.equal(dict(fresh_model.named_parameters())[name], param)


@pytest.mark.slow
def test_bf16_update_stores_bf16_and_resumes_from_the_masters(tmp_path):
    """A bf16 group's stored policy is bf16; its optimizer state holds the fp32 masters, so
    a second update resumed from the store equals one continued in the worker."""
    results = {}
    for label in ("cold", "warm"):
        config, store, policy, _ = make_run(tmp_path / label, "models.tiny.dtype=bfloat16", "train.lr=1e-4")
        advantage(config, store, "run", 0)
        worker = WorkerGroupRuntime(WG, store.settings()) if label == "warm" else None
        args = (config, store.settings(), "run", 0, WG)
        first = U.update_rank(worker, *args, policy, None, None, True, "")
        optim = PolicyRef(optim_path(config.experiment.name, "run", 0, WG))
        state = load_optimizer_state(store.open(optim.artifact).download(tmp_path / label / "optim")).tensors
        assert any(k.startswith("master/") for k in state) and all(
            v.dtype == torch.float32 for k, v in state.items() if k.startswith(("master/", "optim/"))
        )
        second = U.update_rank(worker, *args, PolicyRef(first.artifact), optim, None, True, "")
        results[label] = load_file(
            str(store.open(second.artifact).download(tmp_path / label / "w") / "model.safetensors")
        )
    assert all(t.dtype == torch.bfloat16 for t in results["cold"].values())
    assert all(torch.equal(results["cold"][k], results["warm"][k]) for k in results["cold"])
