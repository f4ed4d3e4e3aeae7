"""The stages of an iteration, one module each, mapping one-to-one onto the Kubeflow
components (``drmas_kfp.components``): initial policies, warm start, rollout, advantage,
update, checkpoint, evaluate; ``io`` is the glue the components share."""
