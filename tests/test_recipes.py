"""The paper's recipes (configs/*_gpu.yaml) hold the reference scripts' values, and the
settings drmas added to express them work: prompt truncation (middle or left), per-model
chat-template variables (Qwen3's enable_thinking), and recomputing the old log-probs by
default where the rollout engine's can drift from the trainer's.

The reference values are those of examples/drmas_trainer/run_math.sh and run_search.sh in
the DrMAS repository at 19c632b (re-read on 2026-12-03 for the fidelity review,
/work/shared/reviews/2026-12-03-fidelity.md), and of veRL's ppo_trainer.yaml defaults where a
script sets nothing. Reference settings that drmas has no field for (speed-only ones such as
use_remove_padding and log_prob_micro_batch_size_per_gpu, SGLang's gpu_memory_utilization,
filter_overlong_prompts) are listed in each YAML's header comment instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from drmas.config import ConfigError, DrmasConfig, ModelSpec, SamplingConfig, load_config
from drmas.generation.workers import WorkerGroupRuntime, truncate_prompt
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store
from drmas.models import build_scratch_policy, load_tokenizer
from drmas.runner import open_run
from drmas.stages import warmstart
from drmas.tasks import run_length

CONFIGS = Path(__file__).parent.parent / "configs"
MATH_RECIPE = CONFIGS / "math_qwen3_4b_gpu.yaml"
SEARCH_RECIPE = CONFIGS / "search_qwen25_7b_gpu.yaml"
TINY = CONFIGS / "math_tiny.yaml"

# (reference setting, as the script or veRL's yaml names it; our resolved field; value)
SHARED_REFERENCE = [
    ("algorithm.adv_estimator=grpo, group_by_agent_id=True", "algorithm.advantage", "drmas"),
    ("algorithm.norm_adv_by_std_in_grpo (default True)", "algorithm.scale_by_std", True),
    ("GRPO std epsilon (1e-6)", "algorithm.eps", 1e-6),
    ("actor.clip_ratio_low (default)", "algorithm.clip_ratio_low", 0.2),
    ("actor.clip_ratio_high (default)", "algorithm.clip_ratio_high", 0.2),
    ("actor.clip_ratio_c (default, dual clip)", "algorithm.clip_ratio_c", 3.0),
    (
        "actor.loss_agg_mode=token-mean (default; per micro-batch, averaged over them)",
        "algorithm.loss_aggregation",
        "token-mean-per-micro-batch",
    ),
    ("actor.use_kl_loss=False, no KL in reward", "algorithm.kl_coef", 0.0),
    ("rollout.name=sglang", "rollout.engine", "sglang"),
    ("rollout.temperature (default)", "rollout.sampling.temperature", 1.0),
    ("rollout.top_p (default)", "rollout.sampling.top_p", 1.0),
    ("rollout.top_k (default -1: off)", "rollout.sampling.top_k", 0),
    ("actor.optim.lr=[1e-6, ...] per agent", "train.lr", 1e-6),
    ("actor.optim.warmup_style=constant, lr_warmup_steps (default)", "train.warmup_steps", 0),
    ("actor.optim.weight_decay (veRL default)", "train.weight_decay", 0.01),
    ("actor.grad_clip (default)", "train.grad_clip", 1.0),
    ("model.enable_gradient_checkpointing=True", "train.gradient_checkpointing", True),
    ("actor.fsdp_config.optimizer_offload=True", "train.offload_optimizer", True),
    ("compute_log_prob before every update (old log-probs by the trainer)", "train.recompute_old_logprobs", True),
    ("val_kwargs.do_sample=True, temperature=0.6", "eval.sampling.temperature", 0.6),
    ("val_kwargs.top_p=0.95", "eval.sampling.top_p", 0.95),
    ("env.rollout.val_n=1 (validation during training)", "eval.k", 1),
    ("env.rollout.val_n=16 (eval mode: the final checkpoint)", "eval.final.k", 16),
    ("eval mode: every test question", "eval.final.max_questions", None),
    (
        "general_projection / math_projection (first tag, last box, the reference's validity)",
        "task.parsing",
        "reference",
    ),
]

MATH_REFERENCE = SHARED_REFERENCE + [
    ("actor_rollout_ref.model.path per agent: Qwen/Qwen3-4B", "models.qwen3-4b.source", "Qwen/Qwen3-4B"),
    ("bf16 (SGLang dtype, FSDP mixed precision)", "models.qwen3-4b.dtype", "bfloat16"),
    (
        "data.apply_chat_template_kwargs.enable_thinking=False",
        "models.qwen3-4b.chat_template_kwargs.enable_thinking",
        False,
    ),
    ("agent_ids[0]=Solver Agent", "agents.solver.model", "qwen3-4b"),
    ("agent_ids[1]=Verifier Agent", "agents.verifier.model", "qwen3-4b"),
    ("model_sharing=False", "workers.sharing", "none"),
    ("orchestra_type=math", "task.name", "math"),
    ("agent.orchestra.math.max_loop_num=2", "task.max_loops", 2),
    ("actor.invalid_action_penalty_coef=0.1", "algorithm.invalid_penalty", 0.1),
    ("actor.entropy_coeff=0.0", "algorithm.entropy_coef", 0.0),
    ("data.train_batch_size=32", "rollout.prompts_per_iteration", 32),
    ("env.rollout.n=8", "rollout.group_size", 8),
    ("data.max_prompt_length=8192", "rollout.max_prompt_tokens", 8192),
    ("data.truncation=middle", "rollout.truncation", "middle"),
    ("data.max_response_length=4096", "rollout.sampling.max_new_tokens", 4096),
    ("data.max_response_length=4096 (validation)", "eval.sampling.max_new_tokens", 4096),
    ("actor.ppo_micro_batch_size_per_gpu=[4,4]", "train.micro_batch_size", 4),
    (
        "actor.use_dynamic_bsz (default False: rows per micro-batch); deviation: at most 20480 tokens a "
        "micro-batch (four rows of up to 5120 tokens), kept until a GPU measures four rows of 12288",
        "train.max_tokens_per_micro_batch",
        20480,
    ),
    ("use_adaptive_ppo_mini_batch_size=True, ppo_mini_update_num=1", "train.updates_per_iteration", 1),
    ("trainer.test_freq=10", "eval.every", 10),
    ("trainer.n_gpus_per_node=4, nnodes=1", "ray.pool_size", 4),
    ("trainer.total_epochs=2", "experiment.epochs", 2),
    ("no trainer.total_training_steps: the epochs decide", "experiment.iterations", None),
    ("reward_model.ground_truth (drmas_math.py's gold answer)", "data.answer_field", "reward_model.ground_truth"),
    ("eval mode: test.parquet", "eval.final.data", "s3://drmas/data/drmas_math/test.parquet"),
    ("RewardMathFn: grade_answer_mathd or grade_answer_sympy", "task.grader", "reference"),
]

SEARCH_REFERENCE = SHARED_REFERENCE + [
    ("actor_rollout_ref.model.path per agent: Qwen/Qwen2.5-7B (base)", "models.qwen25-7b.source", "Qwen/Qwen2.5-7B"),
    ("bf16 (SGLang dtype, FSDP mixed precision)", "models.qwen25-7b.dtype", "bfloat16"),
    ("no apply_chat_template_kwargs", "models.qwen25-7b.chat_template_kwargs", {}),
    ("agent_ids[0]=Verifier Agent", "agents.verifier.model", "qwen25-7b"),
    ("agent_ids[1]=Search Agent", "agents.search.model", "qwen25-7b"),
    ("agent_ids[2]=Answer Agent", "agents.answer.model", "qwen25-7b"),
    ("model_sharing=False", "workers.sharing", "none"),
    ("orchestra_type=search", "task.name", "search"),
    ("env.max_steps=4", "task.max_turns", 4),
    ("env.history_length=4", "task.history_length", 4),
    ("env.search.topk=3", "task.retrieval_top_k", 3),
    ("retrieval_server.py: a dense e5 retriever and a FAISS flat index", "task.retrieval_method", "dense"),
    ("retrieval_launch.sh: retriever_model=intfloat/e5-base-v2", "task.retrieval_encoder", "intfloat/e5-base-v2"),
    ("retrieval_query_max_length=256; index_builder --max_length 256", "task.retrieval_max_length", 256),
    ('Encoder.encode for e5: "query: " before a query', "task.retrieval_query_prefix", "query: "),
    ('index_builder for e5: "passage: " before a passage', "task.retrieval_passage_prefix", "passage: "),
    ("actor.invalid_action_penalty_coef=0.01", "algorithm.invalid_penalty", 0.01),
    ("actor.entropy_coeff (not set: default 0.001)", "algorithm.entropy_coef", 0.001),
    ("data.train_batch_size=128", "rollout.prompts_per_iteration", 128),
    ("env.rollout.n=5", "rollout.group_size", 5),
    ("data.max_prompt_length=4096", "rollout.max_prompt_tokens", 4096),
    ("data.truncation=left", "rollout.truncation", "left"),
    ("data.max_response_length=800", "rollout.sampling.max_new_tokens", 800),
    ("data.max_response_length=800 (validation)", "eval.sampling.max_new_tokens", 800),
    ("actor.ppo_micro_batch_size_per_gpu=[4,4,4]", "train.micro_batch_size", 4),
    ("use_adaptive_ppo_mini_batch_size=True, ppo_mini_update_num=5", "train.updates_per_iteration", 5),
    ("trainer.test_freq=5", "eval.every", 5),
    ("trainer.n_gpus_per_node=4, nnodes=1", "ray.pool_size", 4),
    ("actor.use_dynamic_bsz (default False: rows per micro-batch)", "train.max_tokens_per_micro_batch", None),
    ("trainer.total_epochs=1", "experiment.epochs", 1),
    ("no trainer.total_training_steps: the epochs decide", "experiment.iterations", None),
    (
        "reward_model.ground_truth.target (drmas_search.py's gold answers)",
        "data.answer_field",
        "reward_model.ground_truth.target",
    ),
    ("eval mode: test.parquet", "eval.final.data", "s3://drmas/data/drmas_search/test.parquet"),
]

RECIPES = {"math": (MATH_RECIPE, MATH_REFERENCE), "search": (SEARCH_RECIPE, SEARCH_REFERENCE)}

NO_THINK_TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A chat template that shows whether it was told ``enable_thinking=False``, as Qwen3's
template branches on it."""
TINY_SPEC = ModelSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, vocab_size=300)


