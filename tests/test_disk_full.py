"""A local store whose disk fills up: a clear error naming the file and the reason, nothing
visible or left over from the failed write, and the last complete checkpoint intact.

The small disk is a real tmpfs of a few MB, mounted in a private mount namespace
(``unshare -rm``, which needs no privileges beyond user namespaces) so that nothing on
the host changes; the store code runs in a subprocess inside it. Where user namespaces are
off, those tests are skipped, saying so, and the file-size limit (RLIMIT_FSIZE: EFBIG
instead of ENOSPC, one file at a time) still exercises the same failure path.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TRAINED_RUN, TRAINED_SETTINGS

ROOT = Path(__file__).parent.parent
DRMAS = Path(sys.executable).parent / "drmas"

SCENARIO = textwrap.dedent(
    """
    import errno, json, os, sys
    from pathlib import Path
    from drmas.infra.store import Store, StoreError

    root, big, fill_before_manifest = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "yes"

    def fill(folder: Path) -> None:
        # Take every byte left on the disk, the last ones a page at a time.
        with open(folder / "filler", "wb", buffering=0) as filler:
            for chunk in (1 << 20, 4096, 1):
                try:
                    while True:
                        filler.write(b"x" * chunk)
                except OSError as error:
                    assert error.errno == errno.ENOSPC, error

    store = Store(str(root / "store"))
    checkpoint = {"model.safetensors": bytes(range(256)) * 400, "checkpoint.json": b'{"iteration": 0}'}
    with store.writer("run/iter-000000/checkpoint") as out:
        for name, data in checkpoint.items():
            out.write_bytes(name, data)
    error = None
    try:
        with store.writer("run/iter-000001/policy") as out:
            out.write_bytes("model.safetensors", b"w" * big)
            if fill_before_manifest:
                fill(root)
    except StoreError as failure:
        error = str(failure)
    intact = store.open("run/iter-000000/checkpoint")
    print(json.dumps({
        "error": error,
        "listed": store.list(),
        "files": sorted(str(p.relative_to(store.root)) for p in Path(store.root).rglob("*") if p.is_file()),
        "checkpoint_intact": all(intact.read_bytes(name) == data for name, data in checkpoint.items()),
    }))
    """
)
CHECKPOINT_FILES = [
    "run/iter-000000/checkpoint/_MANIFEST.json",
    "run/iter-000000/checkpoint/checkpoint.json",
    "run/iter-000000/checkpoint/model.safetensors",
]


def tmpfs_works(folder: Path) -> bool:
    """Whether a private tmpfs can be mounted here (user and mount namespaces allowed)."""
    if not shutil.which("unshare"):
        return False
    folder.mkdir(exist_ok=True)
    probe = f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(folder))}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Path:
    disk = tmp_path / "disk"
    if not tmpfs_works(disk):
        pytest.skip(
            "no private tmpfs here (unshare -rm refused: user namespaces off); "
            "the RLIMIT_FSIZE test covers the failure path"
        )
    return disk


def on_small_disk(disk: Path, size: str, script: str, timeout: int = 120, **run) -> subprocess.CompletedProcess[str]:
    """Run a shell ``script`` with a fresh tmpfs of ``size`` mounted on ``disk``, in its own
    mount namespace and session; what it leaves on the tmpfs vanishes with it, so the
    script copies out what the test needs. Any process it leaves behind is ended."""
    mount = f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(disk))}"
    process = subprocess.Popen(
        ["unshare", "-rm", "sh", "-c", f"{mount} && {script}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **run,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # our own session: Ray or stragglers it started
        except ProcessLookupError:
            pass
        process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def scenario(disk: Path, size: str, big: int, fill_before_manifest: bool) -> dict:
    command = " ".join(
        shlex.quote(part)
        for part in [sys.executable, "-c", SCENARIO, str(disk), str(big), "yes" if fill_before_manifest else "no"]
    )
    done = on_small_disk(disk, size, command)
    assert done.returncode == 0, done.stdout
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_disk_full_during_a_file(small_disk: Path):
    """A 2 MB file on a 1 MB disk: refused with its path and the system's reason."""
    seen = scenario(small_disk, "1m", big=2 << 20, fill_before_manifest=False)
    assert seen["error"].startswith(
        f"{small_disk}/store/run/iter-000001/policy/model.safetensors: No space left on device"
    )
    assert seen["listed"] == ["run/iter-000000/checkpoint"]
    assert seen["files"] == CHECKPOINT_FILES  # no partial file, no temporary file
    assert seen["checkpoint_intact"]


