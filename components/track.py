"""Tracking steps: a Kubeflow run of drmas is one MLflow run, as an embedded run is.

    track_start   -> mlflow (Markdown: the MLflow run's link)   opens the run, tags the KFP run id
    track         checkpoint / evaluation -> (nothing)           logs one iteration from the store
    track_end     checkpoint -> mlflow (Markdown: link and figures)  report, registered policies

Small CPU steps beside the stages (drmas.stages.track does the work, as for the embedded
runner): they read what the stages stored and never fail the pipeline. Their artifact
inputs order them after the stages they log; KFP's cache skips a step whose input is
the same artifact as in an earlier run, so a rerun does not log an iteration twice.
"""

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Model, Output

from drmas_kfp.components.images import CPU_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def track_start(
    config_json: str, run_id: str, first_iteration: int, kfp_run_id: str, image: str, mlflow: Output[Markdown]
):
    """Open the drmas run's MLflow run (found by its ``drmas.run_id`` tag, or created with
    the config as params), tag it with this KFP run's id and the image, and publish its
    link (KFP's Visualizations tab)."""
    from drmas.stages.io import open_stage
    from drmas.stages.track import track_start as start

    config, store = open_stage(config_json)
    page = start(config, store, run_id, first_iteration, {"kfp.run_id": kfp_run_id, "drmas.image": image})
    with open(mlflow.path, "w") as handle:
        handle.write(page)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def track(
    config_json: str,
    run_id: str,
    iteration: int,
    checkpoint: Input[Model] = None,
    evaluation: Input[Dataset] = None,
):
    """Log iteration ``iteration`` (its checkpoint's metrics with its evaluation's, lineage,
    sample agent calls, trajectories) at step ``iteration + 1``; ``-1``: the evaluation
    before training, at step 0. The inputs only order the step after what it logs."""
    from drmas.stages.io import open_stage
    from drmas.stages.track import track_iteration

    config, store = open_stage(config_json)
    track_iteration(config, store, run_id, iteration)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def track_end(config_json: str, run_id: str, last_iteration: int, checkpoint: Input[Model], mlflow: Output[Markdown]):
    """After the pipeline's last iteration: the report (store and MLflow) and, when it is
    the run's last iteration, each worker group's policy registered and the MLflow run
    ended; publish the link and the headline figures."""
    from drmas.stages.io import open_stage
    from drmas.stages.track import track_end as end

    config, store = open_stage(config_json)
    page = end(config, store, run_id, last_iteration)
    with open(mlflow.path, "w") as handle:
        handle.write(page)
