"""LoRA worker groups (``models.NAME.lora``) on a tiny Qwen3 built from a config: what
trains, what is stored, what the rollout engine and the KL reference see, resume and
caching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import WG, make_run, torch_env
from safetensors.torch import load_file

import drmas.stages.update as U
from drmas.config import ConfigError, load_config
from drmas.generation.lora import BASE_POLICY, lora_base, merge_lora, read_adapter
from drmas.generation.workers import WorkerGroupRuntime
from drmas.infra.layout import PolicyRef, optim_path
from drmas.infra.store import CorruptArtifact
from drmas.models import load_model
from drmas.stages.advantage import advantage
from drmas.stages.checkpoint import check_policy
from drmas.stages.contracts import UpdateContract, cache_key
from drmas.training.batching import collate, token_logprobs
from drmas.training.lora import BaseReference, with_lora
from drmas.training.shards import load_optimizer_state

ROOT = Path(__file__).parent.parent
LORA = ["models.tiny.lora.rank=4", "models.tiny.lora.alpha=8", "train.lr=0.05"]


def lora_update(folder: Path, *overrides: str, worker=None, optim=None, policy=None):
    """The LoRA run's iteration-0 update from its initial policy (or ``policy``)."""
    config, store, initial, tokenizer = make_run(folder, *LORA, *overrides)
    advantage(config, store, "run", 0)
    start = policy or initial
    result = U.update_rank(worker, config, store.settings(), "run", 0, WG, start, optim, initial, True, "")
    return config, store, initial, tokenizer, result


def rows_of(store, tokenizer):
    table = store.open("math-tiny/run/iter-000000/rollout").read_table("trajectories.parquet")
    return collate([dict(r, advantage=0.0) for r in table.to_pylist()], tokenizer.pad_token_id)


@pytest.mark.slow
def test_only_the_adapters_train_and_only_they_are_stored(tmp_path):
    """The stored policy is PEFT's layout (adapter safetensors, no full weights) with the
    base it adapts; the adapters moved, the base did not (merged minus adapter = base)."""
    config, store, initial, _, result = lora_update(tmp_path, "algorithm.kl_coef=0.1", "train.updates_per_iteration=2")
    files = set(store.open(result.artifact).files)
    assert {"adapter_model.safetensors", "adapter_config.json", BASE_POLICY} <= files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files)
    folder = store.open(result.artifact).download(tmp_path / "policy")
    adapter, adapter_config = read_adapter(folder)
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert adapter_config["base_model_name_or_path"] == store.uri(initial.artifact)
    assert lora_base(store, PolicyRef(result.artifact)) == initial
    ups = [tensor for name, tensor in adapter.items() if ".lora_B." in name]
    assert ups and all(tensor.abs().max() > 0 for tensor in ups)  # B starts at zero: it trained
    base = load_model(store.open(initial.artifact).download(tmp_path / "base"))
    # adapter weights of a 32-wide model at rank 4: a fraction of the base's parameters
    assert sum(t.numel() for t in adapter.values()) < sum(p.numel() for p in base.parameters()) / 4
    # The reference is the base: the policy equals it at the first step (B = 0), not after.
    assert result.metrics[f"wg/{WG}/kl"] > 0
    check_policy(config.worker_groups()[0], store, PolicyRef(result.artifact))


def test_merged_weights_generate_as_the_peft_model_and_the_reference_is_the_base(tmp_path):
    """The merged weights (what the engines load) give the PeftModel's log-probs; with the
    adapter switched off the PeftModel gives the base model's, to the bit."""
    config, store, initial, tokenizer, result = lora_update(tmp_path)
    base_dir = store.open(initial.artifact).download(tmp_path / "base")
    adapter, adapter_config = read_adapter(store.open(result.artifact).download(tmp_path / "policy"))
    base = load_model(base_dir)
    peft = with_lora(load_model(base_dir), config.models["tiny"].lora, seed=1, saved=adapter)
    merged = load_model(base_dir)
    merged.load_state_dict(merge_lora(base.state_dict(), adapter, adapter_config))
    batch = rows_of(store, tokenizer)
    with torch.no_grad():
        plain, _ = token_logprobs(base, batch, want_entropy=False)
        adapted, _ = token_logprobs(peft, batch, want_entropy=False)
        from_merged, _ = token_logprobs(merged, batch, want_entropy=False)
        reference, _ = token_logprobs(BaseReference(peft), batch, want_entropy=False)
    mask = batch.response_mask > 0
    assert torch.equal(reference[mask], plain[mask])
    torch.testing.assert_close(from_merged[mask], adapted[mask], rtol=0, atol=1e-5)
    assert (adapted[mask] - plain[mask]).abs().max() > 1e-3  # the adapter does change the policy
    prompt = batch.input_ids[:1, :8]
    greedy = {
        name: model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        for name, model in (("peft", peft), ("merged", merged))
    }
    assert torch.equal(greedy["peft"], greedy["merged"])


