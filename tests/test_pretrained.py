"""Pretrained models as they come: hub ids pinned by revision and found in a local Hugging
Face cache when offline, each model's own chat template (or the config's, for a model that
has none) with its system message, and the prompt sets (reference for pretrained models,
compact for scratch ones).

The hub is never reached: a tiny model built from a config is laid out in a cache folder
as the hub client lays out what it downloads (``models--ORG--NAME/blobs``, ``snapshots/<commit>``
of links to the blobs, ``refs/<branch>`` holding a commit hash), and huggingface_hub's own
cache scanner must read it back before any test relies on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from drmas.config import ConfigError, ModelSpec, PolicyError, SamplingConfig, TaskConfig, load_config
from drmas.generation.workers import GenerationResult, WorkerGroupRuntime
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store
from drmas.models import build_scratch_policy, chat_prompt, load_model, load_tokenizer, takes_system_message
from drmas.planning import PlanError, architecture_of
from drmas.stages import warmstart
from drmas.stages.policies import init_policies
from drmas.stages.rollout import build_team, play
from drmas.tasks import Question
from drmas.tasks.math import MathOrchestra, math_demonstrations
from drmas.team.agents import AnswerAgent, MathVerifierAgent, RouterAgent, SearchAgent, SolverAgent
from drmas.team.episodes import Episode
from drmas.team.orchestras import Tools
from drmas.team.prompts import MATH_PROMPTS, prompt_set

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "configs"
TINY = CONFIGS / "math_tiny.yaml"
SPEC = ModelSpec(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300)
MAIN_COMMIT = "a" * 40
DEV_COMMIT = "b" * 40
CHAT = "acme/tiny-chat"
BASE = "acme/tiny-base"
REFERENCE_SYSTEM = "You are a helpful and harmless assistant."


# ----------------------------------------------------------------------------- the hub cache


def lay_out_in_hub_cache(cache: Path, repo_id: str, snapshots: dict[str, Path], refs: dict[str, str]) -> None:
    """Put model folders in ``cache`` as huggingface_hub's downloads leave them: each file
    once under ``blobs/`` (named by its hash), each commit a ``snapshots/<commit>/`` of
    relative links to the blobs, each branch a ``refs/<branch>`` file holding its commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, folder in snapshots.items():
        for file in folder.iterdir():
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            shutil.copyfile(file, repo / "blobs" / digest)
            link = repo / "snapshots" / commit / file.name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path("..") / ".." / "blobs" / digest)
    for branch, commit in refs.items():
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A cache holding acme/tiny-chat (main -> one commit, dev -> another with other
    weights) and acme/tiny-base (a tokenizer without a chat template)."""
    root = tmp_path_factory.mktemp("hub")
    main = build_scratch_policy(SPEC, ["What is 12 + 30? \\boxed{42}"] * 20, root / "main", seed=0)
    dev = Path(shutil.copytree(main, root / "dev"))
    weights = load_file(str(main / "model.safetensors"))
    save_file({name: tensor + 1 for name, tensor in weights.items()}, str(dev / "model.safetensors"))
    base = Path(shutil.copytree(main, root / "base"))
    (base / "chat_template.jinja").unlink()
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    cache = root / "home" / "hub"
    lay_out_in_hub_cache(cache, CHAT, {MAIN_COMMIT: main, DEV_COMMIT: dev}, {"main": MAIN_COMMIT, "dev": DEV_COMMIT})
    lay_out_in_hub_cache(cache, BASE, {MAIN_COMMIT: base}, {"main": MAIN_COMMIT})
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch) -> Path:
    """The hub client pointed at ``hub_cache`` and offline, as HF_HUB_CACHE and
    HF_HUB_OFFLINE=1 set it when it is imported (it reads them once, at import)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def first_weight(model: torch.nn.Module) -> torch.Tensor:
    return next(iter(model.state_dict().values()))


def test_the_cache_is_laid_out_as_the_hub_client_reads_it(hub_cache):
    scanned = {repo.repo_id: repo for repo in huggingface_hub.scan_cache_dir(hub_cache).repos}
    assert set(scanned) == {CHAT, BASE}
    refs = {revision.commit_hash: set(revision.refs) for revision in scanned[CHAT].revisions}
    assert refs == {MAIN_COMMIT: {"main"}, DEV_COMMIT: {"dev"}}


