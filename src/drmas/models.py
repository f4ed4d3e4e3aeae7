"""Models and tokenizers: build a small one from scratch, or load one (hub id or folder).

Scratch models are what make CPU training possible: a Qwen3- or Llama-shaped decoder of
about a million parameters with a byte-level BPE tokenizer trained on the task's own
text, digits split one per token (arithmetic is learnable that way; see ENVIRONMENT.md).
Everything is saved in the Hugging Face layout, so ``AutoModelForCausalLM.from_pretrained``
loads it. A policy folder is input (it comes from a store, a hub or a user): weights are
only ever read from safetensors, never with code from the folder, and a folder that cannot
be loaded raises :class:`PolicyError` naming the folder and the reason.

A hub id becomes a folder first (:func:`pretrained_folder`): a snapshot in the local
Hugging Face cache at the pinned revision, downloaded when the hub is reachable and only
looked up when it is not (``HF_HUB_OFFLINE=1``), with its config, safetensors and
tokenizer files and nothing else. Every agent call is rendered by :func:`chat_prompt`:
its model's own chat template, template variables and system message.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer

from drmas.config import ModelSpec, PolicyError, TemplateVariables, weights_problem

__all__ = [
    "read_gguf",
    "PolicyError",
    "build_scratch_policy",
    "chat_prompt",
    "chat_turn",
    "load_model",
    "load_model_partitioned",
    "load_tokenizer",
    "pretrained_folder",
    "train_tokenizer",
]


END_OF_TEXT = "<|endoftext|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
# ChatML, as Qwen uses it: a scratch model and a real one see the same prompt shape.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_turn(user_message: str) -> str:
    """A user message as CHAT_TEMPLATE renders it with the generation prompt."""
    return f"{TURN_START}user\n{user_message}{TURN_END}\n{TURN_START}assistant\n"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``texts``, one token per digit, ChatML specials."""
    from tokenizers import Tokenizer as RawTokenizer  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, TURN_START, TURN_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=TURN_END,
        pad_token=END_OF_TEXT,
        bos_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def build_scratch_policy(spec: ModelSpec, texts: Iterable[str], out_dir: Path, seed: int) -> Path:
    """Train a tokenizer on ``texts``, initialise a model from ``spec``, save both (HF layout)."""
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    model = _scratch_model(spec, tokenizer, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _scratch_model(spec: ModelSpec, tokenizer: Tokenizer, seed: int) -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: PLC0415

    config_class, model_class = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[spec.architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype=spec.dtype,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(getattr(torch, spec.dtype))


def load_tokenizer(source: str | Path, revision: str | None = None) -> Tokenizer:
    """A tokenizer from a hub id (at ``revision``) or a folder, left-padding (generation
    pads on the left)."""
    folder = pretrained_folder(source, revision)
    with _refused_as_policy_error(source):
        tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side="left", trust_remote_code=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(source: str | Path, dtype: str = "float32", revision: str | None = None) -> PreTrainedModel:
    """A causal LM from a hub id (at ``revision``) or a folder: from safetensors only and
    without the folder's own code (``trust_remote_code`` stays off), since either would run
    what the folder holds."""
    folder = _weights_folder(source, revision)
    with _refused_as_policy_error(source):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=getattr(torch, dtype), use_safetensors=True, trust_remote_code=False
        )
    model.eval()
    return model


def load_model_partitioned(source: str | Path, dtype: str, deepspeed_config: dict[str, Any]) -> PreTrainedModel:
    """A causal LM partitioned for DeepSpeed ZeRO-3 from the start, through the same gate as
    :func:`load_model` (safetensors only, no code from the folder): no rank ever holds the
    whole model, only its partition of each parameter, as ``deepspeed.initialize`` would
    have made it from a whole one (``deepspeed_config`` is the engine's).

    The model is built from its config under ``deepspeed.zero.Init`` (DeepSpeed 0.19.8,
    runtime/zero/partition_parameters.py:951-1200): each module's parameters are made
    whole on DeepSpeed's device when the module's ``__init__`` ends, broadcast from rank 0
    and cut to this rank's ``ds_tensor`` (``_post_init_method``, :1232-1262;
    ``_partition_param``, :1778-1880), so one module's parameters at a time. transformers'
    ``no_init_weights`` skips their random initialisation, which the load overwrites. Each
    rank then reads only its own partition of each tensor from the memory-mapped file
    (:func:`_read_partition`). transformers' own ZeRO-3 load (``HfDeepSpeedConfig``) is
    not used: rank 0 reads the whole state dict into memory (``load_state_dict``) and
    broadcasts it module by module (integrations/deepspeed.py,
    ``_load_state_dict_into_zero3_model``), so rank 0 holds the whole model.

    Refused with a :class:`PolicyError` when a parameter has no tensor of its shape in the
    files (a checkpoint whose names transformers converts on load)."""
    import deepspeed  # noqa: PLC0415 - only the ZeRO-3 engine loads this way
    from transformers import AutoConfig  # noqa: PLC0415
    from transformers.initialization import no_init_weights  # noqa: PLC0415

    folder = _weights_folder(source)
    with _refused_as_policy_error(source):
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    # Not a policy's fault: the build's collectives (a rank that fails or times out).
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=deepspeed_config):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), trust_remote_code=False)
    model.tie_weights()  # no_init_weights skips it with the rest of ``init_weights``
    with _refused_as_policy_error(source):
        _read_partitions(model, folder, source)
    model.eval()
    return model


