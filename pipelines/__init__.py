"""Kubeflow pipelines: DAGs of the components in ``components/``, built from a config.

    pipelines.build     training_pipeline, iteration_pipeline, evaluation_pipeline,
                        build_pipeline (by name, with its arguments), compile_pipeline
    pipelines.platform  placement of each stage's pod (resources, nodes, S3 secret)
    pipelines.local     run a pipeline with kfp.local on this machine
    pipelines.submit    submit a compiled pipeline to a KFP API server

``drmas compile``, ``drmas submit`` and ``drmas run --via kfp-local`` use these.
"""
