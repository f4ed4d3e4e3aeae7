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
    "algos": {"grouping"},
    "grouping": set(),  # key columns -> integer codes, under the math
    "weights": set(),  # the weight-safety policy: a leaf
    # The schema imports only the weight policy; loading a config checks and fills in what
    # the task plugins say (config.loading -> registry).
    "config": {"config", "registry", "weights"},
    # Names -> classes, imported by name at run time: it imports no drmas module.
    "registry": set(),
    "infra": {"config", "infra"},
    "models": {"config"},
    "model_import": {"config", "models"},  # `drmas import-gguf`: a GGUF file -> a policy folder
    "team": {"config", "infra", "team"},
    "tasks": {"config", "infra", "team", "registry", "tasks", "models"},  # models: dense retrieval's encoder
    "training": {"algos", "config", "training", "infra.progress"},  # an update's progress, shown by the driver
    "generation": {"config", "infra", "models", "generation"},
    # A run's report is written at its end (stages.track: the runner's and the pipelines' last step).
    "stages": STAGES_MAY_IMPORT,
    # `drmas compare` (analysis) runs runs.
    "runner": STAGES_MAY_IMPORT,
    # A comparison's length comes from the task's data; it runs its runs in one Ray session.
    "analysis": {"config", "infra", "runner", "analysis", "tasks", "generation.ray_session"},
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


STORE_MODULES = ("store", "faults", "schema", "layout", "lease")
"""The artifact store and what it builds on: below every config schema (issue 27 §2), so
the store opens from plain settings (``Store.settings()`` is an infra dataclass)."""


def test_the_store_imports_no_config():
    crossings = [
        f"infra/{name}.py:{line} imports drmas.{target}"
        for name in STORE_MODULES
        for line, target in _drmas_imports(SRC / "drmas" / "infra" / f"{name}.py")
        if not target.startswith("infra.") and target != "infra"
    ]
    assert not crossings, "\n".join(crossings)


ROOT = SRC.parent
TREES = {"drmas": SRC / "drmas", "drmas_kfp": SRC / "drmas_kfp", "drmas_kfp.components": ROOT / "components"}
TREES["drmas_kfp.pipelines"] = ROOT / "pipelines"


def module_files() -> dict[str, Path]:
    """Every module of drmas and of the Kubeflow layer (installed names) -> its file."""
    found = {}
    for package, folder in TREES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the drmas modules it imports, at any depth of its code (function-local and
    type-checking imports too: each is an edge a refactoring can turn into a real one)."""
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
                stem = ".".join(part for part in (base, node.module or "") if part)
                candidates = [
                    f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in files else stem for alias in node.names
                ]
            else:
                continue
            targets |= {target for target in candidates if target in files and target != name}
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: one per strongly connected component of more than one
    module, as a path through it (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back():
    """An import circle (a module that, through others, imports itself) means two modules
    that cannot be understood, tested or moved apart: none is allowed, lazy imports included."""
    assert cycles(import_graph(module_files())) == []


def test_a_circle_is_found_lazy_or_not():
    graph = {"drmas.a": {"drmas.b"}, "drmas.b": {"drmas.c"}, "drmas.c": {"drmas.a"}, "drmas.d": {"drmas.a"}}
    assert cycles(graph) == [["drmas.a", "drmas.b", "drmas.c"]]
    assert cycles({"drmas.a": {"drmas.b"}, "drmas.b": set()}) == []


def test_a_broken_copy_of_the_tree_has_a_circle(tmp_path):
    """The real tree with one module swapped for a copy that imports back, lazily and by a
    relative import (the search task's old circle: the client reaching for the task): the
    walk resolves both forms and names the modules of the circle."""
    files = module_files()
    broken = tmp_path / "client.py"
    client = files["drmas.tasks.search.client"].read_text()
    broken.write_text(client + "\n\ndef _task():\n    from . import task\n    from .world import generate_fact_world\n")
    before = cycles(import_graph(files))
    after = cycles(import_graph({**files, "drmas.tasks.search.client": broken}))
    # The world imports nothing back: its edge joins no circle.
    assert [cycle for cycle in after if cycle not in before] == [
        ["drmas.tasks.search.client", "drmas.tasks.search.task"]
    ]


def _private_imports(path: Path, base: Path = ROOT) -> list[str]:
    """``from drmas... import _name`` in the file: a name its module keeps to itself."""
    return [
        f"{path.relative_to(base)}:{node.lineno} takes {alias.name} from {node.module}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("drmas", "drmas_kfp")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_module_takes_another_modules_private_names():
    """Issue 27 §4: what another module (or a bench script, a tool) needs is public."""
    folders = [*TREES.values(), ROOT / "bench", ROOT / "tools"]
    found = [hit for folder in folders for path in sorted(folder.rglob("*.py")) for hit in _private_imports(path)]
    assert not found, "\n".join(found)


def test_a_private_import_is_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from drmas.stages.update import _hidden, public\n")
    assert _private_imports(probe, tmp_path) == ["probe.py:2 takes _hidden from drmas.stages.update"]
