"""The Kubeflow pipelines: compiled from configs, placed on Kubernetes, run with kfp.local
(every stage, then a rerun that recomputes one forced stage and nothing else; a run
tracked in MLflow like the same run embedded), and submitted through kfp.Client to a
stand-in of the KFP API server."""

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from helpers import LOG_MARK, TINY_OVERRIDES, via_kfp_local
from kfp import dsl
from localmlflow import MlflowServer

import drmas
from drmas.cli import main
from drmas.config import CheckpointConfig, load_config
from drmas_kfp import components
from drmas_kfp.pipelines.build import build_pipeline, compile_pipeline, parse_force
from drmas_kfp.pipelines.platform import S3_SECRET, for_backend, update_scratch_size

ROOT = Path(__file__).resolve().parents[1]
TRACKING = ("track_start", "track", "track_end")
TRACKED = ("track-start", "track", "track-end")
"""The tracking steps' component names, and their kfp.local task names in a one-iteration run."""
# (config, overrides): CPU tiny configs, a single shared worker group, and the GPU recipe
# whose rollout joins a KubeRay cluster (ray.address).
CONFIGS = {
    "math_tiny": ("math_tiny.yaml", ["experiment.iterations=3", "eval.every=2"]),
    "search_tiny": ("search_tiny.yaml", ["experiment.iterations=3", "eval.every=0"]),
    "math_gpu": ("math_qwen3_4b_gpu.yaml", ["experiment.epochs=null", "experiment.iterations=3"]),
}


def config_of(name: str, *extra: str):
    file, overrides = CONFIGS[name]
    return load_config(ROOT / "configs" / file, [*overrides, *extra])


def compiled(tmp_path: Path, kind: str, config, start: int = 0, force=(), iterations=None) -> tuple[dict, dict]:
    func, _ = build_pipeline(kind, config, "run-1", start, force=force, iterations=iterations)
    path = compile_pipeline(func, tmp_path / f"{kind}-{start}.yaml")
    spec, platform = yaml.safe_load_all(path.read_text())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def stage_of(task: dict) -> str:
    """comp-update-3 -> update, comp-load-checkpoint -> load_checkpoint."""
    return re.sub(r"-\d+$", "", task["componentRef"]["name"].removeprefix("comp-")).replace("-", "_")


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(
    "kind,start", [("train", 0), ("train", 2), ("rl_iteration", 0), ("rl_iteration", 1), ("evaluate", 0)]
)
def test_every_pipeline_compiles_loads_back_and_pins_the_images(tmp_path, name, kind, start):
    from kfp.components import load_component_from_file

    config = config_of(name)
    func, arguments = build_pipeline(kind, config, "run-1", start)
    path = compile_pipeline(func, tmp_path / "pipeline.yaml")
    loaded = load_component_from_file(str(path))
    assert loaded.name == f"drmas-{kind.replace('_', '-')}-{config.experiment.name}"
    assert set(loaded.component_spec.inputs) == set(arguments)
    assert json.loads(loaded.component_spec.inputs["config_json"].default) == json.loads(config.to_json())
    spec, platform = yaml.safe_load_all(path.read_text())
    images = {
        executor["container"]["image"]
        for executor in spec["deploymentSpec"]["executors"].values()
        if "container" in executor
    }
    assert images <= {components.CPU_IMAGE, components.GPU_IMAGE} and components.CPU_IMAGE in images
    assert all(image.endswith(f":{drmas.__version__}") for image in images)
    tasks = spec["root"]["dag"]["tasks"]
    groups = len(config.worker_groups())
    if kind == "evaluate":
        assert {stage_of(t) for t in tasks.values()} == {"importer", "load_checkpoint", "evaluate"}
        return
    first, last = start, (config.experiment.iterations if kind == "train" else start + 1)
    counted = {
        stage: sum(stage_of(t) == stage for t in tasks.values())
        for stage in ("rollout", "advantage", "update", "checkpoint", "evaluate")
    }
    due = sum(
        bool(config.eval.every) and ((i + 1) % config.eval.every == 0 or i == config.experiment.iterations - 1)
        for i in range(first, last)
    )
    before = int(kind == "train" and start == 0 and bool(config.eval.every))
    final = int(config.eval.final is not None and last == config.total_iterations)  # the last checkpoint's
    assert counted == {
        "rollout": last - first,
        "advantage": last - first,
        "update": groups * (last - first),
        "checkpoint": last - first,
        "evaluate": due + before + final,
    }
    assert {stage: sum(stage_of(t) == stage for t in tasks.values()) for stage in TRACKING} == {
        "track_start": 1,
        "track": last - first + before,
        "track_end": 1,
    }
    assert sum(stage_of(t) == "importer" for t in tasks.values()) == int(start > 0)
    assert sum(stage_of(t) == "warmstart" for t in tasks.values()) == int(start == 0)
    # The iterations are chained: each rollout reads the previous iteration's checkpoint.
    for task in tasks.values():
        if (
            stage_of(task) == "rollout"
            and task["inputs"]["parameters"]["iteration"]["runtimeValue"]["constant"] > start
        ):
            assert task["inputs"]["artifacts"]["policies"]["taskOutputArtifact"]["outputArtifactKey"] == "checkpoint"


