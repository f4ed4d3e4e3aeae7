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

    from drmas.infra.layout import init_policy_path, run_path
    from drmas.runner import open_run, starting_policies
    from drmas.stages.io import METRICS_FILE, announce, open_stage, policy_set, publish, publish_metrics
    from drmas.stages.policies import init_policies
    from drmas.stages.warmstart import warmstart_path

    config, store = open_stage(config_json)
    run = run_path(config.experiment.name, run_id)
    open_run(config, store, run_id, resume=store.exists(f"{run}/run"))
    groups = [group.name for group in config.worker_groups()]
    outputs = {
        wg: warmstart_path(config, run_id, wg)
        if config.warmstart.steps
        else init_policy_path(config.experiment.name, run_id, wg)
        for wg in groups
    }
    reused = not force and all(store.exists(path) for path in outputs.values())
    if force:
        init_policies(config, store, run_id, overwrite=True)
        for wg in groups:
            if config.warmstart.steps:
                store.delete(warmstart_path(config, run_id, wg))
    refs = starting_policies(config, store, run_id)
    announce("warmstart", reused, store.uri(run))

    values = {}
    for wg, ref in refs.items():
        artifact = store.open(ref.artifact)
        if METRICS_FILE in artifact.files:
            values |= {f"wg/{wg}/{name}": float(value) for name, value in artifact.read_json(METRICS_FILE).items()}
    # Not one artifact but one per worker group: the fingerprint of the set is a hash of theirs.
    prints = {wg: store.fingerprint(ref.artifact, ignore=(METRICS_FILE,)) for wg, ref in sorted(refs.items())}
    extra = policy_set(
        store, f"{run}/init", {wg: (ref.artifact, ref.prefix) for wg, ref in refs.items()}, {wg: None for wg in refs}
    )
    publish(store, run, policies, -1, fingerprint=hashlib.sha256(json.dumps(prints).encode()).hexdigest(), **extra)
    publish_metrics(values, metrics)
