"""Evaluate: the team on the eval split, k episodes per question (avg@k, pass@k)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from drmas_kfp.components.images import GPU_IMAGE


@dsl.component(base_image=GPU_IMAGE, install_kfp_package=False)
def evaluate(
    config_json: str,
    policies: Input[Model],
    results: Output[Dataset],
    metrics: Output[Metrics],
    label: str = "evaluate",
    run_id: str = "",
    force: bool = False,
):
    """Evaluate the policy set ``policies`` (a checkpoint, or the warm start) on the eval
    set of the config; ``eval.parquet`` and metrics go to ``{home}/{label}`` beside it
    (``iter-{i}/evaluate``, or ``init/evaluate`` before training). An empty ``label``
    names the output after the eval settings, ``evaluate-{hash}``, as ``drmas eval`` does,
    so evaluations of one checkpoint on different eval sets do not overwrite each other;
    ``final`` is the run's final evaluation, with ``eval.final``'s settings.
    ``run_id``: the run whose pool it uses (found warm); empty: a pool of its own.
    """
    from drmas.generation.pool import PoolOnDemand
    from drmas.infra.layout import METRICS_FILE, PolicyRef
    from drmas.stages.contracts import EvaluateContract, cache_key, evaluation_config
    from drmas.stages.evaluate import evaluate as evaluate_stage
    from drmas.stages.io import check_inputs, open_stage, publish, publish_metrics, reuse_or_compute

    config, store = open_stage(config_json)
    check_inputs(store, run_id, "the evaluation", policies)
    refs = {wg: PolicyRef(**ref) for wg, ref in policies.metadata["policies"].items()}
    iteration = int(policies.metadata["iteration"])  # KFP metadata numbers come back as floats
    contract = EvaluateContract(policies.metadata["home"], refs, label)
    key = cache_key(config, store, contract)
    path = contract.output(config)

    def compute():
        run = (config.experiment.name, run_id) if run_id else None
        with PoolOnDemand(config, store, None, run=run) as pool:
            evaluate_stage(evaluation_config(config, label), store, path, refs, pool(), overwrite=True, cache_key=key)

    reuse_or_compute(config, store, contract, key, force, compute, label=f"{label or 'evaluate'} iter {iteration}")
    publish(store, path, results, iteration)
    publish_metrics(store.open(path).read_json(METRICS_FILE), metrics)
