"""The schema of a drmas run's config: pydantic sections, their cross-field checks, and the
resolved config's helpers (worker groups, sampling per agent, JSON). It imports nothing of
drmas but the weight-safety policy (``drmas.weights``, a leaf): what depends on a task
plugin (the task's default orchestra and data, whether the agents match the orchestra) is
resolved and checked when a config is loaded (``drmas.config.loading``).

    cfg = load_config("configs/math_tiny.yaml", ["algorithm.advantage=grpo"])
    cfg.worker_groups()      # which agents share which model, with each group's settings
    cfg.to_json()            # the resolved config: the KFP parameter and the MLflow params

Every field has a docstring (it is the reference documentation: ``drmas config --help``
prints it). Bad input raises :class:`ConfigError`, which lists every problem at once, each
naming the field: unknown keys (with a did-you-mean), wrong types, out-of-range values,
impossible combinations. Secrets never live here: S3 and MLflow credentials come from the
environment only, so the resolved config can be logged and stored as it is.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from drmas.config.hardware import native_bf16
from drmas.weights import local_model_problem

__all__ = [
    "AgentConfig",
    "AlgorithmConfig",
    "CHAT_TEMPLATE_ARGUMENTS",
    "CheckpointConfig",
    "ConfigError",
    "DEFAULT_ITERATIONS",
    "DataConfig",
    "DiagnosticsConfig",
    "DrmasConfig",
    "EvalConfig",
    "ExperimentConfig",
    "FinalEvalConfig",
    "KubeflowConfig",
    "Location",
    "LoraSpec",
    "ModelSpec",
    "NAME_PATTERN",
    "RESOLVED_BY",
    "RayConfig",
    "RolloutConfig",
    "SAMPLING_FIELDS",
    "SamplingConfig",
    "Section",
    "StoreConfig",
    "TaskConfig",
    "TemplateVariables",
    "TrackingConfig",
    "TrainConfig",
    "WORKER_GROUP_FIELDS",
    "WarmstartConfig",
    "WorkerGroup",
    "WorkersConfig",
    "did_you_mean",
    "dotted",
    "explain",
    "looks_local",
]

RESOLVED_BY = "drmas.config.load_config (the task's defaults are filled in there)"

DEFAULT_ITERATIONS = 10
"""A run's length when the config gives neither ``experiment.iterations`` nor ``epochs``."""
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
"""Names that appear in paths and metric keys (agents, worker groups, experiments)."""


