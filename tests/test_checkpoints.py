"""Checkpoints that fit a disk: the optimizer state is stored every ``checkpoint.every``-th
iteration and after the last (the pool holds it in between); the checkpoint stage keeps the
last ``checkpoint.keep`` every-N-th ones (the latest among them when it is one) and the
latest, and deletes the rest; policies are all kept,
or with ``checkpoint.prune_policies`` only those a resume or a later stage can read; a resume
starts from the latest iteration whose optimizer state was stored."""

from __future__ import annotations

import pytest
from helpers import ROOT

from drmas.config import load_config
from drmas.infra.layout import PolicyRef, optim_path, policy_path, run_path
from drmas.infra.store import Store
from drmas.stages.checkpoint import checkpoint, prune_optimizer_states, resume_point

RUN = "run"


def stored_run(tmp_path, iterations: int, *overrides: str):
    """A store holding, for iterations 0..iterations-1, a (tiny, fake) policy and optimizer
    state per worker group, as the updates write them."""
    config = load_config(ROOT / "configs" / "math_tiny.yaml", ["workers.sharing=none", *overrides])
    store = Store(str(tmp_path / "store"))
    for i in range(iterations):
        for group in config.worker_groups():
            for path in (policy_path, optim_path):
                with store.writer(path(config.experiment.name, RUN, i, group.name)) as out:
                    out.write_bytes("state.bin", f"{path.__name__} {i} {group.name}".encode())
    return config, store


def optim_iterations(config, store) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in store.list(run_path(config.experiment.name, RUN)):
        *_, iteration, kind, wg = path.split("/")
        if kind == "optim":
            found.setdefault(wg, []).append(int(iteration.removeprefix("iter-")))
    return found


@pytest.mark.parametrize(
    ("every", "keep", "left"),
    [(2, 1, [5]), (2, 2, [3, 5]), (2, None, [1, 3, 5]), (4, 2, [3, 5]), (4, 1, [3, 5]), (10, 1, [5])],
)
def test_only_the_every_nth_and_the_latest_optimizer_states_stay(tmp_path, every, keep, left):
    settings = [f"checkpoint.every={every}"] + ([f"checkpoint.keep={keep}"] if keep else [])
    config, store = stored_run(tmp_path, 6, *settings)
    pruned = prune_optimizer_states(config, store, RUN, 5)
    assert sorted(pruned) == [i for i in range(5) if i not in left]
    assert optim_iterations(config, store) == {"solver": left, "verifier": left}
    policies = [p for p in store.list(run_path(config.experiment.name, RUN)) if "/policy/" in p]
    assert len(policies) == 6 * 2  # every policy stays


def test_the_default_keeps_every_optimizer_state(tmp_path):
    config, store = stored_run(tmp_path, 3)
    assert prune_optimizer_states(config, store, RUN, 2) == []
    assert optim_iterations(config, store) == {"solver": [0, 1, 2], "verifier": [0, 1, 2]}


def test_the_checkpoint_stage_prunes_and_the_latest_checkpoint_stays_whole(tmp_path):
    """Checkpointing iterations 0..3 one after another with every=2, keep=1: iteration 1's
    state stays until iteration 3's, an every-2nd one too, is checkpointed; then only that.
    The latest checkpoint (where a resume starts) names only states that exist, unchanged."""
    config, store = stored_run(tmp_path, 4, "checkpoint.every=2", "checkpoint.keep=1")
    left = []
    for i in range(4):
        checkpoint(config, store, RUN, i, {})
        left.append([s for s in optim_iterations(config, store)["solver"] if s <= i])
    assert left == [[0], [1], [1, 2], [3]]
    assert optim_iterations(config, store) == {"solver": [3], "verifier": [3]}
    latest = store.open(f"{run_path(config.experiment.name, RUN)}/iter-000003/checkpoint").read_json("checkpoint.json")
    for entry in latest["worker_groups"].values():
        assert store.fingerprint(entry["optim"]) == entry["optim_manifest"]


def test_a_rerun_that_needs_a_pruned_optimizer_state_says_so(tmp_path):
    from drmas.runner import rerun

    config, store = stored_run(tmp_path, 4, "checkpoint.every=2", "checkpoint.keep=1")
    for i in range(4):
        checkpoint(config, store, RUN, i, {})
    with pytest.raises(
        ValueError, match=r"optimizer state of iteration 2.*is not in the store \(stored every checkpoint.every 2-th"
    ):
        rerun(config, store, RUN, 3, "update")


