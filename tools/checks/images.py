"""The container images' rules, checked without building them (no Docker engine needed).

The Dockerfiles are parsed and held to the project's pins (pyproject.toml, constraints.txt),
to pinned base images, a non-root user, unbuffered Python and OCI labels, an install of the
project with its constraints, and a .dockerignore that lets through only what is copied.
Each rule lives in `dockerfile_problems`; tests/test_images.py shows with a deliberately
broken Dockerfile that they can fail.

`python -m tools.checks.images [images/Dockerfile.FLAVOR ...]` (from the repository's root;
both flavors without arguments) prints each problem; it is a pre-commit hook.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
FLAVORS = ("cpu", "gpu")
OCI_LABELS = ("title", "description", "version", "revision", "created", "source", "licenses")
# Dockerfile ARG -> distribution whose exact pin in pyproject.toml the ARG must repeat.
PINNED_ARGS = {
    "TORCH_VERSION": "torch",
    "DEEPSPEED_VERSION": "deepspeed",
    "RAY_VERSION": "ray",
    "MLFLOW_VERSION": "mlflow",
    "KFP_VERSION": "kfp",
}


# ----------------------------------------------------------------------------- parsing


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    if pending:
        raise ValueError("dangling line continuation at the end of the Dockerfile")
    return result


def pairs(rest: str) -> dict[str, str]:
    """KEY=VALUE words of an ENV or LABEL instruction (values unquoted)."""
    found = {}
    for word in shlex.split(rest):
        key, sep, value = word.partition("=")
        if sep:
            found[key] = value
    return found


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)


class Dockerfile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text()
        self.steps = instructions(self.text)
        self.args: dict[str, str] = {}
        for keyword, rest in self.steps:
            if keyword == "ARG" and "=" in rest:
                name, _, default = rest.partition("=")
                self.args.setdefault(name.strip(), default.strip().strip('"'))
        final = max(i for i, (keyword, _) in enumerate(self.steps) if keyword == "FROM")
        self.final_stage = self.steps[final:]

    def all(self, keyword: str) -> list[str]:
        return [rest for k, rest in self.steps if k == keyword]

    def base_images(self) -> list[str]:
        return [substitute(rest.split()[0], self.args) for rest in self.all("FROM")]

    def env(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for keyword, rest in self.final_stage:
            if keyword == "ENV":
                found.update(pairs(rest))
        return found

    def labels(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for keyword, rest in self.final_stage:
            if keyword == "LABEL":
                found.update(pairs(rest))
        return found

    def user(self) -> str | None:
        users = [rest for keyword, rest in self.final_stage if keyword == "USER"]
        return users[-1] if users else None

    def runs(self) -> str:
        return "\n".join(substitute(rest, self.args) for rest in self.all("RUN"))

    def copy_sources(self) -> list[str]:
        sources = []
        for rest in self.all("COPY"):
            words = shlex.split(rest)
            if any(word.startswith("--from") for word in words):
                continue
            sources += [word for word in words[:-1] if not word.startswith("--")]
        return sources


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def exact_pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for line in requirements:
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            pins[req.name.lower()] = specs[0].version
    return pins


def constraint_pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return exact_pins([line for line in lines if line.strip() and not line.startswith("#")])


def image_tag(reference: str) -> str | None:
    name = reference.rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else None


# ----------------------------------------------------------------------------- the rules


def dockerfile_problems(path: Path, flavor: str) -> list[str]:
    """Every rule the images must keep; an empty list means the Dockerfile passes."""
    problems: list[str] = []
    dockerfile = Dockerfile(path)
    meta = project()
    pins = exact_pins([*meta["dependencies"], *meta["optional-dependencies"]["kubeflow"]])
    constraints = constraint_pins()
    args = dockerfile.args

    for arg, dist in PINNED_ARGS.items():
        if args.get(arg) != pins.get(dist):
            problems.append(f"ARG {arg}={args.get(arg)} but pyproject pins {dist}=={pins.get(dist)}")
        if dist in constraints and args.get(arg) != constraints[dist]:
            problems.append(f"ARG {arg}={args.get(arg)} but constraints.txt pins {constraints[dist]}")
    if args.get("DRMAS_VERSION") != meta["version"]:
        problems.append(f"ARG DRMAS_VERSION={args.get('DRMAS_VERSION')}, pyproject: {meta['version']}")

    python = args.get("PYTHON_VERSION", "")
    if not re.fullmatch(r"3\.11\.\d+", python):
        problems.append(f"ARG PYTHON_VERSION={python!r}: the images use an exact Python 3.11.x")
    elif python not in SpecifierSet(meta["requires-python"]):
        problems.append(f"Python {python} outside requires-python {meta['requires-python']}")

    for image in dockerfile.base_images():
        tag = image_tag(image)
        if "$" in image:
            problems.append(f"FROM {image}: unresolved build argument")
        elif tag is None or tag == "latest" or not re.search(r"\d", tag):
            problems.append(f"FROM {image}: base image not pinned to a specific version tag")

    user = dockerfile.user()
    if user is None or user.split(":")[0] in ("root", "0"):
        problems.append(f"USER {user}: the image must end on a non-root user")
    if dockerfile.env().get("PYTHONUNBUFFERED") != "1":
        problems.append("ENV PYTHONUNBUFFERED=1 missing")

    labels = dockerfile.labels()
    for name in OCI_LABELS:
        if not labels.get(f"org.opencontainers.image.{name}"):
            problems.append(f"LABEL org.opencontainers.image.{name} missing")
    if labels.get("org.opencontainers.image.version") != "${DRMAS_VERSION}":
        problems.append("LABEL org.opencontainers.image.version must be ${DRMAS_VERSION}")
    if labels.get("org.opencontainers.image.licenses") != meta["license"]:
        problems.append("LABEL org.opencontainers.image.licenses differs from pyproject")

    runs = dockerfile.runs()
    target = ".[kubeflow]" if flavor == "cpu" else ".[gpu,kubeflow]"  # kfp runs every task: the images need it
    install = rf"pip install -c constraints\.txt( -c \S+)* \"?{re.escape(target)}\"?(\s|$)"
    if not re.search(install, runs):
        problems.append(f"no `pip install -c constraints.txt ... {target}` of the project")
    index = "https://download.pytorch.org/whl/" + ("cpu" if flavor == "cpu" else "cu")
    torch_pin = f'"torch=={args.get("TORCH_VERSION")}"'
    if not any(index in line and torch_pin in line for line in runs.splitlines()):
        problems.append(f"torch is not installed as {torch_pin} from {index}...")
    if not re.search(r"/opt/venv/bin[^\n]*> /etc/profile\.d/\S+\.sh", runs):
        problems.append("login shells (KubeRay's bash -lc) would lose /opt/venv/bin from PATH")
    if "drmas-check-versions" not in runs:
        problems.append("the build does not check the installed versions")
    if flavor == "gpu":
        sglang = args.get("SGLANG_VERSION", "")
        extra = [Requirement(r) for r in meta["optional-dependencies"]["gpu"]]
        spec = next((r.specifier for r in extra if r.name == "sglang"), None)
        if spec is None or sglang not in spec:
            problems.append(f"ARG SGLANG_VERSION={sglang!r} outside the gpu extra ({spec})")

    ignore = path.with_name(path.name + ".dockerignore")
    if not ignore.exists():
        problems.append(f"{ignore.name} missing: the build context would hold .venv and runs")
    else:
        patterns = [p.strip() for p in ignore.read_text().splitlines()]
        patterns = [p for p in patterns if p and not p.startswith("#")]
        if not patterns or patterns[0] != "*":
            problems.append(f"{ignore.name} must start by excluding everything ('*')")
        for source in dockerfile.copy_sources():
            if f"!{source.rstrip('/')}" not in patterns:
                problems.append(f"COPY {source}: not let through by {ignore.name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Check the Dockerfiles named (their flavor is their suffix: Dockerfile.cpu), or both
    flavors'; print each problem. 0 when there is none."""
    paths = [Path(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    found = []
    for path in paths or [IMAGES / f"Dockerfile.{flavor}" for flavor in FLAVORS]:
        flavor = path.suffix.lstrip(".")
        if flavor not in FLAVORS:
            found.append(f"{path}: not a Dockerfile.{{{','.join(FLAVORS)}}}")
            continue
        found += [f"{path}: {problem}" for problem in dockerfile_problems(path, flavor)]
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
