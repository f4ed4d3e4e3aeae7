"""Agents: roles with a prompt template and an output parser.

An agent never generates by itself: its orchestra asks the team to call it on a batch of
episodes, and the team sends all those prompts to the agent's worker group as one batched
generate. An agent only says what to ask (``prompt``) and how to read the answer
(``parse``: the extracted text and whether the output was well-formed; a malformed output
costs its call the invalid-format penalty and never crashes anything).

Write your own by implementing the two methods; an orchestra lists its agents by name:

    class Critic:
        def prompt(self, episode: Episode, step: int) -> str:
            return f"Question: {episode.question.question}\\nCriticise the last answer."
        def parse(self, response: str) -> Parsed:
            return Parsed(text=response.strip(), is_valid=bool(response.strip()))

An answer (a boxed result, a query, a final answer) must also be plain text: invisible
characters (zero-width spaces, direction marks, other control or format characters),
private-use or unassigned code points and fullwidth look-alikes make the call malformed.
Such an answer can read as right to a person and still not match, or match only through a
lenient parser; either way the output is not in the format the role asks for.

The built-in agents take their words from a prompt set (``drmas.team.prompts``, chosen by
``task.prompts``): ``compact``, a line per role for models built from scratch, which learn
their roles from demonstrations; ``reference``, modelled on the reference's agents for
pretrained chat models, which follow instructions.

They read outputs by one of two rule sets (``task.parsing``), which decide what is valid
(and so which calls pay the format penalty, which under Dr. MAS shapes the advantages):

- ``drmas`` (the default): the last tag; a verdict only when the tag holds exactly one of
  the two words; a math answer from the last ``\boxed{}`` or a last line ``Answer: ...``;
  an answer must be plain text (``is_plain``), hold no nested tag, and a response no CJK
  character (kana and Hangul included).
- ``reference``, as the authors' code reads them: the first tag; a math answer from the
  last ``\boxed{}`` only; a verdict decided by which tagged word occurs (approve before
  reject, yes before no), a tag with other content valid but no verdict; validity is the
  tags being there (and one think block for the search agents) and no character in
  U+4E00-U+9FFF. docs/deviations.md lists the differences.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Literal, Protocol

from drmas.team.episodes import Episode
from drmas.team.prompts import MATH_PROMPTS, SEARCH_PROMPTS, PromptSetName, prompt_set

__all__ = [
    "Agent",
    "AnswerAgent",
    "MathVerifierAgent",
    "Parsed",
    "RouterAgent",
    "SearchAgent",
    "SolverAgent",
    "ParsingRules",
    "extract_boxed",
    "extract_final_answer",
    "find_tag",
    "first_tag",
    "is_plain",
    "math_answer",
    "verifier_context",
]

ParsingRules = Literal["drmas", "reference"]
"""How agents' outputs are read (``task.parsing``; the module docstring)."""
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
REFERENCE_CJK = re.compile(r"[\u4e00-\u9fff]")
"""The reference's rule: CJK unified ideographs only."""
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cn", "Cs"})
"""Unicode categories that do not belong in an answer: control, format (zero-width,
direction marks), private use, unassigned, surrogate."""


@dataclass(frozen=True)
class Parsed:
    """What an agent's output means: the text passed on, and whether it was well-formed.

    ``verdict`` is a verifier's decision word ("" when missing or malformed); its ``text``
    is then the whole response, which teammates read as the critique, as in the reference.
    ``acted`` is False when the output holds no action of the kind the role asks for (an
    Answer agent's output without <answer> tags): an empty action, not a final one.
    """

    text: str
    is_valid: bool
    verdict: str | None = None
    acted: bool = True


class Agent(Protocol):
    def prompt(self, episode: Episode, step: int) -> str:
        """The user message for this agent in this episode at this step (1-based)."""

    def parse(self, response: str) -> Parsed:
        """Read a response; must accept anything (empty, huge, garbage) without raising."""


