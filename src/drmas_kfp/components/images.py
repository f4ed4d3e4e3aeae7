"""The container images the components run in, pinned by an immutable tag: the installed
drmas version (the images are built from that version with ``images/build.sh cpu|gpu
VERSION``). CPU stages run on the CPU image; the stages that hold a model on an accelerator
(warm start, rollout, update, evaluate) on the GPU image, which has SGLang and CUDA."""

from importlib.metadata import PackageNotFoundError, version

REGISTRY = "ghcr.io/drmas"


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
