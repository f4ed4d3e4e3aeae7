"""Advantage: scores, groups and agent-wise (Dr. MAS) or GRPO advantages."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output

from drmas_kfp.components.images import CPU_IMAGE


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
    from drmas.infra.layout import METRICS_FILE
    from drmas.stages.advantage import advantage as advantage_stage
    from drmas.stages.contracts import AdvantageContract, cache_key
    from drmas.stages.io import check_inputs, expect_input, open_stage, publish, publish_metrics, reuse_or_compute

    config, store = open_stage(config_json)
    contract = AdvantageContract(run_id, iteration)
    expect_input(trajectories, contract.inputs(config)["rollout"], store, f"the advantage of iteration {iteration}")
    check_inputs(store, run_id, f"the advantage of iteration {iteration}", trajectories)
    key = cache_key(config, store, contract)
    path = contract.output(config)

    def compute():
        advantage_stage(config, store, run_id, iteration, overwrite=True, cache_key=key)

    reuse_or_compute(config, store, contract, key, force, compute, label=f"advantage iter {iteration}")
    publish(store, path, batch, iteration)
    publish_metrics(store.open(path).read_json(METRICS_FILE), metrics)
