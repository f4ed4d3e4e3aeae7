"""The advantage and update stages on a real tiny model, and the optimizer state format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import WG, make_run, torch_env, torch_launcher
from safetensors.torch import load_file

from drmas.algos import compute_advantages
from drmas.config import StoreConfig
from drmas.infra.layout import PolicyRef, optim_path, stage_path
from drmas.infra.schema import BATCH_SCHEMA
from drmas.infra.store import Store
from drmas.models import load_model
from drmas.stages.advantage import advantage
from drmas.stages.update import update
from drmas.training.batching import collate, token_logprobs
from drmas.training.engines.deepspeed import deepspeed_config
from drmas.training.engines.torch import TorchEngine
from drmas.training.state import capture_state, load_state, restore_state, save_state

ROOT = Path(__file__).parent.parent


def response_logprob(store: Store, artifact: str, tokenizer, table: pa.Table, tmp: Path) -> np.ndarray:
    """Summed log-prob of each row's response under the policy stored at ``artifact``."""
    model = load_model(store.open(artifact).download(tmp))
    rows = [dict(r, advantage=0.0) for r in table.to_pylist()]
    batch = collate(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch, want_entropy=False)
    return (logprobs * batch.response_mask).sum(-1).numpy()


def test_the_trainer_reads_log_probs_at_the_sampling_temperature(tmp_path):
    """Responses sampled at T = 0.5 carry the engine's log-probs of logits / 0.5: the
    trainer's first log-probs must equal them (gap ~0, nothing clipped), or every update
    at T != 1 would start from a skewed ratio."""
    config, store, policy, _ = make_run(tmp_path, "rollout.sampling.temperature=0.5")
    advantage(config, store, "run", 0)
    metrics = update(config, store, "run", 0, WG, policy, None).metrics
    assert metrics[f"wg/{WG}/logprob_gap"] < 1e-4
    assert metrics[f"wg/{WG}/clipfrac"] == 0.0


def test_advantage_stage_writes_batch_and_agent_metrics(tmp_path):
    config, store, _, _ = make_run(tmp_path)
    result = advantage(config, store, "run", 0)
    batch = store.open(result.artifact).read_table("batch.parquet", BATCH_SCHEMA)
    assert batch["group_id"].to_pylist()[:2] == ["u0/solver", "u0/verifier"]
    expected = compute_advantages(batch["score"].to_numpy(), batch["uid"], batch["traj_uid"], batch["agent"], "drmas")
    np.testing.assert_array_equal(batch["advantage"].to_numpy(), expected)
    # Each (prompt, agent) group has one success and one failure: +-0.7071 after the
    # unbiased std of [1, 0] (0.7071): (1 - 0.5) / 0.7071.
    assert sorted(set(np.round(batch["advantage"].to_numpy(), 4))) == [-0.7071, 0.7071]
    metrics = result.metrics
    assert metrics["agent/solver/calls"] == 4 and metrics["reward/mean"] == 0.5
    # Both agents see the team's reward distribution exactly: multiplier 1, no mean gap,
    # and the global baseline gives them the advantage scale Dr. MAS gives (ratio 1).
    assert metrics["agent/solver/lemma_multiplier"] == pytest.approx(1.0)
    assert metrics["agent/verifier/lemma_mean_gap"] == pytest.approx(0.0)
    assert metrics["agent/solver/adv_sq_ratio"] == pytest.approx(1.0, rel=1e-5)


