"""Loading a config: YAML, ``a.b=value`` overrides, readable errors, and what depends on the
task plugins (``drmas.registry``), which the schema (``config.schema``) cannot know:

- ``plugin_problems``: the task can be imported, the agents are the orchestra's, and a
  model named by a local folder is a model folder;
- ``resolve``: the task's defaults written into the config (``task.orchestra``,
  ``data.train``, ``data.eval``), so that the resolved config (the KFP parameter, a run's
  record) reads them as plain fields, and a stage that opens it imports no task plugin.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from drmas.config.schema import ConfigError, DrmasConfig, Location, did_you_mean, dotted, explain, looks_local
from drmas.registry import get_task, orchestra_agents
from drmas.weights import local_model_problem

__all__ = ["apply_overrides", "load_config", "plugin_problems", "resolve"]


def plugin_problems(config: DrmasConfig) -> list[str]:
    """What the task plugins find wrong with a config, one message per problem, each naming
    the field: an unknown task or orchestra, agents the orchestra does not drive (or that
    it needs), a model folder that is not one."""
    try:
        task = get_task(config.task.name)
    except ValueError as error:
        return [f"task.name: {error}"]
    orchestra = config.task.orchestra or task.default_orchestra
    try:
        expected = orchestra_agents(orchestra)
    except ValueError as error:
        return [f"task.orchestra: {error}"]
    problems = []
    names = [agent.name for agent in config.agents]
    for index, name in enumerate(names):
        if names.index(name) == index and name not in expected:
            problems.append(
                f"agents[{index}].name: orchestra {orchestra!r} has no agent "
                f"{name!r}{did_you_mean(name, expected)} (its agents: {', '.join(expected)})"
            )
    problems += [
        f"agents: orchestra {orchestra!r} needs agent {name!r}, which is not configured"
        for name in expected
        if name not in names
    ]
    for index, agent in enumerate(config.agents):
        if agent.model not in config.models and looks_local(agent.model):
            folder = Path(agent.model).expanduser()
            if not folder.exists():
                problems.append(
                    f"agents[{index}].model: {agent.model!r} is neither a key of models "
                    f"({', '.join(config.models) or 'none defined'}) nor an existing folder"
                )
            elif problem := local_model_problem(folder):
                problems.append(f"agents[{index}].model: {agent.model!r} {problem}")
    return problems


def resolve(config: DrmasConfig) -> DrmasConfig:
    """``config`` with the task's defaults written in: its orchestra and its training and
    eval sets where the config leaves them unset. A resolved config is unchanged."""
    task = get_task(config.task.name)
    updates: dict[str, Any] = {}
    if config.task.orchestra is None:
        updates["task"] = config.task.model_copy(update={"orchestra": task.default_orchestra})
    data = {split: task.default_data for split in ("train", "eval") if getattr(config.data, split) is None}
    if data:
        updates["data"] = config.data.model_copy(update=data)
    return config.model_copy(update=updates) if updates else config


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> DrmasConfig:
    """Read YAML (or start empty), apply ``a.b.c=value`` overrides, validate.

    A problem in what an override set is reported under the override as it was typed
    (``override agents.solver.lr: ...``), not under the resolved path in the file
    (``agents[0].lr``): the user looks for it on the command line.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    raw, targets = _apply_overrides(raw, overrides)
    try:
        config = DrmasConfig.model_validate(raw)
    except ValidationError as error:
        problems = [_name_override(problem, targets) for problem in explain(error)]
        raise ConfigError(problems, _source(path, bool(targets), problems)) from None
    if problems := [_name_override(problem, targets) for problem in plugin_problems(config)]:
        raise ConfigError(problems, _source(path, bool(targets), problems))
    return resolve(config)


def _source(path: str | Path | None, overridden: bool, problems: list[str]) -> str:
    """Where the problems are: the file, the overrides, or the file as overridden (a
    problem of a section, such as two fields that disagree, may come from either)."""
    if path is None or all(problem.startswith(OVERRIDE_PREFIX) for problem in problems):
        return "overrides"
    return f"{path} with overrides" if overridden else str(path)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist"], str(path))
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ConfigError([f"cannot parse YAML: {error}"], str(path)) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([f"the top level must be a mapping, got {type(raw).__name__}"], str(path))
    return raw


