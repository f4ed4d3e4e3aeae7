"""Where each compiled step runs on Kubernetes (issue 29, section 3): GPU steps placed by
the ``nvidia.com/gpu`` resource and its taint, never by a label only the NVIDIA GPU
Operator writes; a node selector of the config's for GPU steps only; no GPU and the CPU
image for a warm start without steps and for the steps that are only Ray clients of the
pool; the config's image pull secrets on every step. Read from the compiled spec, as KFP's
backend reads it."""

import re
from pathlib import Path

import pytest
import yaml

from drmas.config import ConfigError, load_config
from drmas_kfp import components
from drmas_kfp.pipelines.build import build_pipeline, compile_pipeline
from drmas_kfp.pipelines.platform import GPU_TAINT, for_backend, warmstart_memory

ROOT = Path(__file__).resolve().parents[1]
GPU_RECIPE = ROOT / "configs" / "math_qwen3_4b_gpu.yaml"
SHORT = ["experiment.epochs=null", "experiment.iterations=2"]
KUBELET_LABELS = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
"""Labels every kubelet sets on its node: the only ones a step requires unless configured."""


def compiled_steps(tmp_path: Path, config, kind: str = "train") -> dict[str, tuple[str, dict, dict]]:
    """{task name: (stage, container, Kubernetes executor config)} of the compiled pipeline."""
    func, _ = build_pipeline(kind, config, "run-1")
    path = compile_pipeline(func, tmp_path / f"{kind}.yaml")
    spec, platform = yaml.safe_load_all(path.read_text())
    kubernetes = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    steps = {}
    for task in spec["root"]["dag"]["tasks"].values():
        component = task["componentRef"]["name"]
        stage = re.sub(r"-\d+$", "", component.removeprefix("comp-")).replace("-", "_")
        if stage == "importer":
            continue
        label = component.replace("comp-", "exec-")
        steps[task["taskInfo"]["name"]] = (
            stage,
            spec["deploymentSpec"]["executors"][label]["container"],
            kubernetes[label],
        )
    return steps


def gpus_of(container: dict) -> int:
    accelerator = container["resources"].get("accelerator")
    if accelerator is None:
        return 0
    assert accelerator["resourceType"] == accelerator["type"] == "nvidia.com/gpu"
    return int(accelerator["resourceCount"])


def test_gpu_steps_are_placed_by_the_gpu_resource_and_its_taint_not_by_an_operator_label(tmp_path):
    """The pool in the steps' own pods (no ray.address) and a warm start that trains: every
    step that asks for GPUs requests nvidia.com/gpu, tolerates the nvidia.com/gpu taint,
    requires only the kubelet's labels (no nvidia.com/gpu.present, which only the GPU
    Operator writes) and runs the GPU image; every other step none of that."""
    config = load_config(GPU_RECIPE, [*SHORT, "ray.address=null", "warmstart.steps=2"])
    on_gpus = set()
    for name, (stage, container, k8s) in compiled_steps(tmp_path, config).items():
        assert k8s["nodeSelector"]["labels"] == KUBELET_LABELS, name
        if gpus_of(container):
            on_gpus.add(stage)
            assert gpus_of(container) == (1 if stage == "warmstart" else config.ray.pool_size), name
            assert k8s["tolerations"] == [GPU_TAINT], name
            assert container["image"] == components.GPU_IMAGE, name
        else:
            assert "tolerations" not in k8s and container["image"] == components.CPU_IMAGE, name
    assert on_gpus == {"warmstart", "rollout", "update", "evaluate"}


def test_a_configured_gpu_node_selector_reaches_the_gpu_steps_only(tmp_path):
    """kubeflow.gpu_node_selector (a GPU model, a node pool) is added to the kubelet's labels
    on the steps that ask for GPUs; CPU steps keep the kubelet's labels alone."""
    selector = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "pool": "gpu-a"}
    override = "kubeflow.gpu_node_selector={cloud.google.com/gke-accelerator: nvidia-h100-80gb, pool: gpu-a}"
    config = load_config(GPU_RECIPE, [*SHORT, "ray.address=null", override])
    assert config.kubeflow.gpu_node_selector == selector
    placed = {
        name: (gpus_of(container), k8s["nodeSelector"]["labels"])
        for name, (_, container, k8s) in compiled_steps(tmp_path, config).items()
    }
    assert {name for name, (gpus, _) in placed.items() if gpus} == {
        "rollout 0",
        "rollout 1",
        "update solver 0",
        "update verifier 0",
        "update solver 1",
        "update verifier 1",
        "evaluate 1",
        "evaluate final 1",
        "evaluate before training",
    }
    for name, (gpus, labels) in placed.items():
        assert labels == ({**KUBELET_LABELS, **selector} if gpus else KUBELET_LABELS), name


