"""Load a checkpoint imported by URI (``dsl.importer``) as a policy set."""

from kfp import dsl
from kfp.dsl import Input, Model, Output

from drmas_kfp.components.images import CPU_IMAGE


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
    from drmas.infra.layout import run_record_path
    from drmas.runner import open_run
    from drmas.stages.checkpoint import read_checkpoint
    from drmas.stages.io import open_stage, policy_set, publish

    config, store = open_stage(config_json)
    path = checkpoint.metadata.get("artifact")
    if not path:
        uri = checkpoint.uri.rstrip("/")
        if not uri.startswith(store.root + "/"):
            raise ValueError(f"checkpoint {uri} is not in the store of this config ({store.root})")
        path = uri[len(store.root) + 1 :]
    found = read_checkpoint(config, store, path)
    if next_iteration >= 0 and found.next_iteration != next_iteration:
        raise ValueError(
            f"{store.uri(path)} is the checkpoint of iteration {found.next_iteration - 1}; iteration {next_iteration} "
            f"continues from iteration {next_iteration - 1} (compile with --start-iteration {found.next_iteration})"
        )
    if run_id:
        open_run(config, store, run_id, resume=store.exists(run_record_path(config.experiment.name, run_id)))
    print(f"drmas: load_checkpoint iter {found.next_iteration - 1} {store.uri(path)}", flush=True)

    policy_refs = {wg: (ref.artifact, "") for wg, ref in found.policies.items()}
    optims = {wg: ref.artifact for wg, ref in found.optims.items()}
    publish(
        store,
        path,
        policies,
        found.next_iteration - 1,
        **policy_set(store, path.rsplit("/", 1)[0], policy_refs, optims),
    )
