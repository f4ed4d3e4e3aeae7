"""Which agents each orchestra drives, by orchestra name.

The config checks agent names against this before anything runs, so a typo in an agent
name fails at load time, not an hour into a rollout. Built-in orchestras are declared
here; a user's orchestra is named by import path (``package.module:ClassName``) and
declares its agents in a class attribute ``agents`` (a tuple of names).
"""

from __future__ import annotations

import importlib

BUILTIN_ORCHESTRA_AGENTS: dict[str, tuple[str, ...]] = {
    # Solver <-> Verifier refinement loop (DESIGN.md section 5).
    "math": ("solver", "verifier"),
    # Verifier routes to Search or Answer each turn (DESIGN.md section 5).
    "search": ("verifier", "search", "answer"),
}


def orchestra_agents(name: str) -> tuple[str, ...]:
    """The agent names that orchestra ``name`` needs, or a ValueError that says why not."""
    if name in BUILTIN_ORCHESTRA_AGENTS:
        return BUILTIN_ORCHESTRA_AGENTS[name]
    if ":" not in name:
        known = ", ".join(sorted(BUILTIN_ORCHESTRA_AGENTS))
        raise ValueError(
            f"unknown orchestra {name!r}: use one of {known}, or an import path "
            "'package.module:ClassName' to a class with an 'agents' attribute"
        )
    module_name, _, attribute = name.partition(":")
    try:
        orchestra = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import orchestra {name!r}: {error}") from None
    agents = getattr(orchestra, "agents", None)
    if not agents or not all(isinstance(agent, str) for agent in agents):
        raise ValueError(f"orchestra {name!r} must declare 'agents' as a tuple of names")
    return tuple(agents)
