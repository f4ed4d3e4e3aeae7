"""The Kubeflow layer over the drmas library.

    drmas_kfp.components   one thin KFP component per stage (their bodies call drmas.stages)
    drmas_kfp.pipelines    the DAGs built from a config; compile, submit, kfp.local

The library never imports this package; the command line reaches it lazily for
``drmas compile``, ``drmas submit`` and ``drmas run --via kfp-local``. This module imports
nothing, so importing a component loads only the standard library and kfp.
"""
