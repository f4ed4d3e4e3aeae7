"""The memory plan (`drmas plan`, drmas.planning): the formulas against hand-derived figures
and against real transformers models built tiny from a config, the paper's recipes on
8 x 80 GB, and the refusal of run, compile and submit for a config that cannot fit.

No GPU here: the plan is arithmetic over a config, so nothing in it needs one; the
activation formula is checked on CPU against the tensors a transformers layer saves for
its backward (CPU's SDPA is a flash kernel, as the GPU's is)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from drmas.cli import main
from drmas.config import load_config
from drmas.planning import (
    GB,
    KNOWN_ARCHITECTURES,
    RAY_LOG_BYTES,
    STORE_CHUNK_BYTES,
    Architecture,
    PlanError,
    architecture_of,
    parse_size,
    plan_memory,
)

ROOT = Path(__file__).resolve().parents[1]
MATH_RECIPE = str(ROOT / "configs" / "math_qwen3_4b_gpu.yaml")
SEARCH_RECIPE = str(ROOT / "configs" / "search_qwen25_7b_gpu.yaml")
TINY = str(ROOT / "configs" / "math_tiny.yaml")

TINY_PARAMS = 1_049_984
"""configs/math_tiny.yaml's scratch model (qwen3, hidden 128, 4 layers, 4 heads of 32, 2 KV
heads, MLP 512, vocab 512, tied): embeddings 512·128 = 65,536; per layer q 16,384, k and v
2·8,192, o 16,384, q/k norms 64, MLP 3·128·512 = 196,608, norms 256, = 246,080; 4 layers
984,320; final norm 128."""
TINY_LAYER_BYTES = 8_112
"""Per token, bf16 (b = 2), h = 128, q = 128, kv = 64: norms 2·(512 + 256 + 256 + 4) = 2,056;
attention 2·(256 + 128) + 4·4 = 784; MLP 4·2·512 = 4,096; q/k norms 6·192 + 4·6 = 1,176."""
TINY_FINAL_NORM = 512 + 512 + 4
TINY_TOKENS = 2 * (1024 + 48)
"""micro_batch_size 2 rows of max_prompt_tokens (default 1024) + max_new_tokens 48."""


def tiny_plan(*overrides: str, device: int | None = None):
    base = ("models.tiny.dtype=bfloat16", "train.backend=deepspeed", "train.micro_batch_size=2")
    return plan_memory(load_config(TINY, [*base, *overrides]), device)


# --------------------------------------------------------------------------------------
# The architecture: parameters and activations, against real transformers models
# --------------------------------------------------------------------------------------

TINY_HF_MODELS = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}


def _tiny_hf_config(kind: str, layers: int, tied: bool = False):
    config_class, _ = TINY_HF_MODELS[kind]
    return config_class(
        num_hidden_layers=layers,
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", sorted(TINY_HF_MODELS))
def test_parameter_count_is_the_models(kind, tied, tmp_path):
    """From a local folder's config.json, the count is the model's own (q/k/v biases of
    Qwen2, q/k norms of Qwen3, tied or separate LM head)."""
    config = _tiny_hf_config(kind, layers=2, tied=tied)
    config.save_pretrained(tmp_path)
    architecture, source = architecture_of(str(tmp_path), None)
    model = TINY_HF_MODELS[kind][1](config)
    assert architecture.params == sum(p.numel() for p in model.parameters())
    assert source == str(tmp_path / "config.json")


def _saved_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of the tensors autograd saves for the backward in one forward, weights excluded."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(0, 300, (1, tokens)), use_cache=False)
    return sum(saved.values())


@pytest.mark.parametrize("kind", sorted(TINY_HF_MODELS))
def test_layer_activations_are_what_a_transformers_layer_saves(kind):
    """One decoder layer's share (a 2-layer model less a 1-layer one) of what autograd saves
    in bfloat16, byte for byte."""
    tokens = 256
    models = [TINY_HF_MODELS[kind][1](_tiny_hf_config(kind, layers)).to(torch.bfloat16) for layers in (1, 2)]
    one_layer = _saved_bytes(models[1], tokens) - _saved_bytes(models[0], tokens)
    architecture = Architecture.from_hf_config(_tiny_hf_config(kind, 1).to_dict(), "test")
    assert one_layer == tokens * architecture.layer_activation_bytes(2)


def test_published_models_have_their_published_sizes():
    """Qwen3-4B: 4.0B (4,022,468,096 from its config), Qwen2.5-7B: 7.61B (7,615,616,512),
    Qwen2.5-3B: 3.09B, Llama-3.2-3B: 3.21B."""
    assert KNOWN_ARCHITECTURES["Qwen/Qwen3-4B"].params == 4_022_468_096
    assert KNOWN_ARCHITECTURES["Qwen/Qwen2.5-7B"].params == 7_615_616_512
    assert round(KNOWN_ARCHITECTURES["Qwen/Qwen2.5-3B"].params / 1e7) == 309
    assert round(KNOWN_ARCHITECTURES["meta-llama/Llama-3.2-3B"].params / 1e7) == 321


def test_a_model_it_cannot_size_is_named_with_how_to_supply_its_numbers(capsys):
    with pytest.raises(
        PlanError, match=r"cannot size model 'acme/unknown-7b'.*hf download acme/unknown-7b config.json"
    ):
        plan_memory(load_config(MATH_RECIPE, ["models.qwen3-4b.source=acme/unknown-7b"]))
    assert main(["plan", MATH_RECIPE, "models.qwen3-4b.source=acme/unknown-7b"]) == 2
    assert "drmas plan: cannot size model 'acme/unknown-7b'" in capsys.readouterr().err


def test_a_config_json_without_the_numbers_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    with pytest.raises(PlanError, match=rf"{tmp_path}/config.json has no integer num_hidden_layers"):
        architecture_of(str(tmp_path), None)


# --------------------------------------------------------------------------------------
# The training state by ZeRO stage and offload, activations, logits (hand-derived)
# --------------------------------------------------------------------------------------

TWO_PSI = 2 * TINY_PARAMS
FOUR_PSI = 4 * TINY_PARAMS
TWELVE_PSI = 12 * TINY_PARAMS


@pytest.mark.parametrize(
    ("overrides", "weights", "grads", "optimizer", "host"),
    [
        (("train.zero_stage=0", "ray.pool_size=1"), TWO_PSI, TWO_PSI, TWELVE_PSI, 0),
        (("train.zero_stage=0", "ray.pool_size=8"), TWO_PSI, TWO_PSI, TWELVE_PSI, 0),
        (("train.zero_stage=1", "ray.pool_size=8"), TWO_PSI, TWO_PSI, TWELVE_PSI // 8, 0),
        (("train.zero_stage=2", "ray.pool_size=8"), TWO_PSI, FOUR_PSI // 8, TWELVE_PSI // 8, 0),
        (("train.zero_stage=3", "ray.pool_size=1"), TWO_PSI, FOUR_PSI, TWELVE_PSI, 0),
        (("train.zero_stage=3", "ray.pool_size=8"), TWO_PSI // 8, FOUR_PSI // 8, TWELVE_PSI // 8, 0),
        (
            ("train.zero_stage=1", "ray.pool_size=8", "train.offload_optimizer=true"),
            TWO_PSI,
            FOUR_PSI,
            0,
            TWELVE_PSI // 8,
        ),
        (
            ("train.zero_stage=2", "ray.pool_size=8", "train.offload_optimizer=true"),
            TWO_PSI,
            FOUR_PSI // 8,
            0,
            TWELVE_PSI // 8,
        ),
    ],
)
def test_training_state_by_zero_stage_and_offload(overrides, weights, grads, optimizer, host):
    """bf16 mixed precision: 2Ψ weights, 12Ψ fp32 master + Adam, and 2Ψ gradients where
    DeepSpeed accumulates them in bf16 (ZeRO-0, ZeRO-1 without offload), 4Ψ where in fp32
    (ZeRO-2 and -3; ZeRO-1 with offload, unpartitioned); ZeRO-1 splits the optimizer state
    over the slots, ZeRO-2 the gradients too, ZeRO-3 the weights too; offload moves the
    optimizer state to the host. (Ψ = 1,049,984 divides by 8 after doubling, so the shares
    are exact.)"""
    group = tiny_plan(*overrides).groups[0]
    assert (group.train_params, group.train_grads, group.optimizer, group.optimizer_host) == (
        weights,
        grads,
        optimizer,
        host,
    )


def test_the_torch_backend_and_float32_keep_adam_beside_the_weights():
    """No master copy: float32 weights 4Ψ, gradients 4Ψ, Adam's moments 8Ψ; ZeRO is
    DeepSpeed's, so the torch backend replicates whatever train.zero_stage says."""
    group = tiny_plan("models.tiny.dtype=float32", "train.backend=torch", "train.zero_stage=3").groups[0]
    assert (group.train_params, group.train_grads, group.optimizer) == (
        4 * TINY_PARAMS,
        4 * TINY_PARAMS,
        8 * TINY_PARAMS,
    )


