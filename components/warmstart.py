"""Warm start: every worker group's initial policy, then supervised warm start."""

from kfp import dsl
from kfp.dsl import Metrics, Model, Output

from drmas_kfp.components.images import GPU_IMAGE


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

    from drmas.infra.layout import (
        METRICS_FILE,
        init_home,
        init_policy_path,
        run_path,
        run_record_path,
        warmstart_path,
    )
    from drmas.runner import open_run, starting_policies
    from drmas.stages.io import announce, open_stage, policy_set, publish, publish_metrics
    from drmas.stages.policies import init_policies

    config, store = open_stage(config_json)
    experiment = config.experiment.name
    run = run_path(experiment, run_id)
    open_run(config, store, run_id, resume=store.exists(run_record_path(experiment, run_id)))
    groups = [group.name for group in config.worker_groups()]
    where = warmstart_path if config.warmstart.steps else init_policy_path
    outputs = [where(experiment, run_id, wg) for wg in groups]

    def stored_keys() -> list:
        return [store.open(path).meta.get("cache_key") if store.exists(path) else None for path in outputs]

    before = stored_keys()
    if force:
        init_policies(config, store, run_id, overwrite=True)
        for wg in groups if config.warmstart.steps else ():
            store.delete(warmstart_path(experiment, run_id, wg))
    refs = starting_policies(config, store, run_id)
    announce("warmstart", not force and stored_keys() == before, store.uri(run))

    values = {}
    for wg, ref in refs.items():
        artifact = store.open(ref.artifact)
        if METRICS_FILE in artifact.files:
            values |= {f"wg/{wg}/{name}": float(value) for name, value in artifact.read_json(METRICS_FILE).items()}
    # Not one artifact but one per worker group: the fingerprint of the set is a hash of theirs.
    prints = {wg: store.fingerprint(ref.artifact, ignore=(METRICS_FILE,)) for wg, ref in sorted(refs.items())}
    extra = policy_set(
        store,
        init_home(experiment, run_id),
        {wg: (ref.artifact, ref.prefix) for wg, ref in refs.items()},
        {wg: None for wg in refs},
    )
    publish(store, run, policies, -1, fingerprint=hashlib.sha256(json.dumps(prints).encode()).hexdigest(), **extra)
    publish_metrics(values, metrics)