def test_a_warm_start_without_steps_and_the_pools_ray_clients_ask_for_no_gpu_and_run_the_cpu_image(tmp_path):
    """The GPU recipe (warmstart.steps 0, a KubeRay pool): the warm start only fetches and
    re-saves the weights and the pool's drivers are Ray clients, so no step asks Kubernetes
    for a GPU, tolerates the GPU taint or pulls the GPU image. The warm start gets the
    memory to hold the largest model twice. With warm-start steps it trains in its pod: one
    GPU and the GPU image, the pool's drivers unchanged."""
    config = load_config(GPU_RECIPE, SHORT)
    assert config.warmstart.steps == 0 and config.ray.address
    steps = compiled_steps(tmp_path, config)
    for name, (_, container, k8s) in steps.items():
        assert gpus_of(container) == 0 and "tolerations" not in k8s, name
        assert container["image"] == components.CPU_IMAGE, name
    [(_, warm, _)] = [step for step in steps.values() if step[0] == "warmstart"]
    memory = warmstart_memory(config)
    assert memory["memory"] == memory["memory_limit"] == "19Gi"  # Qwen3-4B: 2 x 8.05 GB in bf16, + 4 GiB
    assert warm["resources"]["resourceMemoryLimit"] == warm["resources"]["resourceMemoryRequest"] == "19Gi"

    training = load_config(GPU_RECIPE, [*SHORT, "warmstart.steps=3"])
    for name, (stage, container, _) in compiled_steps(tmp_path, training).items():
        on_gpu = stage == "warmstart"
        assert gpus_of(container) == int(on_gpu), name
        assert container["image"] == (components.GPU_IMAGE if on_gpu else components.CPU_IMAGE), name


def test_every_step_pulls_with_the_configured_image_pull_secrets(tmp_path):
    """kubeflow.image_pull_secrets reach every step's pod (a private registry); none are set
    without them. A spec for KFP < 2.5 names them by secretName only, as its secrets."""
    plain = compiled_steps(tmp_path, load_config(GPU_RECIPE, SHORT))
    assert not any("imagePullSecret" in k8s for _, _, k8s in plain.values())
    config = load_config(GPU_RECIPE, [*SHORT, "kubeflow.image_pull_secrets=[regcred, mirror.pull]"])
    for name, (_, _, k8s) in compiled_steps(tmp_path, config).items():
        assert [secret["secretName"] for secret in k8s["imagePullSecret"]] == ["regcred", "mirror.pull"], name
    func, _ = build_pipeline("evaluate", config, "run-1")
    path = compile_pipeline(func, tmp_path / "old.yaml")
    for_backend(path, "2.3")
    _, platform = yaml.safe_load_all(path.read_text())
    for executor in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        assert executor["imagePullSecret"] == [{"secretName": "regcred"}, {"secretName": "mirror.pull"}]


@pytest.mark.parametrize(
    "override,field,message",
    [
        ("kubeflow.gpu_node_selector={Not A Key: x}", "kubeflow.gpu_node_selector", "is not a label key"),
        ("kubeflow.gpu_node_selector={pool: -gpu}", "kubeflow.gpu_node_selector", "is not a label value"),
        ("kubeflow.image_pull_secrets=[Reg_Cred]", "kubeflow.image_pull_secrets", "not a Secret name"),
        ("kubeflow.gpu_nodes={pool: gpu}", "kubeflow.gpu_nodes", ""),
    ],
)
def test_bad_kubeflow_settings_are_refused_naming_the_field(override, field, message):
    """Kubernetes would refuse such a pod only when the run reaches the step, hours in."""
    with pytest.raises(ConfigError) as refused:
        load_config(GPU_RECIPE, [*SHORT, override])
    assert field in str(refused.value) and message in str(refused.value)


def test_the_pools_steps_are_retried_with_a_back_off_and_no_other_step_is(tmp_path):
    """Patience for GPUs (issue 29 §2): a rollout, update or evaluation that failed (the
    pool's slots not granted within ray.placement_timeout_s, a node lost) runs again after
    90 s, 3 and 6 minutes, in the compiled spec KFP's backend reads; the other steps fail
    at once (their failures are bad input or a store fault, which a retry would not fix)."""
    config = load_config(GPU_RECIPE, SHORT)
    func, _ = build_pipeline("train", config, "run-1")
    spec, _ = yaml.safe_load_all(compile_pipeline(func, tmp_path / "train.yaml").read_text())
    retried = {}
    for task in spec["root"]["dag"]["tasks"].values():
        stage = re.sub(r"-\d+$", "", task["componentRef"]["name"].removeprefix("comp-")).replace("-", "_")
        retried.setdefault(stage, set()).add(yaml.safe_dump(task.get("retryPolicy"), sort_keys=True))
    policy = {"maxRetryCount": 3, "backoffDuration": "90s", "backoffFactor": 2.0, "backoffMaxDuration": "3600s"}
    for stage, policies in retried.items():
        expected = policy if stage in ("rollout", "update", "evaluate") else None
        assert policies == {yaml.safe_dump(expected, sort_keys=True)}, stage
