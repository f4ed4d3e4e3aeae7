"""The run report: figures drawn from the metrics the store holds."""

from __future__ import annotations

from drmas.analysis.report import run_history, write_report
from drmas.config import load_config
from drmas.infra.layout import run_path, stage_path
from drmas.infra.store import Store

CONFIG = "configs/math_tiny.yaml"


def _metrics(i: int) -> dict[str, float]:
    return {
        "reward/mean": 0.1 * i,
        "agent/solver/reward_mean": 0.1 * i,
        "agent/verifier/reward_mean": 0.2,
        "agent/solver/adv_mean": 0.0,
        "agent/solver/adv_std": 0.8,
        "agent/solver/lemma_multiplier": 1.0 + i,
        "agent/solver/adv_sq_ratio": 1.0 + i / 2,
        "agent/solver/lemma_mean_gap": float(i),
        "agent/solver/lemma_var_ratio": 1.0,
        "wg/solver/grad_norm": 0.5,
        "wg/solver/grad_norm_max": 0.7,
    }


def test_history_reads_the_evaluation_before_training_and_every_checkpoint(tmp_path):
    config = load_config(CONFIG, [f"store.root={tmp_path}", "experiment.iterations=5"])
    store = Store.from_config(config.store)
    with store.writer(f"{run_path('math-tiny', 'r')}/init/evaluate") as out:
        out.write_json("metrics.json", {"eval/avg_at_4": 0.25})
    for i in range(3):  # iterations 0..2 checkpointed; 3 and 4 never ran
        with store.writer(stage_path("math-tiny", "r", i, "checkpoint")) as out:
            out.write_json("metrics.json", _metrics(i))
    with store.writer(stage_path("math-tiny", "r", 1, "evaluate")) as out:  # as a Kubeflow run leaves it
        out.write_json("metrics.json", {"eval/avg_at_4": 0.5})
    history = run_history(config, store, "r")
    assert [step for step, _ in history] == [0, 1, 2, 3]
    assert history[0][1] == {"eval/avg_at_4": 0.25} and history[3][1]["reward/mean"] == 0.2
    assert history[2][1]["eval/avg_at_4"] == 0.5 and "eval/avg_at_4" not in history[1][1]


def test_report_draws_what_the_metrics_hold(tmp_path):
    config = load_config(CONFIG)
    history = [(0, {"eval/avg_at_4": 0.25})] + [(i + 1, _metrics(i)) for i in range(4)]
    files = write_report(config, history, tmp_path / "report", "the table")
    names = {path.name for path in files}
    assert names == {"reward.png", "grad_norms.png", "advantages.png", "lemma.png", "report.md"}
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in files if path.suffix == ".png")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "the table" in text and "![lemma](lemma.png)" in text


def test_a_figure_without_data_is_left_out(tmp_path):
    """No Lemma statistics (e.g. a run logged without them): no empty lemma.png."""
    config = load_config(CONFIG)
    history = [(1, {"reward/mean": 0.1, "agent/solver/reward_mean": 0.1, "wg/solver/grad_norm": 0.4})]
    names = {path.name for path in write_report(config, history, tmp_path, "")}
    assert "lemma.png" not in names and "advantages.png" not in names
    assert {"reward.png", "grad_norms.png", "report.md"} <= names