def resolved(config: DrmasConfig, dotted: str) -> Any:
    """A field of the resolved config (every default filled in); list items by name."""
    node: Any = json.loads(config.to_json())
    for part in dotted.split("."):
        node = next(item for item in node if item["name"] == part) if isinstance(node, list) else node[part]
    return node


# ----------------------------------------------------------------------------- recipes


@pytest.mark.parametrize(
    ("recipe", "reference", "field", "value"),
    [
        pytest.param(name, ref, field, value, id=f"{name}:{field}")
        for name, (_, table) in RECIPES.items()
        for ref, field, value in table
    ],
)
def test_recipe_holds_the_reference_value(recipe, reference, field, value):
    config = load_config(RECIPES[recipe][0])
    assert resolved(config, field) == value, f"{recipe}: {reference} -> {field}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_one_model_per_agent_at_the_reference_lr(recipe):
    """model_sharing=False: every agent is its own worker group with its own optimizer, at
    the per-agent lr and micro-batch the script lists, with its model's template variables."""
    config = load_config(RECIPES[recipe][0])
    groups = config.worker_groups()
    assert [g.agents for g in groups] == [(agent.name,) for agent in config.agents]
    expected = {"math": {"enable_thinking": False}, "search": {}}[recipe]
    for group in groups:
        assert (group.lr, group.warmup_steps) == (1e-6, 0)
        assert group.micro_batch_size == config.train.micro_batch_size
        assert group.chat_template_kwargs == expected


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_resolved_config_is_stable(recipe, tmp_path):
    """The resolved config records recompute_old_logprobs as a boolean, loads back equal,
    and a resume with the same YAML passes the 'config differs from the recorded one' check."""
    path = RECIPES[recipe][0]
    config = load_config(path)
    assert json.loads(config.to_json())["train"]["recompute_old_logprobs"] is True
    assert DrmasConfig.from_json(config.to_json()) == config
    # The recipes count epochs: a training set of 1000 questions, as the run would read it.
    resolved_run = config.with_epochs_resolved(1000)
    assert resolved_run.total_iterations == (1000 // config.rollout.prompts_per_iteration) * config.experiment.epochs
    store = Store(str(tmp_path / "store"))
    open_run(resolved_run, store, "r1", resume=False)
    assert open_run(load_config(path).with_epochs_resolved(1000), store, "r1", resume=True) == resolved_run


# ----------------------------------------------------------------------------- run length in epochs

EPOCHS = ["experiment.iterations=null", "data.generated_train_size=100", "rollout.prompts_per_iteration=16"]
"""math_tiny run by epochs over 100 generated questions in batches of 16: 6 iterations an epoch."""


def test_a_run_given_in_epochs_records_its_iterations(tmp_path):
    """open_run counts the training set (the rollout's own questions) and records the run's
    length; a resume may lengthen it by epochs, as by iterations."""
    config = load_config(TINY, [*EPOCHS, "experiment.epochs=2"])
    assert run_length(config).total_iterations == 12
    store = Store(str(tmp_path / "store"))
    recorded = open_run(config, store, "r1", resume=False)
    assert (recorded.experiment.iterations, recorded.experiment.epochs) == (12, 2)
    assert store.open("math-tiny/r1/run").read_json("config.json")["experiment"]["iterations"] == 12
    longer = open_run(load_config(TINY, [*EPOCHS, "experiment.epochs=3"]), store, "r1", resume=True)
    assert longer.total_iterations == 18


def test_epochs_over_a_training_file_that_cannot_be_read_name_the_field_and_the_file(tmp_path):
    missing = tmp_path / "train.jsonl"
    config = load_config(TINY, ["experiment.iterations=null", "experiment.epochs=1", f"data.train={missing}"])
    with pytest.raises(ConfigError) as error:
        run_length(config)
    assert error.value.problems == [f"experiment.epochs: cannot count the training set: {missing}: file not found"]


# ----------------------------------------------------------------------------- recompute default


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], False),  # transformers engine, float32: the same kernels as the trainer
        (["rollout.engine=sglang"], True),
        (["models.tiny.dtype=bfloat16"], True),
        (["rollout.engine=sglang", "train.recompute_old_logprobs=false"], False),  # explicit wins
        (["train.recompute_old_logprobs=true"], True),
    ],
)
def test_recompute_old_logprobs_defaults_to_on_where_logprobs_can_drift(overrides, expected):
    config = load_config(TINY, overrides)
    assert config.train.recompute_old_logprobs is expected
    assert DrmasConfig.from_json(config.to_json()).train.recompute_old_logprobs is expected


