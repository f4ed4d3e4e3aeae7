"""Evaluate: the team on the eval split, k episodes per question (avg@k, pass@k)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.images import GPU_IMAGE


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def evaluate(
    config_json: str,
    policies: Input[Model],
    results: Output[Dataset],
    metrics: Output[Metrics],
    label: str = "evaluate",
    force: bool = False,
):
    """Evaluate the policy set ``policies`` (a checkpoint, or the warm start) on the eval
    set of the config; ``eval.parquet`` and metrics go to ``{home}/{label}`` beside it
    (``iter-{i}/evaluate``, or ``init/evaluate`` before training). An empty ``label``
    names the output after the eval settings, ``evaluate-{hash}``, as ``drmas eval`` does,
    so evaluations of one checkpoint on different eval sets do not overwrite each other.
    """
    import hashlib
    import json
    import math

    from drmas.caching import cache_key, is_cached
    from drmas.config import DrmasConfig
    from drmas.evaluate import evaluate as evaluate_stage
    from drmas.runner import PoolOnDemand
    from drmas.store import Store
    from drmas.workers import PolicyRef

    config = DrmasConfig.from_json(config_json)
    store = Store.from_config(config.store)
    refs = {wg: PolicyRef(**ref) for wg, ref in policies.metadata["policies"].items()}
    iteration = int(policies.metadata["iteration"])  # KFP metadata numbers come back as floats
    if not label:
        settings = json.dumps({"data": config.data_spec("eval"), "eval": config.eval.model_dump()}, sort_keys=True)
        label = f"evaluate-{hashlib.sha256(settings.encode()).hexdigest()[:8]}"
    path = f"{policies.metadata['home']}/{label}"
    key = cache_key(config, "evaluate", store, {f"policy/{wg}": ref.artifact for wg, ref in refs.items()})
    reused = not force and is_cached(store, path, key)
    if not reused:
        with PoolOnDemand(config, store, None) as pool:
            evaluate_stage(config, store, path, refs, pool(), overwrite=True, cache_key=key)
    print(f"drmas: evaluate iter {iteration} {'reused' if reused else 'computed'} {store.uri(path)}", flush=True)

    values = store.open(path).read_json("metrics.json")
    results.metadata.update(
        {
            "store_uri": store.uri(path),
            "artifact": path,
            "fingerprint": store.fingerprint(path, ignore=("metrics.json",)),
            "iteration": iteration,
        }
    )
    with open(results.path, "w") as handle:
        json.dump(results.metadata, handle, indent=2)
    # KFP metadata cannot hold NaN or infinity (e.g. a statistic of a one-row group).
    for name, value in values.items():
        if math.isfinite(value):
            metrics.log_metric(name, float(value))
    with open(metrics.path, "w") as handle:
        json.dump({name: value if math.isfinite(value) else str(value) for name, value in values.items()}, handle, indent=2)
