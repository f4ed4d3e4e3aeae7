"""A cold ZeRO-3 update loads the policy partitioned from the start
(``drmas.stages.update.load_training_model``): two gloo ranks (torchrun, CPU) load a
saved Qwen3 whose layers, not its embedding, hold most of its weights, so that a rank's
partition plus one whole tensor is well below the whole model.

- no rank holds the whole model: the load's peak resident memory (anonymous, above its
  start; ``bench/state_memory.peak_above_start``) stays below the model's bytes, which
  the whole load (``drmas.models.load_model``) reaches, and every parameter is left as
  this rank's ZeRO-3 partition;
- the weights gathered from the partitions equal the file's exactly;
- the first update from it equals the update of an engine made from the whole model:
  the same loss, and the same weights after the step.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import transformers
from helpers import ROOT, torch_env, torch_launcher
from packaging.version import Version

RANKS = 2
GPU_IMAGE_TRANSFORMERS = re.search(
    r"^transformers==(\S+)", (ROOT / "images" / "gpu-pins.txt").read_text(), flags=re.MULTILINE
).group(1)
"""The GPU image's transformers (images/gpu-pins.txt), under which the bf16 update matches."""
OVERRIDES = [
    "models.tiny.hidden_size=256",
    "models.tiny.intermediate_size=1024",
    "models.tiny.num_layers=12",
    "models.tiny.num_heads=8",
    "models.tiny.num_kv_heads=4",
    "models.tiny.vocab_size=512",
    "workers.sharing=by_model",
    f"ray.pool_size={RANKS}",
    "rollout.max_prompt_tokens=16",
    "rollout.sampling.max_new_tokens=16",
    "train.micro_batch_size=2",
    "train.updates_per_iteration=1",
    "train.backend=deepspeed",
    "train.zero_stage=3",
]
"""11.9M parameters, the largest (each layer's 1024 x 256 MLP matrices) 2% of them."""
DTYPES = ("float32", "bfloat16")
MMAP_THRESHOLD = 64 * 1024
"""As tests/test_plan_measured.py: every tensor its own mapping, unmapped when freed."""

SCRIPT = """
import json, os, sys
from pathlib import Path
import deepspeed, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from gpu_checks import random_rows
from state_memory import peak_above_start
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM
from drmas.config import load_config
from drmas.models import load_model
from drmas.stages.update import prepare_for_training
from drmas.stages.update import load_training_model
from drmas.training.engines import make_engine
from drmas.training.loop import train_worker_group

os.environ["DS_ACCELERATOR"] = "cpu"
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
folder, overrides = Path(sys.argv[2]), json.loads(sys.argv[3])


def save(spec, where):
    shape = Qwen3Config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                        head_dim=spec.hidden_size // spec.num_heads, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(shape).to(getattr(torch, spec.dtype)).save_pretrained(where, safe_serialization=True)


def first_update(config, group, model, rows):
    prepare_for_training(model, config.train.gradient_checkpointing)
    engine = make_engine(model, group, config)
    torch.manual_seed(1)
    metrics = train_worker_group(config, group, engine, model, None, rows, 0, 0, rank, world)
    return metrics, engine.full_weights()


report = {}
for dtype in sys.argv[5:]:
    config = load_config(sys.argv[4], [*overrides, f"models.tiny.dtype={dtype}"])
    group = config.worker_groups()[0]
    saved = folder / dtype
    if rank == 0:
        save(group.spec, saved)
    dist.barrier()
    load_training_model(saved, group, config)  # the first load imports DeepSpeed's and the model's code
    held = {}
    peak = peak_above_start(lambda: held.update(model=load_training_model(saved, group, config)))
    model = held.pop("model")
    stored = load_file(str(saved / "model.safetensors"))
    equal = []
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            equal.append(torch.equal(param.detach(), stored[name]))
    partitioned = all(
        param.numel() == 0 and param.ds_tensor.numel() == -(-param.ds_numel // world)
        for param in model.parameters()
    )
    rows = random_rows(2 * world, 16, 16, group.spec.vocab_size, list(group.agents))
    metrics, after = first_update(config, group, model, rows)
    whole_metrics, whole_after = first_update(config, group, load_model(saved, dtype), rows)
    report[dtype] = {
        "peak": peak,
        "weights": sum(tensor.numel() * tensor.element_size() for tensor in stored.values()),
        "partitioned": partitioned,
        "equals_file": all(equal),
        "same_loss": metrics[f"wg/{group.name}/loss"] == whole_metrics[f"wg/{group.name}/loss"],
        "same_step": all(torch.equal(after[name], whole_after[name]) for name in after),
    }
    dist.barrier()

everyone = [None] * world
dist.all_gather_object(everyone, report)
if rank == 0:
    print("REPORT", json.dumps(everyone))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, object]]]:
    folder = tmp_path_factory.mktemp("partitioned_load")
    script = folder / "script.py"
    script.write_text(SCRIPT)
    args = [str(ROOT / "bench"), str(folder), json.dumps(OVERRIDES), str(ROOT / "configs" / "math_tiny.yaml"), *DTYPES]
    done = subprocess.run(
        [*torch_launcher(RANKS), str(script), *args],
        capture_output=True,
        text=True,
        env=torch_env() | {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("REPORT ")[-1].splitlines()[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rank_holds_the_whole_model_while_it_loads(dtype, measured):
    for rank in measured:
        assert rank[dtype]["partitioned"]
        assert rank[dtype]["peak"] < rank[dtype]["weights"], rank[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gathered_partitions_are_the_files_weights(dtype, measured):
    assert all(rank[dtype]["equals_file"] for rank in measured)


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16",
            marks=pytest.mark.xfail(
                Version(transformers.__version__) > Version(GPU_IMAGE_TRANSFORMERS),
                strict=True,
                reason=f"bf16 (11.9M model) under transformers {transformers.__version__}: the same "
                "loss, but the step's gradient norm differs by 4e-4 relative and some weights by one "
                f"bf16 step; under the GPU image's {GPU_IMAGE_TRANSFORMERS} (make test-gpu-pins) it "
                "matches to the bit. Not yet explained (the 1.7M model matched under both)",
            ),
        ),
    ],
)
def test_the_first_update_equals_the_one_from_the_whole_model(dtype, measured):
    for rank in measured:
        assert rank[dtype]["same_loss"]
        assert rank[dtype]["same_step"]