def apply_overrides(raw: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a copy of ``raw``.

    In a list, a path part is an index (``agents.0.lr``) or the ``name`` of an element
    (``agents.solver.lr``). Missing mappings are created; validation then rejects keys
    that do not exist, with a did-you-mean.
    """
    return _apply_overrides(raw, overrides)[0]


OVERRIDE_PREFIX = "override "
"""How a problem caused by an override starts: ``override KEY: ...``, KEY as typed."""


def _apply_overrides(
    raw: dict[str, Any], overrides: typing.Iterable[str]
) -> tuple[dict[str, Any], list[tuple[str, Location]]]:
    """``apply_overrides``, and each override's key as typed with the location it set
    (``agents.solver.lr`` -> ('agents', 0, 'lr')), to report problems under the key.

    A problem names the override by its key, not its text: a value may hold a secret.
    """
    result = json.loads(json.dumps(raw))  # a deep copy with plain types
    problems = []
    targets = []
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override {override!r} must look like section.field=value")
            continue
        try:
            value = _parse_value(text)
            targets.append((key, _set_path(result, key.split("."), value)))
        except (yaml.YAMLError, ValueError) as error:
            problems.append(f"{OVERRIDE_PREFIX}{key}: {error}")
    if problems:
        raise ConfigError(problems, "overrides")
    return result, targets


def _parse_value(text: str) -> Any:
    """YAML, except that '1e-5' is a number (PyYAML's YAML 1.1 reads it as a string)."""
    if not text.strip():
        return None
    value = yaml.safe_load(text)
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value.strip()):
        return float(value)
    return value


def _set_path(node: Any, parts: list[str], value: Any) -> Location:
    """Set ``value`` at ``parts`` and return the location it went to (list parts as indices)."""
    location: list[str | int] = []
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            index = _list_index(node, part, where)
            location.append(index)
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            location.append(part)
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ValueError(f"{where} is inside a value, not a section")
    return tuple(location)


def _list_index(items: list[Any], part: str, where: str) -> int:
    if part.isdigit() and int(part) < len(items):
        return int(part)
    labels = [
        str(item.get("name", index)) if isinstance(item, dict) else str(index) for index, item in enumerate(items)
    ]
    if part in labels:
        return labels.index(part)
    listed = where.rpartition(".")[0] or where
    raise ValueError(
        f"{where}: no element with index or name {part!r} ({listed}: {', '.join(labels) or 'none'})"
        f"{did_you_mean(part, labels)}"
    )


def _name_override(problem: str, targets: list[tuple[str, Location]]) -> str:
    """``problem`` under the override that caused it, if one did: the most specific (and
    then the last) override whose location holds the problem's, or one whose path goes
    through an unknown key. The problem's path is then spelled as the override's key."""
    match = re.match(r"([A-Za-z0-9_.\-\[\]]+): (.*)", problem, re.DOTALL)
    if match is None:
        return problem
    location = _location(match[1])
    message = match[2]
    unknown_key = message.startswith("unknown key")
    causes = [
        (len(target), order, key)
        for order, (key, target) in enumerate(targets)
        if location[: len(target)] == target or (unknown_key and target[: len(location)] == location)
    ]
    if not causes:
        return problem
    _, _, key = max(causes)
    parts = key.split(".")
    path = ".".join(parts[: len(location)]) + dotted(location[len(parts) :], nested=True)
    return f"{OVERRIDE_PREFIX}{key}: {message}" if path == key else f"{OVERRIDE_PREFIX}{key}: {path}: {message}"


def _location(path: str) -> Location:
    """'agents[0].lr' -> ('agents', 0, 'lr'): the inverse of ``dotted``."""
    return tuple(int(index) if index else name for index, name in re.findall(r"\[(\d+)\]|([^.\[\]]+)", path))
