"""Update: one worker group's clipped policy-gradient step on its rows of the batch."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from drmas_kfp.components.images import GPU_IMAGE


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
    (reused when stored with the same cache key, unless ``force``; computed again, the next
    version beside them, ``{wg}@v{n}``: a policy once written is never rewritten). A thin Ray driver: the
    update runs data-parallel on the run's pool workers of ``wg``, which keep the new
    weights for the next rollout."""
    from drmas.generation.pool import PoolOnDemand
    from drmas.infra.layout import METRICS_FILE, PolicyRef
    from drmas.stages.contracts import UpdateContract, cache_key
    from drmas.stages.io import check_inputs, expect_input, open_stage, publish, publish_metrics, reuse_or_compute
    from drmas.stages.update import update as update_stage

    config, store = open_stage(config_json)
    if wg not in policies.metadata["policies"]:
        raise ValueError(f"worker group {wg!r} has no policy in {policies.metadata.get('store_uri')}")
    current = PolicyRef(**policies.metadata["policies"][wg])
    optim = PolicyRef(**policies.metadata["optims"][wg]) if policies.metadata["optims"].get(wg) else None
    anchor = PolicyRef(**reference.metadata["policies"][wg])
    contract = UpdateContract(run_id, iteration, wg, current, optim, anchor)
    expect_input(batch, contract.inputs(config)["batch"], store, f"the update of iteration {iteration}")
    check_inputs(store, run_id, f"the update of {wg} in iteration {iteration}", batch, policies, reference)
    key = cache_key(config, store, contract)

    def compute():
        with PoolOnDemand(config, store, None, run=(config.experiment.name, run_id)) as pool:
            update_stage(
                config, store, run_id, iteration, wg, current, optim, anchor, overwrite=True, cache_key=key, pool=pool()
            )

    reuse_or_compute(config, store, contract, key, force, compute, label=f"policy/{wg} iter {iteration}")
    path, optim_out = contract.stored_output(config, store), contract.stored_optim_output(config, store)
    publish(store, path, policy, iteration, wg=wg, optim=optim_out, optim_uri=store.uri(optim_out))
    publish_metrics(store.open(path).read_json(METRICS_FILE), metrics)
