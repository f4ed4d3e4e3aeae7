"""The memory plan (``drmas.planning``) held to host memory measured on a small model.

Two ranks (torchrun, gloo, on the CPU) train a ~20M-parameter Qwen3, built from the config's
scratch spec as ``drmas plan`` sizes it (a 32000-token vocabulary, so that the embedding is
the largest tensor, as in the recipes' models), with the torch backend and DeepSpeed ZeRO
0-3, with and without optimizer offload. Per phase each rank measures the peak of its
anonymous resident memory above the phase's start (``bench/state_memory.peak_above_start``:
sampled every 2 ms, freed memory given back first):

- **cold update**: the model loaded from its saved folder as the update stage loads it
  (``load_training_model``: ZeRO-3 partitioned from the start, else whole), the engine
  made, one optimizer step over the plan's worst-case micro-batch (rows of
  ``rollout.max_prompt_tokens`` + ``max_new_tokens``);
- **save**: each rank's shard of the optimizer state written and uploaded to a local
  store (``store_shards``);
- **restore**: a fresh engine's ranges read from the shards that hold them
  (``import_stored_state``).

The plan is for a GPU: there the update's training state lives on the device and only its
offloaded part, the model's load and the streamed state on the host. On a CPU device and
host are the same memory, so the cold update is compared with the sum of the plan's device
update peak (less the CUDA contexts a CPU has none of) and its host additions for a cold
update (the model loaded, the offloaded optimizer and its pinned buffers). DeepSpeed's
gradient reduction bucket is allocated whole on a GPU (5e8 elements) but a CPU run touches
only the part the model's gradients fill: the comparison counts that part. The save and the
restore compare their host figures directly, the restore with the Adam moments it creates
(on the device of a GPU run without offload). A save's pieces are views of the state,
which on a CPU is already on the host: the GPU's copy of one piece to the host is not
compared. What only a GPU shows: the CUDA allocator's
peaks, the contexts, the engine's share (bench/gpu_checks.py, ``microbatch``).

Each phase: plan >= measured, and plan <= 2 x measured.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, torch_env, torch_launcher

from drmas.config import load_config
from drmas.planning import DEEPSPEED_REDUCE_BUCKET, MemoryPlan, plan_memory

RANKS = 2
OVERRIDES = [
    "models.tiny.hidden_size=256",
    "models.tiny.intermediate_size=1024",
    "models.tiny.num_layers=12",
    "models.tiny.num_heads=8",
    "models.tiny.num_kv_heads=4",
    "models.tiny.vocab_size=32000",
    "workers.sharing=by_model",
    f"ray.pool_size={RANKS}",
    "rollout.max_prompt_tokens=32",
    "rollout.sampling.max_new_tokens=32",
    "train.micro_batch_size=2",
    "train.updates_per_iteration=1",
    "train.gradient_checkpointing=true",
]
"""The shape of bench/state_memory.py's model (20.0M parameters, 8.2M of them the tied
embedding); one worker group, partitioned over two ranks; micro-batches of two 64-token rows."""
CASES = {
    "torch": ["train.backend=torch"],
    **{f"zero{stage}": ["train.backend=deepspeed", f"train.zero_stage={stage}"] for stage in range(4)},
    **{
        f"zero{stage}-offload": ["train.backend=deepspeed", f"train.zero_stage={stage}", "train.offload_optimizer=true"]
        for stage in (2, 3)
    },
}
PHASES = ("cold update", "save", "restore")
MMAP_THRESHOLD = 64 * 1024
"""glibc serves every allocation of at least this many bytes with its own mapping and
unmaps it when freed (``MALLOC_MMAP_THRESHOLD_``, which also stops glibc raising the
threshold as it goes): the resident peak is then that of the live tensors, not of the
heap's free holes, which added 50-110 MB of run-to-run noise to the 20M model's update."""

SCRIPT = """
import json, os, sys, tempfile
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from gpu_checks import random_rows
from state_memory import peak_above_start
from transformers import Qwen3Config, Qwen3ForCausalLM
from drmas.config import load_config
from drmas.stages.update import prepare_for_training
from drmas.stages.update import load_training_model
from drmas.training.engines import make_engine
from drmas.training.loop import train_worker_group
from drmas.infra.layout import PolicyRef
from drmas.infra.store import Store
from drmas.stages.optimizer_store import store_shards
from drmas.stages.update import import_stored_state

os.environ["DS_ACCELERATOR"] = "cpu"
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cases = json.loads(sys.argv[3])
folder = Path(sys.argv[4])


