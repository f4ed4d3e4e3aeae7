#!/usr/bin/env bash
# Build (and optionally push) one drmas image; the last line on stdout is its reference.
#
#   images/build.sh [cpu|gpu] [TAG]
#
#   TAG               default: <drmas version>-<git short sha>, e.g. 0.1.0-1a2b3c4d5e6f
#                     (a tree with uncommitted changes gets -dirty and cannot be pushed).
#                     Tags are immutable: `latest` is refused, and so is pushing a tag that
#                     the registry already holds.
#   DRMAS_REGISTRY    registry and namespace (default ghcr.io/drmas)
#   DRMAS_PUSH=1      push to the registry (default: load into the local engine)
#   DRMAS_PLATFORM    target platform (default linux/amd64)
#   CONTAINER_ENGINE  docker (buildx) or podman (default: whichever is found first)
#   DRMAS_DRY_RUN=1   print the build command and the reference, build nothing
#   DRMAS_LAST_BUILD  the record of the last build per flavor (default images/.last-build):
#                     a line `FLAVOR REFERENCE pushed|local` that `drmas compile|submit` read
#                     for the images the pipeline runs (unless --image-registry/--image-tag)
#
# Build context: the repository root, trimmed by images/Dockerfile.<flavor>.dockerignore.
set -euo pipefail

usage() {
    echo "usage: images/build.sh [cpu|gpu] [TAG]" >&2
    exit 2
}

flavor="${1:-cpu}"
case "$flavor" in
    cpu | gpu) ;;
    *) usage ;;
esac
[[ $# -le 2 ]] || usage

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dockerfile="$root/images/Dockerfile.$flavor"
ignorefile="$dockerfile.dockerignore"
registry="${DRMAS_REGISTRY:-ghcr.io/drmas}"
registry="${registry%/}"
platform="${DRMAS_PLATFORM:-linux/amd64}"
push="${DRMAS_PUSH:-0}"
record="${DRMAS_LAST_BUILD:-$root/images/.last-build}"

version="$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -n 1)"
[[ -n "$version" ]] || { echo "build.sh: no version in pyproject.toml" >&2; exit 1; }

if git -C "$root" rev-parse --git-dir > /dev/null 2>&1; then
    revision="$(git -C "$root" rev-parse HEAD)"
    short="$(git -C "$root" rev-parse --short=12 HEAD)"
    dirty=""
    [[ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ]] || dirty="-dirty"
else
    revision="unknown"
    short=""
    dirty=""
fi

if [[ $# -ge 2 ]]; then
    tag="$2"
else
    [[ -n "$short" ]] || { echo "build.sh: not a git checkout: give a TAG" >&2; exit 1; }
    tag="${version}-${short}${dirty}"
fi

if [[ "$tag" == "latest" ]]; then
    echo "build.sh: refusing tag 'latest': tags are immutable, use the default or a version" >&2
    exit 1
fi
if ! [[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]]; then
    echo "build.sh: invalid tag '$tag'" >&2
    exit 1
fi
if [[ "$push" == "1" && "$tag" == *-dirty ]]; then
    echo "build.sh: refusing to push '$tag': commit first, so the tag names one tree" >&2
    exit 1
fi

image="$registry/drmas-$flavor:$tag"
build_args=(
    --build-arg "DRMAS_VERSION=$version"
    --build-arg "VCS_REF=$revision"
    --build-arg "BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
)

if [[ "${DRMAS_DRY_RUN:-0}" == "1" ]]; then
    engine="${CONTAINER_ENGINE:-docker}"
else
    engine="${CONTAINER_ENGINE:-}"
    if [[ -z "$engine" ]]; then
        if command -v docker > /dev/null 2>&1 && docker buildx version > /dev/null 2>&1; then
            engine=docker
        elif command -v podman > /dev/null 2>&1; then
            engine=podman
        else
            echo "build.sh: needs docker with buildx, or podman (no container engine found)" >&2
            exit 1
        fi
    fi
fi

already_pushed() {
    if [[ "$engine" == docker ]]; then
        docker buildx imagetools inspect "$image" > /dev/null 2>&1
    elif command -v skopeo > /dev/null 2>&1; then
        skopeo inspect --raw "docker://$image" > /dev/null 2>&1
    else
        echo "build.sh: warning: cannot check whether $image exists (no skopeo)" >&2
        return 1
    fi
}

case "$engine" in
    docker)
        output=(--load)
        [[ "$push" == "1" ]] && output=(--push)
        command=(docker buildx build --platform "$platform" -f "$dockerfile"
            "${build_args[@]}" -t "$image" "${output[@]}" "$root")
        ;;
    podman)
        command=(podman build --platform "$platform" -f "$dockerfile" --ignorefile "$ignorefile"
            "${build_args[@]}" -t "$image" "$root")
        ;;
    *)
        echo "build.sh: CONTAINER_ENGINE must be docker or podman, not '$engine'" >&2
        exit 1
        ;;
esac

if [[ "${DRMAS_DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "${command[@]}" >&2
    echo >&2
    echo "$image"
    exit 0
fi

if [[ "$push" == "1" ]] && already_pushed; then
    echo "build.sh: $image already exists in the registry; tags are immutable" >&2
    exit 1
fi

echo "build.sh: building $image with $engine" >&2
"${command[@]}" >&2
if [[ "$engine" == podman && "$push" == "1" ]]; then
    podman push "$image" >&2
fi
# Record what was built, one line per flavor (the other flavor's line is kept).
state=local
[[ "$push" == "1" ]] && state=pushed
{
    [[ -f "$record" ]] && grep -v "^$flavor " "$record" || true
    echo "$flavor $image $state"
} > "$record.tmp"
mv "$record.tmp" "$record"
echo "$image"
