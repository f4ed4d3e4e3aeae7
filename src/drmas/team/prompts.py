"""Prompt sets: the words each built-in agent is asked with, per task and per kind of model.

A prompt set is chosen in the config (``task.prompts``); every built-in agent renders its
prompt through the set's function for its role.

- ``compact``: the question (and the team's context or search history), then one line
  naming the role and its output format. Made for models built from scratch: they learn
  their roles from warm-start demonstrations rendered with these very prompts, and every
  prompt token costs compute in every rollout and update on a CPU. The tiny configs, their
  demonstrations and tokenizers depend on these prompts staying as they are.
- ``reference``: modelled on the reference's (Dr. MAS) agents, for pretrained chat models,
  which know no drmas role and follow only what they are told: the team's task under a
  heading, the teammates' outputs of this step under a heading, then the role, what to
  check or use, and the exact output format. With the compact prompts a 135M chat model
  wrote a malformed output in nearly every call (no box, no verdict), so every reward was 0.

The reference's wording is paraphrased here, not copied; its headings and the order of the
parts are kept, and the reference set asks for nothing the reference's prompts do not ask
for (no brevity, no extra checks, no example the reference does not give; the fidelity
review of 2026-12-03 listed the instructions earlier versions had added).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from drmas.team.episodes import Episode

__all__ = [
    "MATH_PROMPTS",
    "PROMPT_SETS",
    "SEARCH_PROMPTS",
    "MathPrompts",
    "PromptSetName",
    "SearchPrompts",
    "prompt_set",
]

PromptSetName = Literal["reference", "compact"]
PROMPT_SETS: tuple[PromptSetName, ...] = ("reference", "compact")


@dataclass(frozen=True)
class MathPrompts:
    """The math task's roles: each renders its prompt from the episode."""

    solver: Callable[[Episode], str]
    verifier: Callable[[Episode], str]


SearchPrompt = Callable[[Episode, int, int], str]
"""(episode, step, history_length) -> the prompt of a search role at that step."""


@dataclass(frozen=True)
class SearchPrompts:
    """The search task's roles: the Verifier that routes, the Search and Answer agents."""

    router: SearchPrompt
    searcher: SearchPrompt
    answerer: SearchPrompt


Prompts = TypeVar("Prompts", MathPrompts, SearchPrompts)


def prompt_set(sets: dict[str, Prompts], name: str) -> Prompts:
    """The prompt set ``name`` of a task's ``sets``, or a ValueError that lists them."""
    if name not in sets:
        raise ValueError(f"unknown prompt set {name!r}; the prompt sets are {', '.join(PROMPT_SETS)}")
    return sets[name]


def _context(episode: Episode) -> str:
    return "\n".join(episode.team_context)


def _history(episode: Episode, length: int) -> str:
    """The last ``length`` searches, one line each, numbered from the episode's first."""
    shown = episode.history[-length:] if length else []
    first = len(episode.history) - len(shown) + 1
    return "\n".join(
        f"Step {first + i}: <search>{query}</search> <information>{info}</information>"
        for i, (query, info) in enumerate(shown)
    )


# ------------------------------------------------------------------------------------
# compact: a line per role (scratch models)
# ------------------------------------------------------------------------------------


def _compact_solver(episode: Episode) -> str:
    context = _context(episode)
    return (
        f"Problem: {episode.question.question}\n"
        + (f"{context}\n" if context else "")
        + "Solver: solve it step by step, final answer in \\boxed{}."
    )


def _compact_verifier(episode: Episode) -> str:
    return (
        f"Problem: {episode.question.question}\n"
        f"{_context(episode)}\n"
        "Verifier: check the last solution, end with <verify>approve</verify> or <verify>reject</verify>."
    )


def _compact_search(episode: Episode, history_length: int, instruction: str) -> str:
    """The question, the last turns' queries and passages, then the role's instruction."""
    history = _history(episode, history_length)
    return f"Question: {episode.question.question}\n" + (f"History:\n{history}\n" if history else "") + instruction


def _compact_router(episode: Episode, step: int, history_length: int) -> str:
    return _compact_search(
        episode,
        history_length,
        f"You are the Verifier at step {step}. Is the information enough to answer? "
        "End with <verify>yes</verify> or <verify>no</verify>.",
    )


def _compact_searcher(episode: Episode, step: int, history_length: int) -> str:
    return _compact_search(
        episode,
        history_length,
        f"Teammates at step {step}:\n{_context(episode)}\n"
        "You are the Searcher. Think in <think></think>, then give one query as <search>query</search>.",
    )