def test_resume_compares_the_resolved_value(tmp_path):
    """The recorded config holds the value the run resolved: a resume whose settings would
    resolve it otherwise is named as a change, like any other field."""
    store = Store(str(tmp_path / "store"))
    open_run(load_config(TINY), store, "r1", resume=False)
    with pytest.raises(ConfigError, match="train.recompute_old_logprobs: the run was started with false, now true"):
        open_run(load_config(TINY, ["models.tiny.dtype=bfloat16"]), store, "r1", resume=True)


# ----------------------------------------------------------------------------- truncation


@pytest.mark.parametrize(
    ("truncation", "max_tokens", "expected"),
    [
        ("middle", 4, [0, 1, 8, 9]),
        ("middle", 5, [0, 1, 7, 8, 9]),  # the odd token goes to the end
        ("left", 4, [6, 7, 8, 9]),
        ("left", 10, list(range(10))),
        ("middle", 12, list(range(10))),
    ],
)
def test_truncate_prompt(truncation, max_tokens, expected):
    assert truncate_prompt(list(range(10)), max_tokens, truncation) == expected


@pytest.fixture(scope="module")
def no_think_policy(tmp_path_factory) -> Path:
    """A tiny scratch policy (HF layout) whose chat template branches on enable_thinking."""
    folder = tmp_path_factory.mktemp("policy")
    build_scratch_policy(TINY_SPEC, ["What is 12 + 30? Solver: reason, then box it."] * 20, folder, seed=0)
    tokenizer = load_tokenizer(folder)
    tokenizer.chat_template = NO_THINK_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def stored(folder: Path, tmp_path: Path) -> tuple[Store, PolicyRef]:
    store = Store(str(tmp_path / "store"))
    with store.writer("policies/tiny") as out:
        for path in folder.iterdir():
            out.write_bytes(path.name, path.read_bytes())
    return store, PolicyRef("policies/tiny")


