"""The generated world of ``generated:facts``: made-up countries, towns and people.

No pretrained knowledge helps here: the only way to answer is to search the world's corpus.
Every fact is one short passage, and questions are single-hop (one fact answers them) or
two-hop (the first fact names a bridge entity that the second fact needs). The same seed
and sizes give the same world, so the train questions, the eval questions and the corpus
that a run (or a retrieval service) searches all come from one world. Only here is the
bridge of a two-hop question known, so only here can the warm start demonstrate the
queries that answer it (``demonstration_queries``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from drmas.tasks import DataError
from drmas.tasks.search.retrieval import STOPWORDS
from drmas.team.episodes import Question
from drmas.team.orchestras import Passage

if TYPE_CHECKING:
    from drmas.config import DataConfig

__all__ = [
    "GENERATED_FACTS",
    "GENERATED_PREFIX",
    "demonstration_queries",
    "generate_fact_world",
    "generated_facts",
]

GENERATED_PREFIX = "generated:"
GENERATED_FACTS = "facts"
DEFAULT_COUNTRIES = 200
"""Countries in a generated world unless the configured question counts need more."""
QUESTIONS_PER_COUNTRY = 6
EVAL_EVERY = 10
"""Every 10th country (and all its facts' questions) is held out for evaluation."""
MAX_COUNTRIES = 20_000
"""A bound on generated worlds (120,000 passages), so a typo in a size fails fast."""


_ONSETS = (
    "b",
    "br",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "sh",
    "st",
    "t",
    "th",
    "v",
    "z",
)
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s")
_COUNTRY_ENDINGS = ("nia", "ria", "via", "land")
_CITY_ENDINGS = ("in", "or", "eth", "os", "holm")
_FIRST_NAME_ENDINGS = ("a", "o", "en", "")
FIRST_NAMES = 64
"""People share first names (as in life); surnames, and all place names, are unique."""
_RESERVED = STOPWORDS | {"capital", "town", "country", "founded", "born", "year", "what", "which"}
"""Words that no name may be: a stopword is never indexed, a template word is in every fact."""


@dataclass(frozen=True)
class _Country:
    """One country's facts: a capital and a town, each with a founder and a birth year."""

    index: int
    name: str
    capital: str
    town: str
    capital_founder: str
    capital_founder_born: int
    town_founder: str
    town_founder_born: int


class _Namer:
    """Draws made-up names that are unique across every entity of a world.

    Every name is one word token, so a name in a question matches exactly the facts
    about that entity, and no two entities can be confused by the retriever.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set(_RESERVED)

    def draw(self, endings: Sequence[str]) -> str:
        while True:
            root = "".join(
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS) for _ in range(2)
            )
            name = (root + self.rng.choice(endings)).capitalize()
            if name.lower() not in self.used:
                self.used.add(name.lower())
                return name


def _countries(seed: int, count: int) -> list[_Country]:
    """Countries drawn one after another, so a smaller world is a prefix of a bigger one.

    That keeps the first countries (and hence the eval questions) the same when only the
    requested training size changes.
    """
    rng = random.Random(seed)
    namer = _Namer(rng)
    first_names = [namer.draw(_FIRST_NAME_ENDINGS) for _ in range(FIRST_NAMES)]

    def person() -> str:
        return f"{rng.choice(first_names)} {namer.draw(('',))}"

    return [
        _Country(
            index=index,
            name=namer.draw(_COUNTRY_ENDINGS),
            capital=namer.draw(_CITY_ENDINGS),
            town=namer.draw(_CITY_ENDINGS),
            capital_founder=person(),
            capital_founder_born=rng.randint(1500, 1950),
            town_founder=person(),
            town_founder_born=rng.randint(1500, 1950),
        )
        for index in range(count)
    ]


def _facts(country: _Country) -> list[Passage]:
    """One short passage per fact."""
    c = country
    facts = [
        ("capital", f"The capital of {c.name} is {c.capital}."),
        ("town", f"{c.town} is a town in {c.name}."),
        ("capital-founder", f"{c.capital} was founded by {c.capital_founder}."),
        ("town-founder", f"{c.town} was founded by {c.town_founder}."),
        ("capital-founder-born", f"{c.capital_founder} was born in {c.capital_founder_born}."),
        ("town-founder-born", f"{c.town_founder} was born in {c.town_founder_born}."),
    ]
    return [Passage(f"facts-{c.index:05d}-{kind}", text) for kind, text in facts]


def _questions(country: _Country) -> list[Question]:
    """Four single-hop and two two-hop questions; a two-hop question names neither the
    bridge entity nor anything in the fact that holds its answer."""
    c = country
    one, two = "facts-1hop", "facts-2hop"
    items = [
        ("capital", one, f"What is the capital of {c.name}?", c.capital),
        ("town-founder", one, f"Who founded {c.town}?", c.town_founder),
        ("born", one, f"In what year was {c.capital_founder} born?", str(c.capital_founder_born)),
        ("country", one, f"In which country is {c.town}?", c.name),
        ("capital-founder", two, f"Who founded the capital of {c.name}?", c.capital_founder),
        (
            "town-founder-born",
            two,
            f"In what year was the founder of {c.town} born?",
            str(c.town_founder_born),
        ),
    ]
    return [Question(f"facts-{c.index:05d}-{kind}", text, (answer,), source) for kind, source, text, answer in items]


def generate_fact_world(
    seed: int, entities: int = DEFAULT_COUNTRIES
) -> tuple[list[Passage], list[Question], list[Question]]:
    """A corpus of made-up facts and its (train, eval) questions, the same for the same seed.

    ``entities`` is the number of countries; each brings a capital, a town and their two
    founders (six facts, six questions). Every ``EVAL_EVERY``-th country is eval, so the
    splits share no entity: an eval answer can only be found by searching, never recalled
    from training.
    """
    if entities < 1:
        raise ValueError(f"entities must be at least 1, got {entities}")
    passages: list[Passage] = []
    train: list[Question] = []
    evaluation: list[Question] = []
    for country in _countries(seed, entities):
        passages += _facts(country)
        split = evaluation if country.index % EVAL_EVERY == EVAL_EVERY - 1 else train
        split += _questions(country)
    return passages, train, evaluation


def _countries_needed(train_size: int, eval_size: int) -> int:
    """The smallest world (at least the default) whose splits hold the requested sizes."""
    train_countries = math.ceil(train_size / QUESTIONS_PER_COUNTRY)
    eval_countries = math.ceil(eval_size / QUESTIONS_PER_COUNTRY)
    count = max(DEFAULT_COUNTRIES, EVAL_EVERY * eval_countries, train_countries)
    while count - count // EVAL_EVERY < train_countries:
        count += 1
    return count


def generated_facts(data: DataConfig, seed: int) -> tuple[list[Passage], list[Question], list[Question]]:
    """The world that ``generated:facts`` names for this data config and seed.

    Its size depends on both configured sizes (never on the split asked for), so the train
    questions, the eval questions and the corpus a run searches all come from one world.
    """
    count = _countries_needed(data.generated_train_size, data.generated_eval_size)
    if count > MAX_COUNTRIES:
        most_eval = MAX_COUNTRIES // EVAL_EVERY * QUESTIONS_PER_COUNTRY
        most_train = MAX_COUNTRIES * QUESTIONS_PER_COUNTRY - most_eval
        raise DataError(
            f"{GENERATED_PREFIX}{GENERATED_FACTS}: at most {most_train} train and {most_eval} eval "
            f"questions exist; asked for generated_train_size={data.generated_train_size}, "
            f"generated_eval_size={data.generated_eval_size}"
        )
    passages, train, evaluation = generate_fact_world(seed, count)
    return passages, train[: data.generated_train_size], evaluation[: data.generated_eval_size]


def demonstration_queries(data: DataConfig, seed: int) -> dict[str, tuple[str, ...]]:
    """For every question of the generated world, by id: the queries that find its answer,
    one per hop.

    Only a generated world has them, since only there the bridge of a two-hop question is
    known. A first hop names the entity the question names; a second hop names the bridge
    entity the first hop's passage revealed, so a searcher that learns these demonstrations
    learns to read the retrieved passages, not to recall facts.
    """
    count = _countries_needed(data.generated_train_size, data.generated_eval_size)
    plans: dict[str, tuple[str, ...]] = {}
    for c in _countries(seed, min(count, MAX_COUNTRIES)):
        capital, town_founder = f"capital of {c.name}", f"{c.town} founded"
        for kind, queries in (
            ("capital", (capital,)),
            ("town-founder", (town_founder,)),
            ("born", (f"{c.capital_founder} born",)),
            ("country", (f"{c.town} town",)),
            ("capital-founder", (capital, f"{c.capital} founded")),
            ("town-founder-born", (town_founder, f"{c.town_founder} born")),
        ):
            plans[f"facts-{c.index:05d}-{kind}"] = queries
    return plans
