"""Orchestra routing and agent parsing, driven by a scripted pool.

The scripted pool is a fake at the engine boundary: it returns chosen texts instead of
sampling a model, so each routing rule is tested exactly. Real models through Ray are in
test_rollout.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import ScriptedPool

from drmas.config import load_config
from drmas.stages.rollout import build_team, draw_questions, play
from drmas.tasks import Question
from drmas.tasks.math import MathOrchestra, math_reward
from drmas.tasks.search.retrieval import Retriever
from drmas.tasks.search.task import SearchOrchestra
from drmas.team.agents import AnswerAgent, MathVerifierAgent, RouterAgent, SearchAgent, SolverAgent, find_tag
from drmas.team.episodes import Episode
from drmas.team.orchestras import Passage, Tools

CONFIGS = Path(__file__).parent.parent / "configs"


def math_team(script, *overrides):
    config = load_config(CONFIGS / "math_tiny.yaml", ["workers.sharing=none", *overrides])
    pool = ScriptedPool(script)
    orchestra, team = build_team(config, Tools(), pool, seed=0)
    return orchestra, team, pool


def questions(*texts: str, answer: str = "7") -> list[Question]:
    return [Question(f"q{i}", text, (answer,), "test") for i, text in enumerate(texts)]


def agents_of(episode: Episode) -> list[str]:
    return [call.agent for call in episode.calls]


# ------------------------------------------------------------------------------------
# math
# ------------------------------------------------------------------------------------


def test_math_loop_stops_when_approved_and_never_reruns_approved_items():
    def script(wg, prompt):
        if wg == "solver":
            return "so \\boxed{7}"
        # "hard" questions are rejected every time; "easy" ones approved at once.
        return "<verify>reject</verify>" if "hard" in prompt else "<verify>approve</verify>"

    orchestra, team, pool = math_team(script, "task.max_loops=3")
    easy, hard = play(orchestra, team, questions("easy one", "hard one"), group_size=1, prefix="t")
    assert agents_of(easy) == ["solver", "verifier"]
    # No verification after the last (third) solve.
    assert agents_of(hard) == ["solver", "verifier", "solver", "verifier", "solver"]
    # One batched generate per agent per step: the approved episode leaves the batch.
    assert pool.calls == [("solver", 2), ("verifier", 2), ("solver", 1), ("verifier", 1), ("solver", 1)]
    assert easy.reward == 1.0 and hard.reward == 1.0


def test_math_final_answer_is_the_last_solver_output():
    attempts = iter(["first try \\boxed{3}", "second try \\boxed{7}"])
    solver_prompts = []

    def script(wg, prompt):
        if wg == "solver":
            solver_prompts.append(prompt)
            return next(attempts)
        return "3 + 4 is not 3. <verify>reject</verify>"

    orchestra, team, _ = math_team(script)
    [episode] = play(orchestra, team, questions("3 + 4"), group_size=1, prefix="t")
    assert episode.final_answer == "second try \\boxed{7}"
    assert episode.reward == 1.0 and episode.success
    # The second Solver read the first attempt and the Verifier's whole critique, as in
    # the reference (not only the verdict word).
    assert episode.team_context[:2] == [
        "Solver: first try \\boxed{3}",
        "Verifier: 3 + 4 is not 3. <verify>reject</verify>",
    ]
    assert "Verifier: 3 + 4 is not 3. <verify>reject</verify>" in solver_prompts[1]


@pytest.mark.parametrize(
    ("passes", "expected"), [(True, ["solver", "verifier"]), (False, ["solver", "verifier", "solver"])]
)
def test_math_malformed_verdict_is_a_documented_setting(passes, expected):
    def script(wg, prompt):
        return "\\boxed{7}" if wg == "solver" else "looks fine <verify>maybe</verify>"

    orchestra, team, _ = math_team(script, f"task.malformed_verdict_passes={passes}")
    [episode] = play(orchestra, team, questions("q"), group_size=1, prefix="t")
    assert agents_of(episode) == expected
    verifier_call = episode.calls[1]
    assert not verifier_call.is_valid  # malformed either way: it pays the format penalty


def test_math_empty_and_garbage_outputs_never_crash():
    outputs = {"solver": "", "verifier": "\x00" * 10 + "<verify>" * 1000}
    orchestra, team, _ = math_team(lambda wg, prompt: outputs[wg])
    episodes = play(orchestra, team, questions("a", "b"), group_size=2, prefix="t")
    assert all(e.reward == 0.0 and not e.success for e in episodes)
    assert all(not call.is_valid for e in episodes for call in e.calls)


def test_group_size_makes_episodes_share_a_uid():
    orchestra, team, _ = math_team(lambda wg, p: "\\boxed{7}" if wg == "solver" else "<verify>approve</verify>")
    episodes = play(orchestra, team, questions("a", "b"), group_size=3, prefix="i0")
    assert [e.uid for e in episodes] == ["i0-q0"] * 3 + ["i0-q1"] * 3
    assert len({e.traj_uid for e in episodes}) == 6
    assert [e.sample_idx for e in episodes] == [0, 1, 2, 0, 1, 2]


# ------------------------------------------------------------------------------------
# search
# ------------------------------------------------------------------------------------

PASSAGES = [
    Passage("0", "The capital of Zorbania is Quellin."),
    Passage("1", "Quellin was founded by Mara Voss."),
    Passage("2", "The river Tessa flows through Brandov."),
]


def search_team(script, *overrides):
    config = load_config(CONFIGS / "search_tiny.yaml", ["workers.sharing=none", *overrides])
    pool = ScriptedPool(script)
    orchestra, team = build_team(config, Tools(retriever=Retriever.build(PASSAGES)), pool, seed=0)
    return orchestra, team, pool


def test_search_routes_no_to_search_then_yes_to_answer():
    def script(wg, prompt):
        if wg == "verifier":
            return "<verify>yes</verify>" if "<information>" in prompt else "<verify>no</verify>"
        if wg == "search":
            return "<think>need the capital</think><search>capital of Zorbania</search>"
        return "<think>found it</think><answer>Quellin</answer>"

    orchestra, team, pool = search_team(script)
    [episode] = play(orchestra, team, questions("What is the capital of Zorbania?", answer="Quellin"), 1, "t")
    assert agents_of(episode) == ["verifier", "search", "verifier", "answer"]
    assert [c.env_step for c in episode.calls] == [1, 1, 2, 2]
    query, information = episode.history[0]
    assert query == "capital of Zorbania" and "Quellin" in information
    assert episode.final_answer == "Quellin" and episode.reward == 1.0
    assert all(call.is_valid for call in episode.calls)


def test_search_last_turn_allows_no_search_and_ends_without_answer():
    def script(wg, prompt):
        return "<verify>no</verify>" if wg == "verifier" else "<think>t</think><search>river</search>"

    orchestra, team, pool = search_team(script, "task.max_turns=2")
    [episode] = play(orchestra, team, questions("Which river?", answer="Tessa"), 1, "t")
    assert agents_of(episode) == ["verifier", "search", "verifier"]
    assert episode.final_answer is None and episode.reward == 0.0 and episode.done


def test_search_answer_without_tags_is_an_empty_action_and_the_episode_goes_on():
    """As in the reference: an untagged Answer output does not end the episode; the team
    routes again next turn, and only a tagged answer (or the turn limit) ends it."""
    answers = iter(["I think it is Quellin", "<think>t</think><answer>Quellin</answer>"])

    def script(wg, prompt):
        return "<verify>yes</verify>" if wg == "verifier" else next(answers)

    orchestra, team, _ = search_team(script, "task.max_turns=3")
    [episode] = play(orchestra, team, questions("capital?", answer="Quellin"), 1, "t")
    assert agents_of(episode) == ["verifier", "answer", "verifier", "answer"]
    assert [c.env_step for c in episode.calls] == [1, 1, 2, 2]
    assert not episode.calls[1].is_valid and episode.reward == 1.0
    # Never tagged: the episode runs to the turn limit and ends without an answer.
    orchestra, team, _ = search_team(
        lambda wg, p: "<verify>yes</verify>" if wg == "verifier" else "Quellin", "task.max_turns=2"
    )
    [untagged] = play(orchestra, team, questions("capital?", answer="Quellin"), 1, "t")
    assert agents_of(untagged) == ["verifier", "answer"] * 2
    assert untagged.final_answer is None and untagged.reward == 0.0


def test_search_agent_reads_the_verifiers_whole_response():
    search_prompts = []

    def script(wg, prompt):
        if wg == "verifier":
            return "The history is empty: search for the founder. <verify>no</verify>"
        search_prompts.append(prompt)
        return "<think>t</think><search>founder of Quellin</search>"

    orchestra, team, _ = search_team(script, "task.max_turns=2")
    play(orchestra, team, questions("Who founded Quellin?", answer="Mara Voss"), 1, "t")
    assert "Verifier: The history is empty: search for the founder. <verify>no</verify>" in search_prompts[0]


def test_search_malformed_route_counts_as_yes_and_batches_per_step():
    def script(wg, prompt):
        if wg == "verifier":
            return "hmm" if "first" in prompt else "<verify>no</verify>"
        if wg == "search":
            return "<search>Quellin</search>"  # no think block: invalid, but still searched
        return "<think>x</think><answer>Mara Voss</answer>"

    orchestra, team, pool = search_team(script, "task.max_turns=3")
    episodes = play(orchestra, team, questions("first q", "second q", "third q", answer="Mara Voss"), 1, "t")
    first, second, third = episodes
    assert agents_of(first) == ["verifier", "answer"] and first.reward == 1.0
    assert agents_of(second) == ["verifier", "search", "verifier", "search", "verifier"]
    assert not second.calls[1].is_valid and second.history[0][0] == "Quellin"
    # Per step: one verifier call over all active episodes, one search and one answer call.
    assert pool.calls == [
        ("verifier", 3),
        ("search", 2),
        ("answer", 1),
        ("verifier", 2),
        ("search", 2),
        ("verifier", 2),
    ]


def test_search_orchestra_requires_a_retriever():
    config = load_config(CONFIGS / "search_tiny.yaml")
    with pytest.raises(ValueError, match="needs a retriever"):
        SearchOrchestra(config.task, Tools())


# ------------------------------------------------------------------------------------
# agents' parsers
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent", "text", "extracted", "valid"),
    [
        (SolverAgent(), "x \\boxed{1} then \\boxed{2}", "x \\boxed{1} then \\boxed{2}", True),
        (SolverAgent(), "no box at all", "no box at all", False),
        (MathVerifierAgent(), "ok <verify>approve</verify>", "approve", True),
        (MathVerifierAgent(), "<verify>reject</verify> <verify>approve</verify>", "approve", True),
        (MathVerifierAgent(), "<verify>Approve</verify>", "", False),
        (MathVerifierAgent(), "好 <verify>approve</verify>", "approve", False),
        (RouterAgent(), "<VERIFY>YES</VERIFY>", "yes", True),
        (RouterAgent(), "<verify>perhaps</verify>", "", False),
        (SearchAgent(), "<think>a</think><search> q </search>", "q", True),
        (SearchAgent(), "<think>a</think><think>b</think><search>q</search>", "q", False),
        (SearchAgent(), "</think>a<think><search>q</search>", "q", False),
        (SearchAgent(), "<search><search>q</search>", "q", False),  # nested tags, no think block
        (AnswerAgent(), "<think>t</think><answer>Paris</answer>", "Paris", True),
        (AnswerAgent(), "", "", False),
    ],
)
def test_parsers(agent, text, extracted, valid):
    """What each agent extracts: the verdict word for verifiers (whose text passed on is
    the whole response), the tag's content or the Solver's whole output for the others."""
    parsed = agent.parse(text)
    if isinstance(agent, (MathVerifierAgent, RouterAgent)):
        assert parsed.text == text.strip()
        assert (parsed.verdict, parsed.is_valid) == (extracted, valid)
    else:
        assert (parsed.text, parsed.is_valid) == (extracted, valid)
    if isinstance(agent, AnswerAgent):
        assert parsed.acted == ("<answer>" in text)


REFERENCE = "reference"


@pytest.mark.parametrize(
    ("agent", "text", "passed_on", "verdict", "valid"),
    [
        # The Solver: the last box only; an `Answer:` line is no answer; no plain-text rule.
        (SolverAgent(parsing=REFERENCE), "work\nAnswer: 7", "work\nAnswer: 7", None, False),
        (SolverAgent(parsing=REFERENCE), "\\boxed{7\u200b}", "\\boxed{7\u200b}", None, True),
        # Verifiers: the first tag's content stripped in the text passed on; the tags make it
        # valid; the verdict is the first option whose tagged form occurs (approve wins).
        (MathVerifierAgent(parsing=REFERENCE), "<verify> reject </verify>", "<verify>reject</verify>", "reject", True),
        (
            MathVerifierAgent(parsing=REFERENCE),
            "<verify>approve</verify> <verify>reject</verify>",
            "<verify>approve</verify> <verify>reject</verify>",
            "approve",
            True,
        ),
        (MathVerifierAgent(parsing=REFERENCE), "<verify>Approve</verify>", "<verify>Approve</verify>", "", True),
        (MathVerifierAgent(parsing=REFERENCE), "がんばれ <verify>approve</verify>", None, "approve", True),
        (RouterAgent(parsing=REFERENCE), "<VERIFY>Yes</VERIFY> <verify>no</verify>", None, "yes", True),
        # Search agents: the first tag, one think block, no nested-tag or plain-text rule.
        (SearchAgent(parsing=REFERENCE), "<think>a</think><search> q1 </search><search>q2</search>", "q1", None, True),
        (SearchAgent(parsing=REFERENCE), "<search><search>q</search>", "<search>q", None, False),
        (AnswerAgent(parsing=REFERENCE), "<think>t</think><answer>Par\u200bis</answer>", "Par\u200bis", None, True),
    ],
)
def test_the_references_parsing_rules(agent, text, passed_on, verdict, valid):
    """``task.parsing: reference`` reads outputs as the authors' code does (issue 31 §2;
    docs/deviations.md): each case differs from drmas's own rules in what it extracts,
    its verdict or its validity."""
    parsed = agent.parse(text)
    assert (parsed.verdict, parsed.is_valid) == (verdict, valid)
    if passed_on is not None:
        assert parsed.text == passed_on
    drmas_rules = type(agent)().parse(text)
    assert (drmas_rules.text, drmas_rules.verdict, drmas_rules.is_valid) != (
        parsed.text,
        parsed.verdict,
        parsed.is_valid,
    )
    if isinstance(agent, AnswerAgent):
        assert parsed.acted == ("<answer>" in text)


def test_the_math_reward_by_the_references_rules_reads_boxes_only():
    question = Question("q", "3 + 4?", ("7",), "test")
    assert math_reward("thinking...\nAnswer: 7", question) == 1.0
    assert math_reward("thinking...\nAnswer: 7", question, "reference") == 0.0
    assert math_reward("so \\boxed{7}", question, "reference") == 1.0
    config = load_config(Path(__file__).parent.parent / "configs" / "math_tiny.yaml", ["task.parsing=reference"])
    orchestra = MathOrchestra(config.task, Tools())
    episode = Episode("u", "t", 0, question, final_answer="Answer: 7")
    assert orchestra.reward(episode) == 0.0 and orchestra.agent_objects["solver"].parsing == REFERENCE


def test_find_tag_takes_the_last_and_survives_huge_input():
    assert find_tag("<a>1</a> <a> 2 </a>", "a") == "2"
    assert find_tag("<a>" * 50_000, "a") is None
    assert find_tag("<a>" * 50_000 + "x</a>", "a") == "x"
    assert find_tag("</a><a>", "a") is None


def test_draw_questions_cycles_epochs_without_repeats():
    pool = questions(*[f"q{i}" for i in range(10)])
    first_epoch = [q.qid for i in range(2) for q in draw_questions(pool, 5, i, seed=1)]
    assert sorted(first_epoch) == sorted(q.qid for q in pool)
    assert draw_questions(pool, 5, 3, seed=1) == draw_questions(pool, 5, 3, seed=1)
    assert [q.qid for q in draw_questions(pool, 5, 0, seed=1)] != [q.qid for q in draw_questions(pool, 5, 0, seed=2)]


def test_an_epoch_drops_its_last_partial_batch_as_experiment_epochs_counts_it():
    """11 questions in batches of 4: an epoch is 2 batches (8 distinct questions, 3 left
    out), and iteration 2 starts the next epoch's permutation, as a data loader with
    drop_last does; a set smaller than one batch is cycled through."""
    pool = questions(*[f"q{i}" for i in range(11)])
    epochs = [[q.qid for i in range(2 * e, 2 * e + 2) for q in draw_questions(pool, 4, i, seed=3)] for e in range(3)]
    for drawn in epochs:
        assert len(drawn) == len(set(drawn)) == 8
    assert len({tuple(drawn) for drawn in epochs}) == 3  # a new order every epoch
    second_epoch = np.random.default_rng([3, 1]).permutation(11)
    assert [q.qid for q in draw_questions(pool, 4, 2, seed=3)] == [f"q{i}" for i in second_epoch[:4]]
    few = questions("a", "b", "c")
    assert sorted(q.qid for q in draw_questions(few, 6, 0, seed=0)) == ["q0", "q0", "q1", "q1", "q2", "q2"]


USER_ORCHESTRA = """
from drmas.team.agents import Parsed


