"""The container images, checked without building them (no Docker engine on these machines).

The Dockerfiles against the project's rules (``tools/checks/images.py``; a deliberately
broken Dockerfile shows that they can fail), the two flavors against each other, the
image's own version check, and build.sh: its syntax and its tag rules in dry-run mode.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.checks.images import FLAVORS, IMAGES, PINNED_ARGS, ROOT, Dockerfile, dockerfile_problems, main, project

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


def test_the_check_command_names_the_file_of_each_problem(tmp_path: Path, capsys) -> None:
    """`python -m tools.checks.images [DOCKERFILE...]` (a pre-commit hook without
    arguments: both flavors): 0 on the project's Dockerfiles, 1 and each problem with its
    file on a broken one."""
    assert main([]) == 0
    broken = tmp_path / "Dockerfile.gpu"
    broken.write_text((IMAGES / "Dockerfile.gpu").read_text().replace("USER 1000:1000", "USER root"))
    capsys.readouterr()
    assert main([str(IMAGES / "Dockerfile.cpu"), str(broken)]) == 1
    err = capsys.readouterr().err
    assert f"{broken}: USER root: the image must end on a non-root user" in err and "Dockerfile.cpu" not in err


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
