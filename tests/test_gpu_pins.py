"""The GPU image's own library versions (images/gpu-pins.txt): the pins agree with the
image, the pinned run (`make test-gpu-pins`, part of `make test`) really imports them, and
the training path uses only what those versions have.

The GPU image installs transformers 5.12.1 and tokenizers 0.22.2 (SGLang 0.5.21 pins them)
where the CPU venv has newer releases: a call that only the newer transformers has passes
every other test here and fails on the GPU. The pinned run puts .venv-gpu-pins (the pins,
installed with --no-deps) in front of .venv and runs this file and the training-path tests
again; ``DRMAS_GPU_PINS`` (set by the Makefile) names the pin file it installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT

PINS_FILE = ROOT / "images" / "gpu-pins.txt"
PINNED_RUN = os.environ.get("DRMAS_GPU_PINS")
"""The pin file that the pinned run installed (the Makefile sets it), or None."""

HF_LIBRARIES = ("transformers", "tokenizers", "huggingface_hub", "peft", "accelerate", "safetensors")
"""Whose names drmas imports must exist at the pinned versions."""
LAZY_ONLY = {("transformers", "GgufConfig"): "read_gguf"}
"""Names the pinned versions lack, each allowed only inside this one function (imported
there, where only that path runs): transformers 5.12.1 has no ``GgufConfig``, which only
``drmas import-gguf`` (``drmas.models.read_gguf``) imports. The pinned run runs no test of
that path: one would fail there on the ImportError."""


def _pins(text: str) -> tuple[dict[str, str], dict[str, str], str]:
    """The pin file's installed pins, the pins it says are the same in the CPU venv (the
    ``# same:`` line), and the SGLang release whose pins it holds."""
    installed, same = {}, {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# same:"):
            same |= dict(pin.split("==") for pin in line.removeprefix("# same:").split())
        elif line := line.split("#")[0].strip():
            name, version = line.split("==")
            installed[name.strip()] = version.strip()
    sglang = re.search(r"^# Pinned by sglang==(\S+)", text, flags=re.MULTILINE)
    assert sglang, f"{PINS_FILE} does not name the SGLang release whose pins it holds (# Pinned by sglang==VERSION)"
    return installed, same, sglang.group(1)


def _dockerfile_args() -> dict[str, str]:
    text = (ROOT / "images" / "Dockerfile.gpu").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_pins_are_those_of_the_gpu_image():
    """The pin file holds the pins of the image's SGLang, and the libraries it says the image
    shares with the CPU venv are the image's (Dockerfile.gpu's ARGs) and the venv's."""
    installed, same, sglang = _pins(PINS_FILE.read_text())
    args = _dockerfile_args()
    assert sglang == args["SGLANG_VERSION"], (
        f"Dockerfile.gpu installs SGLang {args['SGLANG_VERSION']}, {PINS_FILE.name} holds the pins of {sglang}: "
        "update it from the new wheel's Requires-Dist (CONTRIBUTING.md)"
    )
    assert {"transformers", "tokenizers"} <= set(installed)
    assert same["torch"] == args["TORCH_VERSION"] and same["deepspeed"] == args["DEEPSPEED_VERSION"]
    assert not {_canonical(name) for name in same} & {_canonical(name) for name in installed}
    if not PINNED_RUN:  # the CPU venv's own versions: the "same" ones are the venv's
        for name, version in same.items():
            assert importlib.metadata.version(name).split("+")[0] == version, name


@pytest.mark.skipif(not PINNED_RUN, reason="the pinned run only (make test-gpu-pins)")
def test_the_pinned_run_imports_the_pinned_versions():
    """Every pin, installed or shared, is what this process and a subprocess (as torchrun
    ranks and Ray workers are) import: .venv-gpu-pins shadows the venv's copies."""
    assert PINNED_RUN is not None
    installed, same, _ = _pins(Path(PINNED_RUN).read_text())
    import transformers

    assert transformers.__version__ == installed["transformers"], transformers.__file__
    for name, version in (installed | same).items():
        assert importlib.metadata.version(name).split("+")[0] == version, name
    probe = "import tokenizers, transformers; print(transformers.__version__, tokenizers.__version__)"
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert seen.stdout.split() == [installed["transformers"], installed["tokenizers"]]


def _hf_imports() -> list[tuple[str, str, str, str]]:
    """Each name drmas imports from a Hugging Face library: (module, name, file:line, the
    function it is imported in, or "" at module level)."""
    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        functions = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    functions.setdefault(inner, node.name)  # the outermost function: ast.walk goes outer first
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in HF_LIBRARIES:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found += [(node.module, alias.name, where, functions.get(node, "")) for alias in node.names]
    return found


def test_every_name_drmas_imports_from_transformers_exists_at_this_version():
    """Each ``from transformers... import NAME`` (peft, tokenizers, ...) in src/ resolves at
    the installed versions, but for ``LAZY_ONLY``: those may be imported only inside their
    one function, so that importing drmas (and everything but that path) never needs them."""
    imports = _hf_imports()
    assert any(module == "transformers" for module, *_ in imports)
    missing = []
    for module, name, where, function in imports:
        if (module, name) in LAZY_ONLY:
            assert function == LAZY_ONLY[module, name], f"{where}: {name} imported outside {LAZY_ONLY[module, name]}"
            continue
        if not hasattr(importlib.import_module(module), name):
            missing.append(f"{where}: {module}.{name}")
    assert not missing, f"absent from the installed versions: {missing}"


def _tiny(architecture: str) -> torch.nn.Module:
    """A two-layer causal LM of ``architecture`` built from its config (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        architecture
    ]
    config = config_class(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_class(config)


def _count_forwards(modules: list[torch.nn.Module]) -> list[int]:
    """A list that grows by one at each forward of any of ``modules``, recomputed ones
    included (torch's checkpoint recomputes without the modules' forward hooks)."""
    calls: list[int] = []
    for module in modules:
        forward = module.forward
        module.forward = lambda *args, forward=forward, **kwargs: calls.append(1) or forward(*args, **kwargs)
    return calls


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_the_update_prepares_checkpointed_training_with_this_transformers(architecture):
    """The update's model preparation (``prepare_for_training``) with gradient
    checkpointing, on the installed transformers: every decoder layer's forward runs again
    in the backward pass, ``torch.autograd.grad`` works (the per-agent diagnostic needs the
    non-reentrant kind) and the gradients are those without checkpointing."""
    from drmas.stages.update import prepare_for_training

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    grads, forwards = {}, {}
    for on in (False, True):
        model = _tiny(architecture)
        model.eval()
        prepare_for_training(model, on)
        assert model.training
        calls = _count_forwards([layer.mlp for layer in model.model.layers])
        loss = model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()
        params = [p for p in model.parameters() if p.requires_grad]
        grads[on] = torch.autograd.grad(loss, params)
        forwards[on] = len(calls)
    assert forwards == {False: 2, True: 4}  # two layers, each recomputed once when checkpointed
    for plain, recomputed in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_installs_the_pins_once_per_change_of_the_pin_file(tmp_path):
    """`make -n test-gpu-pins` (dry run) shows the --no-deps install into .venv-gpu-pins only
    while the stamp for this pin file is missing, and runs the tests with it in front."""
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "images/gpu-pins.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)

    def dry_run(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    venv = next(line.split()[-1] for line in dry_run("venv").splitlines() if line.startswith("touch "))
    deepspeed_op = ".cache/torch_extensions/deepspeed_shm_comm/deepspeed_shm_comm.so"
    for age, path in enumerate((venv, deepspeed_op)):  # an installed venv, then the op built with it
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
        os.utime(tmp_path / path, (1e9 + age, 1e9 + age))
    first = dry_run("test-gpu-pins")
    assert "--no-deps --target .venv-gpu-pins -r images/gpu-pins.txt" in first
    assert "-e '.[dev]'" not in first
    assert "DRMAS_GPU_PINS=" in first and f"PYTHONPATH={tmp_path}/.venv-gpu-pins" in first
    stamp = next(line for line in first.splitlines() if line.startswith("touch .venv-gpu-pins/"))
    (tmp_path / stamp.split()[-1]).parent.mkdir()
    (tmp_path / stamp.split()[-1]).touch()
    assert "pip" not in dry_run("test-gpu-pins")
    with open(tmp_path / "images" / "gpu-pins.txt", "a") as handle:
        handle.write("# a change of the pins\n")
    assert "--target .venv-gpu-pins" in dry_run("test-gpu-pins")
