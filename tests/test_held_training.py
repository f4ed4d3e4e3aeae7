"""A run whose pool loses the training state it held between updates (``checkpoint.every``
> 1: the optimizer state is stored only every N-th iteration) goes back to its last stored
state and goes on, in the same ``drmas run``; what it recomputes equals what it had."""

from __future__ import annotations

import logging

import pytest
from helpers import ROOT, TINY_OVERRIDES

from drmas.config import load_config
from drmas.infra.layout import optim_path, policy_path
from drmas.infra.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_a_run_that_loses_its_pool_goes_back_to_its_last_stored_optimizer_state(
    local_ray, tmp_path, monkeypatch, caplog
):
    """every=2 over 2 iterations: iteration 0's optimizer states live only in the pool's
    workers. They are killed before iteration 1's first update: the rebuilt workers hold no
    state, the update fails (OptimizerStateLost) and the run goes back to the start
    (iteration 0's rollout reused, its updates recomputed to the same bytes), then on to
    the end, where it stores the states."""
    import ray

    import drmas.runner as runner
    from drmas.generation.named_pool import NAMESPACE, run_workers

    config = load_config(
        ROOT / "configs" / "math_tiny.yaml",
        [
            *TINY_OVERRIDES,
            "experiment.iterations=2",
            "checkpoint.every=2",
            "eval.every=0",
            "warmstart.steps=0",
            f"store.root={tmp_path}",
        ],
    )
    store, experiment = Store(str(tmp_path)), config.experiment.name
    first_policy: dict[str, bytes] = {}
    real_update = runner.update

    def update_after_losing_the_pool(config, store, run_id, i, wg, *args, **kwargs):
        if i == 1 and not first_policy:
            for group in ("solver", "verifier"):
                first_policy[group] = store.open(policy_path(experiment, run_id, 0, group)).read_bytes(
                    "model.safetensors"
                )
            for name in run_workers(f"drmas.{experiment}.{run_id}"):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=False)  # Ray restarts it, empty
        return real_update(config, store, run_id, i, wg, *args, **kwargs)

    monkeypatch.setattr(runner, "update", update_after_losing_the_pool)
    rollout = f"{experiment}/r/iter-000000/rollout"
    runner.open_run(config, store, "r", resume=False)
    with caplog.at_level(logging.INFO, logger="drmas"):
        summary = runner.train(config, store, "r", cache_dir=tmp_path / "cache")
    assert summary.last_iteration == 1
    assert "going back to iteration 0, after the last stored optimizer state" in caplog.text
    for group in ("solver", "verifier"):
        assert store.open(policy_path(experiment, "r", 0, group)).read_bytes("model.safetensors") == first_policy[group]
        assert not store.exists(optim_path(experiment, "r", 0, group))
        assert store.exists(optim_path(experiment, "r", 1, group))
    assert store.exists(rollout)
