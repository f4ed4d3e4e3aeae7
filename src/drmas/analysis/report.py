"""The run report: curves a person would rather look at than read, built from the store.

    run_history(config, store, run_id) -> [(step, metrics)]      step 0 = before training
    iteration_metrics(config, store, run_id, i) -> metrics | None
    write_report(config, history, out_dir, summary_text) -> [files]

Every figure comes from the metrics that the checkpoints and the evaluation before training
wrote into the store, not from MLflow: a resumed run, a run whose tracking server went away,
and a run on another machine all get the same report. Figures:

- ``reward.png``: mean reward and each agent's, per iteration, and eval avg@k / pass@k;
- ``eval_by_source.png``: avg@k and pass@k per data source, when the eval set has several
  (MATH-500, AIME and AMC move apart, and the overall figure hides which moved);
- ``grad_norms.png``: per-agent gradient norms (``diagnostics.per_agent_grad_norm``) or,
  without them, per-worker-group ones;
- ``advantages.png``: each agent's advantage mean and standard deviation;
- ``lemma.png``: per agent, the measured factor by which the global baseline scales its
  advantage second moment (mean A^2 under GRPO over Dr. MAS, on the same batch) beside the
  Lemma 4.2 multiplier (mean over prompt groups), and the lemma's two terms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from drmas.config import DrmasConfig
from drmas.infra.layout import FINAL_EVALUATION, evaluation_path, init_home, iteration_path, stage_path
from drmas.infra.store import Store

__all__ = ["FINAL_PREFIX", "History", "as_final", "iteration_metrics", "run_history", "series", "write_report"]

History = list[tuple[int, dict[str, float]]]


def run_history(config: DrmasConfig, store: Store, run_id: str) -> History:
    """(step, metrics) for the evaluation before training (step 0, when there is one) and
    every checkpointed iteration (step i + 1, with its evaluation when one ran), in order."""
    history: History = []
    before = evaluation_path(init_home(config.experiment.name, run_id))
    if store.exists(before):
        history.append((0, store.open(before).read_json("metrics.json")))
    for i in range(config.total_iterations):
        metrics = iteration_metrics(config, store, run_id, i)
        if metrics is None:
            break
        history.append((i + 1, metrics))
    return history


def iteration_metrics(config: DrmasConfig, store: Store, run_id: str, i: int) -> dict[str, float] | None:
    """The metrics of iteration ``i``, with its evaluation's when one ran; None when it has
    no checkpoint."""
    experiment = config.experiment.name
    path = stage_path(experiment, run_id, i, "checkpoint")
    if not store.exists(path):
        return None
    metrics = store.open(path).read_json("metrics.json")
    evaluation = stage_path(experiment, run_id, i, "evaluate")
    if store.exists(evaluation):  # every run evaluates after the checkpoint (drmas.stages.iteration)
        metrics = {**store.open(evaluation).read_json("metrics.json"), **metrics}
    final = evaluation_path(iteration_path(experiment, run_id, i), FINAL_EVALUATION)
    if store.exists(final):
        metrics = {**metrics, **as_final(store.open(final).read_json("metrics.json"))}
    return metrics


FINAL_PREFIX = f"{FINAL_EVALUATION}/"
"""The final evaluation's metrics: ``final/eval/...``."""


def as_final(metrics: dict[str, float]) -> dict[str, float]:
    """A final evaluation's metrics under their own names (``final/eval/avg_at_16``), beside
    the periodic evaluation of the same checkpoint."""
    return {f"{FINAL_PREFIX}{key}": value for key, value in metrics.items()}


def series(history: History, key: str) -> tuple[list[int], list[float]]:
    """The steps at which ``key`` was logged, and its values there."""
    points = [(step, metrics[key]) for step, metrics in history if key in metrics]
    return [p[0] for p in points], [p[1] for p in points]


def _names(history: History, pattern: str) -> list[str]:
    """The distinct first groups of ``pattern`` over every metric key in the history."""
    found = {m.group(1) for _, metrics in history for key in metrics if (m := re.fullmatch(pattern, key))}
    return sorted(found)