def test_a_resume_starts_after_the_last_stored_optimizer_state(tmp_path, monkeypatch):
    """every=3 over 5 iterations: the updates store the optimizer states of iterations 2
    and 4 (the last) only. A checkpoint names a state the pool held with no manifest; a
    resume goes back to after the last iteration whose states are stored, or to the start."""
    from drmas.stages.checkpoint import read_checkpoint, resume_point

    monkeypatch.setattr("drmas.stages.checkpoint.check_policy", lambda *args: None)  # the policies are fakes
    config, store = stored_run(tmp_path, 4, "checkpoint.every=3", "experiment.iterations=5")
    experiment = config.experiment.name
    assert [i for i in range(5) if config.stores_optimizer(i)] == [2, 4]
    for i in range(4):
        if not config.stores_optimizer(i):
            for group in config.worker_groups():
                store.delete(optim_path(experiment, RUN, i, group.name))
    for i in range(2):
        checkpoint(config, store, RUN, i, {})
    assert resume_point(config, store, RUN).next_iteration == 0  # nothing stored yet: from the start
    for i in range(2, 4):
        checkpoint(config, store, RUN, i, {})
    last = f"{run_path(experiment, RUN)}/iter-000003/checkpoint"
    entries = store.open(last).read_json("checkpoint.json")["worker_groups"]
    assert {entry["optim_manifest"] for entry in entries.values()} == {None}
    assert read_checkpoint(config, store, last).next_iteration == 4  # readable: the held state is named
    start = resume_point(config, store, RUN)
    assert start.next_iteration == 3
    assert start.optims == {wg: PolicyRef(optim_path(experiment, RUN, 2, wg)) for wg in ("solver", "verifier")}


def policy_iterations(config, store) -> list[int]:
    paths = store.list(run_path(config.experiment.name, RUN))
    return sorted({int(p.split("/")[2].removeprefix("iter-")) for p in paths if "/policy/" in p})


def test_pruned_policies_leave_those_a_resume_and_the_next_stages_read(tmp_path, monkeypatch, capsys):
    """every=2, keep=1, prune_policies over 6 iterations, checkpointed one after another
    (the updates store the optimizer states of iterations 1, 3 and 5 only): after each
    checkpoint the policies left are those of the kept states and every one from the
    latest stored state on; the run resumes after its last iteration, whose checkpoint
    names only what is stored; and ``drmas eval`` of a pruned iteration says so."""
    from drmas.cli import main
    from drmas.stages.iteration import evaluation_outputs

    monkeypatch.setattr("drmas.stages.checkpoint.check_policy", lambda *args: None)  # the policies are fakes
    overrides = ["checkpoint.every=2", "checkpoint.keep=1", "checkpoint.prune_policies=true", "experiment.iterations=6"]
    config, store = stored_run(tmp_path, 6, *overrides)
    for i in range(6):
        if not config.stores_optimizer(i):
            for group in config.worker_groups():
                store.delete(optim_path(config.experiment.name, RUN, i, group.name))
    left = []
    for i in range(6):
        checkpoint(config, store, RUN, i, {})
        for path in evaluation_outputs(config, RUN, i):  # as the evaluations after it write them
            with store.writer(path) as out:
                out.write_json("metrics.json", {})
        left.append([p for p in policy_iterations(config, store) if p <= i])
    assert left == [[0], [1], [1, 2], [3], [3, 4], [5]]
    assert resume_point(config, store, RUN).next_iteration == 6

    with store.writer(f"{run_path(config.experiment.name, RUN)}/run") as out:  # the run's record
        out.write_json("run.json", {})
    cli = [f"store.root={tmp_path / 'store'}", "workers.sharing=none", *overrides]
    assert main(["eval", str(ROOT / "configs" / "math_tiny.yaml"), "--run-id", RUN, "--iteration", "4", *cli]) == 1
    assert "iter-000004/policy/solver: the policy of iteration 4 is no longer stored" in capsys.readouterr().err


def test_the_default_keeps_every_policy(tmp_path):
    config, store = stored_run(tmp_path, 4, "checkpoint.every=2", "checkpoint.keep=1")
    for i in range(4):
        checkpoint(config, store, RUN, i, {})
    assert policy_iterations(config, store) == [0, 1, 2, 3]