def _read_partitions(model: torch.nn.Module, folder: Path, source: str | Path) -> None:
    """Every parameter's partition, and the buffers the files hold (whole: ZeRO-3 does not
    partition buffers), from the folder's safetensors (one file or a sharded index)."""
    from safetensors import safe_open  # noqa: PLC0415

    files = _tensor_files(folder)
    with ExitStack() as stack:
        opened = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in set(files.values())}
        for name, param in model.named_parameters():
            if name not in files:
                raise PolicyError(f"{source}: no tensor {name} in its safetensors")
            tensor = opened[files[name]].get_slice(name)
            if tuple(tensor.get_shape()) != tuple(param.ds_shape):
                raise PolicyError(f"{source}: {name} is {tensor.get_shape()}, the model's {list(param.ds_shape)}")
            _read_partition(tensor, param)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in files:
                    buffer.copy_(opened[files[name]].get_tensor(name))


def _read_partition(tensor: Any, param: Any) -> None:
    """This rank's partition of ``param`` (a ZeRO-3 parameter: DeepSpeed adds its ``ds_*``
    attributes) from its tensor in a safetensors file.

    ZeRO-3 partitions the flattened parameter in equal parts of ``ds_tensor.ds_numel``
    elements, rank r holding elements [r x part, (r + 1) x part), the last part padded
    (partition_parameters.py:1690-1699, 1841-1872). safetensors reads a range of rows
    (``get_slice``, from the memory-mapped file): the rows that hold the part, at most two
    rows more than the part itself; the padding is zeroed."""
    part = param.ds_tensor
    size = part.ds_numel
    start = min(size * dist.get_rank(group=param.ds_process_group), param.ds_numel)
    end = min(start + size, param.ds_numel)
    row = math.prod(tensor.get_shape()[1:])
    first, last = start // row, -(-end // row)
    values = tensor[first:last].reshape(-1)[start - first * row : end - first * row]
    with torch.no_grad():
        part.zero_()
        part[: end - start].copy_(values)


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Which safetensors file of ``folder`` holds each tensor: the shard index's map, or the
    one file's tensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    from safetensors import safe_open  # noqa: PLC0415

    single = folder / "model.safetensors"
    with safe_open(str(single), framework="pt") as opened:
        return dict.fromkeys(opened.keys(), single)


def _weights_folder(source: str | Path, revision: str | None = None) -> Path:
    """The folder of ``source`` (:func:`pretrained_folder`), refused when its weights are
    not safetensors alone."""
    folder = pretrained_folder(source, revision)
    if problem := weights_problem(path.name for path in folder.iterdir()):
        raise PolicyError(f"{source}: {problem}")
    return folder


HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")
"""What drmas takes of a hub repository: the configs (and the shard index), safetensors
weights, tokenizer files (vocab, merges, sentencepiece or tiktoken models) and the chat
template; never pickled weights or code."""


def read_gguf(gguf_path: Path, dtype: str = "float32") -> tuple[PreTrainedModel, Tokenizer]:
    """The model and tokenizer of a GGUF file (llama.cpp's format: typed header fields and
    raw tensors, nothing executed), the weights dequantised into a plain float model built
    from the file's config without its ``quantization_config``, so that it trains and saves
    like any other. Without ``dequantize=True`` transformers would keep the weights packed
    and, with the ``kernels`` package installed, fetch a matmul kernel (code) from the hub.
    Raises :class:`PolicyError` naming the file when transformers cannot read it."""
    from transformers import GgufConfig  # noqa: PLC0415

    source = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": str(gguf_path)}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source, trust_remote_code=False)
        read = AutoModelForCausalLM.from_pretrained(
            **source,
            quantization_config=GgufConfig(dequantize=True),
            dtype=getattr(torch, dtype),
            trust_remote_code=False,
        )
    except Exception as error:  # a damaged file fails anywhere in the parser (struct, numpy, ...)
        raise PolicyError(f"{gguf_path}: transformers cannot read this GGUF model ({_first_line(error)})") from None
    config = read.config
    if hasattr(config, "quantization_config"):  # the weights are plain floats: no quantizer on load
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), trust_remote_code=False)
    model.load_state_dict(read.state_dict(), strict=True)
    model.generation_config = read.generation_config
    return model, tokenizer


