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
    # per-agent eval metrics are not data sources, and one source draws nothing more
    history[0][1].update({"eval/gsm8k/avg_at_4": 0.25, "eval/agent/solver/avg_at_4": 0.5})
    assert "eval_by_source.png" not in {path.name for path in write_report(config, history, tmp_path / "one", "")}


def test_an_eval_over_several_sources_is_drawn_per_source(tmp_path, monkeypatch):
    """MATH-500 and AIME move apart; the overall figure hides which one moved."""
    from matplotlib.axes import Axes

    drawn: dict[str, list[float]] = {}
    real_plot = Axes.plot
    monkeypatch.setattr(
        Axes, "plot", lambda axis, x, y, **kw: drawn.update({kw["label"]: list(y)}) or real_plot(axis, x, y, **kw)
    )
    every_step = {"eval/avg_at_4": 0.3, "eval/math500/pass_at_4": 0.9}
    history = [
        (step, {**every_step, "eval/math500/avg_at_4": math500, "eval/aime24/avg_at_4": aime24})
        for step, math500, aime24 in ((0, 0.4, 0.1), (2, 0.6, 0.05))
    ]
    files = write_report(load_config(CONFIG), history, tmp_path, "")
    assert tmp_path / "eval_by_source.png" in files
    assert "![eval_by_source](eval_by_source.png)" in (tmp_path / "report.md").read_text()
    # each source's line, as last drawn: math500's pass@4, aime24's avg@4 (it has no pass@4)
    assert drawn["math500"] == [0.9, 0.9] and drawn["aime24"] == [0.1, 0.05]


def test_a_figure_without_data_is_left_out(tmp_path):
    """No Lemma statistics (e.g. a run logged without them): no empty lemma.png."""
    config = load_config(CONFIG)
    history = [(1, {"reward/mean": 0.1, "agent/solver/reward_mean": 0.1, "wg/solver/grad_norm": 0.4})]
    names = {path.name for path in write_report(config, history, tmp_path, "")}
    assert "lemma.png" not in names and "advantages.png" not in names
    assert {"reward.png", "grad_norms.png", "report.md"} <= names