def prompt_ids(folder: Path, tmp_path: Path, message: str, **settings: Any) -> list[int]:
    """The prompt a worker group generated from (the real path: store, load, encode)."""
    store, policy = stored(folder, tmp_path)
    runtime = WorkerGroupRuntime("solver", store.settings(), cache_dir=str(tmp_path / "cache"), **settings)
    runtime.load_policy(policy)
    [result] = runtime.generate([message], SamplingConfig(temperature=0.0, max_new_tokens=2), seed=0)
    return result.prompt_ids


@pytest.mark.parametrize("truncation", ["middle", "left"])
def test_worker_truncates_long_prompts_as_configured(truncation, no_think_policy, tmp_path):
    message = "BEGIN " + "12 + 30 = 42, " * 40 + "END"
    tokenizer = load_tokenizer(no_think_policy)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    full = tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert len(full) > 80
    ids = prompt_ids(no_think_policy, tmp_path, message, max_prompt_tokens=40, truncation=truncation)
    assert ids == truncate_prompt(full, 40, truncation)
    prompt = tokenizer.decode(ids)
    assert prompt.endswith("END<|im_end|>\n<|im_start|>assistant\n")  # the generation prompt survives
    assert ("BEGIN" in prompt) is (truncation == "middle")  # middle keeps the start, left drops it


