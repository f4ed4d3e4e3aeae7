"""Advantage: scores, groups and agent-wise (Dr. MAS) or GRPO advantages."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output

from components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def advantage(
    config_json: str,
    run_id: str,
    iteration: int,
    trajectories: Input[Dataset],
    batch: Output[Dataset],
    metrics: Output[Metrics],
    force: bool = False,
):
    """``iter-{i}/rollout/trajectories.parquet`` -> ``iter-{i}/advantage/batch.parquet``
    (reused when stored with the same cache key, unless ``force``)."""
    import json
    import math

    from drmas.advantage import advantage as advantage_stage
    from drmas.caching import cache_key, is_cached
    from drmas.config import DrmasConfig
    from drmas.layout import stage_path
    from drmas.store import Store

    config = DrmasConfig.from_json(config_json)
    store = Store.from_config(config.store)
    source = stage_path(config.experiment.name, run_id, iteration, "rollout")
    if trajectories.metadata.get("artifact") != source:
        given = trajectories.metadata.get("store_uri") or trajectories.uri
        raise ValueError(f"the advantage of iteration {iteration} reads {store.uri(source)}, but was given {given}")
    path = stage_path(config.experiment.name, run_id, iteration, "advantage")
    key = cache_key(config, "advantage", store, {"rollout": source})
    reused = not force and is_cached(store, path, key)
    if not reused:
        advantage_stage(config, store, run_id, iteration, overwrite=True, cache_key=key)
    print(f"drmas: advantage iter {iteration} {'reused' if reused else 'computed'} {store.uri(path)}", flush=True)

    values = store.open(path).read_json("metrics.json")
    batch.metadata.update(
        {"store_uri": store.uri(path), "artifact": path, "fingerprint": store.fingerprint(path, ignore=("metrics.json",)), "iteration": iteration}
    )
    with open(batch.path, "w") as handle:
        json.dump(batch.metadata, handle, indent=2)
    # KFP metadata cannot hold NaN or infinity (e.g. a statistic of a one-row group).
    for name, value in values.items():
        if math.isfinite(value):
            metrics.log_metric(name, float(value))
    with open(metrics.path, "w") as handle:
        json.dump({name: value if math.isfinite(value) else str(value) for name, value in values.items()}, handle, indent=2)