class ConfigError(ValueError):
    """A config that cannot run; ``problems`` holds one message per problem."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"invalid config{where} ({len(problems)} problem(s)):\n{lines}")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------


class ExperimentConfig(Section):
    name: str = Field("drmas", pattern=NAME_PATTERN)
    """Experiment name: the MLflow experiment and the first folder under the store root."""
    run_id: str | None = Field(None, pattern=NAME_PATTERN)
    """Run id (folder under the experiment). Unset: a new id is made at start."""
    seed: int = 0
    """Seed for data order, sampling and initialisation; a stage is deterministic given it."""
    iterations: int | None = Field(None, ge=1)
    """RL iterations (rollout, advantage, update, checkpoint, evaluate when due). Unset: 10,
    or with ``epochs`` the iterations of that many epochs."""
    epochs: int | None = Field(None, ge=1)
    """The run's length as passes over the training set, as the reference's scripts set it
    (``trainer.total_epochs``): an epoch is (training questions // rollout.prompts_per_iteration)
    iterations, its last partial batch dropped, and each epoch draws the questions in a new
    order. Resolved into ``iterations`` when a run starts or a pipeline is compiled (the
    training set is read to count it), and recorded with it; ``drmas config`` shows
    iterations null until then. Given with ``iterations``, the two must agree (set
    ``experiment.epochs=null`` to run a number of iterations instead)."""


class TaskConfig(Section):
    name: str = "math"
    """The task: its questions, tools, reward and default orchestra. A built-in name (math,
    search) or an import path 'package.module:ClassName' to a drmas.tasks.Task (docs/tasks.md)."""
    orchestra: str | None = None
    """Orchestra driving the agents: a built-in name (math, search) or an import path
    'package.module:ClassName'. Unset: the task's own orchestra."""
    max_loops: int = Field(2, ge=1)
    """math: at most this many Solver calls per episode (a Verifier runs between them)."""
    max_turns: int = Field(4, ge=1)
    """search: at most this many Verifier turns per episode."""
    retrieval_top_k: int = Field(3, ge=1)
    """search: passages returned per query."""
    retrieval_stemmer: Literal["none", "english"] = "none"
    """search: stem BM25 terms with the Snowball English stemmer (PyStemmer), so that
    "running" finds "runs". Passages and queries are tokenised alike, and the corpus hash
    holds this setting: an index built otherwise is neither reused nor accepted from a
    retrieval service (start it with ``--stemmer``)."""
    retrieval_stopwords: Literal["none", "english"] = "english"
    """search: drop bm25s's English stop words from passages and queries ('none' keeps
    every word; the service's ``--stopwords``); part of the corpus hash too."""
    retrieval_method: Literal["bm25", "dense"] = "bm25"
    """search: how passages are found. 'bm25': BM25 over words (bm25s, tokenised as
    retrieval_stemmer and retrieval_stopwords say). 'dense': as the reference's retrieval
    server, an e5-style encoder (retrieval_encoder: mean pooling over the attention mask,
    L2-normalised) and an exact inner-product FAISS index (IndexFlatIP). Part of the corpus
    hash: an index built otherwise is neither reused nor accepted from a retrieval service
    (start it with ``--method``). The settings of the other method must keep their defaults."""
    retrieval_encoder: str = Field("intfloat/e5-base-v2", min_length=1)
    """search, dense: the encoder, a hub id or a local folder, loaded from safetensors only
    (the service's ``--encoder``). The corpus hash holds a fingerprint of its weights and
    vocabulary, not its name: an index built with other weights is never reused, and a local
    copy of a hub model agrees with its hub id."""
    retrieval_max_length: int = Field(256, ge=8, le=8192)
    """search, dense: the most tokens of a query or passage that the encoder reads, its
    prefix included (the rest is cut); the reference's 256. Part of the corpus hash."""
    retrieval_query_prefix: str = "query: "
    """search, dense: put before every query, as e5 was trained ('' for an encoder trained
    without one). Part of the corpus hash."""
    retrieval_passage_prefix: str = "passage: "
    """search, dense: put before every passage, as e5 was trained. Part of the corpus hash."""
    retrieval_batch_size: int = Field(64, ge=1)
    """search, dense: passages encoded at once while the index is built (memory and speed,
    not results)."""
    retrieval_url: str | None = None
    """search: base URL of a retrieval service (``drmas serve-retrieval``), e.g.
    http://drmas-retrieval.drmas.svc.cluster.local:8080. Unset: retrieval in the stage's own
    process (the embedded default). Served and in-process results are the same for the same
    corpus, so this (like the other retrieval_* service settings) is not in any cache key."""
    retrieval_timeout_s: float = Field(60.0, gt=0)
    """search: seconds one request to the retrieval service may take before it is retried."""
    retrieval_retries: int = Field(4, ge=0)
    """search: retries of a request to the retrieval service after a connection error, a
    timeout, a 5xx or a 429 (with exponential backoff); then the stage fails, naming the URL."""
    retrieval_backoff_s: float = Field(0.5, ge=0)
    """search: the first retry's wait; each later retry waits twice as long (at most 30 s)."""
    retrieval_corpus_hash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """search: the corpus hash the retrieval service must report (``GET /health``; the
    service prints it at start). Unset: computed from the corpus this config names, which
    means reading the corpus file once per stage."""
    history_length: int = Field(4, ge=0)
    """search: past turns (query and retrieved passages) shown in every prompt."""
    malformed_verdict_passes: bool = True
    """A missing or malformed verifier verdict counts as approve (math) or as 'enough
    information, answer now' (search), as the reference code does; False makes it reject /
    search again."""
    prompts: Literal["reference", "compact"] = "compact"
    """The built-in agents' prompt set (drmas.team.prompts). 'reference': modelled on the
    reference's agents, for pretrained chat models (the team's task, teammates' outputs
    under a heading, the role and the exact output format). 'compact': a line per role,
    for models built from scratch, which learn the roles from warm-start demonstrations.
    Unset: compact when a model is built from scratch, else reference (set compact for a
    policy that an earlier run trained from scratch)."""
    parsing: Literal["drmas", "reference"] = "drmas"
    """How the built-in agents read outputs (drmas.team.agents): 'drmas', the last tag, exact
    verdict words, a math answer from the last \\boxed{} or a last 'Answer:' line, plain-text
    answers; 'reference', the authors' rules: the first tag, a verdict by which tagged word
    occurs, the last \\boxed{} only, validity by the tags being there and no CJK ideograph.
    They decide which calls pay the format penalty (docs/deviations.md)."""
    grader: Literal["drmas", "reference"] = "drmas"
    """math: how a final answer is graded. 'drmas': an exact path, then math-verify, with a
    person's rules (final form only, no decimal approximations; drmas.tasks.grading).
    'reference': the authors' rules, Hendrycks normalisation or sympy equality, an integer
    or unreduced gold answer matched exactly (drmas.tasks.reference_grading)."""

    @field_validator("retrieval_url")
    @classmethod
    def _retrieval_url_without_secrets(cls, value: str | None) -> str | None:
        """The URL is logged and stored with the config: no credentials in it."""
        if value is None:
            return value
        if not re.match(r"^https?://[^/@\s?#]+(/[^@\s?#]*)?$", value):
            raise ValueError(
                "must look like http(s)://host:port (a path is allowed), with no credentials, query or fragment in it"
            )
        return value

    @model_validator(mode="after")
    def _retrieval_settings_of_its_method(self) -> TaskConfig:
        """A setting that the chosen retrieval method never reads is a mistake (dense
        retrieval asked for in the wrong field, or a forgotten retrieval_method), not a no-op."""
        settings = {
            "bm25": ("retrieval_stemmer", "retrieval_stopwords"),
            "dense": (
                "retrieval_encoder",
                "retrieval_max_length",
                "retrieval_query_prefix",
                "retrieval_passage_prefix",
                "retrieval_batch_size",
            ),
        }
        unread = settings["bm25" if self.retrieval_method == "dense" else "dense"]
        changed = [name for name in unread if getattr(self, name) != type(self).model_fields[name].default]
        if changed:
            other = "dense" if self.retrieval_method == "bm25" else "bm25"
            raise ValueError(
                f"{', '.join(changed)}: only {other} retrieval reads {'them' if len(changed) > 1 else 'it'}, "
                f"and retrieval_method is {self.retrieval_method} (set retrieval_method: {other}, or leave "
                f"{'them' if len(changed) > 1 else 'it'} unset)"
            )
        return self

    @property
    def orchestra_name(self) -> str:
        """The orchestra: ``orchestra``, which loading the config fills with the task's
        default (``drmas.config.loading.resolve``)."""
        if self.orchestra is None:
            raise ValueError(f"task.orchestra is not resolved: load the config with {RESOLVED_BY}")
        return self.orchestra


class DataConfig(Section):
    train: str | None = None
    """Training prompts: a JSONL, JSON or Parquet file, or a dataset folder (a ``datasets``
    save_to_disk folder, or data files such as the hub's ``data/train-00000-of-00002.parquet``),
    local or ``s3://bucket/key`` (read with ``store``'s S3 endpoint and credentials), or
    'generated:NAME' for a set that ships with drmas. Unset: the task's generated set (math:
    generated:arithmetic, search: generated:facts). docs/tasks.md lists the forms."""
    eval: str | None = None
    """Evaluation prompts, same forms as ``train`` (a generated set uses its eval split)."""
    train_split: str = Field("train", min_length=1)
    """The split of a dataset folder in ``train`` to read (a DatasetDict's split, or the
    files named ``{split}-0000i-of-0000n.parquet``, ``{split}.jsonl``, ...); a folder that
    holds one split is read whatever its name."""
    eval_split: str = Field("test", min_length=1)
    """The split of a dataset folder in ``eval`` to read, as ``train_split``."""
    question_field: str = "question"
    """Column holding the question text. Left at 'question' in a file without it, the
    published forms are recognised: ``problem``, ``Problem``, a chat ``prompt``."""
    answer_field: str = "answer"
    """Column holding the gold answer (a string, or a list of accepted strings). Left at
    'answer' in a file without it: ``Answer``, ``golden_answers``,
    ``reward_model.ground_truth``, ``solution`` (its last boxed answer)."""
    data_source_field: str = "data_source"
    """Column naming each row's source (eval metrics are also reported per source)."""
    corpus: str | None = None
    """search: JSONL corpus of passages, local or ``s3://`` (streamed); unset uses the
    generated corpus."""
    generated_train_size: int = Field(2000, ge=1)
    """Questions in a generated training set."""
    generated_eval_size: int = Field(200, ge=1)
    """Questions in a generated eval set."""
    seed: int | None = None
    """The seed a generated set (its train and eval questions, the search corpus) is drawn
    with; unset: ``experiment.seed``. Set it to hold the questions still while the seed
    varies the rest (the draw order, sampling, initialisation): the seeds of a
    ``drmas compare`` are then evaluated on the same questions."""


TemplateVariables = dict[str, bool | int | float | str]
"""Chat-template variables: JSON scalars, so that the resolved config stays plain JSON."""
CHAT_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "add_generation_prompt", "continue_final_message", "tokenize"} | {"return_dict", "chat_template"}
)
"""``apply_chat_template`` arguments that drmas sets itself: not allowed as template
variables in ``models.NAME.chat_template_kwargs``."""


