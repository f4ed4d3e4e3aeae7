"""Fail an image build when an installed distribution is not at its pinned version.

Usage: python check_versions.py NAME==VERSION [NAME==VERSION ...]

A local build label is ignored (torch 2.13.0+cpu and 2.13.0+cu130 both satisfy
torch==2.13.0), as pip's own `==` does. Exit status 1 lists every mismatch at once.
The Dockerfiles run it after `pip install`; tests/test_images.py runs it too.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version


def problems(pins: list[str]) -> list[str]:
    found = []
    for pin in pins:
        name, sep, wanted = pin.partition("==")
        if not sep or not name or not wanted:
            found.append(f"{pin!r}: expected NAME==VERSION")
            continue
        try:
            installed = version(name)
        except PackageNotFoundError:
            found.append(f"{name}: not installed (pinned {wanted})")
            continue
        if installed.split("+", 1)[0] != wanted:
            found.append(f"{name}: installed {installed}, pinned {wanted}")
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    found = problems(argv)
    for line in found:
        print(f"check_versions: {line}", file=sys.stderr)
    if not found:
        print("check_versions: " + ", ".join(argv))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
