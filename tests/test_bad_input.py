"""Bad input, as a user meets it: every case stops with a message that names the problem
(the field; the file, row and reason; the artifact's path and reason), exits non-zero
where the command must stop, and leaves nothing that a reader could take for a result.

Configs and data files go through the command line: ``drmas.cli.main``, in this process
(the console script calls the same function; test_project.py runs it as a process). Model
outputs go through every agent's parser, both reward functions and one rollout stage.
Damaged and foreign artifacts go through ``drmas rerun``, ``drmas run --resume`` and
``drmas eval`` on copies of a real run that ``drmas run`` trained (conftest.py's
``trained_run``, shared with test_security.py).

Covered elsewhere, not repeated: the wording of each config problem (test_config.py),
each data loader error (test_math_task.py, test_search_task.py), the store's refusal of
modified, truncated and damaged artifacts at the API (test_store.py).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TRAINED_RUN, TRAINED_SETTINGS
from helpers import TINY_OVERRIDES, ScriptedPool, record_policy, refuse_ray

from drmas.cli import main
from drmas.config import load_config
from drmas.infra.layout import PolicyRef, optim_path, policy_path, stage_path
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import MANIFEST, CorruptArtifact, Store
from drmas.models import PolicyError, load_model
from drmas.stages.advantage import advantage
from drmas.stages.evaluate import evaluate
from drmas.stages.policies import init_policies
from drmas.stages.rollout import rollout
from drmas.stages.update import update
from drmas.tasks import Question
from drmas.tasks.math import math_reward
from drmas.tasks.search.answers import exact_match
from drmas.team.agents import AnswerAgent, MathVerifierAgent, RouterAgent, SearchAgent, SolverAgent
from drmas.training.engines.torch import TorchEngine
from drmas.training.state import capture_state, save_state

ROOT = Path(__file__).resolve().parents[1]
MATH = str(ROOT / "configs" / "math_tiny.yaml")
SEARCH = str(ROOT / "configs" / "search_tiny.yaml")
EXPERIMENT = "math-tiny"
RUN = TRAINED_RUN
BASE = TRAINED_SETTINGS
"""The settings of the trained run (conftest.py; a resume must repeat them)."""


def drmas(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``drmas ARGS`` as the command line runs it: its exit status and its stderr."""
    status = main(list(args))
    return status, capsys.readouterr().err


def manifests(root: Path) -> dict[str, bytes]:
    """Every artifact a reader can see under a local store root, with its manifest."""
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob(MANIFEST)}


# --------------------------------------------------------------------------------------
# Configs: every command reads them first, and nothing is written when they are wrong
# --------------------------------------------------------------------------------------