@pytest.mark.parametrize(
    ("revision", "shifted"),
    [(None, False), ("main", False), ("dev", True), (MAIN_COMMIT, False), (DEV_COMMIT, True)],
)
def test_a_hub_id_loads_from_the_cache_at_its_revision(offline_hub, revision, shifted):
    """A branch resolves through refs/, a commit hash names its snapshot; dev's weights are
    main's plus one."""
    main_weight = first_weight(load_model(offline_hub / f"models--acme--tiny-chat/snapshots/{MAIN_COMMIT}"))
    loaded = first_weight(load_model(CHAT, revision=revision))
    assert torch.equal(loaded, main_weight + 1 if shifted else main_weight)
    assert load_tokenizer(CHAT, revision).chat_template


@pytest.mark.parametrize(("repo_id", "revision"), [("acme/absent", None), (CHAT, "v9"), (CHAT, "c" * 40)])
def test_a_model_neither_cached_nor_reachable_is_named_with_the_fix(offline_hub, repo_id, revision):
    with pytest.raises(PolicyError) as caught:
        load_model(repo_id, revision=revision)
    message = str(caught.value)
    assert f"hub model {repo_id!r} at revision {revision or 'main'!r}" in message
    assert "neither in the local Hugging Face cache nor reachable (HF_HUB_OFFLINE=1)" in message
    assert f"hf download {repo_id}" + (f" --revision {revision}" if revision else "") in message
    assert str(offline_hub) in message and "HF_HOME or HF_HUB_CACHE" in message


def test_an_invalid_hub_id_is_named():
    with pytest.raises(PolicyError, match=r"^not a/valid id: neither a local folder nor a hub id"):
        load_model("not a/valid id")


@pytest.mark.parametrize(("revision", "layers"), [(None, 2), ("main", 2), ("dev", 5), (DEV_COMMIT, 5)])
def test_the_memory_plan_sizes_the_pinned_revision(offline_hub, monkeypatch, tmp_path, revision, layers):
    """``drmas plan`` reads the config.json that the weights load from: the pinned revision's
    in the cache, not main's (here dev's model is deeper)."""
    for branch, depth in (("main", 2), ("dev", 5)):
        folder = tmp_path / branch
        folder.mkdir()
        numbers = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 1000}
        (folder / "config.json").write_text(json.dumps({**numbers, "num_hidden_layers": depth}))
    cache = tmp_path / "hub"
    lay_out_in_hub_cache(
        cache,
        "acme/deep",
        {MAIN_COMMIT: tmp_path / "main", DEV_COMMIT: tmp_path / "dev"},
        {"main": MAIN_COMMIT, "dev": DEV_COMMIT},
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    architecture, where = architecture_of("deep", ModelSpec(source="acme/deep", revision=revision))
    assert architecture.num_hidden_layers == layers
    assert where.endswith(f"snapshots/{DEV_COMMIT if layers == 5 else MAIN_COMMIT}/config.json")
    with pytest.raises(
        PlanError, match=r"'acme/deep' at revision 'v9'.*hf download acme/deep config.json --revision v9"
    ):
        architecture_of("deep", ModelSpec(source="acme/deep", revision="v9"))


def test_init_policy_stores_the_pinned_revision_with_its_template(offline_hub, tmp_path):
    config = load_config(TINY, [f"models.tiny={{source: {CHAT}, revision: dev}}", "workers.sharing=by_model"])
    assert config.task.prompts == "reference"  # no scratch model: the reference prompt set
    store = Store(str(tmp_path / "store"))
    [policy] = init_policies(config, store, "run").values()
    folder = store.open(policy.artifact).download(tmp_path / "policy")
    dev = first_weight(load_model(CHAT, revision="dev"))
    assert torch.equal(first_weight(load_model(folder)), dev)
    assert load_tokenizer(folder).chat_template == load_tokenizer(CHAT).chat_template


def test_a_model_without_a_chat_template_is_refused_naming_the_field(offline_hub, tmp_path):
    store = Store(str(tmp_path / "store"))
    config = load_config(TINY, [f"models.tiny={{source: {BASE}}}", "workers.sharing=by_model"])
    with pytest.raises(PolicyError, match=r"model 'tiny' has no chat template .*models.tiny.chat_template supplies"):
        init_policies(config, store, "run")
    direct = load_config(TINY, [f"agents.solver.model={BASE}", f"agents.verifier.model={BASE}"])
    with pytest.raises(PolicyError, match=rf"models.NAME.chat_template supplies one: .*source: {BASE}"):
        init_policies(direct, store, "direct")
    assert not list((tmp_path / "store").rglob("_MANIFEST.json"))  # refused before anything was written


def test_the_configs_chat_template_is_stored_with_the_policy(offline_hub, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    config = load_config(
        TINY, [f"models.tiny={{source: {BASE}, chat_template: {json.dumps(template)}}}", "workers.sharing=by_model"]
    )
    store = Store(str(tmp_path / "store"))
    [policy] = init_policies(config, store, "run").values()
    tokenizer = load_tokenizer(store.open(policy.artifact).download(tmp_path / "policy"))
    assert chat_prompt(tokenizer, "hi", "be brief") == "[system] be brief\n[user] hi\n[assistant] "


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["models.tiny.revision=dev"], "models.tiny: revision 'dev' pins a hub id; source 'scratch' is not one"),
        (
            ["models.tiny={source: s3://bucket/policy, revision: dev}"],
            "models.tiny: revision 'dev' pins a hub id; source 's3://bucket/policy' is not one",
        ),
        (["models.tiny.chat_template='{{ messages }}'"], "models.tiny: chat_template: a scratch model is built"),
    ],
)
def test_model_fields_that_do_not_apply_are_refused(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(TINY, overrides)


@pytest.mark.slow
def test_hf_home_and_offline_mode_from_the_environment(hub_cache, tmp_path):
    """As a user runs it: HF_HOME names the cache's parent, HF_HUB_OFFLINE=1, nothing
    patched (a fresh interpreter reads them when it imports the hub client)."""
    code = (
        "from drmas.models import load_model\n"
        f"print(float(next(iter(load_model({CHAT!r}, revision='dev').state_dict().values())).sum()))\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env |= {"HF_HOME": str(hub_cache.parent), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    dev = load_file(str(hub_cache / f"models--acme--tiny-chat/snapshots/{DEV_COMMIT}/model.safetensors"))
    assert float(done.stdout.strip().splitlines()[-1]) == pytest.approx(float(next(iter(dev.values())).sum()))


# ----------------------------------------------------------------------------- system prompts

ROLES_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
)
DROPS_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}"
    "{% endfor %}<assistant>"
)


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    return build_scratch_policy(SPEC, ["What is 1 + 1? \\boxed{2}"] * 20, tmp_path_factory.mktemp("policy"), seed=0)


