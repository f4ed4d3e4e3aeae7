"""The container images the components run in, pinned by an immutable tag.

A step runs on the GPU image (SGLang and CUDA) when its pod asks Kubernetes for a GPU (a
warm start that trains, or a rollout, update or evaluation whose pool runs inside the
step's own pod), and on the CPU image otherwise: a step that is only a Ray client of the
run's pool on the KubeRay cluster does its GPU work there (``pipelines.platform``).

The components are created with ``base_image=CPU_IMAGE|GPU_IMAGE`` (the registry
``ghcr.io/drmas`` and the installed drmas version as the tag). Those are placeholders
for ``kfp.local`` (whose SubprocessRunner ignores the image): nothing pushes them. A
pipeline for a cluster names the images ``images/build.sh`` built and pushed: the
pipelines set each task's image at compile time (``PipelineTask.set_container_image``,
see ``pipelines.build``) from ``resolve_images``: ``--image-registry``/``--image-tag``,
else the last build that ``images/build.sh`` recorded (``images/.last-build``, one line
per flavor: ``FLAVOR REFERENCE pushed|local``), else these defaults with a warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = [
    "CPU_IMAGE",
    "FLAVORS",
    "GPU_IMAGE",
    "IMAGES",
    "LAST_BUILD_ENV",
    "REGISTRY",
    "TAG",
    "ResolvedImages",
    "image_reference",
    "last_build_file",
    "read_last_build",
    "resolve_images",
]

REGISTRY = "ghcr.io/drmas"
FLAVORS = ("cpu", "gpu")


def _drmas_version() -> str:
    try:
        return version("drmas")
    except PackageNotFoundError:  # a source tree that is not installed
        return "0.0.0"


TAG = _drmas_version().replace("+", "-")
"""``drmas.__version__`` as an image tag (a local version's ``+`` is not allowed in tags)."""

CPU_IMAGE = f"{REGISTRY}/drmas-cpu:{TAG}"
GPU_IMAGE = f"{REGISTRY}/drmas-gpu:{TAG}"
IMAGES = {"cpu": CPU_IMAGE, "gpu": GPU_IMAGE}

LAST_BUILD_ENV = "DRMAS_LAST_BUILD"
"""Environment variable naming the record of ``images/build.sh`` (default: see ``last_build_file``)."""


def image_reference(flavor: str, registry: str, tag: str) -> str:
    """``{registry}/drmas-{flavor}:{tag}``, as ``images/build.sh`` names its images."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown image flavor {flavor!r}; flavors: {', '.join(FLAVORS)}")
    return f"{registry.rstrip('/')}/drmas-{flavor}:{tag}"


def _split(reference: str) -> tuple[str, str]:
    """``registry/drmas-cpu:tag`` -> (registry, tag)."""
    name, _, tag = reference.rpartition(":")
    registry, _, _ = name.rpartition("/")
    return registry, tag


def last_build_file() -> Path:
    """Where ``images/build.sh`` records what it built: ``$DRMAS_LAST_BUILD``, else
    ``images/.last-build`` of the checkout this package runs from (an editable install),
    else of the working directory."""
    if os.environ.get(LAST_BUILD_ENV):
        return Path(os.environ[LAST_BUILD_ENV])
    checkout = Path(__file__).resolve().parents[3] / "images" / ".last-build"
    if checkout.parent.is_dir() and (checkout.parent / "build.sh").exists():
        return checkout
    return Path("images") / ".last-build"


def read_last_build(path: Path | None = None) -> dict[str, tuple[str, bool]]:
    """{flavor: (image reference, pushed)} from the record (empty when there is none);
    lines it cannot read are skipped."""
    path = last_build_file() if path is None else path
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    record: dict[str, tuple[str, bool]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] in FLAVORS and ":" in parts[1]:
            record[parts[0]] = (parts[1], len(parts) > 2 and parts[2] == "pushed")
    return record


@dataclass(frozen=True)
class ResolvedImages:
    """The image of each flavor for a compiled pipeline, and what the user should know."""

    images: dict[str, str]
    warnings: tuple[str, ...] = field(default=())


def resolve_images(registry: str | None = None, tag: str | None = None, record: Path | None = None) -> ResolvedImages:
    """The images a pipeline for a cluster runs: the registry and tag given, and for what
    is not given the last build recorded by ``images/build.sh`` (per flavor), else the
    defaults (``ghcr.io/drmas``, the drmas version), with a warning that nothing pushed them."""
    path = last_build_file() if record is None else record
    built = read_last_build(path) if registry is None or tag is None else {}
    images, warnings, defaulted = {}, [], []
    for flavor in FLAVORS:
        if flavor in built:
            built_registry, built_tag = _split(built[flavor][0])
            images[flavor] = image_reference(flavor, registry or built_registry, tag or built_tag)
            if not built[flavor][1] and images[flavor] == built[flavor][0]:
                warnings.append(
                    f"{images[flavor]} was built by images/build.sh but not pushed (DRMAS_PUSH=1 pushes it): "
                    "a cluster cannot pull it"
                )
        else:
            images[flavor] = image_reference(flavor, registry or REGISTRY, tag or TAG)
            if registry is None or tag is None:
                defaulted.append(images[flavor])
    if defaulted:
        warnings.append(
            f"no image build recorded in {path} for {', '.join(defaulted)}: using the default reference, "
            "which nothing pushed; build and push with `DRMAS_PUSH=1 images/build.sh cpu|gpu`, "
            "or give --image-registry and --image-tag"
        )
    return ResolvedImages(images, tuple(warnings))