def test_activations_with_and_without_checkpointing_and_the_logits():
    """Without checkpointing every layer keeps its share; with it, every layer keeps its
    input (b·h) and one layer is recomputed at a time. The logits, whole: the model's bf16
    logits and their gradient, four fp32 copies and the fp32 gradient flowing back."""
    group = tiny_plan("train.gradient_checkpointing=false").groups[0]
    assert group.micro_batch_tokens == TINY_TOKENS
    assert group.activations_full == TINY_TOKENS * (4 * TINY_LAYER_BYTES + TINY_FINAL_NORM)
    assert group.activations_checkpointed == TINY_TOKENS * (4 * 2 * 128 + TINY_LAYER_BYTES + TINY_FINAL_NORM)
    assert group.activations == group.activations_full
    assert tiny_plan("train.gradient_checkpointing=true").groups[0].activations == group.activations_checkpointed
    assert group.logits == TINY_TOKENS * 512 * (2 * 2 + 4 * (4 + 1))


@pytest.mark.parametrize(
    ("max_tokens", "expected"),
    [(None, 2 * 1072), (1500, 1500), (500, 1072)],  # a longer row gets a micro-batch to itself
)
def test_micro_batch_tokens_follow_the_packing(max_tokens, expected):
    overrides = [] if max_tokens is None else [f"train.max_tokens_per_micro_batch={max_tokens}"]
    assert tiny_plan(*overrides).groups[0].micro_batch_tokens == expected


