"""Content-addressed stage caching, with the same rule as Kubeflow's: a stage's output is
reused when the stage, the content of its input artifacts, the config fields it reads and
the code that computes it are all the same; otherwise it is recomputed. What each stage depends on,
and the key made from it, is its contract (``drmas.stages.contracts``).

The key is stored in the output artifact's manifest (``meta.cache_key``), so it appears
and disappears with the output itself.
"""

from __future__ import annotations

from drmas.infra.store import Store

__all__ = ["is_cached"]


def is_cached(store: Store, path: str, key: str) -> bool:
    """Whether a complete output with this key is at ``path``."""
    return store.exists(path) and store.open(path).meta.get("cache_key") == key