def build(config):
    spec = config.worker_groups()[0].spec
    shape = Qwen3Config(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                        head_dim=spec.hidden_size // spec.num_heads, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(shape)
    prepare_for_training(model, config.train.gradient_checkpointing)
    return model


saved_model = folder / "model"
if rank == 0:
    build(load_config(sys.argv[5], next(iter(cases.values())))).save_pretrained(saved_model, safe_serialization=True)
dist.barrier()

report = {}
for name, overrides in cases.items():
    config = load_config(sys.argv[5], overrides)
    group = config.worker_groups()[0]
    prompt, response = config.rollout.max_prompt_tokens, config.rollout.sampling.max_new_tokens
    rows = random_rows(2 * world, prompt, response, group.spec.vocab_size, list(group.agents))
    held = {}

    def cold_update():
        model = load_training_model(saved_model, group, config)
        prepare_for_training(model, config.train.gradient_checkpointing)
        engine = make_engine(model, group, config)
        train_worker_group(config, group, engine, model, None, rows, 0, 0, rank, world)
        held.update(model=model, engine=engine)

    store = Store(str(folder / "store"))

    def save():
        store_shards(held["engine"].shard_stream(), store, name, False, {}, folder / f"save-{name}-{rank}", 600)

    peaks = {"cold update": peak_above_start(cold_update)}
    dist.barrier()
    peaks["save"] = peak_above_start(save)
    dist.barrier()
    held.clear()
    engine = make_engine(build(config), group, config)
    scratch = folder / f"restore-{name}-{rank}"
    peaks["restore"] = peak_above_start(lambda: import_stored_state(engine, store, PolicyRef(name), scratch))
    del engine
    dist.barrier()
    report[name] = peaks

everyone = [None] * world
dist.all_gather_object(everyone, report)
if rank == 0:
    print("REPORT", json.dumps(everyone))
dist.destroy_process_group()
"""


def plan_of(case: str) -> MemoryPlan:
    return plan_memory(load_config(ROOT / "configs" / "math_tiny.yaml", [*OVERRIDES, *CASES[case]]))


def planned_on_cpu(case: str) -> dict[str, int]:
    """The plan's figure per phase as a CPU run holds it (module docstring)."""
    plan = plan_of(case)
    group = plan.groups[0]
    per_element = group.reduce_bucket // DEEPSPEED_REDUCE_BUCKET
    untouched = max(DEEPSPEED_REDUCE_BUCKET - group.params, 0) * per_element
    device = group.update_peak - group.contexts - untouched
    piece = (-(-group.largest_param * 4 // plan.slots)) if plan.zero_stage == 3 else group.largest_param * 4
    return {
        "cold update": device + group.load_host + group.training_host,
        "save": group.save_host - piece,
        "restore": group.restore_host + group.moments,
    }


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, int]]]:
    folder = tmp_path_factory.mktemp("plan_measured")
    script = folder / "script.py"
    script.write_text(SCRIPT)
    cases = {name: [*OVERRIDES, *overrides] for name, overrides in CASES.items()}
    args = [str(ROOT / "bench"), str(Path(__file__).parent), json.dumps(cases), str(folder)]
    done = subprocess.run(
        [*torch_launcher(RANKS), str(script), *args, str(ROOT / "configs" / "math_tiny.yaml")],
        capture_output=True,
        text=True,
        env=torch_env() | {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    shutil.rmtree(folder)  # the ranks' stored states (~3.5 GB): the report is all the tests read
    return json.loads(done.stdout.split("REPORT ")[-1].splitlines()[0])


def check(case: str, phase: str, measured: list[dict[str, dict[str, int]]]) -> None:
    """Plan >= the larger of the two ranks' peaks, and plan <= twice it."""
    planned = planned_on_cpu(case)[phase]
    found = max(rank[case][phase] for rank in measured)
    figures = f"{case} {phase}: plan {planned / 1e6:.1f} MB, measured {found / 1e6:.1f} MB"
    assert planned >= found, figures
    assert planned <= 2 * found, figures


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_cold_update_is_bounded_within_twice_its_measured_peak(case, measured):
    check(case, "cold update", measured)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_restore_is_bounded_within_twice_its_measured_peak(case, measured):
    check(case, "restore", measured)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_save_is_bounded_within_twice_its_measured_peak(case, measured):
    check(case, "save", measured)


def test_the_plan_sizes_the_model_the_measurement_builds():
    """The comparison means something only if the plan counts the measured model: 20.0M
    parameters, the 32000 x 256 embedding the largest."""
    group = plan_of("zero2").groups[0]
    assert group.params == 19_995_648
    assert group.largest_param == 32000 * 256