def find_tag(text: str, tag: str) -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` in ``text``, or None.

    Two reverse scans, linear in the text: a regex would backtrack quadratically on model
    output such as thousands of unclosed opening tags.
    """
    close = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, close) if close >= 0 else -1
    return text[start + len(tag) + 2 : close].strip() if start >= 0 else None


def first_tag(text: str, tag: str) -> tuple[str, int, int] | None:
    """The first ``<tag>...</tag>`` in ``text`` (the reference's reading): its stripped
    content and where the content starts and ends, or None."""
    opening = text.find(f"<{tag}>")
    close = text.find(f"</{tag}>", opening) if opening >= 0 else -1
    if close < 0:
        return None
    start = opening + len(tag) + 2
    return text[start:close].strip(), start, close


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN = re.compile(r"[^\s${}]+")
"""``\\boxed 5``: the argument is the run of text up to a space, a ``$`` or a brace."""


def _closing_brace(text: str, open_at: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_at``, or None if it never closes.

    A backslash escapes the next character, so ``\\{`` and ``\\}`` (set braces) are content,
    not grouping.
    """
    depth = 0
    i = open_at
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _box_argument(text: str, start: int) -> str | None:
    """The argument of a box command whose name ends at ``start``."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] == "{":
        close = _closing_brace(text, i)
        return None if close is None else text[i + 1 : close]
    token = _BARE_TOKEN.match(text, i)
    return token.group() if token else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``), or None.

    Only the text after the last ``</think>`` counts: reasoning drafts are not answers. The
    last box decides even when it is unclosed (None): a response cut off while writing its
    answer gets no credit for an earlier draft, as in the reference. It lives with the
    parsers because the Solver's parser and the math task's reward must read the same box.
    """
    tail = text.rpartition("</think>")[2]
    boxes = list(_BOX.finditer(tail))
    return _box_argument(tail, boxes[-1].end()) if boxes else None


_ANSWER_LINE = re.compile(r"(?:\*\*)?(?:final\s+)?answer(?:\*\*)?\s*:(.*)", re.IGNORECASE)
_MATH_DELIMITERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def extract_final_answer(text: str) -> str | None:
    """The final answer of a solution: the last ``\\boxed{}`` (``extract_boxed``), or, in a
    response with no box after its thoughts, what follows ``Answer:`` on its last non-empty
    line, the form DAPO's prompt asks for ("The last line of your response should be of the
    form Answer: $Answer"). Markdown bold, "Final", and ``$...$`` around the answer are allowed.
    """
    tail = text.rpartition("</think>")[2]
    if _BOX.search(tail):
        return extract_boxed(text)
    line = tail.rstrip().rpartition("\n")[2].strip()
    match = _ANSWER_LINE.fullmatch(line)
    if match is None:
        return None
    answer = match.group(1).strip().removeprefix("**").removesuffix("**").strip()
    for opening, closing in _MATH_DELIMITERS:
        if len(answer) >= len(opening) + len(closing) and answer.startswith(opening) and answer.endswith(closing):
            return answer[len(opening) : -len(closing)].strip()
    return answer


def is_plain(text: str) -> bool:
    """Whether ``text`` has no hidden, private or fullwidth characters (whitespace such as
    newlines and tabs is fine)."""
    return not any(
        (unicodedata.category(char) in HIDDEN_CATEGORIES and not char.isspace())
        or unicodedata.east_asian_width(char) == "F"
        for char in text
    )


def _one_think_block(text: str) -> bool:
    """Exactly one <think> and one </think>, in that order (the reference's format rule)."""
    opened, closed = text.count("<think>"), text.count("</think>")
    return opened == 1 and closed == 1 and text.index("<think>") < text.index("</think>")


def verifier_context(response: str) -> str:
    """The team-context line of a verifier's output: its whole response (the critique the
    next Solver or the Search agent reads, as in the reference), not only its verdict.
    Bounded by the agent's ``max_new_tokens``; the prompt's ``rollout.max_prompt_tokens``
    truncation bounds the whole context. The warm start writes the same line."""
    return f"Verifier: {response or 'no verdict'}"


# ------------------------------------------------------------------------------------
# math: Solver <-> Verifier
# ------------------------------------------------------------------------------------


def math_answer(text: str, parsing: ParsingRules = "drmas") -> str | None:
    """A solution's final answer: ``extract_final_answer`` by drmas's rules, the last box
    only by the reference's. The Solver's validity and the math reward both read it."""
    return extract_boxed(text) if parsing == "reference" else extract_final_answer(text)


@dataclass(frozen=True)
class SolverAgent:
    """Solves the problem, using teammates' earlier outputs as context."""

    prompts: PromptSetName = "compact"
    parsing: ParsingRules = "drmas"

    def prompt(self, episode: Episode, step: int) -> str:
        return prompt_set(MATH_PROMPTS, self.prompts).solver(episode)

    def parse(self, response: str) -> Parsed:
        answer = math_answer(response, self.parsing)
        plain = self.parsing == "reference" or (answer is not None and is_plain(answer))
        return Parsed(text=response, is_valid=answer is not None and plain)


@dataclass(frozen=True)
class MathVerifierAgent:
    """Reviews the latest solution and approves or rejects it."""

    prompts: PromptSetName = "compact"
    parsing: ParsingRules = "drmas"

    def prompt(self, episode: Episode, step: int) -> str:
        return prompt_set(MATH_PROMPTS, self.prompts).verifier(episode)

    def parse(self, response: str) -> Parsed:
        return _verdict(response, ("approve", "reject"), parsing=self.parsing)


# ------------------------------------------------------------------------------------
# search: Verifier routes to Search or Answer
# ------------------------------------------------------------------------------------


def _verdict(response: str, options: tuple[str, str], lower: bool = False, parsing: ParsingRules = "drmas") -> Parsed:
    """A <verify> verdict, with the whole response as the text teammates read. drmas: the
    last tag, which must hold one of ``options`` (anything else is malformed). reference:
    the first tag's content is stripped in the text, the tags being there makes the call
    valid, and the verdict is the first option whose tagged form the text holds."""
    text = response.lower() if lower else response
    if parsing == "reference":
        found = first_tag(text, "verify")
        if found is None:
            return Parsed(text=response.strip(), is_valid=False, verdict="")
        _, start, close = found
        projected = response[:start] + response[start:close].strip() + response[close:]
        tagged = projected.lower() if lower else projected
        verdict = next((option for option in options if f"<verify>{option}</verify>" in tagged), "")
        return Parsed(text=projected.strip(), is_valid=not REFERENCE_CJK.search(response), verdict=verdict)
    verdict = find_tag(text, "verify")
    well_formed = verdict in options and not CJK.search(response)
    return Parsed(text=response.strip(), is_valid=well_formed, verdict=verdict if verdict in options else "")


def _tagged_after_thinking(response: str, tag: str, parsing: ParsingRules = "drmas") -> Parsed:
    """The content of <tag>, valid with exactly one think block before it (reference rule);
    by drmas's rules also plain, with no nested <tag> or </tag> inside it, and read from the
    last tag; by the reference's, from the first."""
    if parsing == "reference":
        found = first_tag(response, tag)
        content = found[0] if found is not None else None
        well_formed = content is not None and _one_think_block(response) and not REFERENCE_CJK.search(response)
        return Parsed(text=content or "", is_valid=well_formed, acted=content is not None)
    content = find_tag(response, tag)
    well_formed = (
        content is not None
        and is_plain(content)
        and f"<{tag}>" not in content
        and f"</{tag}>" not in content
        and _one_think_block(response)
        and not CJK.search(response)
    )
    return Parsed(text=content or "", is_valid=well_formed, acted=content is not None)


@dataclass(frozen=True)
class RouterAgent:
    """Judges whether the retrieved information suffices: yes -> answer, no -> search."""

    history_length: int = 4
    prompts: PromptSetName = "compact"
    parsing: ParsingRules = "drmas"

    def prompt(self, episode: Episode, step: int) -> str:
        return prompt_set(SEARCH_PROMPTS, self.prompts).router(episode, step, self.history_length)

    def parse(self, response: str) -> Parsed:
        return _verdict(response, ("yes", "no"), lower=True, parsing=self.parsing)


@dataclass(frozen=True)
class SearchAgent:
    """Writes one search query; the orchestra answers it with retrieved passages."""

    history_length: int = 4
    prompts: PromptSetName = "compact"
    parsing: ParsingRules = "drmas"

    def prompt(self, episode: Episode, step: int) -> str:
        return prompt_set(SEARCH_PROMPTS, self.prompts).searcher(episode, step, self.history_length)

    def parse(self, response: str) -> Parsed:
        return _tagged_after_thinking(response, "search", self.parsing)


@dataclass(frozen=True)
class AnswerAgent:
    """Gives the final answer from the retrieved information."""

    history_length: int = 4
    prompts: PromptSetName = "compact"
    parsing: ParsingRules = "drmas"

    def prompt(self, episode: Episode, step: int) -> str:
        return prompt_set(SEARCH_PROMPTS, self.prompts).answerer(episode, step, self.history_length)

    def parse(self, response: str) -> Parsed:
        """The answer; an output without <answer> tags has not acted (the episode goes on,
        as in the reference's search environment)."""
        return _tagged_after_thinking(response, "answer", self.parsing)