def test_rollout_truncation_defaults_to_middle():
    assert load_config(TINY).rollout.truncation == "middle"


# ----------------------------------------------------------------------------- chat-template variables


@pytest.mark.parametrize(
    ("variables", "no_think"),
    [(None, False), ({"enable_thinking": True}, False), ({"enable_thinking": False}, True)],
)
def test_worker_passes_its_models_template_variables(variables, no_think, no_think_policy, tmp_path):
    prompt = load_tokenizer(no_think_policy).decode(
        prompt_ids(no_think_policy, tmp_path, "What is 1 + 1?", chat_template_kwargs=variables)
    )
    assert prompt.startswith("NOTHINK") is no_think
    assert prompt.endswith("What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n")


def test_warm_start_passes_the_worker_groups_template_variables(no_think_policy, tmp_path, warm_start_prompts):
    """Only the Solver's model asks for no thinking: the Solver's warm start renders its
    demonstrations with the variable, the Verifier's (another model) without it."""
    config = load_config(
        TINY,
        [
            "models.tiny.chat_template_kwargs={enable_thinking: false}",
            "models.other={hidden_size: 16, num_heads: 2, num_kv_heads: 1}",
            "agents.verifier.model=other",
            "warmstart.steps=1",
            "warmstart.batch_size=2",
        ],
    )
    rendered = warm_start_prompts
    tokenizer = load_tokenizer(no_think_policy)
    pairs = [("What is 1 + 1?", "\\boxed{2}")]
    for label, no_think in (("solver", True), ("verifier", False)):
        rendered.clear()
        warmstart._fine_tune(config, no_think_policy, pairs, np.random.default_rng(0), tmp_path / label, label=label)
        assert rendered and all(tokenizer.decode(ids).startswith("NOTHINK") is no_think for ids in rendered)