CONFIG_CASES = {
    "unknown key": (["rollout.groupsize=4"], "rollout.groupsize: unknown key; did you mean 'group_size'?"),
    "wrong type": (["rollout.group_size=many"], "rollout.group_size: Input should be a valid integer"),
    "wrong type in an agent": (["agents.solver.lr=fast"], "override agents.solver.lr: Input should be a valid number"),
    "impossible width": (
        ["models.tiny.hidden_size=4"],
        "models.tiny.hidden_size: Input should be greater than or equal to 8",
    ),
    "impossible heads": (["models.tiny.num_kv_heads=3"], "models.tiny: num_heads 4 is not divisible by num_kv_heads 3"),
    "impossible group": (["rollout.group_size=1"], "rollout.group_size: is 1, but advantage 'drmas'"),
    "no prompts": (
        ["rollout.prompts_per_iteration=0"],
        "rollout.prompts_per_iteration: Input should be greater than or equal to 1",
    ),
    "shared worker group disagrees": (
        ["workers.sharing=by_model", "agents.solver.micro_batch_size=4"],
        "micro_batch_size differs between agents that share worker group 'solver-verifier' (solver=4, verifier=32)",
    ),
    "missing model folder": (
        ["agents.solver.model=./no/such/model"],
        "override agents.solver.model: './no/such/model' is neither a key of models",
    ),
    "missing model source": (
        ["models.tiny.source=/no/such/model"],
        "models.tiny: source '/no/such/model' looks like a local folder but does not exist",
    ),
    "model folder without config.json": (
        ["models.tiny.source={empty}"],
        "has no config.json (not a Hugging Face model folder)",
    ),
    "unknown orchestra": (["task.orchestra=debate"], "task.orchestra: unknown orchestra 'debate'"),
    "unknown agent": (
        ["agents.verifier.name=critic"],
        "override agents.verifier.name: orchestra 'math' has no agent 'critic'",
    ),
    "credentials in the tracking URI": (
        ["tracking.uri=http://ann:hunter2@mlflow:5000"],
        "tracking.uri: must not hold credentials",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_bad_config_stops_before_anything_is_written(case, tmp_path, monkeypatch, capsys):
    overrides, expected = CONFIG_CASES[case]
    empty = tmp_path / "empty-model"
    empty.mkdir()
    monkeypatch.chdir(tmp_path)
    overrides = [item.format(empty=empty) for item in overrides]
    status, err = drmas(capsys, "run", MATH, *overrides, f"store.root={tmp_path / 'runs'}")
    assert status == 2
    assert expected in err, err
    assert "hunter2" not in err  # a rejected value that holds a secret is not echoed
    assert sorted(tmp_path.iterdir()) == [empty]  # no store, no mlflow.db, no cache


@pytest.mark.parametrize("command", [["run", MATH], ["run", MATH, "--resume", RUN], ["eval", MATH, "--run-id", RUN]])
def test_every_command_refuses_a_bad_config_the_same_way(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, err = drmas(capsys, *command, "algorithm.advantge=grpo", f"store.root={tmp_path / 'runs'}")
    assert status == 2
    assert "algorithm.advantge: unknown key; did you mean 'advantage'?" in err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------
# Data files: read before the run is recorded or Ray starts
# --------------------------------------------------------------------------------------

DATA_CASES = {
    "missing column": (
        b'{"prompt": "What is 1 + 1?", "answer": "2"}\n',
        "no question column 'question' (set data.question_field); columns: answer, prompt",
    ),
    "empty file": (b"", "no rows"),
    "wrong type": (
        b'{"question": 17, "answer": "2"}\n',
        "row 0 (line 1): empty or missing question ('question': int 17, not text)",
    ),
    "non-UTF-8": (
        '{"question": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1"),
        "not UTF-8 text (bad byte at offset 17)",
    ),
    "duplicated ids": (
        b'{"id": "q1", "question": "a", "answer": "1"}\n{"id": "q1", "question": "b", "answer": "2"}\n',
        "duplicated id 'q1' (row 0 (line 1) and row 1 (line 2))",
    ),
    "question without answer": (
        b'{"question": "a", "answer": "1"}\n{"question": "b"}\n',
        "row 1 (line 2): missing or empty answer ('answer')",
    ),
    "not JSON": (b'{"question": "a", "answer": "1"}\n{"question": \n', "line 2: invalid JSON"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_a_bad_training_file_stops_the_run_before_anything_is_written(case, tmp_path, monkeypatch, capsys):
    content, expected = DATA_CASES[case]
    data = tmp_path / "train.jsonl"
    data.write_bytes(content)
    monkeypatch.chdir(tmp_path)
    status, err = drmas(capsys, "run", MATH, f"data.train={data}", f"store.root={tmp_path / 'runs'}")
    assert status == 1
    assert f"drmas run: {data}: {expected}" in err, err
    assert sorted(tmp_path.iterdir()) == [data]


def test_a_bad_eval_file_stops_drmas_eval_before_ray_starts(tmp_path, monkeypatch, capsys):
    data = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["1", "2"]}), data)
    data.write_bytes(data.read_bytes()[:-20])  # cut off the footer
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("drmas.generation.ray_session.connect_ray", refuse_ray)
    status, err = drmas(capsys, "eval", MATH, "--run-id", RUN, f"data.eval={data}", f"store.root={tmp_path / 'runs'}")
    assert status == 1
    assert f"drmas eval: {data}: not a readable Parquet file" in err, err
    assert sorted(tmp_path.iterdir()) == [data]


def test_a_bad_search_corpus_stops_the_run(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "text": "The Vell flows through Quellin."}\n{"id": "2", "title": "no body"}\n')
    monkeypatch.chdir(tmp_path)
    status, err = drmas(capsys, "run", SEARCH, f"data.corpus={corpus}", f"store.root={tmp_path / 'runs'}")
    assert status == 1
    assert f"{corpus}: line 2: no passage text" in err, err
    assert sorted(tmp_path.iterdir()) == [corpus]


# --------------------------------------------------------------------------------------
# Model outputs: malformed calls are invalid (penalised), never a crash
# --------------------------------------------------------------------------------------

ROLES = {
    "solver": (SolverAgent(), "\\boxed{{{}}}", "85"),
    "math verifier": (MathVerifierAgent(), "<verify>{}</verify>", "approve"),
    "router": (RouterAgent(), "<verify>{}</verify>", "yes"),
    "search": (SearchAgent(), "<think>need it</think><search>{}</search>", "capital of Zorbania"),
    "answer": (AnswerAgent(), "<think>found it</think><answer>{}</answer>", "Quellin"),
}
"""Each role: its parser, the output format it asks for, and a content that fills it."""

FULLWIDTH = str.maketrans({chr(c): chr(c + 0xFEE0) for c in range(0x21, 0x7F)})
ODDITIES = {
    "right-to-left mark": lambda text: "\u200f" + text,
    "zero-width space": lambda text: text[:1] + "\u200b" + text[1:],
    "byte-order mark": lambda text: text + "\ufeff",
    "NUL": lambda text: text + "\x00",
    "private use": lambda text: text + "\ue000",
    "noncharacter": lambda text: text + "\uffff",
    "unassigned": lambda text: text + "\u0378",
    "fullwidth": lambda text: text.translate(FULLWIDTH),
}
"""Unicode oddities applied to the content only: the output keeps the role's format."""

HOSTILE = {
    "empty": "",
    "whitespace": " \n\t ",
    "special tokens only": "<|im_start|><|im_end|><|endoftext|>",
    "huge": "x" * 2_000_000,
    "huge unclosed tags": "<verify><answer><search><think>\\boxed{" * 50_000,
    "only closing tags": "</verify></answer></search></think>}" * 1000,
    "missing opening tag": "<think>t</think>approve yes Quellin</verify></answer></search>",
    "missing closing tag": "<think>t</think><verify>yes<answer>Quellin<search>q \\boxed{85",
    "nested tags": "<think>t</think><verify><verify>yes</verify></verify><answer><answer>Quellin</answer></answer>"
    "<search><search>q</search></search>",
    "combining marks": "Q\u0336\u0334\u0337\u0338" * 10_000,
    "astral and odd code points": "\U0010ffff\U0001f600\U000e0001\ufffd\u2028\u2029",
}
"""Outputs that are malformed for every role."""


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_roles_clean_output_is_valid(role):
    """The control for the tables below: only the damage makes a call invalid."""
    agent, template, content = ROLES[role]
    parsed = agent.parse(template.format(content))
    assert parsed.is_valid


@pytest.mark.parametrize("oddity", sorted(ODDITIES))
@pytest.mark.parametrize("role", sorted(ROLES))
def test_unicode_oddities_in_an_answer_make_the_call_invalid(role, oddity):
    agent, template, content = ROLES[role]
    assert not agent.parse(template.format(ODDITIES[oddity](content))).is_valid


@pytest.mark.parametrize("output", sorted(HOSTILE))
@pytest.mark.parametrize("role", sorted(ROLES))
def test_hostile_outputs_are_invalid_and_cheap_to_read(role, output):
    agent, _, _ = ROLES[role]
    started = time.perf_counter()
    parsed = agent.parse(HOSTILE[output])
    assert not parsed.is_valid
    assert isinstance(parsed.text, str)
    assert time.perf_counter() - started < 1.0


EIGHTY_FIVE = Question("q", "What is 37 + 48?", ("85",), "arithmetic-2d")


@pytest.mark.parametrize("output", sorted(HOSTILE) + sorted(ODDITIES))
def test_no_hostile_output_earns_a_reward(output):
    """Neither checker credits a damaged answer; both stay fast on huge ones."""
    solver = "\\boxed{" + ODDITIES[output]("85") + "}" if output in ODDITIES else HOSTILE[output]
    answer = ODDITIES[output]("Quellin") if output in ODDITIES else HOSTILE[output]
    started = time.perf_counter()
    assert math_reward(solver, EIGHTY_FIVE) == 0.0
    assert exact_match(answer, ["Quellin"]) == 0.0
    assert time.perf_counter() - started < 1.0
    assert math_reward("\\boxed{85}", EIGHTY_FIVE) == exact_match("Quellin", ["Quellin"]) == 1.0  # control


@pytest.mark.parametrize("guess", ["", "The", " a. ", "!!!"])
def test_an_answer_that_normalises_to_nothing_never_matches(guess):
    """'the' and 'a' normalise to nothing, as does a gold answer that is only an article."""
    assert exact_match(guess, ["An", "Mara Voss"]) == 0.0


def test_a_rollout_of_hostile_outputs_completes_and_penalises_every_call(tmp_path):
    """The real rollout and advantage stages over outputs that a model could emit, with a
    scripted pool at the engine boundary: no tiny model can be made to produce these exact
    texts, and the stages must take them whatever they are."""
    outputs = [HOSTILE[name] for name in ("empty", "special tokens only", "nested tags", "astral and odd code points")]
    outputs += [
        "\\boxed{" + ODDITIES["fullwidth"]("85") + "}",
        "<verify>" + ODDITIES["zero-width space"]("approve") + "</verify>",
        "\x00" * 100,
        "\\boxed{85\u200f}",
    ]
    served = iter(outputs * 10)
    pool = ScriptedPool(lambda wg, prompt: next(served))
    config = load_config(MATH, [*TINY_OVERRIDES, f"store.root={tmp_path}", "algorithm.invalid_penalty=0.5"])
    store = Store(str(tmp_path))
    result = rollout(config, store, "hostile", 0, {}, pool)
    table = store.open(result.artifact).read_table("trajectories.parquet", TRAJECTORY_SCHEMA)
    texts = table["response_text"].to_pylist()
    assert table.num_rows >= 12 and set(texts) <= set(outputs) and "\x00" * 100 in texts  # stored as returned
    assert not any(table["is_valid"].to_pylist()) and not any(table["reward"].to_pylist())
    scores = (
        store.open(advantage(config, store, "hostile", 0).artifact).read_table("batch.parquet")["score"].to_pylist()
    )
    assert scores == [-0.5] * table.num_rows  # reward 0 minus the penalty on every call


# --------------------------------------------------------------------------------------
# Damaged and foreign artifacts in a real run
# --------------------------------------------------------------------------------------


@pytest.fixture
def run_copy(local_trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A copy of the trained run's store that each test damages (a moved store is the same
    run), the working folder beside it, and Ray out of reach: every case here must stop
    before Ray starts."""
    shutil.copytree(local_trained_run, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("drmas.generation.ray_session.connect_ray", refuse_ray)
    return Store(str(tmp_path / "runs"))


def rewrite(store: Store, path: str, files: dict[str, bytes]) -> None:
    """Replace an artifact's files, with a manifest that matches them (and the old meta, so
    that caching still takes it for the stage's output): damage that no hash can see."""
    meta = store.open(path).meta
    with store.writer(path, overwrite=True, meta=meta) as out:
        for name, data in files.items():
            out.write_bytes(name, data)


def other_model(tmp_path: Path, *overrides: str) -> Path:
    """The initial policy of the solver of the same config with other model settings."""
    config = load_config(MATH, [*BASE, *overrides, f"store.root={tmp_path / 'other'}"])
    store = Store.from_config(config.store)
    ref = init_policies(config, store, "other")["solver"]
    return store.open(ref.artifact).download(tmp_path / "other-policy")


@pytest.mark.slow
def test_a_modified_trajectory_file_is_refused_by_rerun(run_copy, capsys):
    rollout_path = stage_path(EXPERIMENT, RUN, 0, "rollout")
    file = Path(run_copy.root) / rollout_path / "trajectories.parquet"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    before = manifests(Path(run_copy.root))
    status, err = drmas(
        capsys,
        "rerun",
        MATH,
        *BASE,
        "experiment.iterations=1",
        f"store.root={run_copy.root}",
        "--run-id",
        RUN,
        "--iteration",
        "0",
        "--stage",
        "advantage",
    )
    assert status == 1
    assert (
        f"drmas rerun: {run_copy.uri(rollout_path, 'trajectories.parquet')}: "
        "sha256 differs from the manifest (modified?)" in err
    ), err
    assert manifests(Path(run_copy.root)) == before


@pytest.mark.slow
def test_a_truncated_parquet_file_is_refused_by_rerun(run_copy, capsys):
    rollout_path = stage_path(EXPERIMENT, RUN, 0, "rollout")
    artifact = run_copy.open(rollout_path)
    data = artifact.read_bytes("trajectories.parquet")
    rewrite(
        run_copy,
        rollout_path,
        {"trajectories.parquet": data[: len(data) // 2], "metrics.json": artifact.read_bytes("metrics.json")},
    )
    before = manifests(Path(run_copy.root))
    status, err = drmas(
        capsys,
        "rerun",
        MATH,
        *BASE,
        "experiment.iterations=1",
        f"store.root={run_copy.root}",
        "--run-id",
        RUN,
        "--iteration",
        "0",
        "--stage",
        "advantage",
    )
    assert status == 1
    assert f"drmas rerun: {run_copy.uri(rollout_path, 'trajectories.parquet')}: not a readable Parquet file" in err, err
    assert "Traceback" not in err
    assert manifests(Path(run_copy.root)) == before


@pytest.mark.slow
@pytest.mark.parametrize("command", ["resume", "eval", "evaluate stage"])
def test_a_checkpoint_of_another_model_is_refused_before_it_loads(command, run_copy, tmp_path, capsys):
    policy = policy_path(EXPERIMENT, RUN, 0, "solver")
    folder = other_model(tmp_path, "models.tiny.hidden_size=64", "models.tiny.num_layers=2")
    rewrite(run_copy, policy, {path.name: path.read_bytes() for path in folder.iterdir()})
    record_policy(run_copy, RUN, "solver")
    before = manifests(Path(run_copy.root))
    expected = (
        f"{run_copy.uri(policy)}: the checkpoint of another model: hidden_size 64 (expected 32), "
        "num_hidden_layers 2 (expected 1) (worker group 'solver' has model 'tiny')"
    )
    if command == "evaluate stage":  # what ``drmas eval --iteration I`` runs once Ray is up
        config = load_config(MATH, [*BASE, f"store.root={run_copy.root}"])
        policies = {wg: PolicyRef(policy_path(EXPERIMENT, RUN, 0, wg)) for wg in ("solver", "verifier")}
        pool = ScriptedPool(lambda wg, prompt: "")
        with pytest.raises(PolicyError, match=re.escape(expected)):
            evaluate(config, run_copy, stage_path(EXPERIMENT, RUN, 0, "evaluate"), policies, pool)
    else:
        args = (
            ["run", MATH, "--resume", RUN, "experiment.iterations=2"]
            if command == "resume"
            else ["eval", MATH, "--run-id", RUN]
        )
        status, err = drmas(capsys, *args, *BASE, f"store.root={run_copy.root}")
        assert status == 1
        assert expected in err, err
    assert manifests(Path(run_copy.root)) == before


def foreign_optimizer_state(tmp_path: Path, *overrides: str) -> Path:
    """The optimizer state (as drmas saves it) of another model after one step."""
    model = load_model(other_model(tmp_path, *overrides))
    config = load_config(MATH, [*BASE, *overrides])
    engine = TorchEngine(model, config.worker_groups()[0], config)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    engine.step(engine.grad_norm())
    save_state(capture_state(model, engine.optimizer, engine.scheduler), tmp_path / "foreign")
    return tmp_path / "foreign"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            ["models.tiny.hidden_size=64"],
            r"the state for model\.embed_tokens\.weight\.exp_avg is of shape \(\d+, 64\), "
            r"but the parameter has shape \(\d+, 32\)",
        ),
        (
            ["models.tiny.num_layers=2"],
            r"it holds state for 11 parameter\(s\) this model does not have "
            r"\(e\.g\. 'model\.layers\.1\.\S+'\): the optimizer state of another model",
        ),
    ],
    ids=["other shapes", "other parameters"],
)
def test_an_optimizer_state_of_another_model_is_refused_by_the_update(overrides, reason, run_copy, tmp_path):
    folder = foreign_optimizer_state(tmp_path, *overrides)
    with run_copy.writer("foreign/optim") as out:
        out.put_dir(folder, "")
    config = load_config(MATH, [*BASE, "experiment.iterations=1", f"store.root={run_copy.root}"])
    before = manifests(Path(run_copy.root))
    policy = PolicyRef(policy_path(EXPERIMENT, RUN, 0, "solver"))
    with pytest.raises(CorruptArtifact) as error:
        update(config, run_copy, RUN, 0, "solver", policy, PolicyRef("foreign/optim"), overwrite=True)
    prefix = f"{run_copy.uri('foreign/optim')}: cannot resume the optimizer from it: "
    assert re.fullmatch(re.escape(prefix) + reason, str(error.value)), str(error.value)
    assert manifests(Path(run_copy.root)) == before
    assert run_copy.exists(optim_path(EXPERIMENT, RUN, 0, "solver"))  # the last good state stays


def test_an_error_raised_in_a_ray_actor_reads_as_its_reason(capsys):
    """A worker group's actor that refuses an artifact: Ray wraps the error in a remote
    traceback; the command prints the reason alone."""
    from ray.exceptions import RayTaskError

    from drmas.cli_common import fail as _fail

    cause = CorruptArtifact("s3://b/run/policy/solver/model.safetensors: sha256 differs from the manifest (modified?)")
    wrapped = RayTaskError(
        "WorkerGroupRuntime.load_policy", 'Traceback (most recent call last):\n  File "workers.py"', cause
    ).as_instanceof_cause()
    assert isinstance(wrapped, CorruptArtifact) and 'File "workers.py"' in str(wrapped)  # Ray's text
    assert _fail("eval", wrapped) == 1
    assert capsys.readouterr().err == f"drmas eval: {cause}\n"


def test_pickled_weights_in_a_model_folder_are_refused_by_name(tmp_path):
    """What every weight loader says for a folder it must not open (the payload itself is
    in test_security.py)."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(
        PolicyError, match=r"pytorch_model.bin\) and no model.safetensors; drmas loads weights only from safetensors"
    ):
        load_model(tmp_path)
