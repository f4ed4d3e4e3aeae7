"""The Kubeflow components are thin shims: light modules, self-contained function bodies,
pinned images, typed artifacts, and the resolved config as an explicit parameter.

(No ``from __future__ import annotations`` here: KFP reads the annotations of the
pipeline defined in a test, and it needs them as types, not strings.)"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import drmas
from drmas_kfp import components

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(path.stem for path in (ROOT / "components").glob("*.py") if path.stem != "__init__")
STAGE_COMPONENTS = {
    "warmstart": components.warmstart,
    "rollout": components.rollout,
    "advantage": components.advantage,
    "update": components.update,
    "checkpoint": components.checkpoint,
    "evaluate": components.evaluate,
    "load_checkpoint": components.load_checkpoint,
}
GPU = {"warmstart", "rollout", "update", "evaluate"}
HEAVY = ("drmas", "torch", "ray", "pyarrow", "numpy", "pydantic", "transformers", "deepspeed", "mlflow", "boto3")


def test_component_modules_import_only_the_standard_library_and_kfp():
    """Each module, imported alone in a fresh interpreter, loads no drmas and no heavy
    dependency: building and compiling pipelines does not load the training stack."""
    for module in ["drmas_kfp.components", *(f"drmas_kfp.components.{name}" for name in MODULES)]:
        probe = (
            f"import sys, {module}; print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
        )
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
        assert done.stdout.strip() == "", f"{module} imports {done.stdout.strip()}"


def _top_level_imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import at top level"
            names.add(node.module.split(".")[0])
    return names


def test_component_sources_follow_the_import_rules():
    """Top level: the standard library, kfp and this package's image constants. Function
    bodies (shipped alone as the task's program): absolute imports of drmas or the
    standard library only."""
    allowed_top = set(sys.stdlib_module_names) | {"kfp", "drmas_kfp"}
    for name in MODULES:
        tree = ast.parse((ROOT / "components" / f"{name}.py").read_text())
        assert _top_level_imports(tree) <= allowed_top, name
        for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom):
                    assert node.level == 0, f"{name}.{function.name}: relative import"
                    assert node.module.split(".")[0] in {"drmas"} | set(sys.stdlib_module_names), (
                        f"{name}.{function.name}: {node.module}"
                    )
                elif isinstance(node, ast.Import):
                    assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names), (
                        f"{name}.{function.name}"
                    )


def test_every_stage_component_runs_on_the_pinned_image_without_installing_kfp():
    assert components.CPU_IMAGE == f"ghcr.io/drmas/drmas-cpu:{drmas.__version__}"
    assert components.GPU_IMAGE == f"ghcr.io/drmas/drmas-gpu:{drmas.__version__}"
    for name, component in STAGE_COMPONENTS.items():
        container = component.component_spec.implementation.container
        assert container.image == (components.GPU_IMAGE if name in GPU else components.CPU_IMAGE), name
        program = " ".join(container.command)
        assert "pip install" not in program, f"{name} installs packages at run time"
        assert "kfp.dsl.executor_main" in program


def test_typed_artifacts_and_the_explicit_config_parameter():
    specs = {name: component.component_spec for name, component in STAGE_COMPONENTS.items()}

    def types(io) -> dict[str, str]:
        return {key: value.type for key, value in (io or {}).items()}

    for name, spec in specs.items():
        assert types(spec.inputs)["config_json"] == "String", name
        assert not any("secret" in key.lower() or "key_id" in key.lower() for key in spec.inputs), name
    assert types(specs["rollout"].outputs) == {
        "trajectories": "system.Dataset@0.0.1",
        "metrics": "system.Metrics@0.0.1",
    }
    assert types(specs["advantage"].outputs) == {"batch": "system.Dataset@0.0.1", "metrics": "system.Metrics@0.0.1"}
    assert types(specs["update"].outputs) == {"policy": "system.Model@0.0.1", "metrics": "system.Metrics@0.0.1"}
    assert types(specs["checkpoint"].outputs) == {"checkpoint": "system.Model@0.0.1", "metrics": "system.Metrics@0.0.1"}
    assert types(specs["evaluate"].outputs) == {"results": "system.Dataset@0.0.1", "metrics": "system.Metrics@0.0.1"}
    assert types(specs["warmstart"].outputs) == {"policies": "system.Model@0.0.1", "metrics": "system.Metrics@0.0.1"}
    assert types(specs["advantage"].inputs)["trajectories"] == "system.Dataset@0.0.1"
    assert {k: v for k, v in types(specs["update"].inputs).items() if k in ("batch", "policies", "reference")} == {
        "batch": "system.Dataset@0.0.1",
        "policies": "system.Model@0.0.1",
        "reference": "system.Model@0.0.1",
    }
    slots = [key for key in specs["checkpoint"].inputs if key.startswith("update_")]
    assert len(slots) == components.MAX_WORKER_GROUPS
    assert all(specs["checkpoint"].inputs[key].optional for key in slots)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")
def test_a_component_under_kfp_local_reads_and_writes_the_store(tmp_path, monkeypatch):
    """The advantage component under kfp.local, fed a stored rollout through an importer
    whose metadata names it, as the rollout component would: it writes the batch into the
    store with drmas' cache key, points its artifact there, and writes its metrics to
    metrics.path (without that file kfp.local never caches the task)."""
    from helpers import stored_rollout
    from kfp import dsl, local

    from drmas.infra.layout import stage_path
    from drmas.stages.contracts import AdvantageContract, cache_key

    monkeypatch.chdir(tmp_path)
    config, store, source = stored_rollout(tmp_path, rows=12)

    @dsl.pipeline(name="advantage-alone")
    def alone(config_json: str) -> dsl.Dataset:
        rollout = dsl.importer(
            artifact_uri=store.uri(source),
            artifact_class=dsl.Dataset,
            metadata={"artifact": source, "store_uri": store.uri(source)},
        )
        return components.advantage(
            config_json=config_json, run_id="r", iteration=0, trajectories=rollout.output
        ).outputs["batch"]

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"), enable_caching=True)
    try:
        batch = alone(config_json=config.to_json()).output
    finally:
        local.config.LocalExecutionConfig.instance = None  # later tests compile, never run locally
    path = stage_path(config.experiment.name, "r", 0, "advantage")
    assert batch.metadata["store_uri"] == store.uri(path) and batch.metadata["artifact"] == path
    assert store.open(path).meta["cache_key"] == cache_key(config, store, AdvantageContract("r", 0))
    assert batch.metadata["fingerprint"] == store.fingerprint(path, ignore=("metrics.json",))
    assert json.loads(Path(batch.path).read_text())["store_uri"] == store.uri(path)
    [metrics] = (tmp_path / "kfp").glob("advantage-alone-*/advantage/metrics")
    assert json.loads(metrics.read_text())["batch/rows"] == 12.0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task:RuntimeWarning")
def test_a_checkpoint_imported_by_uri_becomes_the_next_iterations_policy_set(tmp_path, monkeypatch, capsys):
    """How a pipeline starts from an earlier checkpoint: ``dsl.importer`` of its store URI
    (no metadata), then load_checkpoint, which checks what the checkpoint names and emits
    the policy set; a checkpoint of another iteration than the one before is refused."""
    from kfp import dsl, local

    from drmas.config import load_config
    from drmas.infra.layout import optim_path, policy_path, stage_path
    from drmas.infra.store import Store
    from drmas.stages.checkpoint import checkpoint

    monkeypatch.chdir(tmp_path)
    config = load_config(ROOT / "configs" / "math_tiny.yaml", [f"store.root={tmp_path / 'runs'}"])
    store = Store.from_config(config.store)
    spec = config.models["tiny"]
    architecture = {
        "model_type": spec.architecture,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
    }
    for wg in ("solver", "verifier"):
        with store.writer(policy_path(config.experiment.name, "old", 3, wg)) as out:
            out.write_json("config.json", architecture)  # what load_checkpoint checks; no weights are read
            out.write_bytes("model.safetensors", wg.encode())
        with store.writer(optim_path(config.experiment.name, "old", 3, wg)) as out:
            out.write_bytes("optimizer.safetensors", wg.encode())
    checkpoint(config, store, "old", 3, {"reward/mean": 0.5})
    uri = store.uri(stage_path(config.experiment.name, "old", 3, "checkpoint"))

    @dsl.pipeline(name="import-checkpoint")
    def start(config_json: str, checkpoint_uri: str, next_iteration: int) -> dsl.Model:
        imported = dsl.importer(artifact_uri=checkpoint_uri, artifact_class=dsl.Model, reimport=False)
        return components.load_checkpoint(
            config_json=config_json, checkpoint=imported.output, run_id="new", next_iteration=next_iteration
        ).outputs["policies"]

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"), enable_caching=False)
    try:
        policies = start(config_json=config.to_json(), checkpoint_uri=uri, next_iteration=4).output
        with pytest.raises(RuntimeError, match="load-checkpoint"):
            start(config_json=config.to_json(), checkpoint_uri=uri, next_iteration=2)
    finally:
        local.config.LocalExecutionConfig.instance = None
    assert "is the checkpoint of iteration 3; iteration 2 continues from iteration 1" in capsys.readouterr().out
    assert policies.metadata["iteration"] == 3 and policies.metadata["store_uri"] == uri
    assert policies.metadata["home"] == "math-tiny/old/iter-000003"
    assert policies.metadata["policies"]["verifier"] == {
        "artifact": "math-tiny/old/iter-000003/policy/verifier",
        "prefix": "",
    }
    assert policies.metadata["optims"]["solver"] == {"artifact": "math-tiny/old/iter-000003/optim/solver", "prefix": ""}
    assert store.exists("math-tiny/new/run"), "the run that continues from the checkpoint has its config recorded"