def test_each_stage_is_placed_and_gets_the_s3_secret(tmp_path):
    """Every task's executor names its image, resources, node selector, tolerations and the
    S3 credentials from the drmas-s3 secret; GPU stages ask for a GPU on GPU nodes unless
    they only drive the pool on a KubeRay cluster (rollout, update and evaluate with ray.address)."""
    for name in ("math_tiny", "math_gpu"):
        config = config_of(name)
        spec, executors = compiled(tmp_path, "train", config)
        for task_name, task in spec["root"]["dag"]["tasks"].items():
            stage = stage_of(task)
            label = task["componentRef"]["name"].replace("comp-", "exec-")
            container = spec["deploymentSpec"]["executors"][label]["container"]
            k8s = executors[label]
            trains_in_pod = stage == "warmstart" and config.warmstart.steps > 0
            on_gpu = trains_in_pod or (stage in {"rollout", "update", "evaluate"} and not config.ray.address)
            assert container["image"] == (components.GPU_IMAGE if on_gpu else components.CPU_IMAGE), task_name
            secret_keys = {
                (s["secretName"], e["secretKey"], e["envVar"], s["optional"])
                for s in k8s["secretAsEnv"]
                for e in s["keyToEnv"]
            }
            assert {
                (S3_SECRET, key, key, False) for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
            } <= secret_keys
            assert (S3_SECRET, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL", True) in secret_keys
            assert "resourceCpuRequest" in container["resources"] and "resourceMemoryLimit" in container["resources"]
            assert k8s["nodeSelector"]["labels"]["kubernetes.io/arch"] == "amd64"
            accelerator = container["resources"].get("accelerator")
            if on_gpu:
                count = config.ray.pool_size if stage in {"rollout", "evaluate"} else 1
                assert accelerator == {
                    "resourceType": "nvidia.com/gpu",
                    "resourceCount": str(count),
                    "type": "nvidia.com/gpu",
                    "count": str(count),
                }, task_name
                assert k8s["nodeSelector"]["labels"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
                assert k8s["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            else:
                assert accelerator is None and "tolerations" not in k8s, task_name
                assert "nvidia.com/gpu.present" not in k8s["nodeSelector"]["labels"]
    # No credentials anywhere in the compiled pipeline's parameters.
    assert "AWS_SECRET_ACCESS_KEY" not in json.dumps(spec["root"]["inputDefinitions"])


def test_force_turns_off_caching_for_the_named_tasks_only(tmp_path):
    config = config_of("math_tiny")
    spec, _ = compiled(tmp_path, "train", config, force=["advantage@1", "update/verifier", "evaluate@-1"])
    forced = set()
    for task in spec["root"]["dag"]["tasks"].values():
        force = task["inputs"]["parameters"].get("force", {}).get("runtimeValue", {}).get("constant", False)
        cached = not force and task["taskInfo"]["name"] != "mlflow: start"  # it tags each KFP run's id
        assert task.get("cachingOptions", {}).get("enableCache", False) is cached
        if force:
            forced.add(task["taskInfo"]["name"])
    assert forced == {
        "advantage 1",
        "update verifier 0",
        "update verifier 1",
        "update verifier 2",
        "evaluate before training",
    }


def test_the_train_pipeline_logs_each_iteration_to_mlflow_after_it_is_stored(tmp_path):
    """The tracking steps run on the CPU image. The start step gets the KFP run id (KFP's
    placeholder). Each iteration's step waits for that iteration's checkpoint and, when
    due, its evaluation, and for the step before it: MLflow gets the steps in order. The
    end step follows the last."""
    config = config_of("math_tiny")
    spec, _ = compiled(tmp_path, "train", config)
    tasks = {task["taskInfo"]["name"]: (key, task) for key, task in spec["root"]["dag"]["tasks"].items()}
    tracked = [name for name in tasks if name.startswith("mlflow: ")]
    assert sorted(tracked) == sorted(
        ["mlflow: start", "mlflow: before training", *(f"mlflow: iteration {i}" for i in range(3)), "mlflow: end"]
    )
    for name in tracked:
        label = tasks[name][1]["componentRef"]["name"].replace("comp-", "exec-")
        assert spec["deploymentSpec"]["executors"][label]["container"]["image"] == components.CPU_IMAGE
    start = tasks["mlflow: start"][1]["inputs"]["parameters"]
    assert start["kfp_run_id"]["runtimeValue"]["constant"] == dsl.PIPELINE_JOB_ID_PLACEHOLDER
    assert start["first_iteration"]["runtimeValue"]["constant"] == 0
    assert not tasks["mlflow: start"][1].get("cachingOptions", {}).get("enableCache", False)
    assert tasks["mlflow: iteration 0"][1]["cachingOptions"]["enableCache"]

    def after(name: str) -> set[str]:
        keys = {key: task_name for task_name, (key, _) in tasks.items()}
        return {keys[key] for key in tasks[name][1].get("dependentTasks", [])}

    assert after("mlflow: before training") == {"mlflow: start", "evaluate before training"}
    assert after("mlflow: iteration 0") == {"mlflow: before training", "checkpoint 0"}
    assert after("mlflow: iteration 1") == {"mlflow: iteration 0", "checkpoint 1", "evaluate 1"}
    assert after("mlflow: iteration 2") == {"mlflow: iteration 1", "checkpoint 2", "evaluate 2"}
    assert after("mlflow: end") == {"mlflow: iteration 2", "checkpoint 2"}


def test_updates_whose_optimizer_state_the_pool_holds_are_never_skipped_by_kfp(tmp_path):
    """checkpoint.every > 1: KFP's cache is off for every update task (a skipped update
    would leave the pool no optimizer state for the next); the other tasks keep it."""
    config = config_of("math_tiny").model_copy(update={"checkpoint": CheckpointConfig(every=2)})
    spec, _ = compiled(tmp_path, "train", config)
    caching = {
        task["taskInfo"]["name"]: task.get("cachingOptions", {}).get("enableCache", False)
        for task in spec["root"]["dag"]["tasks"].values()
    }
    updates = {name for name in caching if name.startswith("update ")}
    assert len(updates) == 2 * config.experiment.iterations
    assert not any(caching[name] for name in updates)
    assert all(caching[name] for name in caching if name not in updates | {"mlflow: start"})


def test_force_names_are_checked():
    config = config_of("math_tiny")
    assert parse_force(["policy/solver@2"], config)("update", 2, "solver")
    assert not parse_force(["policy/solver@2"], config)("update", 2, "verifier")
    for bad, message in [
        ("advantag", "unknown stage"),
        ("update/critic", "no worker group 'critic'"),
        ("rollout/solver", "only update takes"),
        ("rollout@x", "not an iteration"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_force([bad], config)


def test_a_long_run_compiles_in_parts(tmp_path):
    """--iterations splits a long run: a part starts from the checkpoint before it."""
    config = config_of("math_gpu", "experiment.iterations=200")
    func, arguments = build_pipeline("train", config, "run-1", 40, iterations=10)
    assert arguments["start_checkpoint"] == "s3://drmas/runs/math-qwen3-4b/run-1/iter-000039/checkpoint"
    spec, _ = compiled(tmp_path, "train", config, start=40, iterations=10)
    iterations = sorted(
        t["inputs"]["parameters"]["iteration"]["runtimeValue"]["constant"]
        for t in spec["root"]["dag"]["tasks"].values()
        if stage_of(t) == "rollout"
    )
    assert iterations == list(range(40, 50))


def test_cli_compile_writes_the_pipeline_and_refuses_pipeline_options_without_kfp_local(tmp_path, capsys):
    out = tmp_path / "pipeline.yaml"
    code = main(
        [
            "compile",
            str(ROOT / "configs" / "math_tiny.yaml"),
            "experiment.iterations=2",
            "-o",
            str(out),
            "--pipeline",
            "rl_iteration",
            "--start-iteration",
            "1",
            "--run-id",
            "r7",
            "--force",
            "update",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert f"to {out}" in capsys.readouterr().out
    spec = next(yaml.safe_load_all(out.read_text()))
    assert spec["pipelineInfo"]["name"] == "drmas-rl-iteration-math-tiny"
    assert spec["root"]["inputDefinitions"]["parameters"]["run_id"]["defaultValue"] == "r7"
    assert spec["root"]["inputDefinitions"]["parameters"]["start_checkpoint"]["defaultValue"].endswith(
        "math-tiny/r7/iter-000000/checkpoint"
    )
    assert main(["compile", str(ROOT / "configs" / "math_tiny.yaml"), "-o", str(out), "--force", "nonsense"]) == 2
    assert "unknown stage 'nonsense'" in capsys.readouterr().err
    assert main(["run", str(ROOT / "configs" / "math_tiny.yaml"), "--force", "advantage"]) == 2
    assert "need --via kfp-local" in capsys.readouterr().err


def executors_by_task(spec: dict, platform: dict) -> dict[str, tuple[str, dict, dict]]:
    """{task name: (stage, container, Kubernetes executor config)}."""
    result = {}
    for task in spec["root"]["dag"]["tasks"].values():
        if stage_of(task) == "importer":
            continue
        label = task["componentRef"]["name"].replace("comp-", "exec-")
        container = spec["deploymentSpec"]["executors"][label]["container"]
        result[task["taskInfo"]["name"]] = (stage_of(task), container, platform.get(label, {}))
    return result


def test_compile_names_the_images_given_or_last_built_on_every_executor(tmp_path, capsys, monkeypatch):
    """--image-registry/--image-tag set every task's image (GPU image for the stages that
    hold a model, CPU image for the others, the image the MLflow run is tagged with too);
    without them the images come from the record images/build.sh writes; without a
    record the defaults, with a warning that nothing pushed them."""
    config = str(ROOT / "configs" / "math_qwen3_4b_gpu.yaml")
    out = tmp_path / "pipeline.yaml"

    def images_of(*options: str) -> tuple[dict[str, set[str]], str, str]:
        code = main(
            [
                "compile",
                config,
                "experiment.epochs=null",
                "experiment.iterations=2",
                "warmstart.steps=1",  # a warm start that trains: the one step on the GPU image
                "-o",
                str(out),
                "--run-id",
                "r1",
                *options,
            ]
        )
        captured = capsys.readouterr()
        assert code == 0, captured.err
        spec, platform = yaml.safe_load_all(out.read_text())
        tasks = executors_by_task(spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"])
        flavors: dict[str, set[str]] = {"cpu": set(), "gpu": set()}
        for _, container, _ in tasks.values():
            flavors["gpu" if container["resources"].get("accelerator") else "cpu"].add(container["image"])
        start = next(t for t in spec["root"]["dag"]["tasks"].values() if stage_of(t) == "track_start")
        return flavors, start["inputs"]["parameters"]["image"]["runtimeValue"]["constant"], captured.err

    monkeypatch.setenv("DRMAS_LAST_BUILD", str(tmp_path / "last-build"))
    flavors, tagged, err = images_of("--image-registry", "registry.example.com/ml/", "--image-tag", "0.1.0-1a2b")
    assert flavors == {
        "cpu": {"registry.example.com/ml/drmas-cpu:0.1.0-1a2b"},
        "gpu": {"registry.example.com/ml/drmas-gpu:0.1.0-1a2b"},
    }
    assert tagged == "registry.example.com/ml/drmas-gpu:0.1.0-1a2b" and "warning" not in err
    flavors, _, err = images_of()
    assert flavors == {"cpu": {components.CPU_IMAGE}, "gpu": {components.GPU_IMAGE}}
    assert "no image build recorded" in err and "nothing pushed" in err
    (tmp_path / "last-build").write_text(
        "gpu registry.example.com/ml/drmas-gpu:0.1.0-9f8e pushed\n"
        "cpu registry.example.com/ml/drmas-cpu:0.1.0-9f8e pushed\n"
    )
    flavors, tagged, err = images_of()
    assert flavors == {
        "cpu": {"registry.example.com/ml/drmas-cpu:0.1.0-9f8e"},
        "gpu": {"registry.example.com/ml/drmas-gpu:0.1.0-9f8e"},
    }
    assert tagged == "registry.example.com/ml/drmas-gpu:0.1.0-9f8e" and "warning" not in err
    flavors, _, _ = images_of("--image-tag", "0.2.0")  # the registry of the record, the tag given
    assert flavors["cpu"] == {"registry.example.com/ml/drmas-cpu:0.2.0"}


def test_the_steps_that_join_the_ray_cluster_get_its_token(tmp_path):
    """With ray.address, rollout, update and evaluate (the pool's drivers) get
    RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from drmas-ray-token/auth_token; no other step
    does (the warm start trains in its own pod), and without ray.address none does."""
    for name, overrides in (("math_gpu", ()), ("math_gpu", ("ray.address=null",)), ("math_tiny", ())):
        config = config_of(name, *overrides)
        spec, platform = compiled(tmp_path, "train", config)
        joined = set()
        for task_name, (stage, container, k8s) in executors_by_task(spec, platform).items():
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            tokens = [
                (s["secretName"], e["secretKey"], e["envVar"])
                for s in k8s.get("secretAsEnv", [])
                for e in s["keyToEnv"]
                if s["secretName"] == "drmas-ray-token"
            ]
            if env.get("RAY_AUTH_MODE") == "token":
                assert tokens == [("drmas-ray-token", "auth_token", "RAY_AUTH_TOKEN")], task_name
                joined.add(stage)
            else:
                assert "RAY_AUTH_MODE" not in env and tokens == [], task_name
        assert joined == ({"rollout", "update", "evaluate"} if config.ray.address else set()), (name, overrides)


def test_update_pods_get_a_scratch_volume_sized_for_what_they_write(tmp_path):
    """Every update task mounts an emptyDir at /tmp (Python's and Ray's temporary folder)
    with a size limit, and sets no environment variable for it (kfp.local would apply it to
    the local process); no other task has one. A pod that only drives the pool on
    a Ray cluster writes little (2Gi); one that trains a 4B model in bf16 in the pod holds
    two copies of the policy and the optimizer state (12 bytes a parameter) and more."""
    from drmas.planning import architecture_of

    for overrides, expected in ((), "2Gi"), (("ray.address=null",), None):
        config = config_of("math_gpu", *overrides)
        spec, platform = compiled(tmp_path, "train", config)
        sizes = set()
        for task_name, (stage, container, k8s) in executors_by_task(spec, platform).items():
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            assert not {"TMPDIR", "RAY_TMPDIR"} & set(env), task_name
            if stage != "update":
                assert "emptyDirMounts" not in k8s, task_name
                continue
            [mount] = k8s["emptyDirMounts"]
            assert mount["volumeName"] == "scratch" and mount["mountPath"] == "/tmp"
            sizes.add(mount["sizeLimit"])
        assert sizes == {update_scratch_size(config)}
        if expected:
            assert sizes == {expected}
        else:
            group = config.worker_groups()[0]
            params = architecture_of(group.model, group.spec)[0].params
            assert group.spec.dtype == "bfloat16" and config.train.backend == "deepspeed"
            gib = int(sizes.pop().removesuffix("Gi"))
            assert params * (2 * 2 + 12) < gib << 30 < params * (2 * 2 + 12) * 1.25 + (3 << 30)
    tiny = config_of("math_tiny")  # scratch models: a few MB each, 2 GiB of headroom
    assert update_scratch_size(tiny) == "3Gi"


def test_a_spec_for_an_older_kfp_backend_drops_what_it_does_not_know(tmp_path, capsys):
    """KFP < 2.15 has no optional secret keys, < 2.5 no secret names as parameters, < 2.4
    no resource* fields (read in KFP's source, see pipelines.platform): --kfp-backend
    writes a spec without them, the endpoint key then required; 2.15 is left as compiled;
    older than 2.3 is refused."""
    config = config_of("math_gpu")

    def rewritten(backend: str) -> tuple[str, dict, dict, list[str]]:
        _, _ = compiled(tmp_path, "train", config)
        path = tmp_path / "train-0.yaml"
        before = path.read_text()
        changes = for_backend(path, backend)
        spec, platform = yaml.safe_load_all(path.read_text())
        return before, spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"], changes

    before, _, _, changes = rewritten("2.15")
    assert changes == [] and (tmp_path / "train-0.yaml").read_text() == before
    _, spec, executors, changes = rewritten("2.5")
    secrets = [s for e in executors.values() for s in e["secretAsEnv"]]
    assert not any("optional" in s for s in secrets) and all("secretNameParameter" in s for s in secrets)
    assert any("AWS_ENDPOINT_URL" in change for change in changes)
    assert "resourceCpuRequest" in json.dumps(spec)
    _, spec, executors, changes = rewritten("2.3")
    text = json.dumps(executors)
    assert '"optional"' not in text and "secretNameParameter" not in text
    assert {
        (s["secretName"], k["secretKey"]) for e in executors.values() for s in e["secretAsEnv"] for k in s["keyToEnv"]
    } >= {(S3_SECRET, "AWS_ENDPOINT_URL"), ("drmas-ray-token", "auth_token")}
    assert all("emptyDirMounts" in e for label, e in executors.items() if label.startswith("exec-update"))
    resources = [e["container"]["resources"] for e in spec["deploymentSpec"]["executors"].values()]
    assert not any(key.startswith("resource") for r in resources for key in [*r, *r.get("accelerator", {})])
    assert all("cpuRequest" in r and "memoryLimit" in r for r in resources)
    with pytest.raises(ValueError, match="KFP 2.3 or later"):
        for_backend(tmp_path / "train-0.yaml", "2.2")
    out = tmp_path / "cli.yaml"
    file = str(ROOT / "configs" / "math_qwen3_4b_gpu.yaml")
    assert (
        main(
            [
                "compile",
                file,
                "experiment.epochs=null",
                "experiment.iterations=1",
                "-o",
                str(out),
                "--kfp-backend",
                "2.3",
            ]
        )
        == 0
    )
    assert "for KFP 2.3: secret keys required" in capsys.readouterr().err and "optional" not in out.read_text()
    assert main(["compile", file, "-o", str(out), "--kfp-backend", "2.0"]) == 1
    assert "KFP 2.0 is not supported" in capsys.readouterr().err


def test_compile_counts_a_run_given_in_epochs_and_names_a_disagreeing_iteration_count(tmp_path, capsys):
    """The compiled pipeline holds the epochs' iterations (48 questions // 16 = 3 an epoch)."""
    file = str(ROOT / "configs" / "math_tiny.yaml")
    out = tmp_path / "pipeline.yaml"
    epochs = ["experiment.epochs=1", "data.generated_train_size=48", "rollout.prompts_per_iteration=16", "eval.every=0"]
    assert main(["compile", file, "experiment.iterations=null", *epochs, "-o", str(out)]) == 0
    spec = next(yaml.safe_load_all(out.read_text()))
    rollouts = [t for t in spec["root"]["dag"]["tasks"].values() if stage_of(t) == "rollout"]
    assert len(rollouts) == 3
    capsys.readouterr()
    assert main(["compile", file, "experiment.iterations=5", *epochs, "-o", str(out)]) == 2
    assert "experiment.iterations: is 5, but experiment.epochs 1 is 3 iterations" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# kfp.local: the whole iteration, then a rerun of one stage
# --------------------------------------------------------------------------------------

SMALL = ["experiment.iterations=1", *TINY_OVERRIDES, "eval.every=1", "eval.max_questions=2", "eval.k=2"]


def kfp_local(tmp_path: Path, *args: str) -> tuple[str, dict[str, str]]:
    """The rl_iteration pipeline of run 'k' via kfp-local; its console output followed by
    kfp.local's log and, per KFP task, 'executed' or 'cache hit' (as the console says)."""
    output = via_kfp_local(tmp_path, SMALL, "--pipeline", "rl_iteration", "--run-id", "k", *args)
    return output, dict(re.findall(r"^task ([\w.-]+): (executed|cache hit)", output, re.M))


def stage_lines(output: str) -> dict[str, str]:
    """What each component said it did with its stage output: 'computed' or 'reused'."""
    return dict(re.findall(r"drmas: (\S+(?: iter -?\d+)?) (computed|reused) ", output))


def manifests(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("_MANIFEST.json")}


@pytest.mark.slow
@pytest.mark.e2e
def test_kfp_local_runs_every_stage_then_recomputes_only_the_forced_one(tmp_path):
    """One RL iteration with kfp.local executes every stage and leaves every stage's
    artifact in the store. A rerun with --force advantage executes the advantage again;
    the tasks before it are kfp.local cache hits. The tasks after it are re-executed by KFP
    (their input is a new artifact: KFP's cache keys on artifact identity, kfp.local on its
    URI) but find their outputs in the store with the same drmas cache key (the recomputed
    batch is byte-identical), so they reuse them: no store artifact but the advantage's
    changes. A third, plain run is all cache hits."""
    started = time.monotonic()
    output, tasks = kfp_local(tmp_path)
    first_run = time.monotonic() - started
    assert set(tasks.values()) == {"executed"}
    assert set(tasks) == {"warmstart", "rollout", "advantage", "update", "update-2", "checkpoint", "evaluate", *TRACKED}
    assert set(stage_lines(output).values()) == {"computed"}
    # The run's pool outlives its tasks: the rollout starts it, the updates and the
    # evaluation (thin Ray drivers) find its workers warm.
    assert re.findall(r"drmas: pool (started|found warm)", output) == ["started", *["found warm"] * 3]
    run = tmp_path / "runs" / "math-tiny" / "k"
    for stage in (
        "run",
        "init/policy/solver",
        "warmstart/policy/verifier",
        "iter-000000/rollout",
        "iter-000000/advantage",
        "iter-000000/policy/solver",
        "iter-000000/policy/verifier",
        "iter-000000/optim/solver",
        "iter-000000/optim/verifier",
        "iter-000000/checkpoint",
        "iter-000000/evaluate",
    ):
        assert (run / stage / "_MANIFEST.json").is_file(), stage
    assert (run / "iter-000000" / "rollout" / "trajectories.parquet").is_file()
    assert (run / "iter-000000" / "evaluate" / "eval.parquet").is_file()
    assert f"checkpoint: {run / 'iter-000000' / 'checkpoint'}" in output
    # The KFP artifacts are pointers to the store; their metrics files exist (cacheable).
    [pointer] = (tmp_path / ".cache" / "kfp-local").glob("drmas-rl-iteration-math-tiny-*/advantage/batch")
    assert json.loads(pointer.read_text())["store_uri"] == str(run / "iter-000000" / "advantage")
    assert (
        json.loads(next((tmp_path / ".cache" / "kfp-local").glob("*/advantage/metrics")).read_text())["batch/rows"] > 0
    )

    before = manifests(run)
    batch = (run / "iter-000000" / "advantage" / "batch.parquet").read_bytes()
    started = time.monotonic()
    output, tasks = kfp_local(tmp_path, "--force", "advantage")
    forced_run = time.monotonic() - started
    assert tasks == {
        "warmstart": "cache hit",
        "rollout": "cache hit",
        "advantage": "executed",
        "update": "executed",
        "update-2": "executed",
        "checkpoint": "executed",
        "evaluate": "executed",
        **dict.fromkeys(TRACKED, "executed"),  # the start always (a new KFP run id), the others: a new checkpoint
    }
    assert stage_lines(output) == {
        "advantage iter 0": "computed",
        "policy/solver iter 0": "reused",
        "policy/verifier iter 0": "reused",
        "checkpoint iter 0": "reused",
        "evaluate iter 0": "reused",
    }
    after = manifests(run)
    assert after.keys() == before.keys()
    # and the report, which the end of the run writes again from the iteration's new artifacts
    assert [name for name in after if after[name] != before[name]] == [
        "iter-000000/advantage/_MANIFEST.json",
        "report/_MANIFEST.json",
    ]
    assert (run / "iter-000000" / "advantage" / "batch.parquet").read_bytes() == batch

    output, tasks = kfp_local(tmp_path)
    assert tasks.pop("track-start") == "executed"  # it tags the MLflow run with each KFP run's id
    assert set(tasks.values()) == {"cache hit"} and len(tasks) == 9
    assert manifests(run) == after
    print(f"kfp.local: first run {first_run:.0f} s, forced rerun {forced_run:.0f} s")


@dataclass
class TrackedRuns:
    """The same 2-iteration config run with kfp.local and embedded, tracked by one server."""

    folder: Path
    output: str
    """kfp-local's console output, then kfp.local's log."""
    server: MlflowServer


@pytest.fixture(scope="module")
def tracked_runs(tmp_path_factory: pytest.TempPathFactory, mlflow_service: MlflowServer) -> TrackedRuns:
    server = mlflow_service if mlflow_service.process is not None else mlflow_service.start()
    folder = tmp_path_factory.mktemp("tracked")
    settings = [
        *TINY_OVERRIDES,
        "experiment.iterations=2",
        "eval.every=1",
        "eval.max_questions=2",
        "eval.k=2",
        "warmstart.steps=0",
        f"tracking.uri={server.uri}",
        f"tracking.experiment={TRACKED_EXPERIMENT}",
    ]
    (folder / "kfp").mkdir()
    output = via_kfp_local(folder / "kfp", settings, "--run-id", "kfp")
    (folder / "embedded").mkdir()
    command = [str(Path(sys.executable).parent / "drmas"), "run", str(ROOT / "configs" / "math_tiny.yaml"), *settings]
    command += [f"store.root={folder / 'embedded' / 'runs'}", "--run-id", "embedded"]
    done = subprocess.run(command, cwd=folder / "embedded", capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return TrackedRuns(folder, output, server)


TRACKED_EXPERIMENT = "kfp-and-embedded"


@pytest.mark.slow
@pytest.mark.e2e
def test_a_kfp_local_train_run_starts_its_pool_once(tracked_runs: TrackedRuns):
    """`drmas run --via kfp-local` of the train pipeline over 2 iterations: the first task
    that needs the pool starts its workers (one per worker group and slot), and every later
    one (the rollouts, the updates and the evaluations of every iteration, each a process
    of its own) finds them warm; none starts another."""
    pools = re.findall(
        r"drmas: pool (started|found warm): (\d+) worker\(s\) on 1 slot\(s\), (\d+) started", tracked_runs.output
    )
    # 2 rollouts, 4 updates, 3 evaluations (before training, after iterations 0 and 1)
    assert [found for found, _, _ in pools] == ["started", *["found warm"] * (2 + 4 + 3 - 1)]
    assert {int(workers) for _, workers, _ in pools} == {2}
    assert sum(int(started) for _, _, started in pools) == 2
    assert (tracked_runs.folder / "kfp" / "runs" / "math-tiny" / "kfp" / "iter-000001" / "checkpoint").is_dir()


@pytest.mark.slow
@pytest.mark.e2e
def test_a_kfp_local_run_is_one_mlflow_run_like_an_embedded_one(tracked_runs: TrackedRuns):
    """The same config run embedded and via kfp-local against one MLflow server: two MLflow
    runs with the same params (where the runs are stored aside), the same metric keys with
    the same steps, the same lineage, episodes tables, datasets and report figures, and a
    registered model version per worker group each; the Kubeflow one is tagged with its KFP
    run id and image, and its first and last steps link to it. The console shows a line per
    task and the embedded runner's summary; kfp.local's own output is in its log file."""
    from mlflow import MlflowClient

    client = MlflowClient(tracked_runs.server.uri)
    experiment = client.get_experiment_by_name(TRACKED_EXPERIMENT)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = {run.data.tags["drmas.run_id"]: run for run in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"kfp", "embedded"}
    kfp, embedded = runs["kfp"], runs["embedded"]
    assert kfp.info.status == embedded.info.status == "FINISHED"
    assert kfp.data.tags["kfp.run_id"] and kfp.data.tags["drmas.image"] == components.GPU_IMAGE
    assert {k: v for k, v in kfp.data.params.items() if k != "store.root"} == {
        k: v for k, v in embedded.data.params.items() if k != "store.root"
    }

    def steps(run) -> dict[str, list[int]]:
        return {
            key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) for key in run.data.metrics
        }

    kfp_steps, embedded_steps = steps(kfp), steps(embedded)
    assert kfp_steps == embedded_steps
    assert kfp_steps["reward/mean"] == [1, 2] and kfp_steps["eval/avg_at_2"] == [0, 1, 2]
    assert len(kfp_steps) > 30  # rewards, advantages, worker-group statistics, times, evaluation

    def tags(run, prefix: str) -> set[str]:
        return {key for key in run.data.tags if key.startswith(prefix)}

    assert tags(kfp, "lineage.") == tags(embedded, "lineage.") and "lineage.checkpoint" in tags(kfp, "lineage.")

    def artifacts(run, folder: str) -> list[str]:
        return sorted(a.path for a in client.list_artifacts(run.info.run_id, folder))

    for folder in ("report", "lineage", "episodes"):
        assert artifacts(kfp, folder) == [
            p.replace(embedded.info.run_id, kfp.info.run_id) for p in artifacts(embedded, folder)
        ]
    assert "report/reward.png" in artifacts(kfp, "report")
    assert len(artifacts(kfp, "episodes")) == 2
    datasets = {run_id: sorted(d.dataset.name for d in runs[run_id].inputs.dataset_inputs) for run_id in runs}
    assert datasets["kfp"] == datasets["embedded"] and "trajectories-iter-000001" in datasets["kfp"]
    for run in (kfp, embedded):
        versions = client.search_model_versions(f"run_id='{run.info.run_id}'")
        assert sorted(v.name for v in versions) == [f"{TRACKED_EXPERIMENT}-solver", f"{TRACKED_EXPERIMENT}-verifier"]
        # a local store: the source is a pointer in the run's artifacts (a server refuses a
        # local path), the tag names the policy in the store
        store = tracked_runs.folder / ("kfp" if run is kfp else "embedded") / "runs"
        for version in versions:
            assert version.source == f"runs:/{run.info.run_id}/policies/{version.tags['drmas.wg']}"
            assert Path(version.tags["drmas.store_uri"]).is_relative_to(store)

    page = f"experiments/{experiment.experiment_id}/runs/{kfp.info.run_id}"
    link = f"{tracked_runs.server.uri}/#/{page}?workflowType=machine_learning"  # MLflow's model-training mode
    pages = {
        step: next((tracked_runs.folder / "kfp" / ".cache" / "kfp-local").glob(f"*/{step}/mlflow")).read_text()
        for step in ("track-start", "track-end")
    }
    assert all(link in page for page in pages.values())
    assert "| before |" in pages["track-end"] and "| 1 |" in pages["track-end"]

    console = tracked_runs.output.split(LOG_MARK)[0]
    assert "config_json" not in console and "executor" not in console.lower()
    task_lines = re.findall(r"^task ([\w.-]+): executed", console, re.M)
    # the warm start; rollouts, advantages, updates, checkpoints; 3 evaluations; tracking: start,
    # before training, 2 iterations, end
    assert len(task_lines) == 1 + 2 + 2 + 4 + 2 + 3 + 5
    assert len(console.splitlines()) < len(task_lines) + 20
    for line in ("iter 0: reward", "iter 1: reward", "eval avg@2", "report: ", "mlflow: ", "checkpoint: "):
        assert line in console, line


# --------------------------------------------------------------------------------------
# Submission: kfp.Client against a stand-in of the KFP API server
# --------------------------------------------------------------------------------------


class StubKfpApi:
    """The four REST calls kfp.Client 2.17.3 makes to create a run: GET healthz, list
    experiments by name (filter), POST an experiment when there is none, POST the run.
    Anything else is answered 404 and recorded as unexpected."""

    def __init__(self) -> None:
        self.experiments: dict[str, dict] = {}
        self.runs: list[dict] = []
        self.calls: list[str] = []
        self.unexpected: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def reply(self, body: dict, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                stub.calls.append(f"GET {url.path}")
                if url.path == "/apis/v2beta1/healthz":
                    return self.reply({"commit_sha": "stub", "tag_name": "2.5.0", "multi_user": False})
                if url.path == "/apis/v2beta1/experiments":
                    wanted = {
                        p["stringValue"]
                        for p in json.loads(parse_qs(url.query)["filter"][0])["predicates"]
                        if p["key"] == "display_name"
                    }
                    found = [e for e in stub.experiments.values() if e["display_name"] in wanted]
                    return self.reply({"experiments": found, "total_size": len(found)} if found else {})
                stub.unexpected.append(f"GET {self.path}")
                return self.reply({"error": "not found"}, 404)

            def do_POST(self) -> None:
                url = urlparse(self.path)
                stub.calls.append(f"POST {url.path}")
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if url.path == "/apis/v2beta1/experiments":
                    experiment = {**body, "experiment_id": f"exp-{len(stub.experiments) + 1}"}
                    stub.experiments[experiment["experiment_id"]] = experiment
                    return self.reply(experiment)
                if url.path == "/apis/v2beta1/runs":
                    stub.runs.append(body)
                    return self.reply({**body, "run_id": f"kfp-run-{len(stub.runs)}", "state": "PENDING"})
                stub.unexpected.append(f"POST {self.path}")
                return self.reply({"error": "not found"}, 404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "StubKfpApi":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.standin
def test_submit_posts_the_compiled_pipeline_with_its_parameters(tmp_path, capsys, monkeypatch):
    """`drmas submit` compiles the pipeline and creates a run through kfp.Client. A real
    Kubeflow Pipelines API server is the one boundary that cannot run on these machines
    (it needs Kubernetes); this stub stands in for it, implementing exactly the REST calls
    kfp.Client makes, and records what was posted: the test checks that it is our compiled
    pipeline (name, images, placement, per-task caching) with the run's parameters."""
    import kfp

    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))  # no user settings
    monkeypatch.setenv("DRMAS_LAST_BUILD", str(tmp_path / "no-build"))  # the default images, with a warning
    config_file = str(ROOT / "configs" / "math_qwen3_4b_gpu.yaml")
    config = load_config(config_file, ["experiment.epochs=null", "experiment.iterations=2"])
    with StubKfpApi() as api:
        code = main(
            [
                "submit",
                config_file,
                "experiment.epochs=null",
                "experiment.iterations=2",
                "--host",
                api.host,
                "--run-id",
                "r1",
                "--run-name",
                "first",
                "-o",
                str(tmp_path / "submitted.yaml"),
            ]
        )
        assert code == 0, capsys.readouterr().err
        assert "as KFP run kfp-run-1 (drmas run r1)" in capsys.readouterr().out
        code = main(
            [
                "submit",
                config_file,
                "experiment.epochs=null",
                "experiment.iterations=2",
                "--host",
                api.host,
                "--run-id",
                "r1",
                "--experiment",
                "math-qwen3-4b",
                "--force",
                "advantage@1",
            ]
        )
        assert code == 0, capsys.readouterr().err
    assert api.unexpected == []
    assert api.calls == [
        "GET /apis/v2beta1/healthz",
        "GET /apis/v2beta1/experiments",
        "POST /apis/v2beta1/experiments",
        "POST /apis/v2beta1/runs",
        "GET /apis/v2beta1/healthz",
        "GET /apis/v2beta1/experiments",
        "POST /apis/v2beta1/runs",  # the experiment exists now
    ]
    [experiment] = api.experiments.values()
    assert experiment["display_name"] == "math-qwen3-4b"
    first, second = api.runs
    assert (
        first["display_name"] == "first"
        and first["experiment_id"] == experiment["experiment_id"] == second["experiment_id"]
    )
    assert first["service_account"] == "drmas-pipeline"
    assert first["runtime_config"]["parameters"] == {"config_json": config.to_json(), "run_id": "r1"}
    pipeline, platform = first["pipeline_spec"]["pipeline_spec"], first["pipeline_spec"]["platform_spec"]
    on_disk, _ = yaml.safe_load_all((tmp_path / "submitted.yaml").read_text())
    assert pipeline == json.loads(json.dumps(on_disk)), "the posted spec is the compiled pipeline"
    assert pipeline["pipelineInfo"]["name"] == "drmas-train-math-qwen3-4b"
    images = {e["container"]["image"] for e in pipeline["deploymentSpec"]["executors"].values()}
    assert images == {components.CPU_IMAGE}  # every step of the GPU recipe is a Ray client or on CPU
    assert all(
        any(s["secretName"] == S3_SECRET for s in e["secretAsEnv"])
        for e in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values()
    )
    caching = {
        t["taskInfo"]["name"]: t.get("cachingOptions", {}).get("enableCache", False)
        for t in second["pipeline_spec"]["pipeline_spec"]["root"]["dag"]["tasks"].values()
    }
    # The forced task, and the updates: the recipe stores optimizer states every 10th
    # iteration, so KFP must never skip an update (the pool holds the state in between).
    uncached = {name for name, enabled in caching.items() if not enabled}
    assert uncached == {"advantage 1", "mlflow: start", *(name for name in caching if name.startswith("update "))}
    assert len(uncached) == 2 + 2 * 2  # the forced advantage, the MLflow start, two worker groups x two iterations
    assert second["display_name"] == "r1 train (force advantage@1)"


@pytest.mark.standin
def test_submit_reports_an_unreachable_server(tmp_path, capsys, monkeypatch):
    import kfp

    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    with StubKfpApi() as api:
        host = api.host
    monkeypatch.setattr("kfp.client.client.time.sleep", lambda seconds: None)  # kfp.Client retries healthz 5 times
    code = main(["submit", str(ROOT / "configs" / "math_tiny.yaml"), "--host", host, "--run-id", "r1"])
    captured = capsys.readouterr()
    assert code == 1
    assert f"could not start the run on {host}" in captured.err
    assert "store.root is './runs', a local folder" in captured.err


def test_a_kfp_task_setter_misused_still_names_itself():
    """drmas gives kfp's task setters a cheap way to name themselves while it sets a task's
    container (``platform.cheap_setter_checks``): the error for a setter on an importer task
    (no container) still says which setter, and kfp is itself again afterwards."""
    import inspect

    import kfp.dsl.pipeline_task
    from kfp import dsl

    from drmas_kfp.pipelines.platform import cheap_setter_checks

    assert kfp.dsl.pipeline_task.inspect is inspect  # importing drmas's platform patches nothing
    raised: list[str] = []

    def misuse():
        task = dsl.importer(artifact_uri="s3://bucket/policy", artifact_class=dsl.Model)
        with cheap_setter_checks():
            assert kfp.dsl.pipeline_task.inspect is not inspect
            try:
                task.set_cpu_request("1")
            except ValueError as error:
                raised.append(str(error))

    dsl.pipeline(misuse)  # building the pipeline runs its body
    assert len(raised) == 1 and raised[0].startswith("set_cpu_request can only be used on single-step components")
    assert kfp.dsl.pipeline_task.inspect is inspect


@pytest.mark.standin
def test_submit_runs_a_long_run_in_parts_and_prints_the_next_ones(tmp_path, capsys, monkeypatch):
    """A run longer than --iterations-per-run: KFP cannot start a run when another ends, and
    a part can only start once the checkpoint before it exists, so `drmas submit` starts
    the first part and prints the exact command of each next one (run id and images
    pinned). Running the printed command submits the next part, starting from the
    checkpoint the part before ends with."""
    import shlex

    import kfp

    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    monkeypatch.setenv("DRMAS_LAST_BUILD", str(tmp_path / "no-build"))
    config_file = str(ROOT / "configs" / "math_qwen3_4b_gpu.yaml")
    images = ["--image-registry", "registry.example.com/ml", "--image-tag", "0.1.0-1a2b"]

    def iterations_of(run: dict) -> list[int]:
        tasks = run["pipeline_spec"]["pipeline_spec"]["root"]["dag"]["tasks"].values()
        return sorted(
            t["inputs"]["parameters"]["iteration"]["runtimeValue"]["constant"]
            for t in tasks
            if stage_of(t) == "rollout"
        )

    with StubKfpApi() as api:
        argv = [
            "submit",
            config_file,
            "experiment.epochs=null",
            "experiment.iterations=25",
            "--host",
            api.host,
            "--run-id",
            "r9",
            *images,
        ]
        code = main([*argv, "--iterations-per-run", "10"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert "submitted iterations 0..9 (part 1/3) of the train pipeline" in captured.out
        commands = [line.strip() for line in captured.out.splitlines() if line.strip().startswith("drmas submit")]
        assert len(commands) == 2
        second, third = (shlex.split(command) for command in commands)
        assert second[second.index("--start-iteration") + 1 :][:3] == ["10", "--iterations", "10"]
        assert third[third.index("--start-iteration") + 1 :][:3] == ["20", "--iterations", "5"]
        for words in (second, third):
            assert words[2:5] == [config_file, "experiment.epochs=null", "experiment.iterations=25"]
            assert words[words.index("--run-id") + 1] == "r9" and words[words.index("--host") + 1] == api.host
            assert words[words.index("--image-tag") + 1] == "0.1.0-1a2b"
        assert main(second[1:]) == 0, capsys.readouterr().err
        assert "submitted the train pipeline" in capsys.readouterr().out  # one part: no further commands
    first, then = api.runs
    assert iterations_of(first) == list(range(10)) and iterations_of(then) == list(range(10, 20))
    assert first["display_name"] == "r9 iterations 0..9 (part 1/3)"
    assert then["display_name"] == "r9 iterations 10..19 (part 2/3)"
    assert "start_checkpoint" not in first["runtime_config"]["parameters"]
    assert (
        then["runtime_config"]["parameters"]["start_checkpoint"]
        == "s3://drmas/runs/math-qwen3-4b/r9/iter-000009/checkpoint"
    )
    executors = then["pipeline_spec"]["pipeline_spec"]["deploymentSpec"]["executors"].values()
    assert {e["container"]["image"].rpartition(":")[2] for e in executors if "container" in e} == {"0.1.0-1a2b"}


@pytest.mark.standin
def test_submit_to_a_profile_namespace_runs_as_its_default_account(tmp_path, capsys, monkeypatch):
    """With --namespace (a Profile of multi-user Kubeflow) the steps run as the namespace's
    default-editor: no service account in the run, unless one is given."""
    import kfp

    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    monkeypatch.setenv("DRMAS_LAST_BUILD", str(tmp_path / "no-build"))
    config_file = str(ROOT / "configs" / "math_qwen3_4b_gpu.yaml")
    with StubKfpApi() as api:
        argv = [
            "submit",
            config_file,
            "experiment.epochs=null",
            "experiment.iterations=1",
            "--host",
            api.host,
            "--run-id",
            "r1",
        ]
        assert main([*argv, "--namespace", "kubeflow-user-example-com"]) == 0, capsys.readouterr().err
        assert main([*argv, "--namespace", "team", "--service-account", "runner"]) == 0, capsys.readouterr().err
        assert main(argv) == 0, capsys.readouterr().err
    profile, named, standalone = api.runs
    assert not profile.get("service_account")
    assert named["service_account"] == "runner" and standalone["service_account"] == "drmas-pipeline"
    assert api.unexpected == []
