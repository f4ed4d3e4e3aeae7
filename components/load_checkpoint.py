"""Load a checkpoint imported by URI (``dsl.importer``) as a policy set."""

from kfp import dsl
from kfp.dsl import Input, Model, Output

from components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def load_checkpoint(
    config_json: str,
    checkpoint: Input[Model],
    policies: Output[Model],
    run_id: str = "",
    next_iteration: int = -1,
):
    """The policy set recorded by ``checkpoint`` (an ``iter-{i}/checkpoint`` artifact of
    the store, typically imported by its URI), after checking that every policy and
    optimizer state it names is intact (as resuming does).

    ``next_iteration`` >= 0 requires the checkpoint to be of the iteration before it.
    A ``run_id`` records the run's config in the store (or checks it against the recorded
    one, as ``drmas run --resume`` does) for the run that continues from here.
    """
    from drmas.layout import run_path
    from drmas.runner import open_run
    from drmas.stage_io import open_stage, policy_set, publish
    from drmas.store import MANIFEST, CorruptArtifact

    config, store = open_stage(config_json)
    path = checkpoint.metadata.get("artifact")
    if not path:
        uri = checkpoint.uri.rstrip("/")
        if not uri.startswith(store.root + "/"):
            raise ValueError(f"checkpoint {uri} is not in the store of this config ({store.root})")
        path = uri[len(store.root) + 1 :]
    record = store.open(path).read_json("checkpoint.json")
    if next_iteration >= 0 and record["iteration"] != next_iteration - 1:
        raise ValueError(
            f"{store.uri(path)} is the checkpoint of iteration {record['iteration']}; iteration {next_iteration} "
            f"continues from iteration {next_iteration - 1} (compile with --start-iteration {record['iteration'] + 1})"
        )
    groups = [group.name for group in config.worker_groups()]
    for wg in groups:
        entry = record["worker_groups"].get(wg)
        if entry is None:
            raise CorruptArtifact(f"{store.uri(path)} has no worker group {wg!r} (config changed?)")
        for kind in ("policy", "optim"):
            if store.fingerprint(entry[kind]) != entry[f"{kind}_manifest"]:
                raise CorruptArtifact(f"{store.uri(entry[kind], MANIFEST)}: differs from what {store.uri(path)} recorded")
    if run_id:
        open_run(config, store, run_id, resume=store.exists(f"{run_path(config.experiment.name, run_id)}/run"))
    print(f"drmas: load_checkpoint iter {record['iteration']} {store.uri(path)}", flush=True)

    entries = {wg: record["worker_groups"][wg] for wg in groups}
    policy_refs = {wg: (entry["policy"], "") for wg, entry in entries.items()}
    optims = {wg: entry["optim"] for wg, entry in entries.items()}
    publish(store, path, policies, record["iteration"], **policy_set(store, path.rsplit("/", 1)[0], policy_refs, optims))
