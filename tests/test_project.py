"""The package's promises about itself: light imports, the two commands, the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
HEAVY = ("ray", "kfp", "deepspeed", "sglang", "mlflow")


def _heavy_modules_after(statement: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    probe = f"import sys; {statement}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [name for name in result.stdout.strip().split(",") if name]


def test_core_imports_stay_light():
    assert _heavy_modules_after("import drmas, drmas.algos, drmas.config, drmas.infra.store, drmas.infra.schema") == []


def test_the_probe_does_see_a_heavy_import():
    assert _heavy_modules_after("import drmas.config, kfp") == ["kfp"]


def test_the_pool_stages_drivers_load_no_torch():
    """The rollout, update and evaluation tasks are thin Ray drivers: what they import
    loads neither torch nor transformers (the pool's workers do), so a task starts in a
    second rather than six."""
    drivers = "import drmas.stages.rollout, drmas.stages.update, drmas.stages.evaluate, drmas.generation.pool"
    assert _heavy_modules_after(drivers, ("torch", "transformers", "deepspeed")) == []


def _package_of(folder: Path) -> str:
    """The import name a package folder installs as (pyproject.toml's package-dir)."""
    relative = folder.relative_to(ROOT).as_posix()
    if relative.split("/")[0] in ("components", "pipelines"):
        return f"drmas_kfp.{relative.replace('/', '.')}"
    return relative.removeprefix("src/").replace("/", ".")


def test_every_package_folder_is_in_the_wheel():
    """pyproject.toml lists the packages (a package-dir mapping puts the top-level
    components/ and pipelines/ under drmas_kfp): a subpackage missing from the list would
    be missing from the image's wheel while the editable install still finds it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = [
        init.parent for tree in ("src", "components", "pipelines") for init in (ROOT / tree).rglob("__init__.py")
    ]
    assert {_package_of(folder) for folder in folders} == listed


def test_the_kubeflow_layer_imports_from_its_top_level_folders():
    """The editable install maps drmas_kfp.components and drmas_kfp.pipelines to the
    top-level folders (the design card's layout) under one namespaced import name."""
    import importlib.util

    for name, folder in (("drmas_kfp.components", "components"), ("drmas_kfp.pipelines", "pipelines")):
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).parent == ROOT / folder, name


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_installs_once_per_dependency_change(tmp_path):
    """`make -n` (dry run) shows the install only while the stamp for these deps is missing."""
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)

    def dry_run() -> str:
        return subprocess.run(["make", "-n", "venv"], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    assert "torch==2.13.0" in dry_run()  # torch comes first, pinned
    assert dry_run().index("torch==2.13.0") < dry_run().index("-e '.[dev,kubeflow]'")
    stamp = next(line for line in dry_run().splitlines() if line.startswith("touch "))
    (tmp_path / ".venv").mkdir()
    (tmp_path / stamp.split()[-1]).touch()
    assert "pip" not in dry_run()
    with open(tmp_path / "pyproject.toml", "a") as handle:
        handle.write("\n# a dependency change\n")
    assert "-e '.[dev,kubeflow]'" in dry_run()


def _drmas(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "drmas.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_config_prints_worker_groups_and_resolved_json():
    result = _drmas("config", "configs/math_tiny.yaml", "workers.sharing=by_model")
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("worker group solver-verifier: model tiny, agents solver, verifier")
    assert json.loads(result.stdout)["workers"]["sharing"] == "by_model"


def test_cli_bad_config_exits_2_with_the_problem():
    result = _drmas("run", "configs/math_tiny.yaml", "rollout.grup_size=4")
    assert result.returncode == 2
    assert "rollout.grup_size: unknown key; did you mean 'group_size'?" in result.stderr


def test_cli_docs_cover_every_field():
    from drmas.config import DrmasConfig

    lines = _drmas("config", "--docs").stdout.splitlines()
    assert any(
        line.startswith("rollout.sampling.temperature (float, default 1.0): Sampling temperature") for line in lines
    )
    assert any(line.startswith("agents[].lr (") for line in lines)
    documented = [line for line in lines if " (" in line.split(":")[0]]
    undocumented = [line for line in documented if line.rstrip().endswith(":")]
    assert documented and not undocumented
    assert len([line for line in lines if line.startswith("algorithm.")]) == len(
        DrmasConfig.model_fields["algorithm"].annotation.model_fields
    )
