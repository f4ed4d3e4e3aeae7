"""Content-addressed stage caching, with the same rule as Kubeflow's: a stage's output is
reused when the stage, the content of its input artifacts, the config fields it reads and
the code version are all the same; otherwise it is recomputed.

The key is stored in the output artifact's manifest (``meta.cache_key``), so it appears
and disappears with the output itself.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from drmas import __version__
from drmas.config import DrmasConfig
from drmas.infra.store import Store

__all__ = ["STAGE_FIELDS", "cache_key", "is_cached"]

STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "rollout": ("experiment.seed", "task", "data", "models", "agents", "workers", "rollout"),
    "advantage": ("algorithm",),
    "update": ("experiment.seed", "models", "agents", "workers", "algorithm", "train", "diagnostics"),
    "evaluate": ("experiment.seed", "task", "data", "models", "agents", "workers", "eval", "rollout.max_prompt_tokens", "rollout.truncation", "rollout.engine"),
    "checkpoint": ("workers",),
}
"""The config each stage reads: a change anywhere else leaves its cached output valid."""


def _select(resolved: dict[str, Any], dotted: str) -> Any:
    node: Any = resolved
    for part in dotted.split("."):
        node = node[part]
    return node


def cache_key(config: DrmasConfig, stage: str, store: Store, inputs: dict[str, str], **values: Any) -> str:
    """Key of ``stage`` given its input artifacts (paths, fingerprinted by content), plain
    input values (e.g. the iteration), the config fields it reads, and the code version."""
    resolved = json.loads(config.to_json())
    payload = {
        "stage": stage,
        "config": {name: _select(resolved, name) for name in STAGE_FIELDS[stage]},
        # metrics.json reports timings: it is not an input, and would make every key new.
        "inputs": {name: store.fingerprint(path, ignore=("metrics.json",)) for name, path in sorted(inputs.items())},
        "values": values,
        "code": __version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def is_cached(store: Store, path: str, key: str) -> bool:
    """Whether a complete output with this key is at ``path``."""
    return store.exists(path) and store.open(path).meta.get("cache_key") == key
