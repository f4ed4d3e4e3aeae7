"""Update: one worker group's clipped policy-gradient step on its rows of the batch."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.images import GPU_IMAGE


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def update(
    config_json: str,
    run_id: str,
    iteration: int,
    wg: str,
    batch: Input[Dataset],
    policies: Input[Model],
    reference: Input[Model],
    policy: Output[Model],
    metrics: Output[Metrics],
    force: bool = False,
):
    """Update worker group ``wg`` from its policy (and optimizer state) in the policy set
    ``policies`` on its rows of ``batch``; ``reference`` is the KL anchor (the run's
    starting policies). Writes ``iter-{i}/policy/{wg}`` and ``iter-{i}/optim/{wg}``
    (reused when stored with the same cache key, unless ``force``)."""
    import json
    import math

    from drmas.caching import cache_key, is_cached
    from drmas.config import DrmasConfig
    from drmas.layout import optim_path, policy_path, stage_path
    from drmas.store import Store
    from drmas.update import update as update_stage
    from drmas.workers import PolicyRef

    config = DrmasConfig.from_json(config_json)
    store = Store.from_config(config.store)
    experiment = config.experiment.name
    source = stage_path(experiment, run_id, iteration, "advantage")
    if batch.metadata.get("artifact") != source:
        given = batch.metadata.get("store_uri") or batch.uri
        raise ValueError(f"the update of iteration {iteration} reads {store.uri(source)}, but was given {given}")
    if wg not in policies.metadata["policies"]:
        raise ValueError(f"worker group {wg!r} has no policy in {policies.metadata.get('store_uri')}")
    current = PolicyRef(**policies.metadata["policies"][wg])
    optim = PolicyRef(**policies.metadata["optims"][wg]) if policies.metadata["optims"].get(wg) else None
    anchor = PolicyRef(**reference.metadata["policies"][wg])
    inputs = {"batch": source, "policy": current.artifact}
    if optim is not None:
        inputs["optim"] = optim.artifact
    if config.algorithm.kl_coef:
        inputs["reference"] = anchor.artifact
    path = policy_path(experiment, run_id, iteration, wg)
    key = cache_key(config, "update", store, inputs, iteration=iteration, wg=wg)
    reused = not force and is_cached(store, path, key)
    if not reused:
        update_stage(config, store, run_id, iteration, wg, current, optim, anchor, overwrite=True, cache_key=key)
    print(f"drmas: policy/{wg} iter {iteration} {'reused' if reused else 'computed'} {store.uri(path)}", flush=True)

    values = store.open(path).read_json("metrics.json")
    optim_out = optim_path(experiment, run_id, iteration, wg)
    policy.metadata.update(
        {
            "store_uri": store.uri(path),
            "artifact": path,
            "fingerprint": store.fingerprint(path, ignore=("metrics.json",)),
            "iteration": iteration,
            "wg": wg,
            "optim": optim_out,
            "optim_uri": store.uri(optim_out),
        }
    )
    with open(policy.path, "w") as handle:
        json.dump(policy.metadata, handle, indent=2)
    # KFP metadata cannot hold NaN or infinity (e.g. a statistic of a one-row group).
    for name, value in values.items():
        if math.isfinite(value):
            metrics.log_metric(name, float(value))
    with open(metrics.path, "w") as handle:
        json.dump({name: value if math.isfinite(value) else str(value) for name, value in values.items()}, handle, indent=2)
