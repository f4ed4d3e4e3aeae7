"""The search task's reward: Search-R1's exact match, SQuAD normalisation then equality with
any gold answer. Its own module because the reward is the task's contract with every
orchestra that scores an episode, and it needs nothing of retrieval."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

__all__ = ["exact_match", "normalize_answer"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation, as Search-R1 scores: lower case, no punctuation, no articles,
    single spaces; so "The Eiffel Tower." matches "eiffel tower"."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str | None, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0.

    No answer (None) scores 0, as an episode that never answered does; so does an answer
    that normalises to nothing ("", "the", "."), which would otherwise match a gold answer
    that does too.
    """
    if prediction is None:
        return 0.0
    guess = normalize_answer(prediction)
    return float(bool(guess) and any(guess == normalize_answer(answer) for answer in answers))