def test_update_moves_the_policy_along_the_advantage(tmp_path):
    config, store, policy, tokenizer = make_run(tmp_path, "train.updates_per_iteration=3")
    advantage(config, store, "run", 0)
    result = update(config, store, "run", 0, WG, policy, None)
    table = store.open(stage_path(config.experiment.name, "run", 0, "advantage")).read_table("batch.parquet")
    before = response_logprob(store, policy.artifact, tokenizer, table, tmp_path / "before")
    after = response_logprob(store, result.artifact, tokenizer, table, tmp_path / "after")
    # Solver rows: per prompt, the rewarded answer gains log-probability relative to the
    # wrong one (verifier rows are identical text in both episodes, so they cancel out).
    gain = after - before
    solver = np.array(table["agent"].to_pylist()) == "solver"
    positive = table["advantage"].to_numpy() > 0
    assert gain[solver & positive].mean() > gain[solver & ~positive].mean() + 0.5
    metrics = result.metrics
    assert metrics[f"wg/{WG}/steps"] == 3 and metrics[f"wg/{WG}/skipped"] == 0
    assert metrics[f"wg/{WG}/grad_norm"] > 0 and metrics[f"wg/{WG}/logprob_gap"] < 1e-4
    assert metrics[f"wg/{WG}/tokens"] == sum(len(r) for r in table["response_ids"].to_pylist())
    # The written policy loads as a Hugging Face model, from safetensors.
    files = store.open(result.artifact).files
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)


def test_micro_batching_does_not_change_the_update(tmp_path):
    weights = []
    for name, overrides in {
        "one": ["train.micro_batch_size=1"],
        "all": ["train.micro_batch_size=64"],
        "tokens": ["train.max_tokens_per_micro_batch=40"],
    }.items():
        config, store, policy, _ = make_run(tmp_path / name, *overrides)
        advantage(config, store, "run", 0)
        result = update(config, store, "run", 0, WG, policy, None)
        weights.append(
            load_file(str(store.open(result.artifact).download(tmp_path / name / "w") / "model.safetensors"))
        )
    for other in weights[1:]:
        for key, value in weights[0].items():
            # Adam divides by sqrt(v): parameters with near-zero gradients turn summation-order
            # noise into visible differences; 1e-4 is 1% of one step at lr 0.01.
            torch.testing.assert_close(other[key], value, rtol=0, atol=1e-4)


