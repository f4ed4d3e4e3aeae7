"""The ``drmas`` command line as a user meets it: what it prints where, its messages and
its exit statuses (0 done, 1 failed, 2 a usage or config error), in this process."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import drmas

from drmas import __version__, cli_common
from drmas.config import load_config
from drmas.infra.store import Store
from drmas.runner import open_run

ROOT = Path(__file__).resolve().parents[1]
MATH = str(ROOT / "configs" / "math_tiny.yaml")
COMMANDS = ("config", "run", "eval", "rerun", "compare", "compile", "submit")


# --------------------------------------------------------------------------------------
# drmas alone, --version, --help
# --------------------------------------------------------------------------------------


def test_drmas_alone_prints_the_commands_and_exits_2(capsys):
    status, out, err = drmas(capsys)
    assert status == 2
    assert out == ""
    assert "usage: drmas" in err
    assert all(f"\n    {command} " in err for command in COMMANDS), err
    assert "error" not in err


def test_version_prints_the_package_version(capsys):
    status, out, _ = drmas(capsys, "--version")
    assert (status, out) == (0, f"drmas {__version__}\n")


def test_root_help_keeps_the_examples(capsys):
    status, out, _ = drmas(capsys, "--help")
    assert status == 0
    assert "examples:\n    drmas config CONFIG" in out
    assert "drmas rerun CONFIG --run-id ID --iteration I --stage advantage" in out


# --------------------------------------------------------------------------------------
# drmas config: machine output on stdout, prose on stderr
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_config_prints_only_the_resolved_config_on_stdout(output, capsys):
    status, out, err = drmas(capsys, "config", MATH, "workers.sharing=by_model", "-o", output)
    assert status == 0, err
    resolved = json.loads(out) if output == "json" else yaml.safe_load(out)
    assert resolved == json.loads(load_config(MATH, ["workers.sharing=by_model"]).to_json())
    assert err.startswith("worker group solver-verifier: model tiny, agents solver, verifier")


def test_config_output_defaults_to_json(capsys):
    status, out, _ = drmas(capsys, "config", MATH)
    assert status == 0
    assert json.loads(out)["experiment"]["name"] == "math-tiny"


def test_docs_show_the_allowed_values_of_literal_fields(capsys):
    status, out, _ = drmas(capsys, "config", "--docs")
    assert status == 0
    assert "workers.sharing ('none' | 'by_model', default 'by_model'): " in out
    assert "algorithm.advantage ('drmas' | 'grpo', default 'drmas'): " in out
    assert "workers.groups (dict[str, list[str]] | None, default None): " in out
    assert "Literal" not in out


# --------------------------------------------------------------------------------------
# Override errors name the override as typed
# --------------------------------------------------------------------------------------


def test_an_override_error_names_the_override_not_the_file(capsys):
    status, out, err = drmas(capsys, "config", MATH, "agents.solver.lr=abc")
    assert (status, out) == (2, "")
    assert "invalid config in overrides (1 problem(s))" in err
    assert "  - override agents.solver.lr: Input should be a valid number" in err
    assert "agents[0]" not in err and "math_tiny.yaml" not in err


def test_a_problem_in_the_file_keeps_the_files_path(tmp_path, capsys):
    raw = yaml.safe_load(Path(MATH).read_text())
    raw["agents"][0]["lr"] = "abc"
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(raw))
    status, _, err = drmas(capsys, "config", str(config), "rollout.group_size=4")
    assert status == 2
    assert f"invalid config in {config} with overrides (1 problem(s))" in err
    assert "  - agents[0].lr: Input should be a valid number" in err


def test_an_unknown_agent_in_an_override_gets_a_did_you_mean_and_the_agents(capsys):
    status, _, err = drmas(capsys, "config", MATH, "agents.solvr.lr=1")
    assert status == 2
    assert (
        "override agents.solvr.lr: agents.solvr: no element with index or name 'solvr' "
        "(agents: solver, verifier); did you mean 'solver'?"
    ) in err


def test_an_override_error_does_not_echo_the_override(capsys):
    status, _, err = drmas(capsys, "config", MATH, "experiment.name.x=http://ann:hunter2@mlflow:5000")
    assert status == 2
    assert "override experiment.name.x: experiment.name.x is inside a value, not a section" in err
    assert "hunter2" not in err


def test_an_unknown_section_in_an_override_is_named_under_the_override(capsys):
    status, _, err = drmas(capsys, "config", MATH, "rolout.group_size=2")
    assert status == 2
    assert "override rolout.group_size: rolout: unknown key; did you mean 'rollout'?" in err


# --------------------------------------------------------------------------------------
# Usage errors: exit 2 with the command's usage
# --------------------------------------------------------------------------------------


def test_run_without_arguments_asks_for_config_only(capsys):
    status, _, err = drmas(capsys, "run")
    assert status == 2
    assert "drmas run: error: the following arguments are required: CONFIG\n" in err


def test_a_folder_as_config_is_named_a_folder_with_its_yaml_files(capsys):
    status, _, err = drmas(capsys, "run", str(ROOT / "configs"))
    assert status == 2
    assert f"drmas run: error: CONFIG {ROOT / 'configs'} is a folder, not a YAML file; its YAML files: " in err
    assert MATH in err
    assert "does not exist" not in err


def test_an_override_as_config_says_the_config_is_missing(capsys):
    status, _, err = drmas(capsys, "run", "agents.solver.lr=1")
    assert status == 2
    assert "drmas run: error: CONFIG is missing: agents.solver.lr=1 is an override; the YAML file comes first" in err
    assert "does not exist" not in err


def test_a_missing_config_file_still_says_it_does_not_exist(tmp_path, capsys):
    status, _, err = drmas(capsys, "run", str(tmp_path / "nope.yaml"))
    assert status == 2
    assert f"config file {tmp_path / 'nope.yaml'} does not exist" in err


def test_stage_takes_only_the_stages_of_an_iteration(capsys):
    status, _, err = drmas(capsys, "rerun", MATH, "--run-id", "r", "--iteration", "0", "--stage", "bogus")
    assert status == 2
    assert (
        "argument --stage: invalid choice: 'bogus' "
        "(choose from 'rollout', 'advantage', 'update', 'checkpoint', 'evaluate')" in err
    )


@pytest.mark.parametrize(("count", "problem"), [("0", "0: a run part takes at least 1"), ("x", "'x' is not a whole")])
def test_iterations_takes_a_count_of_at_least_one(tmp_path, count, problem, capsys):
    status, _, err = drmas(capsys, "compile", MATH, "--iterations", count, "-o", str(tmp_path / "p.yaml"))
    assert status == 2
    assert f"drmas compile: error: argument --iterations: {problem}" in err
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.parametrize("command", ["rerun", "eval"])
def test_run_id_and_iteration_have_help(command, capsys):
    status, out, _ = drmas(capsys, command, "--help")
    assert status == 0
    assert re.search(r"--run-id RUN_ID\s+the run whose", out), out
    assert re.search(r"--iteration I\s+\w", out), out


def test_worker_group_needs_stage_update_and_a_worker_group_of_the_config(tmp_path, capsys):
    for stage, group in (("advantage", "solver"), ("update", "critic")):
        status, _, err = drmas(
            capsys,
            "rerun",
            MATH,
            f"store.root={tmp_path}",
            "--run-id",
            "r",
            "--iteration",
            "0",
            "--stage",
            stage,
            "--worker-group",
            group,
        )
        assert status == 2
        assert (
            "drmas rerun: --worker-group takes --stage update and one of solver, verifier "
            f"(got --stage {stage} --worker-group {group})" in err
        )


# --------------------------------------------------------------------------------------
# A run that does not exist
# --------------------------------------------------------------------------------------


def started_run(root: Path, run_id: str) -> None:
    """Record a run in the store at ``root``, as ``drmas run`` does before training."""
    config = load_config(MATH, [f"store.root={root}"])
    open_run(config, Store.from_config(config.store), run_id, resume=False)


@pytest.mark.parametrize(
    "command",
    [
        ["rerun", "--run-id", "nope", "--iteration", "0", "--stage", "advantage"],
        ["eval", "--run-id", "nope"],
        ["run", "--resume", "nope"],
    ],
    ids=lambda command: command[0],
)
def test_an_unknown_run_is_named_with_the_runs_there(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    started_run(tmp_path / "runs", "first")
    status, _, err = drmas(capsys, *command, MATH, f"store.root={tmp_path / 'runs'}")
    assert status == 1
    assert f"drmas {command[0]}: no run 'nope' in {tmp_path / 'runs'}/math-tiny (its runs: first)\n" in err
    assert "invalid config" not in err


def test_rerun_of_one_worker_groups_update_recomputes_its_policy(tmp_path, monkeypatch, capsys):
    started_run(tmp_path, "first")
    stages = []

    def rerun(config, store, run_id, iteration, stage, cache_dir=None):
        stages.append(stage)
        return SimpleNamespace(recomputed=[stage], ran=["rollout", stage])

    monkeypatch.setattr("drmas.runner.rerun", rerun)
    status, out, err = drmas(
        capsys,
        "rerun",
        MATH,
        f"store.root={tmp_path}",
        "--run-id",
        "first",
        "--iteration",
        "0",
        "--stage",
        "update",
        "--worker-group",
        "verifier",
    )
    assert status == 0, err
    assert stages == ["update/verifier"]
    assert "recomputed: update/verifier; cache hits: rollout" in out


@pytest.mark.parametrize(
    ("native", "overrides", "warned"),
    [
        (False, ["models.tiny.dtype=bfloat16"], True),
        (True, ["models.tiny.dtype=bfloat16"], False),  # AVX-512 or AMX
        (False, [], False),  # float32
        (False, ["models.tiny.dtype=bfloat16", "ray.pool_resource=GPU"], False),  # trains on GPUs
    ],
)
def test_a_bf16_model_on_a_cpu_without_native_bf16_is_warned_about(native, overrides, warned, monkeypatch, capsys):
    """Emulated bf16 took 12.6x float32's time on an AVX2-only CPU: the run says so and how
    to switch, before it starts."""
    monkeypatch.setattr("drmas.config.hardware.native_bf16", lambda: native)
    cli_common.warn_if_bf16_is_slow_here(load_config(MATH, overrides))
    expected = "drmas run: warning: this CPU has no native bf16 (AVX-512 or AMX): the bfloat16 model(s) tiny "
    assert (expected in capsys.readouterr().err) == warned
    if warned:
        cli_common.warn_if_bf16_is_slow_here(load_config(MATH, overrides))
        assert "add models.tiny.dtype=float32\n" in capsys.readouterr().err


def test_the_kubeflow_commands_name_their_extra_when_kfp_is_missing(tmp_path):
    """kfp is the ``kubeflow`` extra, not a dependency of the library: without it, drmas
    still runs, and compile, submit and run --via kfp-local stop naming the extra to
    install, writing nothing. (A ``kfp`` package that fails to import stands in for its
    absence.)"""
    import subprocess

    missing = tmp_path / "no-kfp" / "kfp"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('No module named kfp')\n")
    env = {**os.environ, "PYTHONPATH": str(missing.parent)}
    drmas_bin = str(Path(sys.executable).parent / "drmas")
    out, store = tmp_path / "p.yaml", tmp_path / "store"
    for command in (
        ["compile", MATH, "-o", str(out)],
        ["submit", MATH, "--host", "http://127.0.0.1:9", "-o", str(out)],
        ["run", MATH, "--via", "kfp-local", f"store.root={store}"],
    ):
        done = subprocess.run([drmas_bin, *command], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "pip install 'drmas[kubeflow]'" in done.stderr, done.stderr
    assert not out.exists() and not store.exists()
    assert subprocess.run([drmas_bin, "config", MATH], env=env, capture_output=True, timeout=120).returncode == 0
