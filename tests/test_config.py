"""drmas.config: loading, overrides, worker-group resolution and one error per problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from drmas.config import ConfigError, DrmasConfig, apply_overrides, load_config

CONFIGS = Path(__file__).parent.parent / "configs"
MATH = CONFIGS / "math_tiny.yaml"


def problems(*overrides: str, path: Path = MATH) -> list[str]:
    with pytest.raises(ConfigError) as error:
        load_config(path, overrides)
    return error.value.problems


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path):
    config = load_config(path)
    assert DrmasConfig.from_json(config.to_json()) == config
    assert json.loads(config.to_json())["agents"]  # defaults are filled in


def test_worker_groups_none_by_model_and_explicit():
    separate = load_config(MATH)  # sharing: none in the file
    assert [(g.name, g.agents) for g in separate.worker_groups()] == [
        ("solver", ("solver",)),
        ("verifier", ("verifier",)),
    ]
    shared = load_config(MATH, ["workers.sharing=by_model"])
    [group] = shared.worker_groups()
    assert (group.name, group.agents, group.model) == ("solver-verifier", ("solver", "verifier"), "tiny")
    assert group.spec is not None and group.spec.hidden_size == 128
    explicit = load_config(MATH, ["workers.groups={team: [verifier, solver]}"])
    assert [(g.name, g.agents) for g in explicit.worker_groups()] == [("team", ("verifier", "solver"))]
    assert explicit.agent_to_worker_group() == {"verifier": "team", "solver": "team"}


def test_worker_group_by_name_carries_its_models_template_variables():
    config = load_config(
        MATH, ["models.tiny.chat_template_kwargs={enable_thinking: false}", "agents.verifier.model=Qwen/Qwen3-4B"]
    )
    assert config.worker_group("solver").chat_template_kwargs == {"enable_thinking": False}
    assert config.worker_group("verifier").chat_template_kwargs == {}  # a hub id: no spec
    assert config.flat_params()["models.tiny.chat_template_kwargs.enable_thinking"] == "false"
    with pytest.raises(KeyError, match="no worker group 'critic'; worker groups: solver, verifier"):
        config.worker_group("critic")


def test_heterogeneous_models_by_model_gives_one_group_per_model(tmp_path):
    config = load_config(MATH, ["models.big={hidden_size: 256}", "agents.solver.model=big", "workers.sharing=by_model"])
    assert {g.name: g.model for g in config.worker_groups()} == {"solver": "big", "verifier": "tiny"}


def test_per_agent_overrides_resolve_per_worker_group_and_per_agent_sampling():
    config = load_config(MATH, ["agents.solver.lr=1e-4", "agents.verifier.temperature=0.3"])
    lrs = {g.name: g.lr for g in config.worker_groups()}
    assert lrs == {"solver": 1e-4, "verifier": 5e-5}
    assert config.agent_sampling("verifier").temperature == 0.3
    assert config.agent_sampling("solver").temperature == 1.0
    # Sampling may differ between agents of one shared model: it is per call, not per model.
    shared = load_config(MATH, ["workers.sharing=by_model", "agents.verifier.temperature=0.3"])
    assert shared.agent_sampling("verifier").temperature == 0.3


def test_overrides_index_name_nesting_and_types():
    raw = apply_overrides(
        {"agents": [{"name": "solver", "model": "m"}]},
        ["agents.0.lr=2e-5", "agents.solver.micro_batch_size=4", "rollout.sampling.top_p=0.9", "x.y=[1, 2]"],
    )
    assert raw["agents"][0]["lr"] == 2e-5  # a float, although YAML 1.1 reads "2e-5" as text
    assert raw["agents"][0]["micro_batch_size"] == 4
    assert raw["rollout"] == {"sampling": {"top_p": 0.9}}
    assert raw["x"] == {"y": [1, 2]}
    assert load_config(MATH, ["agents.0.lr=2e-5"]).agents[0].lr == 2e-5


def test_flat_params_name_agents():
    params = load_config(MATH).flat_params()
    assert params["agents.solver.model"] == "tiny"
    assert params["algorithm.advantage"] == "drmas"
    assert params["rollout.sampling.max_new_tokens"] == "48"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.grup_size=3"], "rollout.grup_size: unknown key; did you mean 'group_size'?"),
        (["algorithm.advantge=grpo"], "algorithm.advantge: unknown key; did you mean 'advantage'?"),
        (["agents.solver.lrr=1"], "override agents.solver.lrr: unknown key; did you mean 'lr'?"),
        (["models.tiny.hiden_size=64"], "models.tiny.hiden_size: unknown key; did you mean 'hidden_size'?"),
        (["train.lr=fast"], "train.lr: Input should be a valid number"),
        (["train.zero_stage=4"], "train.zero_stage: Input should be less than or equal to 3"),
        (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p: Input should be less than or equal to 1"),
        (["algorithm.advantage=ppo"], "algorithm.advantage: Input should be 'drmas' or 'grpo'"),
        (["rollout.group_size=1"], "rollout.group_size: is 1, but advantage 'drmas'"),
        (["rollout.group_size=1", "algorithm.advantage=grpo"], "advantage 'grpo' normalises"),
        (["agents.verifier.name=critic"], "override agents.verifier.name: orchestra 'math' has no agent 'critic'"),
        (["agents.verifier.name=verfier"], "did you mean 'verifier'?"),
        (["agents.verifier.name=solver"], "override agents.verifier.name: agent 'solver' is listed twice"),
        (["agents.solver.model=./no/such/folder"], "override agents.solver.model: './no/such/folder' is neither"),
        (["task.orchestra=nope"], "task.orchestra: unknown orchestra 'nope'"),
        (["task.orchestra=no_such_module:X"], "cannot import orchestra"),
        (["store.endpoint=http://key:secret@host:9000"], "store.endpoint: must look like http(s)://host:port"),
        (["models.tiny.num_kv_heads=3"], "models.tiny: num_heads 4 is not divisible by num_kv_heads 3"),
        (["experiment.name=has space"], "experiment.name: String should match pattern"),
        (["rollout.truncation=right"], "rollout.truncation: Input should be 'middle' or 'left'"),
        (
            ["train.backend=deepspeed", "train.offload_optimizer=true"],
            "train: offload_optimizer needs zero_stage 1, 2 or 3",
        ),
        (
            ["models.tiny.chat_template_kwargs={tokenize: true, enable_thinking: false}"],
            "models.tiny.chat_template_kwargs: tokenize: set by drmas itself, not a template variable",
        ),
    ],
)
def test_each_problem_is_named(overrides, expected):
    found = problems(*overrides)
    assert any(expected in problem for problem in found), found


def test_missing_agent_is_reported():
    found = problems("agents=[{name: solver, model: tiny}]")
    assert found == ["override agents: orchestra 'math' needs agent 'verifier', which is not configured"]


def test_conflicting_settings_in_a_shared_worker_group_name_field_and_agents():
    found = problems("workers.sharing=by_model", "agents.solver.lr=1e-3")
    assert len(found) == 1
    message = found[0]
    assert "lr differs" in message and "'solver-verifier'" in message
    assert "solver=0.001" in message and "verifier=5e-05" in message


def test_explicit_groups_are_checked():
    found = problems(
        "workers.groups={g1: [solver], g2: [solver, verifir]}",
    )
    assert "override workers.groups: agent 'solver' is in both 'g1' and 'g2'" in found
    assert "override workers.groups: workers.groups.g2: unknown agent 'verifir'; did you mean 'verifier'?" in found
    assert "override workers.groups: agent 'verifier' is in no worker group" in found
    mixed = problems(
        "models.other={hidden_size: 64}", "agents.solver.model=other", "workers.groups={g: [solver, verifier]}"
    )
    assert any("its agents name different models (other, tiny)" in p for p in mixed)


def test_pool_slots_are_checked_and_default_to_all():
    config = load_config(MATH, ["workers.sharing=none", "ray.pool_size=3", "ray.slots={verifier: [2]}"])
    assert config.slots_of("solver") == [0, 1, 2] and config.slots_of("verifier") == [2]
    found = problems("workers.sharing=none", "ray.pool_size=2", "ray.slots={solvr: [0], verifier: [0, 2], solver: []}")
    joined = "\n".join(found)
    assert "ray.slots: unknown worker group 'solvr'; did you mean 'solver'?" in joined
    assert "ray.slots.verifier: slot(s) [2] outside the pool (ray.pool_size 2: 0-1)" in joined
    assert "ray.slots.solver: is empty" in joined


def test_several_problems_reported_at_once():
    found = problems("rollout.grup_size=3", "train.lr=x", "eval.k=0")
    assert len(found) == 3


def test_file_problems(tmp_path):
    assert "does not exist" in problems(path=tmp_path / "missing.yaml")[0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("agents: [unclosed\n")
    assert "cannot parse YAML" in problems(path=broken)[0]
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    assert "top level must be a mapping" in problems(path=listed)[0]
    assert "must look like section.field=value" in problems("no-equals-sign")[0]
    assert "no element with index or name 'critic'" in problems("agents.critic.lr=1")[0]


def test_user_orchestra_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_team.py").write_text(
        "class PlanAndCode:\n    agents = ('planner', 'coder')\n\nclass NoAgents:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = yaml.safe_load(MATH.read_text())
    raw["task"]["orchestra"] = "my_team:PlanAndCode"
    raw["agents"] = [{"name": "planner", "model": "tiny"}, {"name": "coder", "model": "tiny"}]
    config_file = tmp_path / "team.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    config = load_config(config_file)
    assert [g.name for g in config.worker_groups()] == ["planner", "coder"]
    assert any("must declare 'agents'" in p for p in problems("task.orchestra=my_team:NoAgents", path=config_file))


def test_from_json_errors_are_config_errors():
    with pytest.raises(ConfigError, match="agents: Field required"):
        DrmasConfig.from_json("{}")


def test_no_credentials_field_exists():
    """Secrets come from the environment; a config that tries to carry them is rejected."""
    found = problems("store.secret_key=abc", "tracking.token=abc")
    assert {p.split(":")[0] for p in found} == {"override store.secret_key", "override tracking.token"}


@pytest.mark.parametrize(
    ("start", "count", "expected"), [(0, None, [0, 1, 2, 3, 4]), (1, 2, [1, 2]), (3, 9, [3, 4]), (2, 0, [2, 3, 4])]
)
def test_a_run_part_ends_at_its_count_or_the_last_iteration(start, count, expected):
    """What the train pipeline and `drmas submit`'s parts cut a run by."""
    config = load_config(MATH, ["experiment.iterations=5"])
    assert list(config.iterations_from(start, count)) == expected


