"""The package tree is the architecture (docs/architecture.md §3): each layer imports only
the layers below it. A new import that crosses a layer upwards fails here, with the file
and the import named, instead of slowly turning the folders into decoration."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

STAGES_MAY_IMPORT = {
    "algos",
    "config",
    "registry",
    "infra",
    "models",
    "tasks",
    "team",
    "training",
    "generation",
    "stages",
    "analysis.report",
}
"""Everything below the runner, and a run's report."""

ALLOWED: dict[str, set[str]] = {
    "algos": set(),
    "config": {"registry"},  # task and orchestra names are checked when a config loads
    # Names -> classes, imported by name at run time (its imports of config and tasks are
    # for type checking only).
    "registry": {"config", "tasks"},
    "infra": {"config", "infra"},
    "models": {"config"},
    "model_import": {"config", "models"},  # `drmas import-gguf`: a GGUF file -> a policy folder
    "team": {"config", "infra", "team"},
    "tasks": {"config", "infra", "team", "registry", "tasks"},
    "training": {"algos", "config", "training"},
    "generation": {"config", "infra", "models", "generation"},
    # A run's report is written at its end (stages.track: the runner's and the pipelines' last step).
    "stages": STAGES_MAY_IMPORT,
    # `drmas compare` (analysis) runs runs.
    "runner": STAGES_MAY_IMPORT,
    "analysis": {"config", "infra", "runner", "analysis", "tasks"},  # a comparison's length: the task's data
    # The memory plan sizes the rollout with the SGLang engine's memory share.
    "planning": {"config", "generation.engines"},
    "cli": {"*"},
    "cli_common": {"*"},  # what every command shares, the Kubeflow layer's included
}
"""Layer -> the drmas layers (or modules) it may import. ``drmas`` itself (the version) is
allowed everywhere."""


def _layer(path: Path) -> str:
    parts = path.relative_to(SRC / "drmas").with_suffix("").parts
    return parts[0]


def _drmas_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module under drmas) of every import of drmas or drmas_kfp in the file, at
    any depth (lazy imports count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            if name == "drmas_kfp" or name.startswith("drmas_kfp."):
                found.append((node.lineno, "drmas_kfp"))
            elif name.startswith("drmas."):
                found.append((node.lineno, name.removeprefix("drmas.")))
    return found


def _allowed(target: str, allowed: set[str]) -> bool:
    return "*" in allowed or any(target == a or target.startswith(a + ".") for a in allowed)


def test_every_layer_imports_only_the_layers_below_it():
    crossings = []
    for path in sorted((SRC / "drmas").rglob("*.py")):
        if path.name == "__init__.py" and path.parent == SRC / "drmas":
            continue
        layer = _layer(path)
        assert layer in ALLOWED, (
            f"{path.relative_to(SRC)}: a new layer? add it to ALLOWED and to docs/architecture.md §3"
        )
        for line, target in _drmas_imports(path):
            if target == "drmas_kfp" and layer != "cli":
                crossings.append(f"{path.relative_to(SRC)}:{line} imports the Kubeflow layer (only the CLI may)")
            elif target != "drmas_kfp" and not _allowed(target, ALLOWED[layer]):
                crossings.append(f"{path.relative_to(SRC)}:{line} ({layer}) imports drmas.{target}")
    assert not crossings, "\n".join(crossings)


def test_the_checker_sees_a_crossing(tmp_path):
    """The walk finds lazy imports inside functions too (a check that finds nothing would pass)."""
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from drmas.stages.rollout import rollout\n    import drmas_kfp.pipelines\n")
    assert _drmas_imports(module) == [(2, "stages.rollout"), (3, "drmas_kfp")]
    assert not _allowed("stages.rollout", ALLOWED["infra"]) and _allowed("infra.store", ALLOWED["team"])
