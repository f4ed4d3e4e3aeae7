"""Rollout: the team plays every episode of an iteration on the Ray pool."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from drmas_kfp.components.images import GPU_IMAGE


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def rollout(
    config_json: str,
    run_id: str,
    iteration: int,
    policies: Input[Model],
    trajectories: Output[Dataset],
    metrics: Output[Metrics],
    force: bool = False,
):
    """Roll out ``iteration`` with the policy set ``policies`` (the warm start or the previous
    checkpoint): ``iter-{i}/rollout/trajectories.parquet`` in the store.

    Joins the RayCluster named by ``ray.address`` (or ``RAY_ADDRESS``: the one Ray of a
    kfp.local run) or starts a local Ray, and shuts down the Ray it started; the run's pool
    of workers is found warm when an earlier task left it (a thin Ray driver). The output is
    reused when the store holds it with the same cache key (``drmas.stages.contracts``) unless
    ``force``.
    """
    from drmas.generation.pool import PoolOnDemand
    from drmas.infra.layout import METRICS_FILE, PolicyRef
    from drmas.stages.contracts import RolloutContract, cache_key
    from drmas.stages.io import check_inputs, open_stage, publish, publish_metrics, reuse_or_compute
    from drmas.stages.rollout import rollout as rollout_stage

    config, store = open_stage(config_json)
    check_inputs(store, run_id, f"the rollout of iteration {iteration}", policies)
    refs = {wg: PolicyRef(**ref) for wg, ref in policies.metadata["policies"].items()}
    contract = RolloutContract(run_id, iteration, refs)
    key = cache_key(config, store, contract)
    path = contract.output(config)

    def compute():
        with PoolOnDemand(config, store, None, run=(config.experiment.name, run_id)) as pool:
            rollout_stage(config, store, run_id, iteration, refs, pool(), overwrite=True, cache_key=key)

    reuse_or_compute(config, store, contract, key, force, compute, label=f"rollout iter {iteration}")
    publish(store, path, trajectories, iteration)
    publish_metrics(store.open(path).read_json(METRICS_FILE), metrics)