class Planner:
    def prompt(self, episode, step):
        return f"Plan for: {episode.question.question}"

    def parse(self, response):
        return Parsed(text=response.strip(), is_valid=response.startswith("PLAN"))


class Coder:
    def prompt(self, episode, step):
        return "Follow: " + " | ".join(episode.team_context)

    def parse(self, response):
        return Parsed(text=response.strip(), is_valid=True)


class PlanThenCode:
    agents = {"planner": Planner, "coder": Coder}

    def __init__(self, task, tools):
        self.agent_objects = {name: cls() for name, cls in self.agents.items()}

    def run(self, episodes, team):
        for episode, plan in zip(episodes, team.call("planner", episodes, step=1)):
            episode.team_context.append(f"Planner: {plan.text}")
        for episode, code in zip(episodes, team.call("coder", episodes, step=1)):
            episode.final_answer, episode.done = code.text, True

    def reward(self, episode):
        return float(episode.final_answer in episode.question.answers)
"""


def test_a_user_orchestra_named_by_import_path_runs(tmp_path, monkeypatch):
    (tmp_path / "plan_then_code_team.py").write_text(USER_ORCHESTRA)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(
        CONFIGS / "math_tiny.yaml",
        [
            "task.orchestra=plan_then_code_team:PlanThenCode",
            "agents=[{name: planner, model: tiny}, {name: coder, model: tiny}]",
        ],
    )
    pool = ScriptedPool(lambda wg, prompt: "PLAN add" if wg == "planner" else ("7" if "PLAN add" in prompt else "?"))
    orchestra, team = build_team(config, Tools(), pool, seed=0)
    episodes = play(orchestra, team, questions("3 + 4", "5 + 2"), group_size=2, prefix="t")
    assert [agents_of(e) for e in episodes] == [["planner", "coder"]] * 4
    assert all(e.reward == 1.0 for e in episodes)
    assert pool.calls == [("planner", 4), ("coder", 4)]


def test_avg_and_pass_at_k_by_hand():
    from drmas.stages.evaluate import success_at_k

    # q0 (source a): successes [1, 0] -> avg 0.5, pass 1; q1 (source b): [0, 0] -> 0, 0.
    episodes = []
    for qid, source, wins in (("q0", "a", [True, False]), ("q1", "b", [False, False])):
        for j, win in enumerate(wins):
            episodes.append(Episode(qid, f"{qid}-{j}", j, Question(qid, "?", ("x",), source), success=win))
    metrics = success_at_k(episodes, 2)
    assert metrics["eval/avg_at_2"] == 0.25 and metrics["eval/pass_at_2"] == 0.5
    assert metrics["eval/a/avg_at_2"] == 0.5 and metrics["eval/b/pass_at_2"] == 0.0
    assert metrics["eval/questions"] == 2
