"""The container images, checked without building them (no Docker engine on these machines).

The Dockerfiles are parsed and held to the project's pins (pyproject.toml, constraints.txt),
to pinned base images, a non-root user, unbuffered Python and OCI labels; build.sh is
checked for syntax and for its tag rules in dry-run mode. Each rule lives in
`dockerfile_problems`, and a deliberately broken Dockerfile shows that it can fail.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
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
    assert not pending, "dangling line continuation at the end of the Dockerfile"
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


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("flavor", FLAVORS)
def test_dockerfile_keeps_every_rule(flavor: str) -> None:
    assert dockerfile_problems(IMAGES / f"Dockerfile.{flavor}", flavor) == []


def test_both_images_share_python_and_pins() -> None:
    cpu, gpu = (Dockerfile(IMAGES / f"Dockerfile.{flavor}") for flavor in FLAVORS)
    for arg in ("PYTHON_VERSION", "DRMAS_VERSION", *PINNED_ARGS):
        assert cpu.args[arg] == gpu.args[arg], arg
    assert cpu.base_images()[-1].endswith(f"python:{cpu.args['PYTHON_VERSION']}-slim-bookworm")
    assert cpu.user() == gpu.user() == "1000:1000"


def test_a_broken_dockerfile_fails_the_rules(tmp_path: Path) -> None:
    good = (IMAGES / "Dockerfile.cpu").read_text()
    broken = (
        good.replace("ARG TORCH_VERSION=2.13.0", "ARG TORCH_VERSION=2.14.1")
        .replace("FROM docker.io/library/python:${PYTHON_VERSION}-slim-bookworm", "FROM python:latest")
        .replace("USER 1000:1000", "USER root")
        .replace("PYTHONUNBUFFERED=1", "PYTHONUNBUFFERED=0")
        .replace('org.opencontainers.image.revision="${VCS_REF}"', "")
    )
    assert broken != good
    path = tmp_path / "Dockerfile.cpu"
    path.write_text(broken)
    problems = "\n".join(dockerfile_problems(path, "cpu"))
    for expected in (
        "TORCH_VERSION=2.14.1",
        "FROM python:latest",
        "USER root",
        "PYTHONUNBUFFERED",
        "image.revision",
        "Dockerfile.cpu.dockerignore missing",
    ):
        assert expected in problems


def test_check_versions_script_checks_installed_pins() -> None:
    script = IMAGES / "check_versions.py"
    pins = [f"{dist}=={Dockerfile(IMAGES / 'Dockerfile.cpu').args[arg]}" for arg, dist in PINNED_ARGS.items()]
    ok = subprocess.run([sys.executable, str(script), *pins], check=False, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [sys.executable, str(script), "torch==0.0.1", "no-such-dist==1.0"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert "torch: installed" in bad.stderr and "no-such-dist: not installed" in bad.stderr


def _build(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(IMAGES / "build.sh"), *args],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "DRMAS_DRY_RUN": "1", **env},
        cwd=ROOT,
        timeout=30,
    )


def test_build_script_is_executable_and_parses() -> None:
    script = IMAGES / "build.sh"
    assert os.access(script, os.X_OK), "images/build.sh must be executable"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    syntax = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize("flavor", FLAVORS)
def test_build_script_default_tag_is_version_and_sha(flavor: str) -> None:
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"], check=False, capture_output=True)
    if inside.returncode != 0:
        pytest.skip("not a git checkout: build.sh needs an explicit TAG here")
    result = _build(flavor)
    assert result.returncode == 0, result.stderr
    reference = result.stdout.strip().splitlines()[-1]
    version = re.escape(project()["version"])
    assert re.fullmatch(rf"ghcr\.io/drmas/drmas-{flavor}:{version}-[0-9a-f]{{7,40}}(-dirty)?", reference)
    assert f"images/Dockerfile.{flavor}" in result.stderr  # the command it would run


def test_build_script_refuses_latest_and_bad_usage() -> None:
    assert _build("cpu", "latest").returncode != 0
    assert _build("arm").returncode == 2
    custom = _build("gpu", "0.1.0", DRMAS_REGISTRY="registry.example.com/ml/")
    assert custom.stdout.strip() == "registry.example.com/ml/drmas-gpu:0.1.0"
    assert _build("cpu", "0.1.0-abc-dirty", DRMAS_PUSH="1").returncode != 0


def test_build_script_records_each_flavor_for_drmas_compile(tmp_path: Path) -> None:
    """build.sh records what it built (per flavor, pushed or only loaded) in the file
    DRMAS_LAST_BUILD names; drmas compile|submit take their images from it. A stand-in
    podman (no container engine here) lets the real script run to its end; a dry run
    records nothing."""
    from drmas_kfp.components.images import TAG, read_last_build, resolve_images

    engine = tmp_path / "bin" / "podman"
    engine.parent.mkdir()
    engine.write_text('#!/usr/bin/env bash\necho "podman $*" >> "$(dirname "$0")/calls"\n')
    engine.chmod(0o755)
    record = tmp_path / "last-build"
    env = {
        "DRMAS_DRY_RUN": "0",
        "CONTAINER_ENGINE": "podman",
        "PATH": f"{engine.parent}:{os.environ['PATH']}",
        "DRMAS_LAST_BUILD": str(record),
        "DRMAS_REGISTRY": "registry.example.com/ml",
    }
    assert _build("cpu", "0.1.0-a", **{**env, "DRMAS_DRY_RUN": "1"}).returncode == 0
    assert not record.exists(), "a dry run records nothing"
    gpu = _build("gpu", "0.1.0-a", **env, DRMAS_PUSH="1")
    assert gpu.returncode == 0, gpu.stderr
    assert gpu.stdout.strip().splitlines()[-1] == "registry.example.com/ml/drmas-gpu:0.1.0-a"
    assert "podman push registry.example.com/ml/drmas-gpu:0.1.0-a" in (engine.parent / "calls").read_text()
    cpu = _build("cpu", "0.1.0-b", **env)  # loaded into the local engine, not pushed
    assert cpu.returncode == 0, cpu.stderr
    assert read_last_build(record) == {
        "gpu": ("registry.example.com/ml/drmas-gpu:0.1.0-a", True),
        "cpu": ("registry.example.com/ml/drmas-cpu:0.1.0-b", False),
    }
    resolved = resolve_images(record=record)
    assert resolved.images == {
        "cpu": "registry.example.com/ml/drmas-cpu:0.1.0-b",
        "gpu": "registry.example.com/ml/drmas-gpu:0.1.0-a",
    }
    assert (
        len(resolved.warnings) == 1
        and "drmas-cpu:0.1.0-b was built by images/build.sh but not pushed" in (resolved.warnings[0])
    )
    again = _build("cpu", "0.1.0-c", **env, DRMAS_PUSH="1")  # the cpu line is replaced, the gpu line kept
    assert again.returncode == 0, again.stderr
    assert record.read_text().splitlines() == [
        "gpu registry.example.com/ml/drmas-gpu:0.1.0-a pushed",
        "cpu registry.example.com/ml/drmas-cpu:0.1.0-c pushed",
    ]
    assert resolve_images(record=record).warnings == ()
    # Given options win; what is not given comes from the record.
    assert resolve_images("other.example.com/x", None, record=record).images == {
        "cpu": "other.example.com/x/drmas-cpu:0.1.0-c",
        "gpu": "other.example.com/x/drmas-gpu:0.1.0-a",
    }
    none = resolve_images(record=tmp_path / "none")
    assert none.images == {"cpu": f"ghcr.io/drmas/drmas-cpu:{TAG}", "gpu": f"ghcr.io/drmas/drmas-gpu:{TAG}"}
    assert len(none.warnings) == 1 and "which nothing pushed" in none.warnings[0]
    assert resolve_images("r.example.com", "1.0", record=tmp_path / "none").warnings == ()