@pytest.mark.parametrize(("every", "evaluated"), [(2, [1, 3, 4]), (5, [4]), (0, [])])
def test_an_evaluation_ends_every_nth_iteration_and_the_last(every, evaluated):
    config = load_config(MATH, ["experiment.iterations=5", f"eval.every={every}"])
    assert [i for i in range(5) if config.evaluates(i)] == evaluated


# ----------------------------------------------------------------------------- run length in epochs


def test_neither_iterations_nor_epochs_is_ten_iterations():
    config = load_config(MATH, ["experiment.iterations=null"])
    assert (config.experiment.iterations, config.experiment.epochs, config.total_iterations) == (10, None, 10)
    assert config.with_epochs_resolved(5) is config  # no epochs: nothing to resolve


@pytest.mark.parametrize(
    ("questions", "batch", "epochs", "expected"), [(100, 16, 2, 12), (96, 16, 1, 6), (17, 16, 3, 3)]
)
def test_epochs_resolve_against_the_training_set_dropping_the_last_partial_batch(questions, batch, epochs, expected):
    config = load_config(
        MATH, ["experiment.iterations=null", f"experiment.epochs={epochs}", f"rollout.prompts_per_iteration={batch}"]
    )
    assert config.experiment.iterations is None
    with pytest.raises(ConfigError, match=r"experiment.iterations: not known yet: experiment.epochs \d+ is counted"):
        _ = config.total_iterations
    with pytest.raises(ConfigError, match="not known yet"):
        config.evaluates(0)  # nothing that needs the length runs on a guess
    resolved = config.with_epochs_resolved(questions)
    assert (resolved.total_iterations, resolved.experiment.epochs) == (expected, epochs)
    assert config.experiment.iterations is None  # the original is left as it was
    assert DrmasConfig.from_json(resolved.to_json()) == resolved  # recorded with both
    assert resolved.with_epochs_resolved(questions) == resolved  # the record agrees with its data
    unresolved = DrmasConfig.from_json(config.to_json())
    assert unresolved.experiment.iterations is None and unresolved == config  # JSON keeps it unresolved


def test_iterations_and_epochs_that_disagree_are_named_with_the_count():
    config = load_config(MATH, ["experiment.iterations=200", "experiment.epochs=2", "rollout.prompts_per_iteration=32"])
    assert config.with_epochs_resolved(3200).total_iterations == 200  # both given and agreeing: fine
    with pytest.raises(ConfigError) as error:
        config.with_epochs_resolved(1000)
    assert error.value.problems == [
        "experiment.iterations: is 200, but experiment.epochs 2 is 62 iterations (1000 training questions // 32 "
        "a batch = 31 an epoch); give one of them (experiment.epochs=null to run a number of iterations)"
    ]


def test_a_training_set_smaller_than_a_batch_has_no_epoch():
    config = load_config(MATH, ["experiment.iterations=null", "experiment.epochs=1"])
    with pytest.raises(ConfigError, match=r"experiment.epochs: the training set has 15 question\(s\), fewer than one"):
        config.with_epochs_resolved(15)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_epochs_must_be_a_positive_count(value):
    [problem] = problems(f"experiment.epochs={value}")
    assert problem.startswith("override experiment.epochs:")