@pytest.mark.parametrize(
    ("template", "takes_system", "expected"),
    [
        (ROLES_TEMPLATE, True, "<system>Be brief.<user>What is 1 + 1?<assistant>"),
        (NO_SYSTEM_TEMPLATE, False, "<user>Be brief.\n\nWhat is 1 + 1?<assistant>"),  # it raises on a system turn
        (DROPS_SYSTEM_TEMPLATE, False, "<user>Be brief.\n\nWhat is 1 + 1?<assistant>"),  # it leaves it out
    ],
)
def test_the_system_prompt_is_a_system_message_where_the_template_takes_one(policy, template, takes_system, expected):
    tokenizer = load_tokenizer(policy)
    tokenizer.chat_template = template
    assert takes_system_message(tokenizer) is takes_system
    assert chat_prompt(tokenizer, "What is 1 + 1?", "Be brief.") == expected
    assert chat_prompt(tokenizer, "What is 1 + 1?") == "<user>What is 1 + 1?<assistant>"


def test_without_a_system_prompt_a_scratch_models_prompt_is_one_chatml_user_turn(policy):
    """The shape the tiny configs learn with: unchanged by the system-prompt support."""
    expected = "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt(load_tokenizer(policy), "What is 1 + 1?") == expected


def test_the_worker_sends_its_models_system_prompt(policy, tmp_path):
    store = Store(str(tmp_path / "store"))
    with store.writer("policies/tiny") as out:
        out.put_dir(policy, "")
    runtime = WorkerGroupRuntime(
        "solver", store.settings(), cache_dir=str(tmp_path / "cache"), system_prompt=REFERENCE_SYSTEM
    )
    runtime.load_policy(PolicyRef("policies/tiny"))
    [result] = runtime.generate(["What is 1 + 1?"], SamplingConfig(temperature=0.0, max_new_tokens=2), seed=0)
    assert load_tokenizer(policy).decode(result.prompt_ids) == (
        f"<|im_start|>system\n{REFERENCE_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_warm_start_renders_with_the_system_prompt(policy, tmp_path, warm_start_prompts):
    config = load_config(
        TINY,
        [
            f"models.tiny.system_prompt='{REFERENCE_SYSTEM}'",
            "models.other={hidden_size: 16, num_heads: 2, num_kv_heads: 1}",
            "agents.verifier.model=other",
            "warmstart.steps=1",
            "warmstart.batch_size=2",
        ],
    )
    rendered = warm_start_prompts
    tokenizer = load_tokenizer(policy)
    for label, system in (("solver", True), ("verifier", False)):  # only the Solver's model has one
        rendered.clear()
        pairs = [("What is 1 + 1?", "\\boxed{2}")]
        warmstart._fine_tune(config, policy, pairs, np.random.default_rng(0), tmp_path / label, label=label)
        assert rendered
        assert all(tokenizer.decode(ids).startswith("<|im_start|>system\n") is system for ids in rendered)


# ----------------------------------------------------------------------------- prompt sets

QUESTION = Question("q0", "What is 12 + 30?", ("42",), "test")


def episode(context: list[str] = (), history: list[tuple[str, str]] = ()) -> Episode:
    return Episode("u", "t", 0, QUESTION, team_context=list(context), history=list(history))


def test_compact_prompts_keep_the_shape_the_scratch_models_learn():
    """Every character of the compact set, written out by hand: the tiny configs, their
    demonstrations and their tokenizers depend on it."""
    solved = episode(["Solver: 2+0=2. \\boxed{42}"])
    searched = episode(["Verifier: <verify>no</verify>"], [("a", "Doc 1"), ("b", "Doc 2"), ("c", "Doc 3")])
    assert SolverAgent().prompt(episode(), 1) == (
        "Problem: What is 12 + 30?\nSolver: solve it step by step, final answer in \\boxed{}."
    )
    assert MathVerifierAgent().prompt(solved, 1) == (
        "Problem: What is 12 + 30?\nSolver: 2+0=2. \\boxed{42}\n"
        "Verifier: check the last solution, end with <verify>approve</verify> or <verify>reject</verify>."
    )
    history = "History:\nStep 2: <search>b</search> <information>Doc 2</information>\n"
    history += "Step 3: <search>c</search> <information>Doc 3</information>\n"
    assert RouterAgent(history_length=2).prompt(searched, 3) == (
        f"Question: What is 12 + 30?\n{history}You are the Verifier at step 3. Is the information enough to "
        "answer? End with <verify>yes</verify> or <verify>no</verify>."
    )
    assert SearchAgent(history_length=2).prompt(searched, 3) == (
        f"Question: What is 12 + 30?\n{history}Teammates at step 3:\nVerifier: <verify>no</verify>\n"
        "You are the Searcher. Think in <think></think>, then give one query as <search>query</search>."
    )
    assert AnswerAgent(history_length=0).prompt(searched, 3) == (
        "Question: What is 12 + 30?\n"
        "You are the Answerer. Think in <think></think>, then answer as <answer>answer</answer>."
    )


def sections(prompt: str) -> list[str]:
    return [line for line in prompt.splitlines() if line.startswith("# ")]


def test_reference_math_prompts_give_the_task_the_teammates_and_the_exact_format():
    first = SolverAgent("reference").prompt(episode(), 1)
    assert sections(first) == ["# Task Introduction", "# Your Teammates' Outputs", "# Your Role"]
    assert "What is 12 + 30?" in first and "inside \\boxed{}" in first
    assert (
        first.split("# Your Teammates' Outputs\n")[1].split("# Your Role")[0].strip() == ""
    )  # none yet, as in the reference
    context = ["Solver: 2+0=2. \\boxed{42}", "Verifier: wrong. <verify>reject</verify>"]
    again = SolverAgent("reference").prompt(episode(context), 1)
    teammates = again.split("# Your Teammates' Outputs\n")[1].split("\n\n# Your Role")[0]
    assert teammates == "\n\n".join(context)
    verifier = MathVerifierAgent("reference").prompt(episode(context[:1]), 1)
    assert "Solver: 2+0=2. \\boxed{42}" in verifier
    assert "exactly <verify>approve</verify>" in verifier and "<verify>reject</verify>" in verifier


def test_reference_search_prompts_follow_the_references_sections():
    searched = episode(["Verifier: <verify>no</verify>"], [("who founded acme", "Doc 1: Ada founded Acme.")])
    router = RouterAgent(prompts="reference").prompt(searched, 2)
    assert sections(router) == ["# Task Introduction", "# Your Role"]  # the router sees no teammates
    assert "searched 1 time(s)" in router and "Step 1: <search>who founded acme</search>" in router
    assert "at step 2" in router and "<verify>yes</verify>" in router and "<verify>no</verify>" in router
    searcher = SearchAgent(prompts="reference").prompt(searched, 2)
    assert sections(searcher) == ["# Task Introduction", "# Your Teammates' Outputs at Step 2", "# Your Role"]
    assert "Verifier: <verify>no</verify>" in searcher and "<search> and </search>" in searcher
    answerer = AnswerAgent(prompts="reference").prompt(episode(), 1)
    assert "searched" not in answerer  # no history yet: the step-1 introduction
    assert "<answer> and </answer>" in answerer and "<think> and </think>" in answerer
    assert "thoroughly" in answerer and "<answer>Beijing</answer>" in answerer  # the reference's full answer


def test_the_reference_prompts_add_no_instruction_the_references_do_not_give():
    """The additions the fidelity review (2026-12-03) found: a short answer, a Solver told to
    distrust its teammates and to end on the box alone, a brief Verifier, an example query,
    a placeholder for an empty team context. The compact set is left as it is."""
    searched = episode(["Verifier: <verify>no</verify>"], [("who founded acme", "Doc 1: Ada founded Acme.")])
    prompts = [
        SolverAgent("reference").prompt(episode(), 1),
        SolverAgent("reference").prompt(episode(["Solver: \\boxed{41}", "Verifier: <verify>reject</verify>"]), 1),
        MathVerifierAgent("reference").prompt(episode(["Solver: \\boxed{42}"]), 1),
        RouterAgent(prompts="reference").prompt(searched, 2),
        SearchAgent(prompts="reference").prompt(searched, 2),
        AnswerAgent(prompts="reference").prompt(searched, 2),
    ]
    added = ["few words", "only the answer", "brief", "rather than copy", "may be wrong", "nothing else", "Australia"]
    for prompt in prompts:
        assert not [phrase for phrase in added + ["none yet"] if phrase in prompt], prompt


def test_an_unknown_prompt_set_is_named():
    with pytest.raises(ValueError, match="unknown prompt set 'verbose'; the prompt sets are reference, compact"):
        prompt_set(MATH_PROMPTS, "verbose")
    with pytest.raises(ConfigError, match="task.prompts"):
        load_config(TINY, ["task.prompts=verbose"])


@pytest.mark.parametrize(
    ("path", "overrides", "expected"),
    [
        (TINY, [], "compact"),  # scratch models
        (TINY, ["agents.verifier.model=Qwen/Qwen3-4B"], "compact"),  # one scratch model is enough
        (TINY, ["models.tiny.source=Qwen/Qwen3-4B"], "reference"),
        (TINY, ["models.tiny.source=Qwen/Qwen3-4B", "task.prompts=compact"], "compact"),  # explicit wins
        (TINY, ["task.prompts=reference"], "reference"),
        (CONFIGS / "math_qwen3_4b_gpu.yaml", [], "reference"),
        (CONFIGS / "search_qwen25_7b_gpu.yaml", [], "reference"),
    ],
)
def test_the_prompt_set_defaults_by_kind_of_model(path, overrides, expected):
    config = load_config(path, overrides)
    assert config.task.prompts == expected
    assert json.loads(config.to_json())["task"]["prompts"] == expected  # recorded resolved


@pytest.mark.parametrize("recipe", ["math_qwen3_4b_gpu.yaml", "search_qwen25_7b_gpu.yaml"])
def test_the_papers_recipes_use_the_reference_prompts_and_system_message(recipe):
    assert yaml.safe_load((CONFIGS / recipe).read_text())["task"]["prompts"] == "reference"  # not by default
    config = load_config(CONFIGS / recipe)
    assert config.task.prompts == "reference"
    assert {group.system_prompt for group in config.worker_groups()} == {REFERENCE_SYSTEM}


class EchoPool:
    """Answers every call with a fixed verdict-and-box text; records the prompts (a fake at
    the engine boundary, as in test_orchestras)."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def load(self, policies) -> None:
        pass

    def generate(self, wg, messages, sampling, seed):
        self.prompts += messages
        text = "\\boxed{42} <verify>reject</verify>"
        return [GenerationResult([1], [2], [-0.1], text, "stop") for _ in messages]


def test_the_orchestra_and_the_demonstrations_speak_the_configs_prompt_set():
    config = load_config(TINY, ["task.prompts=reference", "workers.sharing=none"])
    pool = EchoPool()
    orchestra, team = build_team(config, Tools(), pool, seed=0)
    play(orchestra, team, [QUESTION], group_size=1, prefix="p")
    assert len(pool.prompts) == 3 and all(prompt.startswith("# Task Introduction") for prompt in pool.prompts)
    assert "\\boxed{42} <verify>reject</verify>" in pool.prompts[-1]  # the teammates' outputs
    demos = math_demonstrations([QUESTION], config, np.random.default_rng(0))
    assert all(prompt.startswith("# Task Introduction") for pairs in demos.values() for prompt, _ in pairs)
    assert MathOrchestra(TaskConfig(), Tools()).agent_objects["solver"] == SolverAgent("compact")