def _updated(tmp_path: Path, *overrides: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The weights and metrics of the first update of a new run."""
    config, store, policy, _ = make_run(tmp_path, *overrides)
    advantage(config, store, "run", 0)
    result = update(config, store, "run", 0, WG, policy, None)
    return load_file(str(store.open(result.artifact).download(tmp_path / "w") / "model.safetensors")), result.metrics


def test_the_mean_over_micro_batches_weighs_short_micro_batches_more(tmp_path):
    """token-mean-per-micro-batch (veRL's) averages the micro-batches' token means: with
    one micro-batch it is token-mean exactly; with one row per micro-batch (rows of
    unequal lengths) a short row's tokens weigh more: another gradient, another update."""
    modes = {"token-mean": (), "per-micro-batch": ("algorithm.loss_aggregation=token-mean-per-micro-batch",)}
    whole = {
        mode: _updated(tmp_path / f"whole-{mode}", "train.micro_batch_size=64", *extra) for mode, extra in modes.items()
    }
    split = {
        mode: _updated(tmp_path / f"split-{mode}", "train.micro_batch_size=1", *extra) for mode, extra in modes.items()
    }
    (tokens, tokens_metrics), (micro, micro_metrics) = whole["token-mean"], whole["per-micro-batch"]
    assert all(torch.equal(tokens[key], micro[key]) for key in tokens)
    assert micro_metrics[f"wg/{WG}/grad_norm"] == tokens_metrics[f"wg/{WG}/grad_norm"]
    (tokens, tokens_metrics), (micro, micro_metrics) = split["token-mean"], split["per-micro-batch"]
    assert micro_metrics[f"wg/{WG}/grad_norm"] != pytest.approx(tokens_metrics[f"wg/{WG}/grad_norm"], rel=0.05)
    # Adam's first step is nearly the gradient's sign, whatever its scale: the weights move
    # apart less than the gradients, but beyond the 1e-4 that packing alone may cause.
    assert max(float((tokens[key] - micro[key]).abs().max()) for key in tokens) > 2e-4


def test_activation_checkpointing_recomputes_and_changes_nothing(tmp_path, monkeypatch):
    """train.gradient_checkpointing checkpoints the decoder layers (torch's checkpoint
    runs), every training forward runs without a KV cache, the update and the per-agent
    norms are those without it, and the saved policy's config is the one it started from."""
    import transformers.modeling_utils

    checkpointed, caches = [], []
    checkpoint = transformers.modeling_utils.checkpoint
    monkeypatch.setattr(
        transformers.modeling_utils, "checkpoint", lambda *a, **k: checkpointed.append(1) or checkpoint(*a, **k)
    )

    def load_and_watch(*args, **kwargs):
        model = load_model(*args, **kwargs)
        model.register_forward_pre_hook(
            lambda module, args, kwargs: caches.append(kwargs.get("use_cache")), with_kwargs=True
        )
        return model

    monkeypatch.setattr("drmas.models.load_model", load_and_watch)  # the update imports it when it trains
    results = {}
    for on in (False, True):
        config, store, policy, _ = make_run(
            tmp_path / str(on),
            f"train.gradient_checkpointing={on}",
            "diagnostics.per_agent_grad_norm=true",
            "train.micro_batch_size=2",
        )
        advantage(config, store, "run", 0)
        result = update(config, store, "run", 0, WG, policy, None)
        folder = store.open(result.artifact).download(tmp_path / str(on) / "out")
        results[on] = (
            load_file(str(folder / "model.safetensors")),
            result.metrics,
            json.loads((folder / "config.json").read_text()),
        )
        assert bool(checkpointed) == on
    assert caches and set(caches) == {False}
    (plain, plain_metrics, plain_config), (recomputed, metrics, saved_config) = results[False], results[True]
    assert all(torch.equal(plain[key], recomputed[key]) for key in plain)
    for agent in ("solver", "verifier"):
        assert metrics[f"agent/{agent}/grad_norm"] == pytest.approx(plain_metrics[f"agent/{agent}/grad_norm"], rel=1e-6)
    initial = json.loads((store.open(policy.artifact).download(tmp_path / "initial") / "config.json").read_text())
    assert saved_config == plain_config and saved_config["use_cache"] == initial["use_cache"]


def test_log_probs_computed_in_chunks_are_the_whole_computation_to_the_bit(tmp_path):
    """train.logprob_chunk_positions: the fp32 log-softmax and entropy over pieces of the
    sequence, each recomputed in the backward pass, give the same log-probs, entropies
    and gradients as all positions at once (every position's softmax is its own), and so
    the same update, with the KL term and the recomputed old log-probs on."""
    config, store, policy, tokenizer = make_run(tmp_path / "direct")
    model = load_model(store.open(policy.artifact).download(tmp_path / "policy"))
    table = store.open(stage_path("math-tiny", "run", 0, "rollout")).read_table("trajectories.parquet")
    batch = collate([dict(r, advantage=0.0) for r in table.to_pylist()], tokenizer.pad_token_id)
    temperature = torch.linspace(0.5, 1.5, len(batch.agents))
    outcomes = []
    for chunk in (None, 3):
        model.zero_grad()
        taken, entropy = token_logprobs(model, batch, want_entropy=True, temperature=temperature, chunk=chunk)
        (taken.sum() + entropy.sum()).backward()
        outcomes.append((taken, entropy, [p.grad.clone() for p in model.parameters()]))
    (taken, entropy, grads), (chunked, chunked_entropy, chunked_grads) = outcomes
    assert taken.shape[1] > 3  # more than one chunk
    assert torch.equal(taken, chunked) and torch.equal(entropy, chunked_entropy)
    assert all(torch.equal(a, b) for a, b in zip(grads, chunked_grads, strict=True))
    weights = []
    for chunk in ("null", "2"):
        config, store, policy, _ = make_run(
            tmp_path / chunk,
            f"train.logprob_chunk_positions={chunk}",
            "algorithm.kl_coef=0.1",
            "train.recompute_old_logprobs=true",
        )
        advantage(config, store, "run", 0)
        result = update(config, store, "run", 0, WG, policy, None, reference=policy)
        weights.append(
            load_file(str(store.open(result.artifact).download(tmp_path / chunk / "out") / "model.safetensors"))
        )
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


def test_only_the_positions_from_the_first_response_token_are_projected_to_the_vocabulary(tmp_path):
    """The prompts are most of an update's tokens: token_logprobs asks the model for logits
    from the batch's earliest response position on (logits_to_keep), and its response
    log-probs, entropies and the gradient of a response loss equal those computed from
    every position's logits."""
    config, store, policy, tokenizer = make_run(tmp_path)
    model = load_model(store.open(policy.artifact).download(tmp_path / "policy"))
    table = store.open(stage_path("math-tiny", "run", 0, "rollout")).read_table("trajectories.parquet")
    batch = collate([dict(r, advantage=0.0) for r in table.to_pylist()], tokenizer.pad_token_id)
    mask = batch.response_mask > 0
    first = int(mask.float().argmax(dim=1)[mask.any(dim=1)].min())
    assert first > 0  # the batch's prompts are not empty: there is something to leave out
    projected: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _, inputs, __: projected.append(inputs[0].shape[1]))
    model.zero_grad()
    taken, entropy = token_logprobs(model, batch, want_entropy=True)
    (taken * batch.response_mask).sum().backward()
    kept_grads = [p.grad.clone() for p in model.parameters()]
    hook.remove()
    assert projected == [batch.input_ids.shape[1] - first]

    model.zero_grad()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    whole = log_probs.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    whole_entropy = -(log_probs.exp() * log_probs).sum(-1)
    (whole * batch.response_mask).sum().backward()
    torch.testing.assert_close(taken[mask], whole[mask], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy[mask], whole_entropy[mask], rtol=1e-6, atol=1e-6)
    assert not taken[:, :first].any() and not entropy[:, :first].any()
    for kept, full in zip(kept_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(kept, full, rtol=1e-5, atol=1e-7)


def test_deepspeed_config_offloads_the_optimizer_from_zero1_on(tmp_path):
    """train.offload_optimizer puts Adam's state in host memory, keeping the torch AdamW
    (DeepSpeed refuses a client optimizer there unless told); ZeRO-0 has none to offload
    (refused with the config, tests/test_config.py)."""
    for stage in (1, 2, 3):
        config, _, _, _ = make_run(
            tmp_path / str(stage),
            "train.backend=deepspeed",
            f"train.zero_stage={stage}",
            "train.offload_optimizer=true",
        )
        ds = deepspeed_config(config, config.worker_groups()[0], 1)
        assert ds["zero_optimization"] == {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        assert ds["zero_force_ds_cpu_optimizer"] is False


def test_non_finite_gradient_skips_the_step(tmp_path):
    config, store, policy, _ = make_run(tmp_path)
    result = advantage(config, store, "run", 0)
    batch = store.open(result.artifact).read_table("batch.parquet")
    column = batch.schema.get_field_index("advantage")
    poisoned = batch.set_column(column, "advantage", pa.array([float("nan")] * batch.num_rows, pa.float32()))
    with store.writer(result.artifact, overwrite=True) as out:
        out.write_table("batch.parquet", poisoned, BATCH_SCHEMA)
    updated = update(config, store, "run", 0, WG, policy, None)
    assert updated.metrics[f"wg/{WG}/skipped"] == 1
    before = load_file(str(store.open(policy.artifact).download(tmp_path / "b") / "model.safetensors"))
    after = load_file(str(store.open(updated.artifact).download(tmp_path / "a") / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # no NaN reached the checkpoint


def _flatten_first_prompt(store: Store, artifact: str) -> int:
    """Sets the advantage of the first prompt's rows to 0, as a group whose episodes all
    scored alike has it; returns how many rows keep a non-zero advantage."""
    batch = store.open(artifact).read_table("batch.parquet")
    flat = np.array(batch["uid"].to_pylist()) == "u0"
    advantages = np.where(flat, 0.0, batch["advantage"].to_numpy())
    column = batch.schema.get_field_index("advantage")
    with store.writer(artifact, overwrite=True) as out:
        out.write_table(
            "batch.parquet", batch.set_column(column, "advantage", pa.array(advantages, pa.float32())), BATCH_SCHEMA
        )
    return int((~flat).sum())


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_rows_without_advantage_are_left_out_and_the_step_is_the_same(tmp_path, monkeypatch, aggregation):
    """Rows whose advantage is 0 add nothing to the gradient: the update leaves them out
    of every pass (old log-probs, the per-agent norms, the steps) and must give the
    weights that passing every row gives (``rows_with_gradient`` replaced by the identity
    for the reference run), with the same per-agent gradient norms."""
    import drmas.training.loop as loop

    results = {}
    for name in ("skipping", "every-row"):
        config, store, policy, _ = make_run(
            tmp_path / name,
            "train.updates_per_iteration=2",
            "train.recompute_old_logprobs=true",
            "diagnostics.per_agent_grad_norm=true",
            f"algorithm.loss_aggregation={aggregation}",
        )
        result = advantage(config, store, "run", 0)
        informative = _flatten_first_prompt(store, result.artifact)
        if name == "every-row":
            monkeypatch.setattr(loop, "rows_with_gradient", lambda rows, config: rows)
        updated = update(config, store, "run", 0, WG, policy, None)
        weights = load_file(str(store.open(updated.artifact).download(tmp_path / name / "w") / "model.safetensors"))
        results[name] = (weights, updated.metrics)
    (skipping, metrics), (every_row, reference) = results["skipping"], results["every-row"]
    assert metrics[f"wg/{WG}/rows_trained"] == informative == 4
    assert reference[f"wg/{WG}/rows_trained"] == reference[f"wg/{WG}/rows"] == 8
    assert metrics[f"wg/{WG}/tokens"] < reference[f"wg/{WG}/tokens"]
    for agent in ("solver", "verifier"):
        assert metrics[f"agent/{agent}/grad_norm"] == pytest.approx(reference[f"agent/{agent}/grad_norm"], rel=1e-5)
    assert metrics[f"wg/{WG}/grad_norm"] == pytest.approx(reference[f"wg/{WG}/grad_norm"], rel=1e-5)
    for key, value in every_row.items():
        torch.testing.assert_close(skipping[key], value, rtol=0, atol=1e-6)
    initial = load_file(str(store.open(policy.artifact).download(tmp_path / "initial") / "model.safetensors"))
    assert any(not torch.equal(skipping[key], value) for key, value in initial.items())  # the step moved them


def test_every_row_is_trained_when_the_loss_has_a_term_without_the_advantage(tmp_path):
    """A KL or entropy term has a gradient on every row, and veRL's per-micro-batch token
    mean's normaliser depends on how rows are packed: then no row is left out. With none
    of them, only the rows with an advantage stay, and one row when no row has one."""
    from drmas.config import load_config
    from drmas.training.loop import rows_with_gradient

    rows = [
        {"advantage": a, "prompt_ids": [1] * p, "response_ids": [2] * 3}
        for a, p in [(0.0, 5), (0.5, 4), (0.0, 2), (-0.5, 6)]
    ]
    config_of = lambda *o: load_config(ROOT / "configs" / "math_tiny.yaml", list(o))  # noqa: E731
    assert rows_with_gradient(rows, config_of()) == [rows[1], rows[3]]
    assert rows_with_gradient([rows[0], rows[2]], config_of()) == [rows[2]]  # the shortest
    for override in (
        "algorithm.kl_coef=0.1",
        "algorithm.entropy_coef=0.01",
        "algorithm.loss_aggregation=token-mean-per-micro-batch",
    ):
        assert rows_with_gradient(rows, config_of(override)) == rows, override


def test_per_agent_grad_norms_and_kl_to_the_reference(tmp_path):
    config, store, policy, _ = make_run(tmp_path, "diagnostics.per_agent_grad_norm=true", "algorithm.kl_coef=0.1")
    advantage(config, store, "run", 0)
    with pytest.raises(ValueError, match="needs a reference policy"):
        update(config, store, "run", 0, WG, policy, None)
    metrics = update(config, store, "run", 0, WG, policy, None, reference=policy).metrics
    solver, verifier = metrics["agent/solver/grad_norm"], metrics["agent/verifier/grad_norm"]
    assert solver > 0 and verifier > 0 and solver != verifier
    assert metrics[f"wg/{WG}/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is its reference


def _first_update(folder: Path, worker, *overrides: str):
    """A run's iteration-0 update, in ``worker`` (None: no pool worker, as torchrun runs it)."""
    import drmas.stages.update as U

    config, store, policy, _ = make_run(folder, *overrides)
    advantage(config, store, "run", 0)
    first = U.update_rank(worker, config, store.settings(), "run", 0, WG, policy, None, None, False, "")
    return config, store, PolicyRef(first.artifact), PolicyRef(optim_path(config.experiment.name, "run", 0, WG))


def test_a_pool_worker_continues_from_the_training_state_it_kept(tmp_path, monkeypatch):
    """With ``checkpoint.every=2`` the first update stores no optimizer state: its pool
    worker keeps the training state (offloaded), and the next update continues from it (no
    engine built, nothing read) to the bit where an update from the stored policy and
    optimizer state (every=1, no worker) ends. Without the worker that update fails, naming
    the state it would continue from (OptimizerStateLost)."""
    import drmas.stages.update as U
    from drmas.generation.workers import WorkerGroupRuntime

    built: list[str] = []
    start = U._start_training
    monkeypatch.setattr(U, "_start_training", lambda *args: built.append(args[3].artifact) or start(*args))
    config, _, _, _ = _first_update(tmp_path / "probe", None)  # the settings, for the worker
    worker = WorkerGroupRuntime(WG, config.store)
    config, store, policy, optim = _first_update(tmp_path / "warm", worker, "checkpoint.every=2")
    assert not store.exists(optim.artifact) and worker.status()["training"] == policy.artifact
    with pytest.raises(
        U.OptimizerStateLost, match=f"{optim.artifact}: the optimizer state .* is not stored.* no earlier"
    ):
        U.update_rank(None, config, store.settings(), "run", 0, WG, policy, optim, None, True, "")
    built.clear()
    warm = U.update_rank(worker, config, store.settings(), "run", 0, WG, policy, optim, None, True, "")
    assert built == []  # continued from the worker's state

    config, store_cold, policy, optim = _first_update(tmp_path / "cold", None)
    cold = U.update_rank(None, config, store_cold.settings(), "run", 0, WG, policy, optim, None, True, "")
    assert built[-1] == policy.artifact  # the cold update built its engine from the stored policy
    weights = [
        s.open(result.artifact).read_bytes("model.safetensors") for s, result in ((store, warm), (store_cold, cold))
    ]
    assert weights[0] == weights[1]
    steady = [{k: v for k, v in r.metrics.items() if not k.endswith(("/time", "tokens_per_s"))} for r in (warm, cold)]
    assert steady[0] == steady[1]


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    config, store, policy, _ = make_run(tmp_path, "train.warmup_steps=10")
    model = load_model(store.open(policy.artifact).download(tmp_path / "m"))
    group = config.worker_groups()[0]
    engine = TorchEngine(model, group, config)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    assert engine.step(engine.grad_norm())[0]
    save_state(capture_state(model, engine.optimizer, engine.scheduler), tmp_path / "state")
    fresh_model = load_model(store.open(policy.artifact).download(tmp_path / "m2"))
    fresh = TorchEngine(fresh_model, group, config)
    restore_state(load_state(tmp_path / "state"), fresh_model, fresh.optimizer, fresh.scheduler)
    assert fresh.lr() == engine.lr() == pytest.approx(0.01 * 2 / 10)  # warm-up step 2 of 10
    for (name, p), (_, q) in zip(model.named_parameters(), fresh_model.named_parameters(), strict=True):
        assert torch.equal(engine.optimizer.state[p]["exp_avg"], fresh.optimizer.state[q]["exp_avg"]), name
    # A pickle planted where the state belongs is refused by safetensors, never executed.
    marker = tmp_path / "pwned"
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "state" / "optimizer.safetensors").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(Exception, match="(?i)header|safetensor|deserializ"):
        load_state(tmp_path / "state")
    assert not marker.exists()


def _update_in_subprocess(tmp_path: Path, name: str, launcher: list[str], *overrides: str) -> dict[str, torch.Tensor]:
    config, store, policy, _ = make_run(tmp_path / name, *overrides)
    advantage(config, store, "run", 0)
    config_file = tmp_path / name / "config.json"
    config_file.write_text(config.model_copy(update={"store": StoreConfig(**store.settings().as_dict())}).to_json())
    command = [
        *launcher,
        "-m",
        "drmas.stages.update",
        "--config",
        str(config_file),
        "--run-id",
        "run",
        "--iteration",
        "0",
        "--wg",
        WG,
        "--policy",
        policy.artifact,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=torch_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["metrics"][f"wg/{WG}/skipped"] == 0
    return load_file(str(store.open(result["artifact"]).download(tmp_path / name / "out") / "model.safetensors"))


@pytest.mark.slow
def test_two_processes_give_the_same_update_as_one(tmp_path):
    overrides = ["train.micro_batch_size=2", "train.updates_per_iteration=2"]
    one = _update_in_subprocess(tmp_path, "one", torch_launcher(1), *overrides)
    two = _update_in_subprocess(tmp_path, "two", torch_launcher(2), *overrides)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_deepspeed_zero0_matches_plain_torch(tmp_path):
    overrides = ["train.micro_batch_size=2", "train.updates_per_iteration=2"]
    plain = _update_in_subprocess(tmp_path, "torch", [sys.executable], *overrides)
    speed = _update_in_subprocess(
        tmp_path, "ds", [sys.executable], *overrides, "train.backend=deepspeed", "train.zero_stage=0"
    )
    for key in plain:
        torch.testing.assert_close(speed[key], plain[key], rtol=0, atol=1e-4)


ZERO_PARITY = """
import sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from helpers import make_run, WG
import drmas.stages.update as U
import drmas.training.engines.deepspeed as DS
from drmas.stages.advantage import advantage
from drmas.infra.layout import optim_path
import json
from deepspeed.runtime.engine import DeepSpeedEngine
from drmas.generation.workers import WorkerGroupRuntime
from drmas.infra.layout import PolicyRef
from safetensors.torch import load_file
config_for = DS.deepspeed_config
def small_params_partitioned(config, group, world):  # DeepSpeed keeps parameters this small whole otherwise
    ds = config_for(config, group, world)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return ds
DS.deepspeed_config = small_params_partitioned
moved = []  # DeepSpeed's own offload and reload, called by a kept engine between updates
def recorded(name, real):
    return lambda self, *args, **kwargs: moved.append(name) or real(self, *args, **kwargs)
for name in ("offload_states", "reload_states"):
    setattr(DeepSpeedEngine, name, recorded(name, getattr(DeepSpeedEngine, name)))
weights, kept = {}, {}
for label in ("0", "1", "2", "3", "2+offload", "3+offload", "0+kept", "1+kept", "3+kept", "3+offload+kept"):
    stage, offload = label[0], "+offload" in label
    tmp = Path(tempfile.mkdtemp(dir=sys.argv[2]))
    config, store, policy, _ = make_run(
        tmp, "train.backend=deepspeed", f"train.zero_stage={stage}", f"train.offload_optimizer={offload}",
        "train.micro_batch_size=2",
    )
    advantage(config, store, "run", 0)
    worker = WorkerGroupRuntime(WG, config.store) if "+kept" in label else None
    args = (config, store.settings(), "run", 0, WG)
    first = U.update_rank(worker, *args, policy, None, None, False, "")
    optim = PolicyRef(optim_path(config.experiment.name, "run", 0, WG))
    moved.clear()
    second = U.update_rank(worker, *args, PolicyRef(first.artifact), optim, None, True, "")
    kept[label] = list(moved)
    weights[label] = load_file(str(store.open(second.artifact).download(tmp / "w") / "model.safetensors"))
gaps = {label: max(float((weights[label][k] - weights["0"][k]).abs().max()) for k in weights["0"]) for label in weights}
print("GAPS", gaps)
print("MOVED", json.dumps(kept))
print("GAP", max(gaps.values()))
"""


@pytest.mark.slow
def test_deepspeed_zero_stages_save_and_resume_alike(tmp_path):
    """Two updates with the optimizer state saved and restored in between: ZeRO-1, -2 and
    -3 (moments gathered per parameter; ZeRO-3's weights gathered for saving), also with
    the optimizer offloaded to host memory, end where ZeRO-0 does; so do two updates in a
    pool worker that keeps the engine in between, moved out and back by DeepSpeed's own
    ``offload_states``/``reload_states`` (ZeRO >= 1)."""
    done = subprocess.run(
        [sys.executable, "-c", ZERO_PARITY, str(Path(__file__).parent), str(tmp_path)],
        capture_output=True,
        text=True,
        env=torch_env(threads=None),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    gap = float(done.stdout.split("GAP ")[-1])
    assert gap < 1e-5, done.stdout
    moved = json.loads(done.stdout.split("MOVED ")[-1].splitlines()[0])
    assert moved["0+kept"] == [] and moved["1"] == []  # ZeRO-0 moves tensors itself; nothing kept: no moves
    assert all(moved[label] == ["reload_states", "offload_states"] for label in ("1+kept", "3+kept", "3+offload+kept"))


def test_recomputed_old_logprobs_replace_the_engines(tmp_path):
    """With rollout log-probs that are off by 0.5 nats, the ratio starts at exp(0.5) unless
    the trainer recomputes the old policy; recomputed, the first step is unclipped."""
    config, store, policy, _ = make_run(tmp_path, "algorithm.advantage=grpo")
    path = stage_path(config.experiment.name, "run", 0, "rollout")
    table = store.open(path).read_table("trajectories.parquet")
    shifted = [[v - 0.5 for v in row] for row in table["rollout_logprobs"].to_pylist()]
    table = table.set_column(
        table.schema.get_field_index("rollout_logprobs"), "rollout_logprobs", pa.array(shifted, pa.list_(pa.float32()))
    )
    with store.writer(path, overwrite=True) as out:
        out.write_table("trajectories.parquet", table)
    advantage(config, store, "run", 0)
    trusted = update(config, store, "run", 0, WG, policy, None).metrics
    config = config.model_copy(update={"train": config.train.model_copy(update={"recompute_old_logprobs": True})})
    recomputed = update(config, store, "run", 0, WG, policy, None, overwrite=True).metrics
    assert trusted[f"wg/{WG}/logprob_gap"] == pytest.approx(0.5, abs=1e-3)  # measured either way
    assert recomputed[f"wg/{WG}/logprob_gap"] == pytest.approx(0.5, abs=1e-3)
    assert trusted[f"wg/{WG}/clipfrac"] > 0.4 and recomputed[f"wg/{WG}/clipfrac"] == 0.0