def _compact_answerer(episode: Episode, step: int, history_length: int) -> str:
    return _compact_search(
        episode,
        history_length,
        "You are the Answerer. Think in <think></think>, then answer as <answer>answer</answer>.",
    )


# ------------------------------------------------------------------------------------
# reference: the reference's sections and instructions (pretrained models)
# ------------------------------------------------------------------------------------


def _sections(*parts: tuple[str, str]) -> str:
    """Markdown sections, as the reference's agent templates lay out their prompts."""
    return "\n\n".join(f"# {heading}\n{body}" for heading, body in parts)


def _math_task(episode: Episode) -> tuple[str, str]:
    return (
        "Task Introduction",
        "You are a member of an expert team of agents that solves math problems together.\n"
        f"The team's problem is:\n{episode.question.question}",
    )


def _teammates(episode: Episode, heading: str = "Your Teammates' Outputs") -> tuple[str, str]:
    return heading, "\n\n".join(episode.team_context)


def _reference_solver(episode: Episode) -> str:
    return _sections(
        _math_task(episode),
        _teammates(episode),
        (
            "Your Role",
            "You are the Solver. Solve the problem: reason step by step and derive the correct answer. Take "
            "your teammates' outputs above, if there are any, as supporting context. Give the final answer "
            "inside \\boxed{}.",
        ),
    )


def _reference_verifier(episode: Episode) -> str:
    return _sections(
        _math_task(episode),
        _teammates(episode),
        (
            "Your Role",
            "You are the Verifier. Critically review the Solver's most recent solution above: check each step, "
            "formula and conclusion for accuracy, completeness and logical consistency. End your response "
            "with exactly <verify>approve</verify> if the solution is entirely correct, or "
            "<verify>reject</verify> if anything in it is wrong.",
        ),
    )


def _search_task(episode: Episode, history_length: int) -> tuple[str, str]:
    """The question and the team's search history (the reference's environment prompt)."""
    text = (
        "You are a member of an expert team of agents that answers a question step by step.\n"
        f"The question is:\n{episode.question.question}\n"
        "The team can use a search engine; work together to make progress."
    )
    history = _history(episode, history_length)
    if history:
        text += (
            f"\nYour team has searched {len(episode.history)} time(s) so far. Its history follows: <search> holds "
            f"each query and <information> what the search engine returned.\n{history}"
        )
    return "Task Introduction", text


THINK_FIRST = "First reason inside <think> and </think>"


def _reference_router(episode: Episode, step: int, history_length: int) -> str:
    return _sections(
        _search_task(episode, history_length),
        (
            "Your Role",
            "You are the Verifier: you decide whether the team searches again or answers now. Review the past "
            "<search> queries and the <information> they returned. Judge whether the queries were sound (say "
            "so if one repeats an earlier query, is redundant or imprecise, or misses the question) and whether "
            f"the information gathered is enough to answer the question. You are now at step {step}. Reason "
            "first, then end your response with exactly <verify>yes</verify> if the information is enough to "
            "answer, or <verify>no</verify> if the team must search more.",
        ),
    )


def _reference_searcher(episode: Episode, step: int, history_length: int) -> str:
    return _sections(
        _search_task(episode, history_length),
        _teammates(episode, f"Your Teammates' Outputs at Step {step}"),
        (
            "Your Role",
            "You are the Search agent: you query the search engine for the team. "
            f"{THINK_FIRST} about the question, the earlier queries and results, and your teammates' outputs; "
            "then write one search query inside <search> and </search>.",
        ),
    )


def _reference_answerer(episode: Episode, step: int, history_length: int) -> str:
    return _sections(
        _search_task(episode, history_length),
        (
            "Your Role",
            "You are the Answer agent. Answer the question thoroughly, correctly and with careful reasoning, "
            "drawing on the earlier queries, the retrieved information and what you know yourself. "
            f"{THINK_FIRST}, then give the final answer inside <answer> and </answer>, for example "
            "<answer>Beijing</answer>.",
        ),
    )


MATH_PROMPTS: dict[str, MathPrompts] = {
    "compact": MathPrompts(solver=_compact_solver, verifier=_compact_verifier),
    "reference": MathPrompts(solver=_reference_solver, verifier=_reference_verifier),
}
SEARCH_PROMPTS: dict[str, SearchPrompts] = {
    "compact": SearchPrompts(router=_compact_router, searcher=_compact_searcher, answerer=_compact_answerer),
    "reference": SearchPrompts(router=_reference_router, searcher=_reference_searcher, answerer=_reference_answerer),
}