class LoraSpec(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021, through peft) instead of full fine-tuning:
    only the adapters train and are stored (PEFT layout, safetensors) beside a reference to
    the base policy; the rollout engines get the merged weights, and the KL reference is
    the base itself (the adapter switched off, no second copy)."""

    rank: int = Field(8, ge=1)
    """Rank r of every adapter (A is r x in, B is out x r)."""
    alpha: int = Field(16, ge=1)
    """Scale: the adapter adds alpha / rank x B A to each targeted weight."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (0: the trained policy is the sampled one)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """Names of the linear layers that get an adapter (the suffix of their module names);
    the default is every projection of a Qwen/Llama decoder layer."""


class ModelSpec(Section):
    source: str = "scratch"
    """'scratch' builds a small model from the fields below (with a tokenizer trained on the
    task's text); anything else is a Hugging Face hub id or a local folder in HF layout."""
    architecture: Literal["qwen3", "llama"] = "qwen3"
    """Architecture of a model built from scratch."""
    hidden_size: int = Field(128, ge=8)
    """Scratch models: hidden size."""
    num_layers: int = Field(4, ge=1)
    """Scratch models: decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Scratch models: attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Scratch models: key/value heads (grouped-query attention)."""
    intermediate_size: int = Field(512, ge=8)
    """Scratch models: MLP width."""
    vocab_size: int = Field(512, ge=64)
    """Scratch models: tokenizer vocabulary size."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Parameter dtype for training and rollout. bfloat16 trains in mixed precision: bf16
    compute, fp32 master weights and optimizer state (both engines, saved with the
    optimizer state so a resume continues from them); gradients accumulate in fp32 on the
    torch engine and in bf16 under DeepSpeed (as DeepSpeed does by default). The stored and
    rolled-out policy is bf16. ``auto``: bfloat16 where the pool computes it natively (a GPU
    pool; this machine's CPU with AVX-512 or AMX), else float32 (a CPU that would emulate
    bf16 many times slower; a remote CPU pool, which this machine cannot inspect). Resolved
    when the config is loaded: the resolved config records the choice."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of every weight (see LoraSpec). Unset: full fine-tuning."""
    chat_template_kwargs: TemplateVariables = {}
    """Extra variables for this model's chat template, passed to every
    ``apply_chat_template`` of its worker groups (rollout, evaluation, warm start), as the
    reference's ``data.apply_chat_template_kwargs``; e.g. ``{enable_thinking: false}`` for
    Qwen3, whose template otherwise lets the model think first."""
    revision: str | None = None
    """Hub ids: the branch, tag or commit hash to load (a commit hash pins the weights for
    good). With ``HF_HUB_OFFLINE=1`` it is resolved in the local Hugging Face cache
    (``HF_HOME`` / ``HF_HUB_CACHE``) and the hub is never asked. Unset: the hub's main."""
    chat_template: str | None = None
    """A Jinja chat template for this model, replacing its tokenizer's own. Needed for a
    model whose tokenizer has none (many base models): drmas refuses such a model when it
    loads it, naming this field. Stored with the run's initial policy, so every stage and
    every later policy renders prompts with it."""
    system_prompt: str | None = None
    """A system message before every agent prompt of this model (rollout, evaluation, warm
    start), as the reference sends "You are a helpful and harmless assistant."; a template
    without a system role gets it at the start of the user message instead. Unset: none
    (the template's own default, if it has one)."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_drmas_own_arguments(cls, value: TemplateVariables) -> TemplateVariables:
        """drmas sets these itself (it wants the rendered text of one user turn); letting a
        config change them would silently change what the workers tokenise."""
        taken = sorted(set(value) & CHAT_TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by drmas itself, not a template variable")
        return value

    @model_validator(mode="after")
    def _buildable(self) -> ModelSpec:
        if looks_local(self.source):
            problem = local_model_problem(Path(self.source).expanduser())
            if problem:
                raise ValueError(f"source {self.source!r} {problem}")
        hub_id = not (self.source == "scratch" or looks_local(self.source) or "://" in self.source)
        if self.revision is not None and not hub_id:
            raise ValueError(f"revision {self.revision!r} pins a hub id; source {self.source!r} is not one")
        if self.source == "scratch":
            if self.chat_template is not None:
                raise ValueError("chat_template: a scratch model is built with drmas's own (ChatML); leave it unset")
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        return self


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 switches it off."""
    max_new_tokens: int = Field(64, ge=1)
    """Most tokens one agent call may generate."""


SAMPLING_FIELDS = tuple(SamplingConfig.model_fields)
"""Sampling fields an agent may override for itself (also when it shares a model)."""
WORKER_GROUP_FIELDS = ("lr", "micro_batch_size", "warmup_steps")
"""Training fields an agent may override; agents sharing a worker group must agree."""


class AgentConfig(Section):
    name: str = Field(pattern=NAME_PATTERN)
    """The agent's role, as its orchestra names it (e.g. solver, verifier)."""
    model: str
    """A key of ``models``, or a Hugging Face hub id or local folder."""
    lr: float | None = Field(None, gt=0.0)
    """Learning rate for this agent's worker group (default: train.lr)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per micro-batch for this agent's worker group (default: train.micro_batch_size)."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear lr warm-up steps for this agent's worker group (default: train.warmup_steps)."""
    temperature: float | None = Field(None, ge=0.0)
    """Sampling temperature for this agent's calls (default: rollout.sampling)."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """Nucleus sampling mass for this agent's calls (default: rollout.sampling)."""
    top_k: int | None = Field(None, ge=0)
    """Top-k for this agent's calls (default: rollout.sampling)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Token limit for this agent's calls (default: rollout.sampling)."""


class WorkersConfig(Section):
    sharing: Literal["none", "by_model"] = "by_model"
    """How agents map to worker groups (trainable models): 'none' gives every agent its own
    copy, 'by_model' lets agents naming the same model share one. Ignored when ``groups``
    is set."""
    groups: dict[str, list[str]] | None = None
    """Explicit map from worker-group name to its agents; the agents of a group must name
    the same model, and every agent must be in exactly one group."""


class AlgorithmConfig(Section):
    advantage: Literal["drmas", "grpo"] = "drmas"
    """'drmas': agent-wise normalisation over (uid, agent), every call a sample. 'grpo': the
    global baseline over uid, one sample per trajectory (its rows' mean score)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the group std before dividing."""
    scale_by_std: bool = True
    """Divide by the group std (False: only subtract the group mean, Dr. GRPO style)."""
    invalid_penalty: float = Field(0.1, ge=0.0)
    """Subtracted from the score of each call whose output was malformed."""
    clip_ratio_low: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO clip range below 1 (ratio >= 1 - clip_ratio_low)."""
    clip_ratio_high: float = Field(0.2, gt=0.0)
    """PPO clip range above 1 (ratio <= 1 + clip_ratio_high; DAPO uses 0.28)."""
    clip_ratio_c: float = Field(3.0, gt=1.0)
    """Dual-clip bound on the loss of negative-advantage tokens."""
    loss_aggregation: Literal[
        "token-mean", "token-mean-per-micro-batch", "seq-mean-token-mean", "seq-mean-token-sum"
    ] = "token-mean"
    """How token losses are reduced to the mini-batch loss. 'token-mean': every response
    token of the mini-batch weighs the same, however the rows are packed into micro-batches.
    'token-mean-per-micro-batch': each micro-batch's token mean, averaged over the
    micro-batches (veRL's and the reference's gradient accumulation: a token of a short
    micro-batch weighs more). 'seq-mean-token-mean' / 'seq-mean-token-sum': every row weighs
    the same (the mean over rows of each row's token mean / token sum)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the low-variance KL to a frozen reference (0: no reference model kept)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus."""


class RolloutConfig(Section):
    group_size: int = Field(8, ge=1)
    """Episodes per prompt (the GRPO group, key uid); at least 2 for a baseline."""
    prompts_per_iteration: int = Field(16, ge=1)
    """Prompts drawn per iteration; an iteration rolls out prompts * group_size episodes."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Default sampling for every agent call (agents may override fields)."""
    max_prompt_tokens: int = Field(1024, ge=16)
    """Most tokens of one agent prompt (chat-formatted); longer ones are cut as
    ``truncation`` says."""
    truncation: Literal["middle", "left"] = "middle"
    """How a prompt over ``max_prompt_tokens`` is cut, as the reference's
    ``data.truncation``: 'middle' keeps its first and last halves (the task statement and
    the agent's role survive; the reference's math recipe), 'left' keeps its last tokens
    (the most recent turns; the reference's search recipe)."""
    engine: Literal["hf", "sglang"] = "hf"
    """Rollout engine: transformers on CPU, or SGLang on GPUs (the gpu image)."""


class TrainConfig(Section):
    backend: Literal["torch", "deepspeed"] = "torch"
    """Training engine per worker group."""
    zero_stage: int = Field(0, ge=0, le=3)
    """DeepSpeed ZeRO stage."""
    lr: float = Field(1e-6, gt=0.0)
    """Learning rate (agents may override it for their worker group)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear lr warm-up, in optimizer steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    micro_batch_size: int = Field(8, ge=1)
    """Rows per micro-batch (gradient accumulation fills the mini-batch)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget per micro-batch; set, it packs rows by tokens instead of by count."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    updates_per_iteration: int = Field(1, ge=1)
    """Optimizer steps per worker group per iteration, whatever its row count."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory,
    about a third more compute), as the reference's recipes do."""
    logprob_chunk_positions: int | None = Field(None, ge=1)
    """Compute the log-probs and entropy this many sequence positions at a time, each chunk
    recomputed in the backward pass: the fp32 [positions x vocab] temporaries (scaled
    logits, log-softmax, its exp, the entropy product) exist for one chunk instead of the
    whole micro-batch; only the model's own logits stay whole. The result is the same to
    the bit. Unset: all positions at once."""
    offload_optimizer: bool = False
    """DeepSpeed: keep the optimizer state in host memory (ZeRO-Offload), as the
    reference's recipes do; needs ``zero_stage`` 1 or more; ignored by the torch backend."""
    recompute_old_logprobs: bool | None = None
    """Recompute the old policy's log-probs before updating instead of trusting the
    rollout engine's (costs one forward pass; removes engine/trainer mismatch). Unset: on
    when the engine's log-probs can drift from the trainer's (rollout.engine sglang, or a
    bfloat16 model), as the reference always recomputes; off otherwise. Resolved when the
    config is loaded, so the resolved config records the value the run used."""

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> TrainConfig:
        if self.offload_optimizer and self.backend == "deepspeed" and self.zero_stage == 0:
            raise ValueError(
                "offload_optimizer needs zero_stage 1, 2 or 3 "
                "(ZeRO-Offload partitions the optimizer state it moves to host memory)"
            )
        return self


class WarmstartConfig(Section):
    steps: int = Field(0, ge=0)
    """Supervised fine-tuning steps per worker group on generated demonstrations of its
    agents' roles, before RL (0: no warm start). Needed for models built from scratch."""
    batch_size: int = Field(64, ge=1)
    """Demonstrations per step."""
    lr: float = Field(2e-3, gt=0.0)
    """Peak learning rate (cosine decay to 0 over the steps)."""
    wrong_fraction: float = Field(0.3, ge=0.0, le=1.0)
    """Share of the Solver's demonstrated answers that are wrong (so the team starts below
    perfect)."""
    verdict_noise: float = Field(0.1, ge=0.0, le=1.0)
    """Share of the Verifier's demonstrated verdicts that are wrong."""
    hesitation: float | None = Field(None, ge=0.0, le=1.0)
    """search: share of the Verifier's demonstrated verdicts that still say 'no' once every
    hop's passage is in the history (a router that keeps searching, and on the last turn
    leaves the episode without an answer, so that the Answer agent acts mostly in episodes
    that succeed). Unset: ``verdict_noise``, the same error rate both ways."""


class DiagnosticsConfig(Section):
    per_agent_grad_norm: bool = False
    """Also measure the gradient norm of each agent's share of the loss, separately, even
    when agents share a model (the paper's per-agent figure). Costs one extra backward pass
    per agent and optimizer step."""


class CheckpointConfig(Section):
    every: int = Field(1, ge=1)
    """Store the optimizer state (fp32 Adam moments and master weights: ~12 bytes a
    parameter) every N-th iteration and after the last one. In between, the pool's workers
    hold it (host memory) from one update to the next; a run that loses its pool resumes
    from the last iteration whose state was stored (recomputing the updates after it,
    bit-exact on CPU). The policy is stored every iteration (lineage, eval, rerun). 1:
    every iteration's (a rerun of any update needs the optimizer state before it)."""
    keep: int | None = Field(None, ge=1)
    """Of the every-N-th optimizer states, keep only the last N (the latest stored state
    stays too, where a resume starts: a run of 60 iterations with every 20 and keep 1 ends
    with one state, iteration 59's); unset: all."""
    prune_policies: bool = False
    """Also delete the policy of each iteration before the latest stored optimizer state
    whose own optimizer state is not kept (``every``, ``keep``): the policies that stay
    are those a resume, a rerun of an update or an evaluation can start from (the kept
    states' iterations, and every iteration from the latest stored state on). False: every
    iteration's policy stays (lineage; ~0.26 GB an iteration for SmolLM2-135M in bf16)."""


class FinalEvalConfig(Section):
    """The evaluation of a run's last checkpoint, the paper's protocol: while training, a
    small sampled set with few samples (``eval``); at the end, the full test sets with many
    samples per question (avg@16 / pass@16 per data source)."""

    data: str | None = None
    """Its questions, in the forms of ``data.eval``; unset: ``data.eval``."""
    k: int = Field(16, ge=1)
    """Samples per question (avg@k, pass@k)."""
    max_questions: int | None = Field(None, ge=1)
    """At most this many questions; unset: all."""
    sampling: SamplingConfig | None = None
    """Unset: ``eval.sampling``."""


class EvalConfig(Section):
    every: int = Field(0, ge=0)
    """Evaluate every this many iterations (and after the last); 0 never evaluates."""
    k: int = Field(4, ge=1)
    """Samples per eval question (avg@k, pass@k)."""
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=0.6, top_p=0.95))
    """Sampling for evaluation."""
    max_questions: int | None = Field(None, ge=1)
    """Evaluate on at most this many questions of the eval set."""
    final: FinalEvalConfig | None = None
    """Set: the last iteration's checkpoint is also evaluated with these settings (stored as
    ``iter-N/final``, its metrics logged as ``final/eval/...``), by ``drmas run`` and by
    the pipelines alike, whatever ``every`` says."""


