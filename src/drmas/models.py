"""Models and tokenizers: build a small one from scratch, or load one (hub id or folder).

Scratch models are what make CPU training possible: a Qwen3- or Llama-shaped decoder of
about a million parameters with a byte-level BPE tokenizer trained on the task's own
text, digits split one per token (arithmetic is learnable that way; see ENVIRONMENT.md).
Everything is saved in the Hugging Face layout, so ``AutoModelForCausalLM.from_pretrained``
loads it. A policy folder is input (it comes from a store, a hub or a user): weights are
only ever read from safetensors, never with code from the folder, and a folder that cannot
be loaded raises :class:`PolicyError` naming the folder and the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer

from drmas.config import ModelSpec, PolicyError, weights_problem

__all__ = ["PolicyError", "build_scratch_policy", "chat_turn", "load_model", "load_tokenizer", "train_tokenizer"]


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


def load_tokenizer(source: str | Path) -> Tokenizer:
    """A tokenizer from a hub id or a folder, left-padding (generation pads on the left)."""
    with _refused_as_policy_error(source):
        tokenizer = AutoTokenizer.from_pretrained(str(source), padding_side="left", trust_remote_code=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(source: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """A causal LM from a hub id or a folder: from safetensors only and without the folder's
    own code (``trust_remote_code`` stays off), since either would run what the folder holds."""
    folder = Path(source)
    if folder.is_dir() and (problem := weights_problem(path.name for path in folder.iterdir())):
        raise PolicyError(f"{source}: {problem}")
    with _refused_as_policy_error(source):
        model = AutoModelForCausalLM.from_pretrained(
            str(source), dtype=getattr(torch, dtype), use_safetensors=True, trust_remote_code=False
        )
    model.eval()
    return model


@contextmanager
def _refused_as_policy_error(source: str | Path) -> Iterator[None]:
    """What transformers and safetensors raise for a folder they cannot load (missing or
    damaged files, an unknown architecture, code it would have to run), as a PolicyError."""
    from safetensors import SafetensorError  # noqa: PLC0415

    try:
        yield
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PolicyError(f"{source}: not a loadable policy ({reason})") from None