def test_a_kl_reference_model_adds_its_weights_and_logits():
    plain, with_kl = tiny_plan().groups[0], tiny_plan("algorithm.kl_coef=0.01").groups[0]
    assert with_kl.reference_model == TWO_PSI
    assert with_kl.logits == plain.logits + TINY_TOKENS * 512 * 4 * 2  # the reference's two fp32 copies
    assert with_kl.update_peak == plain.update_peak + TWO_PSI + TINY_TOKENS * 512 * 4 * 2


@pytest.mark.parametrize(
    ("text", "expected"), [("80GB", 80 * GB), ("80 GiB", 80 * 2**30), ("81920MiB", 80 * 2**30), ("80", 80 * GB)]
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "80PB", "0"])
def test_a_bad_size_is_named(text):
    with pytest.raises(PlanError, match=f"device memory {text!r} is not a size"):
        parse_size(text)


# --------------------------------------------------------------------------------------
# The paper's recipes, and the refusal
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [[], ["ray.pool_size=8"]], ids=["as-configured", "8-gpus"])
@pytest.mark.parametrize("recipe", [MATH_RECIPE, SEARCH_RECIPE], ids=["math", "search"])
def test_the_papers_recipes_fit_80_gb_gpus(recipe, overrides):
    plan = plan_memory(load_config(recipe, overrides))
    assert plan.device_memory == 80 * GB
    assert plan.fits, plan.problems
    assert max(plan.rollout_peak, plan.update_peak) < 80 * GB


