"""The Kubeflow layer over the drmas library.

    drmas_kfp.components   one thin KFP component per stage (their bodies call drmas.stages);
                           the folder components/ at the top of the repository
    drmas_kfp.pipelines    the DAGs built from a config; compile, submit, kfp.local; the
                           folder pipelines/ (pyproject.toml's package-dir maps both)
    drmas_kfp.cli          ``drmas compile``, ``drmas submit``, ``drmas run --via kfp-local``

The library never imports this package; ``drmas.cli`` registers the commands of
``drmas_kfp.cli``, which imports kfp (the ``kubeflow`` extra) only when a command builds a
pipeline. This module imports nothing, so importing a component loads only the standard
library and kfp.
"""
