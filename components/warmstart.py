"""Warm start: every worker group's initial policy, then supervised warm start."""

from kfp import dsl
from kfp.dsl import Metrics, Model, Output

from components.images import GPU_IMAGE


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def warmstart(
    config_json: str,
    run_id: str,
    policies: Output[Model],
    metrics: Output[Metrics],
    force: bool = False,
):
    """The policy set that iteration 0 starts from (and the KL anchor): each worker group's
    initial policy, fine-tuned on demonstrations when ``warmstart.steps`` > 0.

    Also records the run's resolved config in the store (``{run}/run/config.json``), or
    checks it against the recorded one, as ``drmas run`` does, so a run started here can
    be resumed, rerun or evaluated by the other drmas commands. ``force`` rebuilds the
    initial policies and redoes the warm start.
    """
    import hashlib
    import json
    import math

    from drmas.config import DrmasConfig
    from drmas.layout import init_policy_path, run_path
    from drmas.policies import init_policies
    from drmas.runner import open_run, starting_policies
    from drmas.store import Store
    from drmas.warmstart import warmstart_path

    config = DrmasConfig.from_json(config_json)
    store = Store.from_config(config.store)
    run = run_path(config.experiment.name, run_id)
    open_run(config, store, run_id, resume=store.exists(f"{run}/run"))
    groups = [group.name for group in config.worker_groups()]
    outputs = {wg: warmstart_path(config, run_id, wg) if config.warmstart.steps else init_policy_path(config.experiment.name, run_id, wg) for wg in groups}
    reused = not force and all(store.exists(path) for path in outputs.values())
    if force:
        init_policies(config, store, run_id, overwrite=True)
        for wg in groups:
            if config.warmstart.steps:
                store.delete(warmstart_path(config, run_id, wg))
    refs = starting_policies(config, store, run_id)
    print(f"drmas: warmstart {'reused' if reused else 'computed'} {store.uri(run)}", flush=True)

    values = {}
    for wg, ref in refs.items():
        artifact = store.open(ref.artifact)
        if "metrics.json" in artifact.files:
            values |= {f"wg/{wg}/{name}": float(value) for name, value in artifact.read_json("metrics.json").items()}
    prints = {wg: store.fingerprint(ref.artifact, ignore=("metrics.json",)) for wg, ref in sorted(refs.items())}
    policies.metadata.update(
        {
            "store_uri": store.uri(run),
            "artifact": run,
            "fingerprint": hashlib.sha256(json.dumps(prints).encode()).hexdigest(),
            "iteration": -1,
            "home": f"{run}/init",
            "policies": {wg: {"artifact": ref.artifact, "prefix": ref.prefix} for wg, ref in refs.items()},
            "optims": {wg: None for wg in refs},
            "policy_uris": {wg: store.uri(ref.artifact) for wg, ref in refs.items()},
        }
    )
    with open(policies.path, "w") as handle:
        json.dump(policies.metadata, handle, indent=2)
    # KFP metadata cannot hold NaN or infinity (e.g. a statistic of a one-row group).
    for name, value in values.items():
        if math.isfinite(value):
            metrics.log_metric(name, float(value))
    with open(metrics.path, "w") as handle:
        json.dump({name: value if math.isfinite(value) else str(value) for name, value in values.items()}, handle, indent=2)
