"""Rollout: the team plays every episode of an iteration on the Ray pool."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.images import GPU_IMAGE


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

    Joins the RayCluster named by ``ray.address`` or starts a local Ray, and shuts down the
    Ray it started. The output is reused when the store holds it with the same cache key
    (``drmas.caching``) unless ``force``.
    """
    import json
    import math

    from drmas.caching import cache_key, is_cached
    from drmas.config import DrmasConfig
    from drmas.layout import stage_path
    from drmas.rollout import rollout as rollout_stage
    from drmas.runner import PoolOnDemand
    from drmas.store import Store
    from drmas.workers import PolicyRef

    config = DrmasConfig.from_json(config_json)
    store = Store.from_config(config.store)
    refs = {wg: PolicyRef(**ref) for wg, ref in policies.metadata["policies"].items()}
    path = stage_path(config.experiment.name, run_id, iteration, "rollout")
    key = cache_key(config, "rollout", store, {f"policy/{wg}": ref.artifact for wg, ref in refs.items()}, iteration=iteration)
    reused = not force and is_cached(store, path, key)
    if not reused:
        with PoolOnDemand(config, store, None) as pool:
            rollout_stage(config, store, run_id, iteration, refs, pool(), overwrite=True, cache_key=key)
    print(f"drmas: rollout iter {iteration} {'reused' if reused else 'computed'} {store.uri(path)}", flush=True)

    values = store.open(path).read_json("metrics.json")
    trajectories.metadata.update(
        {"store_uri": store.uri(path), "artifact": path, "fingerprint": store.fingerprint(path, ignore=("metrics.json",)), "iteration": iteration}
    )
    with open(trajectories.path, "w") as handle:
        json.dump(trajectories.metadata, handle, indent=2)
    # KFP metadata cannot hold NaN or infinity (e.g. a statistic of a one-row group).
    for name, value in values.items():
        if math.isfinite(value):
            metrics.log_metric(name, float(value))
    with open(metrics.path, "w") as handle:
        json.dump({name: value if math.isfinite(value) else str(value) for name, value in values.items()}, handle, indent=2)
