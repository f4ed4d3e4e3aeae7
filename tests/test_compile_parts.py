"""``drmas compile`` of a run longer than one KFP run holds (issue 29, section 4): one
file per part, as ``drmas submit`` splits it, never one spec of every iteration."""

from pathlib import Path

import yaml

from drmas.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "math_tiny.yaml")


def rollouts_and_start(path: Path) -> tuple[list[int], str | None, bool]:
    """The iterations a compiled part rolls out, its start_checkpoint default, and whether
    it starts with the warm start."""
    spec = next(yaml.safe_load_all(path.read_text()))
    tasks = spec["root"]["dag"]["tasks"].values()
    iterations = sorted(
        t["inputs"]["parameters"]["iteration"]["runtimeValue"]["constant"]
        for t in tasks
        if t["componentRef"]["name"].startswith("comp-rollout")
    )
    start = spec["root"]["inputDefinitions"]["parameters"].get("start_checkpoint", {}).get("defaultValue")
    warm = any(t["componentRef"]["name"] == "comp-warmstart" for t in tasks)
    return iterations, start, warm


def test_compile_writes_one_file_per_part_each_starting_from_the_checkpoint_before_it(tmp_path, capsys):
    """5 iterations, 2 a run: three files beside --output (none at --output itself), the
    first with the warm start, each next one defaulting to the checkpoint the one before
    ends with; no warning of an oversized pipeline."""
    out = tmp_path / "specs" / "math.yaml"
    argv = ["compile", TINY, "experiment.iterations=5", "eval.every=0", "-o", str(out), "--run-id", "r3"]
    assert main([*argv, "--iterations-per-run", "2"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "warning: the pipeline runs" not in captured.err
    files = sorted(path.name for path in out.parent.iterdir())
    assert files == ["math-part1-of-3.yaml", "math-part2-of-3.yaml", "math-part3-of-3.yaml"]
    assert "compiled iterations 2..3 (part 2/3) of the train pipeline" in captured.out
    parts = [rollouts_and_start(out.parent / name) for name in files]
    checkpoint = "/math-tiny/r3/iter-{:06d}/checkpoint"
    assert parts[0] == ([0, 1], None, True)
    assert parts[1][0] == [2, 3] and parts[1][1].endswith(checkpoint.format(1))
    assert parts[2][0] == [4] and parts[2][1].endswith(checkpoint.format(3))


def test_compile_writes_one_file_for_a_run_that_fits_or_when_told_not_to_split(tmp_path, capsys):
    """The default of 10 iterations a run: 12 iterations are parts of 10 and 2 (the part
    files numbered so they sort); 3 iterations, or --iterations-per-run 0, one file at
    --output with every iteration."""
    out = tmp_path / "one.yaml"
    base = ["compile", TINY, "eval.every=0", "-o", str(out)]
    assert main([*base, "experiment.iterations=3"]) == 0, capsys.readouterr().err
    assert rollouts_and_start(out)[0] == [0, 1, 2]
    assert main([*base, "experiment.iterations=12", "--iterations-per-run", "0"]) == 0
    assert rollouts_and_start(out)[0] == list(range(12))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["one.yaml"]
    assert main([*base, "experiment.iterations=12"]) == 0
    assert rollouts_and_start(tmp_path / "one-part1-of-2.yaml")[0] == list(range(10))
    assert rollouts_and_start(tmp_path / "one-part2-of-2.yaml")[0] == [10, 11]
