"""A fingerprint of the code that computes a stage: the hash of its module's source and of
every drmas module it imports, directly or not (function-local imports included).

Why: a stage's cache key must change when the code that computes it changes, or a fixed
stage would keep reusing outputs that the old code computed. The package version (a
static ``0.1.0``) does not move with the code; the image digest on Kubeflow does, but not
in ``drmas run``, and a key must be the same in both so that they share outputs. Hashing
the sources does both: an installed drmas (a wheel in the image, or an editable checkout)
gives the same fingerprint for the same code, and a change to a module changes the keys
of exactly the stages that import it.

The import graph is read from the sources (``ast``), not from ``sys.modules``, so the
fingerprint does not depend on what happens to be imported already.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

__all__ = ["PACKAGE_ROOT", "module_fingerprint"]

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
"""The installed ``drmas`` package folder."""


def module_fingerprint(module: str, root: Path = PACKAGE_ROOT) -> str:
    """sha256 over the sources of ``module`` (``drmas.stages.rollout``) and every drmas
    module it reaches through imports, in a fixed order."""
    digest = hashlib.sha256()
    for path in sorted(_reached(module, root)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _reached(module: str, root: Path) -> set[Path]:
    """The source files of ``module``, of the packages it is in, and of everything they import."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        for path in _files_of(todo.pop(), root):
            if path not in seen:
                seen.add(path)
                todo.extend(_imports(path, root))
    return seen


def _files_of(module: str, root: Path) -> list[Path]:
    """The file of ``module`` and the ``__init__.py`` of each package above it (importing a
    module runs them); empty for what is not a drmas module (a name imported from one)."""
    parts = module.split(".")
    if parts[0] != root.name:
        return []
    files = []
    for depth in range(1, len(parts) + 1):
        folder = root.parent.joinpath(*parts[:depth])
        if (folder / "__init__.py").is_file():
            files.append(folder / "__init__.py")
        elif folder.with_suffix(".py").is_file():
            return [*files, folder.with_suffix(".py")]  # a module: what follows are its names
        else:
            break
    return files


def _imports(path: Path, root: Path) -> tuple[str, ...]:
    """Every module ``path`` imports, at any depth of its code, absolute; ``from a import b``
    names both ``a`` and ``a.b`` (``b`` may be a module)."""
    package = path.parent.relative_to(root.parent).parts
    found = []
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            stem = ".".join(part for part in (base, node.module or "") if part)
            found += [stem, *(f"{stem}.{alias.name}" for alias in node.names)]
    return tuple(found)