class StoreConfig(Section):
    root: str = "./runs"
    """Artifact root: a local folder or s3://bucket/prefix."""
    endpoint: str | None = None
    """S3 endpoint URL (MinIO, SeaweedFS); unset: $DRMAS_S3_ENDPOINT, then $AWS_ENDPOINT_URL,
    then AWS. Credentials come from the environment (AWS_ACCESS_KEY_ID, ...), never here."""
    region: str = "us-east-1"
    """S3 region."""
    lease_timeout_s: float = Field(60.0, gt=0)
    """Seconds after its last heartbeat that a run's lease counts as stale. A process
    writing a run holds a lease in the run's folder (one writer per run; a Kubeflow task
    holds the part it writes) and renews it every few seconds (a quarter of this, at most
    5 s); a second writer is refused, naming the holder. A holder silent for longer is
    taken for dead (killed) and taken over; one that had only stalled stops writing. Hosts'
    clocks must agree to well within it."""

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_a_url_without_secrets(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not re.match(r"^https?://[^/@\s]+(:\d+)?/?$", value):
            raise ValueError(
                "must look like http(s)://host:port, with no credentials or path in it "
                "(put credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
            )
        return value


class TrackingConfig(Section):
    uri: str | None = None
    """MLflow tracking URI: sqlite:///path.db (embedded) or http(s)://server. Unset: sqlite
    in the store's folder (``{store.root}/mlflow.db``, artifacts beside it in
    ``mlartifacts/``), or ``./mlflow.db`` when the store is on S3."""
    experiment: str | None = None
    """MLflow experiment name; unset: experiment.name."""
    ui_url: str | None = None
    """Where people open the MLflow UI (an Ingress, a port-forward), for the links a
    Kubeflow run shows in its steps; unset: ``uri`` (an in-cluster address a browser
    outside the cluster may not reach)."""

    @field_validator("uri", "ui_url")
    @classmethod
    def _uri_without_credentials(cls, value: str | None) -> str | None:
        """The URI is logged and stored with the config: a password in it would leak."""
        if value is not None and re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://[^/@\s]*@", value):
            raise ValueError(
                "must not hold credentials (user:password@); give them in "
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN"
            )
        return value


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_KEY = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
"""A Kubernetes label key: an optional DNS-subdomain prefix and ``/``, then a name of at
most 63 characters."""
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
"""A Kubernetes label value: at most 63 characters, alphanumeric at both ends."""
_OBJECT_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
"""A Kubernetes object name (a DNS subdomain), such as a Secret's."""


class KubeflowConfig(Section):
    """Where the Kubeflow pipeline's steps run: read by ``drmas compile|submit`` only (no
    stage reads it, so it changes no cache key)."""

    gpu_node_selector: dict[str, str] = {}
    """Node labels a step that asks Kubernetes for GPUs also requires, to pick a GPU model
    or node pool, e.g. ``{cloud.google.com/gke-accelerator: nvidia-h100-80gb}``. Unset: any
    linux/amd64 node that offers the ``nvidia.com/gpu`` resource (the NVIDIA device plugin's),
    whose ``nvidia.com/gpu`` taint such steps tolerate; no GPU Operator label is needed."""
    image_pull_secrets: list[str] = []
    """Secrets (type kubernetes.io/dockerconfigjson, in the pipeline's namespace) every
    step's pod pulls the drmas images with: a private registry. The RayCluster's pods
    name theirs in its manifest."""

    @field_validator("gpu_node_selector")
    @classmethod
    def _labels_kubernetes_accepts(cls, value: dict[str, str]) -> dict[str, str]:
        """Kubernetes would refuse the pod only once the run reaches the step."""
        problems = [f"{key!r} is not a label key" for key in value if not re.match(_LABEL_KEY, key)]
        problems += [
            f"{key}: {label!r} is not a label value"
            for key, label in value.items()
            if not re.match(_LABEL_VALUE, label)
        ]
        if problems:
            raise ValueError("; ".join(problems) + " (Kubernetes label syntax: at most 63 characters, [A-Za-z0-9-_.])")
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _secret_names(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not re.match(_OBJECT_NAME, name)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not a Secret name (lower-case letters, digits, '-', '.')")
        return value


class RayConfig(Section):
    address: str | None = None
    """Ray cluster to join (e.g. ray://head-svc:10001 for KubeRay); unset starts a local Ray."""
    pool_resource: str = "pool_slot"
    """Ray resource standing for one accelerator of the shared pool ('GPU' on a cluster)."""
    pool_size: int = Field(1, ge=1)
    """Accelerators in the pool that all worker groups share."""
    max_resident: int = Field(1, ge=1)
    """Worker groups whose engines may be resident in the pool at once (on every slot)."""
    slots: dict[str, list[int]] = {}
    """Worker group -> the pool slots (0 .. pool_size-1) it runs on; a group not named runs
    on all of them (time-shared with the others, as in the paper). On each of its slots a
    group has one worker: its engine for the rollout and its training shard for the update."""
    idle_timeout_s: float = Field(1800.0, gt=0)
    """A run's pool (named, detached Ray actors that outlive each stage) frees itself after
    this many seconds without a call; the next stage rebuilds it from the store."""
    placement_timeout_s: float = Field(1800.0, gt=0)
    """How long a stage waits for the pool's slots (its placement group) to be granted. On a
    cluster that starts GPU workers on demand (KubeRay autoscaling from zero) a cold
    scale-up with a 15-20 GB image takes minutes; the wait prints a line every 30 s. Past
    it the stage fails saying what it asked for and what the cluster has."""
    device_memory_gb: float | None = Field(None, gt=0)
    """Memory of one pool accelerator, in GB (10^9 bytes). Set, ``drmas run``, ``compile``
    and ``submit`` refuse a config whose memory plan (``drmas plan``) does not fit it; unset
    (CPU runs): no check. An "80 GB" H100 holds 80 GiB = 85.9 GB: 80 leaves the driver's share."""
    host_memory_gb: float | None = Field(None, gt=0)
    """Host memory one pool slot may use, in GB (10^9 bytes): a one-GPU pod's memory limit,
    or a node's memory divided by its GPUs, less what else runs there. Set, the memory plan
    refuses a config whose host peak in any phase (offloaded training state, engines' weight
    backups, a cold update's model load, an optimizer save or restore, /dev/shm) exceeds
    it; unset: no check."""


class DrmasConfig(Section):
    """The whole run. Sections are documented field by field."""

    experiment: ExperimentConfig = Field(default_factory=ExperimentConfig)
    """Names, seed and length of the run."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    """What the team solves and how it is orchestrated."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Where prompts, answers and corpora come from."""
    models: dict[str, ModelSpec] = {}
    """Named model specs that agents refer to by key."""
    agents: list[AgentConfig] = Field(min_length=1)
    """The team: one entry per agent role of the orchestra."""
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    """Which agents share a trainable model."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator and loss."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Group size, batch and sampling of the rollout."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The per-worker-group update."""
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    """Supervised warm start before RL."""
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    """Extra measurements."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Periodic evaluation."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Which optimizer states the store keeps."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """The artifact store."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """MLflow."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray cluster and the shared device pool."""
    kubeflow: KubeflowConfig = Field(default_factory=KubeflowConfig)
    """Where the Kubeflow pipeline's steps run (nodes, image pull secrets)."""

    @model_validator(mode="after")
    def _consistent(self) -> DrmasConfig:
        problems = self._agent_problems() + self._worker_group_problems() + self._slot_problems()
        problems += self._lora_problems()
        if self.rollout.group_size < 2:
            problems.append(
                f"rollout.group_size: is {self.rollout.group_size}, but advantage "
                f"'{self.algorithm.advantage}' normalises within a group of episodes of one "
                "prompt and needs at least 2 (a group of 1 has no baseline)"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _resolve_automatic_defaults(self) -> DrmasConfig:
        """Fill the fields whose default depends on others; a copy is assigned (not the
        nested section changed in place) so that a section object the caller passed in is
        never altered. The assignment validates once more and finds nothing left to fill."""
        if any(spec.dtype == "auto" for spec in self.models.values()):
            chosen = self._automatic_dtype()
            self.models = {
                name: spec.model_copy(update={"dtype": chosen}) if spec.dtype == "auto" else spec
                for name, spec in self.models.items()
            }
        if self.train.recompute_old_logprobs is None:
            drift = self._logprobs_may_drift()
            self.train = self.train.model_copy(update={"recompute_old_logprobs": drift})
        if self.experiment.iterations is None and self.experiment.epochs is None:
            self.experiment = self.experiment.model_copy(update={"iterations": DEFAULT_ITERATIONS})
        if "prompts" not in self.task.model_fields_set:
            scratch = any(g.spec is not None and g.spec.source == "scratch" for g in self.worker_groups())
            self.task = self.task.model_copy(update={"prompts": "compact" if scratch else "reference"})
        return self

    def _automatic_dtype(self) -> Literal["float32", "bfloat16"]:
        """``dtype: auto``'s choice for this config's pool (see ModelSpec.dtype)."""
        if self.ray.pool_resource == "GPU":
            return "bfloat16"
        if self.ray.address:
            return "float32"
        return "bfloat16" if native_bf16() else "float32"

    def _logprobs_may_drift(self) -> bool:
        """Whether the rollout engine's log-probs can differ from the trainer's for the same
        weights: SGLang's kernels are not the trainer's, and bfloat16 rounds differently
        along the two paths."""
        bf16 = any(g.spec is not None and g.spec.dtype == "bfloat16" for g in self.worker_groups())
        return self.rollout.engine == "sglang" or bf16

    def _agent_problems(self) -> list[str]:
        """Agents named twice; whether they match the orchestra, and whether a model named by
        a local folder is one, is checked when the config is loaded (``config.loading``)."""
        names = [agent.name for agent in self.agents]
        return [
            f"agents[{index}].name: agent {name!r} is listed twice"
            for index, name in enumerate(names)
            if names.index(name) != index
        ]

    def _worker_group_problems(self) -> list[str]:
        try:
            groups = self._group_agents()
        except ValueError as error:
            return [str(error)]
        problems = []
        for wg_name, members in groups.items():
            for field in WORKER_GROUP_FIELDS:
                values = {agent.name: self._agent_value(agent, field) for agent in members}
                if len(set(values.values())) > 1:
                    listed = ", ".join(f"{name}={value}" for name, value in values.items())
                    problems.append(
                        f"agents: {field} differs between agents that share worker group "
                        f"{wg_name!r} ({listed}); give them the same {field} or separate "
                        "worker groups (workers.sharing: none)"
                    )
        return problems

    def _lora_problems(self) -> list[str]:
        """LoRA trains on the torch engine and DeepSpeed ZeRO 0-2. ZeRO-3 partitions the
        frozen base too, and the adapter merge for the rollout engines and the KL reference
        (the adapter switched off) read whole base weights: not supported (yet)."""
        if self.train.backend != "deepspeed" or self.train.zero_stage < 3:
            return []
        return [
            f"models.{name}.lora: LoRA is not supported with train.zero_stage 3; use zero_stage 0-2 "
            "(the frozen base is not partitioned there, and the adapters' optimizer state is small)"
            for name, spec in self.models.items()
            if spec.lora is not None
        ]

    def _slot_problems(self) -> list[str]:
        try:
            names = list(self._group_agents())
        except ValueError:
            return []  # reported by _worker_group_problems
        problems = []
        for wg, slots in self.ray.slots.items():
            if wg not in names:
                problems.append(
                    f"ray.slots: unknown worker group {wg!r}{did_you_mean(wg, names)} "
                    f"(worker groups: {', '.join(names)})"
                )
            elif not slots:
                problems.append(f"ray.slots.{wg}: is empty; name at least one slot (or leave {wg!r} out: all slots)")
            elif bad := [s for s in slots if not 0 <= s < self.ray.pool_size]:
                problems.append(
                    f"ray.slots.{wg}: slot(s) {bad} outside the pool (ray.pool_size {self.ray.pool_size}: 0-"
                    f"{self.ray.pool_size - 1})"
                )
            elif len(set(slots)) != len(slots):
                problems.append(f"ray.slots.{wg}: {slots} names a slot twice")
        return problems

    def _group_agents(self) -> dict[str, list[AgentConfig]]:
        """Worker-group name -> its agents, in config order."""
        by_name = {agent.name: agent for agent in self.agents}
        if self.workers.groups is not None:
            return self._explicit_groups(by_name)
        if self.workers.sharing == "none":
            return {agent.name: [agent] for agent in self.agents}
        by_model: dict[str, list[AgentConfig]] = {}
        for agent in self.agents:
            by_model.setdefault(agent.model, []).append(agent)
        return {"-".join(a.name for a in members): members for members in by_model.values()}

    def _explicit_groups(self, by_name: dict[str, AgentConfig]) -> dict[str, list[AgentConfig]]:
        problems, seen = [], {}
        for wg_name, agent_names in (self.workers.groups or {}).items():
            if not re.match(NAME_PATTERN, wg_name):
                problems.append(f"workers.groups: {wg_name!r} is not a valid worker-group name")
            for name in agent_names:
                if name not in by_name:
                    problems.append(
                        f"workers.groups.{wg_name}: unknown agent {name!r}{did_you_mean(name, list(by_name))}"
                    )
                elif name in seen:
                    problems.append(f"workers.groups: agent {name!r} is in both {seen[name]!r} and {wg_name!r}")
                else:
                    seen[name] = wg_name
            models = {by_name[n].model for n in agent_names if n in by_name}
            if len(models) > 1:
                problems.append(
                    f"workers.groups.{wg_name}: its agents name different models "
                    f"({', '.join(sorted(models))}); a worker group is one model"
                )
        problems += [f"workers.groups: agent {name!r} is in no worker group" for name in by_name if name not in seen]
        if problems:
            raise ValueError("\n".join(problems))
        return {wg: [by_name[n] for n in names] for wg, names in self.workers.groups.items()}

    def _agent_value(self, agent: AgentConfig, field: str) -> Any:
        value = getattr(agent, field)
        if value is not None:
            return value
        return getattr(self.rollout.sampling if field in SAMPLING_FIELDS else self.train, field)

    # ----------------------------------------------------------------------------------
    # Resolved views
    # ----------------------------------------------------------------------------------

    def worker_groups(self) -> list[WorkerGroup]:
        """The trainable models of this run, each with its agents and resolved settings."""
        groups = []
        for wg_name, members in self._group_agents().items():
            first = members[0]
            groups.append(
                WorkerGroup(
                    name=wg_name,
                    model=first.model,
                    spec=self.models.get(first.model),
                    agents=tuple(agent.name for agent in members),
                    lr=self._agent_value(first, "lr"),
                    micro_batch_size=self._agent_value(first, "micro_batch_size"),
                    warmup_steps=self._agent_value(first, "warmup_steps"),
                )
            )
        return groups

    def worker_group(self, name: str) -> WorkerGroup:
        """One worker group by name (e.g. in a process that was handed only its name)."""
        for group in self.worker_groups():
            if group.name == name:
                return group
        raise KeyError(f"no worker group {name!r}; worker groups: {', '.join(g.name for g in self.worker_groups())}")

    @property
    def total_iterations(self) -> int:
        """The run's length in iterations: ``experiment.iterations``, which a config given
        in ``experiment.epochs`` has only once they are resolved (``with_epochs_resolved``);
        before that a ConfigError says so, rather than a run of some other length."""
        if self.experiment.iterations is None:
            raise ConfigError(
                [
                    f"experiment.iterations: not known yet: experiment.epochs {self.experiment.epochs} is "
                    "counted against the training set when a run starts or a pipeline is compiled "
                    "(drmas run, compile, submit)"
                ]
            )
        return self.experiment.iterations

    def with_epochs_resolved(self, train_questions: int) -> DrmasConfig:
        """This config with ``experiment.epochs`` turned into ``experiment.iterations`` for a
        training set of ``train_questions`` questions: (train_questions //
        rollout.prompts_per_iteration) iterations an epoch, the last partial batch dropped.
        Unchanged without epochs; a ConfigError when the set holds less than one batch or
        when ``experiment.iterations`` is given too and says otherwise."""
        epochs = self.experiment.epochs
        if epochs is None:
            return self
        batch = self.rollout.prompts_per_iteration
        per_epoch = train_questions // batch
        if per_epoch == 0:
            raise ConfigError(
                [
                    f"experiment.epochs: the training set has {train_questions} question(s), fewer than one "
                    f"batch (rollout.prompts_per_iteration {batch}): an epoch would be no iteration; set "
                    "experiment.iterations instead (and experiment.epochs=null)"
                ]
            )
        total = epochs * per_epoch
        given = self.experiment.iterations
        if given is not None and given != total:
            raise ConfigError(
                [
                    f"experiment.iterations: is {given}, but experiment.epochs {epochs} is {total} iterations "
                    f"({train_questions} training questions // {batch} a batch = {per_epoch} an epoch); give "
                    "one of them (experiment.epochs=null to run a number of iterations)"
                ]
            )
        return self.model_copy(update={"experiment": self.experiment.model_copy(update={"iterations": total})})

    def iterations_from(self, start: int, count: int | None = None) -> range:
        """The iterations a run (or one part of it) takes from ``start``: up to
        ``experiment.iterations``, at most ``count`` of them (None or 0: no limit). The
        train pipeline, ``drmas submit``'s parts and the kfp-local summary cut a run by it."""
        total = self.total_iterations
        return range(start, min(total, start + count) if count else total)

    def evaluates(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` ends with an evaluation: every ``eval.every``
        iterations and after the last (never with ``eval.every: 0``)."""
        every = self.eval.every
        return bool(every) and ((iteration + 1) % every == 0 or iteration == self.total_iterations - 1)

    def final_evaluation(self) -> DrmasConfig:
        """This config as the final evaluation reads it: ``eval`` and ``data.eval`` replaced
        by ``eval.final``'s settings (which must be set)."""
        final = self.eval.final
        if final is None:
            raise ValueError("eval.final is not set: this run has no final evaluation")
        evaluation = self.eval.model_copy(
            update={
                "k": final.k,
                "max_questions": final.max_questions,
                "sampling": final.sampling or self.eval.sampling,
                "final": None,
            }
        )
        data = self.data.model_copy(update={"eval": final.data or self.data.eval})
        return self.model_copy(update={"eval": evaluation, "data": data})

    def stores_optimizer(self, iteration: int) -> bool:
        """Whether iteration ``iteration``'s update stores its optimizer state
        (``checkpoint.every``): every N-th iteration, and the last one."""
        return (iteration + 1) % self.checkpoint.every == 0 or iteration == self.total_iterations - 1

    def slots_of(self, wg: str) -> list[int]:
        """The pool slots worker group ``wg`` runs on (``ray.slots``; default: all)."""
        return sorted(self.ray.slots.get(wg, range(self.ray.pool_size)))

    def agent_to_worker_group(self) -> dict[str, str]:
        """Agent name -> worker-group name."""
        return {agent: wg.name for wg in self.worker_groups() for agent in wg.agents}

    @property
    def data_seed(self) -> int:
        """The seed of the generated data: ``data.seed``, else ``experiment.seed``."""
        return self.experiment.seed if self.data.seed is None else self.data.seed

    def data_spec(self, split: Literal["train", "eval"]) -> str:
        """Where the ``split`` questions come from: the configured file or generated set."""
        spec = self.data.train if split == "train" else self.data.eval
        if spec is None:
            raise ValueError(f"data.{split} is not resolved: load the config with {RESOLVED_BY}")
        return spec

    def agent_sampling(self, agent_name: str) -> SamplingConfig:
        """The rollout sampling of one agent: rollout.sampling with its overrides."""
        agent = next(a for a in self.agents if a.name == agent_name)
        return SamplingConfig(**{f: self._agent_value(agent, f) for f in SAMPLING_FIELDS})

    def to_json(self, indent: int | None = None) -> str:
        """The resolved config (every default filled in): loads back to an equal config."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> DrmasConfig:
        """Load a resolved config (e.g. the KFP parameter), with the same checks as YAML."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as error:
            raise ConfigError(explain(error)) from None

    def flat_params(self) -> dict[str, str]:
        """'section.field' -> value as text, for MLflow params."""
        return _flatten(json.loads(self.to_json()))


@dataclass(frozen=True)
class WorkerGroup:
    """One trainable model: its agents and the settings that its optimizer and engine use."""

    name: str
    model: str
    spec: ModelSpec | None
    agents: tuple[str, ...]
    lr: float
    micro_batch_size: int
    warmup_steps: int

    @property
    def chat_template_kwargs(self) -> TemplateVariables:
        """The template variables of this group's model (none for a model named directly
        by hub id or folder instead of by a key of ``models``)."""
        return dict(self.spec.chat_template_kwargs) if self.spec is not None else {}

    @property
    def system_prompt(self) -> str | None:
        """The system message of this group's model (``models.NAME.system_prompt``)."""
        return self.spec.system_prompt if self.spec is not None else None


# --------------------------------------------------------------------------------------
# Error messages
# --------------------------------------------------------------------------------------


Location = tuple[str | int, ...]
"""A path in the raw config, as pydantic reports it: ('agents', 0, 'lr')."""


def explain(error: ValidationError) -> list[str]:
    """One readable line per pydantic error, naming the field."""
    problems = []
    for item in error.errors():
        loc = item["loc"]
        path = dotted(loc)
        if item["type"] == "extra_forbidden":
            parent_fields = _fields_at(loc[:-1])
            hint = did_you_mean(str(loc[-1]), parent_fields)
            problems.append(f"{path}: unknown key{hint}")
        elif item["type"] == "value_error":
            message = item["msg"].removeprefix("Value error, ")
            problems += [
                line if not path or line.startswith(path) else f"{path}: {line}" for line in message.split("\n")
            ]
        else:
            shown = repr(item.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            problems.append(f"{path or '(top level)'}: {item['msg']} (got {shown})")
    return problems


def dotted(loc: tuple[Any, ...], nested: bool = False) -> str:
    """('agents', 0, 'lr') -> 'agents[0].lr'; ``nested``: the rest of a longer path ('.lr')."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text or nested else str(part))
    return text


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section that ``loc`` points into, for did-you-mean."""
    annotation: Any = DrmasConfig
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return []
            annotation = field.annotation
        else:
            args = typing.get_args(annotation)
            annotation = args[-1] if args else None
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """X | None -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return options[0] if len(options) == 1 else annotation
    return annotation


def did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _flatten(node: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict) and node:
        flat: dict[str, str] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(node, list) and node and all(isinstance(item, dict) for item in node):
        flat = {}
        for index, item in enumerate(node):
            label = item.get("name", index)
            flat.update(_flatten(item, f"{prefix}.{label}"))
        return flat
    return {prefix: json.dumps(node) if not isinstance(node, str) else node}


def looks_local(model: str) -> bool:
    """Whether a model is named by a local folder rather than a hub id or a key of ``models``."""
    return model.startswith(("/", "./", "../", "~"))