def test_the_math_recipe_without_its_token_cap_fits_only_with_chunked_log_probs():
    """Two rows of 8192 + 4096 tokens in one micro-batch: 89.6 GB of logits alone when the
    log-probs are computed over the whole micro-batch at once; in chunks of 1024 positions,
    three whole-size bf16 tensors (the logits, the slices' zero-filled gradients, the
    accumulated gradient: 22.4 GB) and one chunk's fp32 copies with their gradient (6.2 GB)."""
    two_rows = ["train.micro_batch_size=2", "train.max_tokens_per_micro_batch=null"]
    whole = plan_memory(load_config(MATH_RECIPE, [*two_rows, "train.logprob_chunk_positions=null"]))
    assert not whole.fits
    assert whole.groups[0].micro_batch_tokens == 2 * 12288
    assert round(whole.groups[0].logits / GB, 1) == 89.6
    chunked = plan_memory(load_config(MATH_RECIPE, two_rows))
    vocab = 151936
    assert chunked.groups[0].logits == 3 * 2 * 12288 * vocab * 2 + 2 * 1024 * vocab * 4 * 5
    assert chunked.fits


OVERSIZED = ["train.micro_batch_size=4", "train.max_tokens_per_micro_batch=null", "train.logprob_chunk_positions=null"]


def test_an_oversized_config_is_refused_with_the_numbers(capsys, tmp_path):
    """run, compile and submit stop before anything starts or is written (the refusal comes
    before Ray, the store and the Kubeflow host, which is never contacted here)."""
    output = tmp_path / "pipeline.yaml"
    commands = [
        ["run", MATH_RECIPE, *OVERSIZED],
        ["compile", MATH_RECIPE, *OVERSIZED, "-o", str(output)],
        ["submit", MATH_RECIPE, *OVERSIZED, "--host", "http://127.0.0.1:9"],
    ]
    for command in commands:
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"drmas {command[0]}: the config does not fit 80 GB per slot (ray.device_memory_gb)" in err
        assert "update solver: needs 215.5 GB per slot, more than 80.0 GB (weights 8.0 GB, gradients 4.0 GB" in err
        assert "activations 18.4 GB, logits 179.2 GB, DeepSpeed buffers 1.8 GB, CUDA contexts 4.0 GB" in err
        assert "set train.max_tokens_per_micro_batch to at most" in err
    assert not output.exists()


def test_no_device_memory_means_no_check_and_an_unknown_verdict(capsys):
    assert main(["plan", MATH_RECIPE, *OVERSIZED, "ray.device_memory_gb=null", "ray.host_memory_gb=null"]) == 0
    assert "fits: unknown" in capsys.readouterr().out


def test_the_plan_command_prints_the_table_and_exits_by_the_verdict(capsys):
    assert main(["plan", MATH_RECIPE]) == 0
    out = capsys.readouterr().out
    assert "4 slot(s) of 80.0 GB; ZeRO-2 with optimizer offload" in out
    assert "device per slot: rollout peak 42.0 GB, update peak 47.3 GB" in out
    assert "host per slot: peak 79.9 GB at rollout; between updates 79.9 GB, of which 4 processes 8.0 GB" in out
    assert "fits in 80.0 GB of device memory and 214.0 GB of host memory\n" in out
    rows = ("engine weights", "KV cache", "activations, checkpointing", "activations, none", "logits", "hand-over peak")
    for row in (*rows, "training state kept", "engine weights kept", "model load (cold update)", "host at cold update"):
        assert row in out
    assert main(["plan", MATH_RECIPE, "--device-memory", "24GB"]) == 1
    assert "does NOT fit in 24.0 GB" in capsys.readouterr().out