@pytest.mark.slow
def test_a_worker_loads_a_stored_lora_policy_merged(tmp_path):
    """A rollout worker given the stored LoRA policy loads the merged weights (written once
    to its cache); they are the bytes an update hands to a worker's engine in memory."""
    config, store, initial, _, result = lora_update(tmp_path / "cold")
    cold = WorkerGroupRuntime(WG, store.settings(), cache_dir=str(tmp_path / "cache"))
    assert cold.load_policy(PolicyRef(result.artifact))
    assert list((tmp_path / "cache").glob("*-merged/model.safetensors"))
    warm = WorkerGroupRuntime(WG, store.settings(), cache_dir=str(tmp_path / "cache2"))
    warm.load_policy(initial)
    args = (config, store.settings(), "run", 0, WG, initial, None, initial, True, "")
    adopted = U.update_rank(warm, *args)
    assert adopted.artifact == f"{result.artifact}@v2"  # computed again: the next version, never over the first
    assert not warm.load_policy(PolicyRef(adopted.artifact))  # adopted in memory: no reload
    loaded, handed = cold.engine.model.state_dict(), warm.engine.model.state_dict()
    assert all(torch.equal(loaded[name], handed[name]) for name in loaded)
    assert not torch.equal(
        loaded["model.layers.0.self_attn.q_proj.weight"],
        load_model(store.open(initial.artifact).download(tmp_path / "base")).state_dict()[
            "model.layers.0.self_attn.q_proj.weight"
        ],
    )


@pytest.mark.slow
def test_resume_restores_the_adapter_and_its_optimizer_state(tmp_path):
    """Two updates straight in one worker equal one update, stored, and a second one that
    starts from the stored adapter and optimizer state (adapter parameters only)."""
    config, store, initial, _, first = lora_update(tmp_path / "cold")
    optim = PolicyRef(optim_path(config.experiment.name, "run", 0, WG))
    state = load_optimizer_state(store.open(optim.artifact).download(tmp_path / "optim")).tensors
    moments = [name for name in state if name.startswith("optim/")]
    assert moments and all(".lora_" in name for name in moments)
    args = (config, store.settings(), "run", 0, WG)
    cold = U.update_rank(None, *args, PolicyRef(first.artifact), optim, initial, True, "")

    worker = WorkerGroupRuntime(WG, store.settings())
    config, store_warm, initial, _, first = lora_update(tmp_path / "warm", worker=worker)
    optim = PolicyRef(optim_path(config.experiment.name, "run", 0, WG))
    warm = U.update_rank(
        worker, config, store_warm.settings(), "run", 0, WG, PolicyRef(first.artifact), optim, initial, True, ""
    )
    adapters = [
        s.open(r.artifact).read_bytes("adapter_model.safetensors") for s, r in ((store, cold), (store_warm, warm))
    ]
    assert adapters[0] == adapters[1]


def test_a_changed_base_is_refused(tmp_path):
    config, store, initial, _, result = lora_update(tmp_path)
    folder = store.open(initial.artifact).download(tmp_path / "base")
    with store.writer(initial.artifact, overwrite=True) as out:
        out.put_dir(folder, "")
        out.write_json("extra.json", {})
    with pytest.raises(CorruptArtifact, match="changed since the LoRA policy"):
        check_policy(config.worker_groups()[0], store, PolicyRef(result.artifact))


def test_lora_settings_are_in_the_update_key_and_zero3_is_refused(tmp_path):
    keys = []
    for rank in (4, 8):
        config, store, policy, _ = make_run(tmp_path / str(rank), *LORA, f"models.tiny.lora.rank={rank}")
        advantage(config, store, "run", 0)
        keys.append(cache_key(config, store, UpdateContract("run", 0, WG, policy, None, policy)))
    assert keys[0] != keys[1]
    with pytest.raises(ConfigError, match="models.tiny.lora: LoRA is not supported with train.zero_stage 3"):
        load_config(ROOT / "configs" / "math_tiny.yaml", [*LORA, "train.backend=deepspeed", "train.zero_stage=3"])
    with pytest.raises(ConfigError, match="rank"):
        load_config(ROOT / "configs" / "math_tiny.yaml", ["models.tiny.lora.rank=0"])


@pytest.mark.slow
def test_checkpointing_gives_lora_the_same_update(tmp_path):
    """Activation checkpointing (non-reentrant: peft's input-grad hook is not needed) on a
    LoRA policy: the same adapter as without it."""
    adapters = []
    for on in (False, True):
        _, store, _, _, result = lora_update(tmp_path / str(on), f"train.gradient_checkpointing={on}")
        adapters.append(
            load_file(str(store.open(result.artifact).download(tmp_path / f"a{on}") / "adapter_model.safetensors"))
        )
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    assert json.dumps(sorted(adapters[0])) == json.dumps(sorted(adapters[1]))


DEEPSPEED_LORA = """
import sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_lora import lora_update
from safetensors.torch import load_file
adapters = {}
for label, overrides in {
    "torch": [],
    "zero0": ["train.backend=deepspeed", "train.zero_stage=0"],
    "zero2": ["train.backend=deepspeed", "train.zero_stage=2"],
    "zero2+checkpointing": ["train.backend=deepspeed", "train.zero_stage=2", "train.gradient_checkpointing=true"],
}.items():
    tmp = Path(tempfile.mkdtemp(dir=sys.argv[2]))
    _, store, _, _, result = lora_update(tmp, "train.micro_batch_size=2", "algorithm.kl_coef=0.1", *overrides)
    adapters[label] = load_file(str(store.open(result.artifact).download(tmp / "a") / "adapter_model.safetensors"))
gaps = {k: max(float((v[n] - adapters["torch"][n]).abs().max()) for n in v) for k, v in adapters.items()}
print("GAPS", gaps)
print("GAP", max(gaps.values()))
"""


@pytest.mark.slow
def test_deepspeed_trains_lora_as_torch_does(tmp_path):
    """DeepSpeed ZeRO-0 and ZeRO-2 (gloo, CPU), also with activation checkpointing, train
    the same adapter as the torch engine, with the KL term to the adapter-less base."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_LORA, str(Path(__file__).parent), str(tmp_path)],
        capture_output=True,
        text=True,
        env=torch_env(threads=None),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("GAP ")[-1]) < 1e-5, done.stdout
