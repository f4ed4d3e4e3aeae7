"""A policy once written is never rewritten (issue 29 §5): an update computed again (a
resubmitted part recomputes every update since the last stored optimizer state) writes the
next version beside the first, ``policy/{wg}@v2`` with ``optim/{wg}@v2``; readers by layout
(the checkpoint, a resume, the cache keys) take the newest, and a task or a metric that came
from the first still finds it unchanged. Real tiny models and a real local store."""

from __future__ import annotations

from helpers import WG, make_run

import drmas.stages.update as U
from drmas.infra.layout import current_update, optim_path, policy_path, stored_versions
from drmas.stages.advantage import advantage
from drmas.stages.checkpoint import checkpoint, read_checkpoint
from drmas.stages.contracts import UpdateContract, cache_key, reuses


def test_an_update_computed_again_writes_the_next_version_and_keeps_the_first(tmp_path):
    config, store, policy, _ = make_run(tmp_path)
    advantage(config, store, "run", 0)
    experiment = config.experiment.name
    base, state = policy_path(experiment, "run", 0, WG), optim_path(experiment, "run", 0, WG)
    contract = UpdateContract("run", 0, WG, policy, None, policy)
    args = (config, store.settings(), "run", 0, WG)

    first = U.update_rank(None, *args, policy, None, None, True, cache_key(config, store, contract))
    assert first.artifact == base and first.metrics[f"wg/{WG}/policy_version"] == 1.0
    kept = {name: store.open(base).read_bytes(name) for name in store.open(base).files}
    checkpoint(config, store, "run", 0, {})
    assert reuses(config, store, contract, cache_key(config, store, contract))

    again = U.update_rank(None, *args, policy, None, None, True, "another key")
    assert again.artifact == f"{base}@v2" and again.metrics[f"wg/{WG}/policy_version"] == 2.0
    assert {name: store.open(base).read_bytes(name) for name in store.open(base).files} == kept
    assert stored_versions(store, base) == stored_versions(store, state) == [1, 2]
    assert current_update(store, experiment, "run", 0, WG) == (f"{base}@v2", f"{state}@v2")
    assert not reuses(config, store, contract, cache_key(config, store, contract))  # the newest has another key

    written = checkpoint(config, store, "run", 0, {}, overwrite=True)
    resumed = read_checkpoint(config, store, written.artifact)
    assert resumed.policies[WG].artifact == f"{base}@v2"
    assert resumed.optims[WG] is not None and resumed.optims[WG].artifact == f"{state}@v2"