def test_disk_full_at_the_manifest(small_disk: Path):
    """Every file fits, then the disk fills: the manifest cannot be written, so the
    artifact never appears, and neither its files nor a temporary manifest stay behind."""
    seen = scenario(small_disk, "1m", big=100_000, fill_before_manifest=True)
    assert seen["error"].startswith(
        f"{small_disk}/store/run/iter-000001/policy/_MANIFEST.json: No space left on device"
    )
    assert seen["listed"] == ["run/iter-000000/checkpoint"]
    assert seen["files"] == CHECKPOINT_FILES
    assert seen["checkpoint_intact"]


def test_file_size_limit(tmp_path: Path):
    """The same failure through RLIMIT_FSIZE (no namespace needed): EFBIG, same guarantees."""
    limit = 1 << 20

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-c", SCENARIO, str(tmp_path), str(2 * limit), "no"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_file_size,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["error"].startswith(f"{tmp_path}/store/run/iter-000001/policy/model.safetensors: File too large")
    assert seen["listed"] == ["run/iter-000000/checkpoint"]
    assert seen["files"] == CHECKPOINT_FILES
    assert seen["checkpoint_intact"]


RUN_ON_FULL_DISK = """
set -u
run() { "$DRMAS" run "$CONFIG" $OVERRIDES "store.root=$DISK/runs" "tracking.uri=sqlite:///$OUT/mlflow.db" "$@"; }
fill() { "$PYTHON" -c "
import sys
with open(sys.argv[1], 'wb', buffering=0) as filler:
    for chunk in (1 << 20, 4096, 1):
        try:
            while True: filler.write(b'x' * chunk)
        except OSError: pass
" "$DISK/filler"; }
cp -a "$TRAINED" "$DISK/runs"
cp -a "$DISK/runs/math-tiny/$RUN/iter-000000/checkpoint" "$OUT/checkpoint-before"
fill
run --resume "$RUN" experiment.iterations=2 > "$OUT/full.log" 2>&1; echo $? > "$OUT/full.rc"
cp -a "$DISK/runs/math-tiny/$RUN/iter-000000/checkpoint" "$OUT/checkpoint-after"
find "$DISK/runs" -name _MANIFEST.json | sort > "$OUT/manifests-after-full.txt"
rm "$DISK/filler"
run --resume "$RUN" experiment.iterations=2 > "$OUT/resumed.log" 2>&1; echo $? > "$OUT/resumed.rc"
find "$DISK/runs" -name _MANIFEST.json | sort > "$OUT/manifests-at-end.txt"
"""
"""The store starts as a copy of the session's trained run (one complete iteration): the
first iteration's checkpoint is what the full disk must leave intact."""


@pytest.mark.slow
def test_run_on_full_disk_stops_then_resumes(small_disk: Path, local_trained_run: Path, tmp_path: Path):
    """`drmas run --resume` of a run whose store's disk is full: non-zero exit with a clear
    message, the last complete checkpoint untouched; once space is freed, --resume
    completes the run."""
    out = tmp_path / "out"
    out.mkdir()
    env = {
        **os.environ,
        "DISK": str(small_disk),
        "OUT": str(out),
        "DRMAS": str(DRMAS),
        "PYTHON": sys.executable,
        "CONFIG": str(ROOT / "configs" / "math_tiny.yaml"),
        "OVERRIDES": " ".join(TRAINED_SETTINGS),
        "TRAINED": str(local_trained_run),
        "RUN": TRAINED_RUN,
        "HF_HUB_OFFLINE": "1",
    }
    done = on_small_disk(small_disk, "64m", RUN_ON_FULL_DISK, timeout=400, cwd=tmp_path, env=env)
    logs = {name: (out / f"{name}.log").read_text() for name in ("full", "resumed")}
    codes = {name: (out / f"{name}.rc").read_text().strip() for name in ("full", "resumed")}
    run = f"{small_disk}/runs/math-tiny/{TRAINED_RUN}"

    assert codes["full"] == "1", logs["full"] + done.stdout
    [message] = [
        line for line in logs["full"].splitlines() if line.startswith(f"drmas run: cannot continue run {TRAINED_RUN}:")
    ]
    # The first write that fails names its file: the run's lease (taken before any stage),
    # or the stage's artifact when the lease still fitted.
    assert re.search(rf"{re.escape(run)}/(_LEASE\.json|iter-000001/)", message), message
    assert "No space left on device" in message
    assert "Traceback" not in logs["full"]
    before, after = out / "checkpoint-before", out / "checkpoint-after"
    assert sorted(p.name for p in after.iterdir()) == sorted(p.name for p in before.iterdir())
    assert all((after / p.name).read_bytes() == p.read_bytes() for p in before.iterdir())
    assert "iter-000001/checkpoint" not in (out / "manifests-after-full.txt").read_text()

    assert codes["resumed"] == "0", logs["resumed"]
    assert "iter 1:" in logs["resumed"] and "iter 0:" not in logs["resumed"]
    assert f"{run}/iter-000001/checkpoint/_MANIFEST.json" in (out / "manifests-at-end.txt").read_text()
