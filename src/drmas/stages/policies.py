"""The initial policy of every worker group, as an artifact in the store.

    init_policies(config, store, run_id) -> {wg: PolicyRef}

A worker group whose model spec says ``source: scratch`` gets a tokenizer trained on the
task's text (questions, answers, every agent's prompt, the tags agents must write) and a
freshly initialised model; any other model is a hub id (at ``models.NAME.revision``, from
the local Hugging Face cache when offline) or a local folder, loaded (from safetensors) and
saved as it is; ``s3://...`` names a policy artifact of an earlier run. A pretrained
policy's tokenizer is saved with the chat template every later stage renders prompts with:
``models.NAME.chat_template`` when set, else its own; a model with neither is refused here,
before anything trains, naming that field. Either way the store holds one HF-layout
artifact per worker group at ``{experiment}/{run_id}/init/policy/{wg}/`` and every later
stage reads from there.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from drmas.config import DrmasConfig, PolicyError, WorkerGroup
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store
from drmas.models import build_scratch_policy, chat_turn, load_model, load_tokenizer
from drmas.registry import load_orchestra
from drmas.stages.contracts import PoliciesContract, cache_key, starting_point_reusable
from drmas.tasks import task_for
from drmas.team.agents import Agent
from drmas.team.episodes import Episode
from drmas.team.prompts import PromptSetName

__all__ = ["init_policies", "tokenizer_corpus"]

AGENT_TAGS = (
    "\\boxed{}",
    "<verify>approve</verify>",
    "<verify>reject</verify>",
    "<verify>yes</verify>",
    "<verify>no</verify>",
    "<think></think>",
    "<search></search>",
    "<answer></answer>",
    "<information></information>",
    "0123456789 + - * / = . ,",
)


def init_policies(config: DrmasConfig, store: Store, run_id: str, overwrite: bool = False) -> dict[str, PolicyRef]:
    """Write every worker group's initial policy and return where each one is. One stored
    is kept when its contract's key is the same (``starting_point_reusable``); ``overwrite``
    rebuilds them all."""
    groups = config.worker_groups()
    contracts = {g.name: PoliciesContract(run_id, g.name) for g in groups}
    paths = {name: contract.output(config) for name, contract in contracts.items()}
    todo = [g for g in groups if overwrite or not starting_point_reusable(config, store, contracts[g.name], run_id)]
    texts = tokenizer_corpus(config) if any(_is_scratch(g) for g in todo) else []
    for index, group in enumerate(groups):
        if group not in todo:
            continue
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch) / group.name
            _materialise(group, texts, local, config, seed=config.experiment.seed + index)
            key = cache_key(config, store, contracts[group.name])
            meta = {"stage": "init", "wg": group.name, "cache_key": key}
            with store.writer(paths[group.name], overwrite=True, meta=meta) as out:
                out.put_dir(local, "")
    return {name: PolicyRef(path, "") for name, path in paths.items()}


def _is_scratch(group: WorkerGroup) -> bool:
    return group.spec is not None and group.spec.source == "scratch"


def _materialise(group: WorkerGroup, texts: list[str], out_dir: Path, config: DrmasConfig, seed: int) -> None:
    """Put the group's initial policy in ``out_dir``: built from scratch, copied from an
    artifact of an earlier run (an s3:// URI), or loaded from a hub id or local folder."""
    if _is_scratch(group):
        build_scratch_policy(group.spec, texts, out_dir, seed)
        return
    spec = group.spec
    source = spec.source if spec is not None else group.model
    revision = spec.revision if spec is not None else None
    from_store = source.startswith("s3://")
    if from_store:
        bucket, _, key = source[len("s3://") :].partition("/")
        store = Store(f"s3://{bucket}", config.store.endpoint, config.store.region)
        store.open(key).download(out_dir)
    tokenizer = load_tokenizer(out_dir if from_store else source, revision)
    tokenizer.chat_template = _chat_template(group, tokenizer.chat_template)  # before any weights load
    if not from_store:
        dtype = spec.dtype if spec is not None else "float32"
        load_model(source, dtype, revision).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


ChatTemplate = str | dict[str, str]
"""A tokenizer's chat template: one Jinja template, or several by name (transformers)."""


def _chat_template(group: WorkerGroup, own: ChatTemplate | None) -> ChatTemplate:
    """The template a pretrained policy is stored with: the config's, else the tokenizer's
    own; without either no agent call could be rendered, so the model is refused now."""
    if group.spec is not None and group.spec.chat_template is not None:
        return group.spec.chat_template
    if own:
        return own
    if group.spec is not None:
        field, how = f"models.{group.model}.chat_template", "set it to a Jinja chat template"
    else:
        field = "models.NAME.chat_template"
        how = (
            f"declare the model under models (models.NAME.source: {group.model}) with a Jinja chat template "
            "and name NAME as its agents' model"
        )
    raise PolicyError(
        f"worker group {group.name!r}: model {group.model!r} has no chat template (its tokenizer has none, as "
        f"many base models); {field} supplies one: {how}"
    )


def tokenizer_corpus(config: DrmasConfig, limit: int = 2000) -> list[str]:
    """Text a scratch tokenizer should cover: questions, answers and every agent's prompts,
    the prompts in their chat turns (so that the role words become one token each, not
    seventeen single characters in every prompt), then the task's own corpus."""
    task = task_for(config)
    questions = (task.questions(config, "train") + task.questions(config, "eval"))[:limit]
    orchestra = load_orchestra(config.task.orchestra_name)
    agents = {name: _agent(cls, config.task.prompts) for name, cls in orchestra.agents.items()}
    texts = list(AGENT_TAGS)
    for question in questions:
        episode = Episode(uid="u", traj_uid="t", sample_idx=0, question=question)
        episode.team_context = [f"{name.title()}: " for name in agents]
        texts += [chat_turn(agent.prompt(episode, 1)) for agent in agents.values()]
        texts += [question.question, *question.answers]
    return texts + task.corpus(config)[:limit]


def _agent(agent_class: type, prompts: PromptSetName) -> Agent:
    """An agent as its orchestra builds it: the built-in ones (dataclasses with a prompt
    set) speaking the config's prompt set, a user's with no arguments."""
    takes_prompts = dataclasses.is_dataclass(agent_class) and any(
        field.name == "prompts" for field in dataclasses.fields(agent_class)
    )
    return agent_class(prompts=prompts) if takes_prompts else agent_class()