def test_the_plan_command_writes_json(capsys):
    assert main(["plan", SEARCH_RECIPE, "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["device_memory"] == 80 * GB and plan["slots"] == 4
    assert [group["name"] for group in plan["groups"]] == ["verifier", "search", "answer"]
    assert plan["groups"][0]["params"] == 7_615_616_512
    assert plan["update_peak"] == plan["groups"][0]["update_peak"]


def test_a_worker_pod_holds_every_slots_host_peak_and_shm_and_its_disk(capsys):
    """Issue 28 §6: the KubeRay worker pods are sized from the plan, one pod per node with
    all its GPUs. Its disk holds every group's policy cache (the version held and the next
    one) once per node and every slot's update folder (the policy in and out, and a rank's
    optimizer shard read, a neighbour's when it reshards, and written)."""
    plan = plan_memory(load_config(SEARCH_RECIPE))
    pod = plan.pod(8)
    assert (pod.memory, pod.shm) == (8 * plan.host_peak, 8 * plan.shm)
    group = plan.groups[0]
    shard = -(-group.params * 12 // 4)  # bf16: two fp32 moments and the fp32 master, over 4 ranks
    assert group.update_disk == 2 * group.engine_weights + 3 * shard
    assert group.engine_disk == 2 * group.engine_weights
    assert pod.disk == 3 * group.engine_disk + 8 * group.update_disk + RAY_LOG_BYTES
    lora = plan_memory(load_config(MATH_RECIPE, ["models.qwen3-4b.lora.rank=16"])).groups[0]
    assert lora.engine_disk == 3 * lora.engine_weights  # the base and the merged weights beside the adapter

    assert main(["plan", SEARCH_RECIPE, "--gpus-per-node", "4"]) == 0
    four = plan.pod(4)
    expected = f"memory {-(-four.memory // 2**30)}Gi, /dev/shm {-(-four.shm // 2**30)}Gi, ephemeral-storage"
    assert f"KubeRay worker pod of 4 GPU(s), one per node: {expected}" in capsys.readouterr().out
    assert main(["plan", SEARCH_RECIPE, "-o", "json", "--gpus-per-node", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["pod"] == {
        "gpus": 2,
        **{k: getattr(plan.pod(2), k) for k in ("memory", "shm", "disk")},
    }
    with pytest.raises(SystemExit) as stopped:
        main(["plan", SEARCH_RECIPE, "--gpus-per-node", "0"])
    assert stopped.value.code == 2 and "'0' is not a whole number of at least 1" in capsys.readouterr().err


def test_a_bad_device_memory_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["plan", MATH_RECIPE, "--device-memory", "80 gigs"])
    assert stopped.value.code == 2
    assert "device memory '80 gigs' is not a size" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# The host side, and its refusal
# --------------------------------------------------------------------------------------


def test_an_optimizer_save_and_restore_hold_one_piece_and_the_transfers_chunks():
    """Each rank saves its own shard one piece at a time (its range of one tensor: at most
    the largest parameter's fp32 state, Qwen3-4B's 151936 x 2560 embedding; under ZeRO-3
    its partition of it) and streams the file up in chunks; a restore reads one range at a
    time while it downloads. Never the 12 bytes a parameter of the whole state."""
    from drmas.infra.store import CHUNK_BYTES

    assert STORE_CHUNK_BYTES == CHUNK_BYTES
    embedding = 151936 * 2560 * 4
    for overrides, piece in (([], embedding), (["ray.pool_size=8", "train.zero_stage=3"], embedding // 8)):
        group = plan_memory(load_config(MATH_RECIPE, overrides)).groups[0]
        assert group.largest_param == 151936 * 2560
        assert group.save_host == piece + 3 * CHUNK_BYTES
        assert group.restore_host == embedding + 2 * CHUNK_BYTES


def test_a_cold_update_loads_the_model_on_the_host_of_every_slot():
    """ZeRO 0-2 load the whole model on every rank's host before the engine moves it; ZeRO-3
    loads it partitioned from the start, holding one tensor's rows at a time on the host,
    unless the KL term's reference model is loaded whole beside it. The cold update's host
    phase counts the load, while the update from kept state does not."""
    for stage in (2, 3):
        plan = plan_memory(load_config(MATH_RECIPE, [f"train.zero_stage={stage}", "train.offload_optimizer=false"]))
        group = plan.groups[0]
        assert group.load_host == (group.largest_param if stage == 3 else group.params) * 2
        phases = plan.host_phases()
        assert phases["cold update solver"] - phases["update solver"] == (
            group.load_host + group.restore_host - group.handover_host - group.save_host
        )
    assert group.train_params == group.params * 2 // 4  # partitioned over the 4 slots on the device
    with_reference = plan_memory(load_config(MATH_RECIPE, ["train.zero_stage=3", "algorithm.kl_coef=0.001"]))
    assert with_reference.groups[0].load_host == group.params * 2


def test_the_offloaded_optimizer_stays_on_the_host_while_its_group_trains():
    """Offload: the update brings weights and gradients to the device and leaves the fp32
    optimizer partition (and DeepSpeed's pinned buffers) on the host; without offload the
    whole state leaves the host."""
    offloaded = plan_memory(load_config(MATH_RECIPE))
    on_device = plan_memory(load_config(MATH_RECIPE, ["train.offload_optimizer=false"]))
    for plan in (offloaded, on_device):
        group = plan.groups[0]
        left = plan.host_phases()["update solver"] - (plan.host_between_phases - group.held_host)
        assert left == group.optimizer_host + group.offload_buffers_host + group.save_host
    assert offloaded.groups[0].optimizer_host == 12 * offloaded.groups[0].params // 4
    assert on_device.groups[0].optimizer_host == on_device.groups[0].offload_buffers_host == 0


def test_a_zero3_hand_over_goes_through_dev_shm():
    """ZeRO-3 hands SGLang host copies of the whole weights, which the push moves into
    /dev/shm; ZeRO-2 pushes from the device."""
    zero2 = plan_memory(load_config(MATH_RECIPE))
    zero3 = plan_memory(load_config(MATH_RECIPE, ["train.zero_stage=3"]))
    assert zero3.shm - zero2.shm == zero3.groups[0].params * 2


def test_a_config_whose_host_need_exceeds_host_memory_is_refused_naming_the_phase(capsys, tmp_path):
    """The math recipe keeps 79.9 GB per slot on the host between updates (two groups'
    offloaded training state, their engines' weight backups, four processes, /dev/shm):
    60 GB is refused before anything starts, 100 GB is not."""
    plan = plan_memory(load_config(MATH_RECIPE, ["ray.host_memory_gb=60"]))
    assert plan.fits is False
    assert plan.problems[0].startswith("host, rollout: needs 79.9 GB per slot, more than 60.0 GB (ray.host_memory_gb)")
    assert any(problem.startswith("host, cold update solver: needs 77.5 GB") for problem in plan.problems)
    assert plan_memory(load_config(MATH_RECIPE, ["ray.host_memory_gb=100"])).fits is True
    output = tmp_path / "pipeline.yaml"
    assert main(["compile", MATH_RECIPE, "ray.host_memory_gb=60", "-o", str(output)]) == 2
    assert "host, rollout: needs 79.9 GB per slot, more than 60.0 GB (ray.host_memory_gb)" in capsys.readouterr().err
    assert not output.exists()
    host_only = ["ray.device_memory_gb=null", "ray.host_memory_gb=60"]
    assert main(["compile", MATH_RECIPE, *host_only, "-o", str(output)]) == 2  # the host alone is checked too
    assert "does not fit 60 GB per slot (ray.host_memory_gb); drmas plan" in capsys.readouterr().err
    assert not output.exists()