def load_encoder(source: str | Path) -> tuple[Tokenizer, PreTrainedModel, list[str]]:
    """A text encoder (``AutoModel``, float32) and its tokenizer from a hub id or a folder,
    through the same gate as a policy: from safetensors only and without the folder's own
    code; with the names of the weights the files lacked (drawn at random by transformers)."""
    folder = pretrained_folder(source)
    with _refused_as_policy_error(source):
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        model, loading = AutoModel.from_pretrained(
            str(folder), dtype=torch.float32, use_safetensors=True, trust_remote_code=False, output_loading_info=True
        )
    model.eval()
    return tokenizer, model, list(loading["missing_keys"])


def pretrained_folder(source: str | Path, revision: str | None = None) -> Path:
    """The folder that holds ``source``: a folder as it is; a hub id as its snapshot at
    ``revision`` (a branch, tag or commit hash; unset: main) in the local Hugging Face
    cache (``HF_HOME`` / ``HF_HUB_CACHE``), downloaded there first when the hub is
    reachable. With ``HF_HUB_OFFLINE=1`` the hub is never asked: a branch or tag resolves
    through the cache's refs, as the hub client itself records them."""
    folder = Path(source).expanduser()
    if revision is None and folder.is_dir():
        return folder
    from huggingface_hub import constants, snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import (  # noqa: PLC0415
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, at = str(source), f"at revision {revision or 'main'!r}"
    fetch = (
        f"download it once where the hub is reachable (hf download {repo_id}"
        + (f" --revision {revision}" if revision else "")
        + f") into the cache this machine reads ({constants.HF_HUB_CACHE}; set by HF_HOME or HF_HUB_CACHE), "
        "or make its source a local folder; HF_HUB_OFFLINE=1 keeps drmas to that cache"
    )
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    except HFValidationError as error:
        raise PolicyError(f"{repo_id}: neither a local folder nor a hub id ({_first_line(error)})") from None
    except IncompleteSnapshotError:
        raise PolicyError(f"hub model {repo_id!r} {at}: its cached snapshot is incomplete; {fetch}") from None
    except LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "the hub could not be reached"
        raise PolicyError(
            f"hub model {repo_id!r} {at} is neither in the local Hugging Face cache nor reachable ({reason}); {fetch}"
        ) from None
    except RevisionNotFoundError:
        raise PolicyError(
            f"hub model {repo_id!r} has no revision {revision!r} (a branch, tag or commit hash)"
        ) from None
    except RepositoryNotFoundError:
        raise PolicyError(
            f"hub model {repo_id!r} does not exist or is private or gated: check the id, or give a token "
            "with access (HF_TOKEN, or hf auth login)"
        ) from None


def chat_prompt(
    tokenizer: Tokenizer,
    message: str,
    system_prompt: str | None = None,
    template_kwargs: TemplateVariables | None = None,
) -> str:
    """One agent call as its model expects it: ``message`` as the user turn of the model's
    own chat template (with its template variables), after ``system_prompt`` as a system
    message, then the generation prompt. A template that refuses a system message (it
    raises) or drops it gets it at the start of the user message: the model still reads it."""
    variables: dict[str, Any] = dict(template_kwargs or {})  # Any: transformers types its own kwargs
    messages = [{"role": "user", "content": message}]
    if system_prompt:
        if takes_system_message(tokenizer, variables):
            messages.insert(0, {"role": "system", "content": system_prompt})
        else:
            messages[0]["content"] = f"{system_prompt}\n\n{message}"
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **variables)
    return str(text)  # tokenize=False: the rendered text


SYSTEM_PROBE = "drmas-system-probe"
"""A system message that no template writes by itself: found in the rendering, it was kept."""


def takes_system_message(tokenizer: Tokenizer, template_kwargs: TemplateVariables | None = None) -> bool:
    """Whether the tokenizer's chat template renders a system message (some raise on one,
    some leave it out)."""
    from jinja2 import TemplateError  # noqa: PLC0415

    probe = [{"role": "system", "content": SYSTEM_PROBE}, {"role": "user", "content": "?"}]
    variables: dict[str, Any] = dict(template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, **variables)
    except TemplateError:
        return False
    return SYSTEM_PROBE in text


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@contextmanager
def _refused_as_policy_error(source: str | Path) -> Iterator[None]:
    """What transformers and safetensors raise for a folder they cannot load (missing or
    damaged files, an unknown architecture, code it would have to run), as a PolicyError."""
    from safetensors import SafetensorError  # noqa: PLC0415

    try:
        yield
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:
        raise PolicyError(f"{source}: not a loadable policy ({_first_line(error)})") from None
