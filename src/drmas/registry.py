"""Tasks and orchestras by name: the built-in ones, or a user's by import path.

``task.name`` and ``task.orchestra`` name either a built-in (below) or a class anywhere on
the path, ``package.module:ClassName``. Built-ins are import paths too, so naming one
imports only its own module (the search task needs bm25s, math does not). The config
checks agent names against an orchestra's ``agents`` before anything runs, so a typo in an
agent name fails at load time, not an hour into a rollout.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

__all__ = ["BUILTIN_ORCHESTRAS", "BUILTIN_TASKS", "get_task", "load_orchestra", "orchestra_agents"]

BUILTIN_TASKS: dict[str, str] = {
    "math": "drmas.tasks.math:MathTask",  # Solver <-> Verifier on arithmetic, GSM8K, MATH, DAPO
    "search": "drmas.tasks.search.task:SearchTask",  # Verifier routes to Search or Answer over BM25
}

BUILTIN_ORCHESTRAS: dict[str, str] = {
    "math": "drmas.tasks.math:MathOrchestra",  # Solver <-> Verifier refinement loop
    "solo": "drmas.tasks.math:SoloOrchestra",  # one Solver call: single-agent GRPO
    "search": "drmas.tasks.search.task:SearchOrchestra",  # Verifier routes to Search or Answer
}


def _load(kind: str, name: str, builtin: dict[str, str], shape: str) -> Any:
    """The class that ``name`` names, or a ValueError that lists the built-in names."""
    path = builtin.get(name, name)
    if ":" not in path:
        known = ", ".join(sorted(builtin))
        raise ValueError(
            f"unknown {kind} {name!r}: use one of {known}, or an import path 'package.module:ClassName' to {shape}"
        )
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import {kind} {name!r}: {error}") from None


@functools.cache
def get_task(name: str) -> Any:
    """The task that ``name`` names (instantiated once: tasks hold no state), a
    ``drmas.tasks.Task``; ``drmas.tasks.task_for`` gives it typed for a config."""
    return _load("task", name, BUILTIN_TASKS, "a class implementing drmas.tasks.Task")()


def load_orchestra(name: str) -> Any:
    """The orchestra class that ``name`` names."""
    return _load("orchestra", name, BUILTIN_ORCHESTRAS, "a class with an 'agents' attribute")


def orchestra_agents(name: str) -> tuple[str, ...]:
    """The agent names that orchestra ``name`` drives."""
    agents = getattr(load_orchestra(name), "agents", None)
    if not agents or not all(isinstance(agent, str) for agent in agents):
        raise ValueError(f"orchestra {name!r} must declare 'agents' (a mapping or tuple of names)")
    return tuple(agents)