def _panel(axis, history: History, keys: Iterable[tuple[str, str]], title: str, ylabel: str) -> bool:
    """Plot (label, metric key) lines on ``axis``; False when none of them has data."""
    drawn = False
    for label, key in keys:
        steps, values = series(history, key)
        if steps:
            axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
            drawn = True
    axis.set_title(title)
    axis.set_xlabel("completed iterations")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    if drawn:
        axis.legend(fontsize=8)
    return drawn


def write_report(config: DrmasConfig, history: History, out_dir: Path, summary_text: str = "") -> list[Path]:
    """Write the PNG figures and a ``report.md`` that shows them; returns the files written."""
    import matplotlib  # noqa: PLC0415 - plotting only when a report is asked for

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    agents = _names(history, r"agent/([^/]+)/reward_mean")
    groups = _names(history, r"wg/([^/]+)/grad_norm")
    k = config.eval.k
    written: list[Path] = []

    def figure(name: str, panels: list[tuple[list[tuple[str, str]], str, str]]) -> None:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        drawn = [
            _panel(axis, history, keys, title, ylabel)
            for axis, (keys, title, ylabel) in zip(axes[0], panels, strict=True)
        ]
        if any(drawn):
            fig.tight_layout()
            fig.savefig(out_dir / name, dpi=100)
            written.append(out_dir / name)
        plt.close(fig)

    figure(
        "reward.png",
        [
            ([("mean", "reward/mean")] + [(a, f"agent/{a}/reward_mean") for a in agents], "training reward", "reward"),
            ([(f"avg@{k}", f"eval/avg_at_{k}"), (f"pass@{k}", f"eval/pass_at_{k}")], "evaluation", "success"),
        ],
    )
    sources = _names(history, rf"eval/([^/]+)/avg_at_{k}")
    if len(sources) > 1:  # one source is the overall figure again
        figure(
            "eval_by_source.png",
            [
                ([(s, f"eval/{s}/avg_at_{k}") for s in sources], f"avg@{k} per data source", "success"),
                ([(s, f"eval/{s}/pass_at_{k}") for s in sources], f"pass@{k} per data source", "success"),
            ],
        )
    per_agent = _names(history, r"agent/([^/]+)/grad_norm")
    norms = [(a, f"agent/{a}/grad_norm") for a in per_agent] or [(g, f"wg/{g}/grad_norm") for g in groups]
    figure(
        "grad_norms.png",
        [
            (norms, "gradient norm per " + ("agent" if per_agent else "worker group"), "norm before clipping"),
            ([(g, f"wg/{g}/grad_norm_max") for g in groups], "largest step norm per worker group", "norm"),
        ],
    )
    figure(
        "advantages.png",
        [
            ([(a, f"agent/{a}/adv_mean") for a in agents], "advantage mean per agent", "mean"),
            ([(a, f"agent/{a}/adv_std") for a in agents], "advantage std per agent", "std"),
        ],
    )
    figure(
        "lemma.png",
        [
            (
                [(f"{a} measured", f"agent/{a}/adv_sq_ratio") for a in agents]
                + [(f"{a} Lemma 4.2", f"agent/{a}/lemma_multiplier") for a in agents],
                "global baseline / Dr. MAS, advantage second moment",
                "ratio",
            ),
            (
                [(f"{a} mean gap", f"agent/{a}/lemma_mean_gap") for a in agents]
                + [(f"{a} variance ratio", f"agent/{a}/lemma_var_ratio") for a in agents],
                "the lemma's terms, mean over prompt groups",
                "term",
            ),
        ],
    )
    lines = [f"# drmas run report: {config.experiment.name}", ""]
    if summary_text:
        lines += ["```", summary_text, "```", ""]
    lines += [f"![{path.stem}]({path.name})" for path in written]
    (out_dir / "report.md").write_text("\n".join(lines) + "\n")
    return [*written, out_dir / "report.md"]
