"""Orchestras by name: the built-in ones, or a user's by import path.

The config checks agent names against an orchestra's ``agents`` before anything runs, so
a typo in an agent name fails at load time, not an hour into a rollout. A user's
orchestra is named ``package.module:ClassName``; its class declares ``agents``, a mapping
from agent name to agent class (see ``drmas.team.orchestras`` for the interface).
"""

from __future__ import annotations

import importlib
from typing import Any

BUILTIN_ORCHESTRAS: dict[str, str] = {
    "math": "drmas.team.orchestras:MathOrchestra",  # Solver <-> Verifier refinement loop
    "solo": "drmas.team.orchestras:SoloOrchestra",  # one Solver call: single-agent GRPO
    "search": "drmas.team.orchestras:SearchOrchestra",  # Verifier routes to Search or Answer
}


def load_orchestra(name: str) -> Any:
    """The orchestra class for a built-in name or an import path, or a clear ValueError."""
    path = BUILTIN_ORCHESTRAS.get(name, name)
    if ":" not in path:
        known = ", ".join(sorted(BUILTIN_ORCHESTRAS))
        raise ValueError(
            f"unknown orchestra {name!r}: use one of {known}, or an import path "
            "'package.module:ClassName' to a class with an 'agents' attribute"
        )
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import orchestra {name!r}: {error}") from None


def orchestra_agents(name: str) -> tuple[str, ...]:
    """The agent names that orchestra ``name`` drives."""
    agents = getattr(load_orchestra(name), "agents", None)
    if not agents or not all(isinstance(agent, str) for agent in agents):
        raise ValueError(f"orchestra {name!r} must declare 'agents' (a mapping or tuple of names)")
    return tuple(agents)
