"""Checkpoint: commit an iteration once every worker group's update is in the store."""

from kfp import dsl
from kfp.dsl import Input, Metrics, Model, Output

from drmas_kfp.components.images import CPU_IMAGE

MAX_WORKER_GROUPS = 8
"""Update slots of the checkpoint component (``update_0`` ... ``update_7``): a KFP
component has a fixed signature, and fanning in with ``dsl.Collected`` would need a
``ParallelFor``, which kfp.local 2.17.3 gets wrong; the pipelines fill one slot per worker
group and refuse configs with more groups."""


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def checkpoint(
    config_json: str,
    run_id: str,
    iteration: int,
    checkpoint: Output[Model],
    metrics: Output[Metrics],
    update_0: Input[Model] = None,
    update_1: Input[Model] = None,
    update_2: Input[Model] = None,
    update_3: Input[Model] = None,
    update_4: Input[Model] = None,
    update_5: Input[Model] = None,
    update_6: Input[Model] = None,
    update_7: Input[Model] = None,
    force: bool = False,
):
    """Write ``iter-{i}/checkpoint`` naming every worker group's new policy and optimizer
    state (one ``update_k`` per worker group) with the iteration's metrics; the output is
    the policy set the next iteration starts from."""
    from drmas.infra.layout import METRICS_FILE, current_update, iteration_path
    from drmas.stages.checkpoint import checkpoint as checkpoint_stage
    from drmas.stages.checkpoint import training_metrics
    from drmas.stages.contracts import CheckpointContract, cache_key
    from drmas.stages.io import check_inputs, open_stage, policy_set, publish, publish_metrics, reuse_or_compute

    config, store = open_stage(config_json)
    experiment = config.experiment.name
    updates = [
        u for u in (update_0, update_1, update_2, update_3, update_4, update_5, update_6, update_7) if u is not None
    ]
    check_inputs(store, run_id, f"the checkpoint of iteration {iteration}", *updates)
    given = {u.metadata["wg"]: u.metadata["artifact"] for u in updates}
    groups = [group.name for group in config.worker_groups()]
    current = {wg: current_update(store, experiment, run_id, iteration, wg) for wg in groups}
    expected = {wg: policy for wg, (policy, _) in current.items()}
    if given != expected:
        raise ValueError(f"the checkpoint of iteration {iteration} needs the updates {expected}, got {given}")
    optims = {wg: optim for wg, (_, optim) in current.items()}
    contract = CheckpointContract(run_id, iteration)
    key = cache_key(config, store, contract)
    path = contract.output(config)

    def compute():
        values = training_metrics(config, store, run_id, iteration)
        checkpoint_stage(config, store, run_id, iteration, values, overwrite=True, cache_key=key)

    reuse_or_compute(config, store, contract, key, force, compute, label=f"checkpoint iter {iteration}")
    home = iteration_path(experiment, run_id, iteration)
    publish(
        store, path, checkpoint, iteration, **policy_set(store, home, {wg: (expected[wg], "") for wg in groups}, optims)
    )
    publish_metrics(store.open(path).read_json(METRICS_FILE), metrics)
