"""One typed config for a drmas run: YAML in, overrides on the command line, JSON out.

    config.schema    the sections and their checks; the resolved config's helpers
    config.loading   YAML, overrides, errors, and the task plugins' defaults and checks
    config.docs      every field with its documentation (``drmas config --docs``)

This package re-exports what callers use, so ``from drmas.config import DrmasConfig,
load_config`` reads the same wherever the names live.
"""

from drmas.config.loading import apply_overrides, load_config, plugin_problems, resolve
from drmas.config.schema import *  # noqa: F403 - the sections, by name, for every caller
from drmas.config.schema import __all__ as _schema_names
from drmas.weights import PolicyError, local_model_problem, weights_problem

__all__ = [
    *_schema_names,
    "PolicyError",
    "apply_overrides",
    "load_config",
    "local_model_problem",
    "plugin_problems",
    "resolve",
    "weights_problem",
]
