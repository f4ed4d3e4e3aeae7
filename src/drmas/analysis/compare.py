"""Advantage modes side by side: the paper's finding (Figure 3), reproduced on one machine.

    drmas compare CONFIG --advantage grpo,drmas --seeds 3 [overrides] [--name NAME]

trains the same team once per (mode, seed) with ``algorithm.advantage`` set to the mode,
``experiment.seed`` to the seed and per-agent gradient norms switched on, then writes a
report (Markdown and PNG, into the store and to MLflow):

- per-agent gradient norms over iterations for every mode (mean over seeds, band = range);
- per agent, what the global baseline does to it: the measured ratio of its advantage
  second moment under GRPO over Dr. MAS (both computed on every batch), the Lemma 4.2
  multiplier per prompt group and its two terms (1 when its rewards look like everyone's);
- per agent, the GRPO / Dr. MAS ratio of gradient norms beside the square roots of those
  two predictions, the largest gradient-norm spike per mode (max over median of a run,
  mean and spread over seeds), skipped non-finite steps, and final eval avg@k and pass@k.

Every run starts from the same policies: the first run's initial and warm-started policies
are copied (byte for byte, manifest and all) into the other runs instead of being trained
again. As in the paper, where every run starts from one pretrained model, the seeds vary
the RL (question order, sampling, update noise), not the starting point; and the warm
start, often the longest part of a small run, is trained once. Every run is an
ordinary drmas run (``{name}-{mode}-s{seed}``): resumable, browsable, rerunnable. A
comparison that was interrupted continues where it stopped when started again.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from drmas.analysis.report import History, run_history, series
from drmas.config import DrmasConfig, load_config
from drmas.infra.layout import run_path
from drmas.infra.store import Store

__all__ = ["ComparisonRun", "compare", "mismatch_reading", "spike", "write_comparison"]


@dataclass(frozen=True)
class ComparisonRun:
    mode: str
    seed: int
    run_id: str
    history: History


def compare(
    config_path: str,
    overrides: list[str],
    modes: list[str],
    seeds: list[int],
    name: str,
    cache_dir: Path | None = None,
) -> tuple[list[ComparisonRun], str]:
    """Train every (mode, seed), then write the comparison report; returns the runs and the
    report's URI in the store."""
    from drmas.generation.ray_session import ray_session  # noqa: PLC0415 - Ray only when comparing
    from drmas.runner import open_run, train  # noqa: PLC0415 - the runner pulls in Ray
    from drmas.tasks import run_length  # noqa: PLC0415

    runs: list[ComparisonRun] = []
    base = run_length(load_config(config_path, overrides))  # the report names the runs' length
    store = Store.from_config(base.store)
    first: str | None = None
    # One Ray for all the runs: each frees its pool when it completes, and a local Ray
    # started once saves every later run its start-up (~5 s and its processes).
    with ray_session(base, cache_dir / "ray" if cache_dir else None):
        for seed in seeds:
            for mode in modes:
                config = load_config(
                    config_path,
                    [
                        *overrides,
                        f"algorithm.advantage={mode}",
                        f"experiment.seed={seed}",
                        "diagnostics.per_agent_grad_norm=true",
                    ],
                )
                run_id = f"{name}-{mode}-s{seed}"
                config = open_run(
                    config, store, run_id, resume=store.exists(f"{run_path(config.experiment.name, run_id)}/run")
                )
                if first is not None:
                    _share_start(store, config.experiment.name, first, run_id)
                train(config, store, run_id, cache_dir=cache_dir, config_path=config_path)
                runs.append(ComparisonRun(mode, seed, run_id, run_history(config, store, run_id)))
                first = first or run_id
    from drmas.infra.tracking import Tracker  # noqa: PLC0415

    tracker = Tracker(base, name, store.root, config_path)
    uri = write_comparison(base, store, name, runs, tracker)
    tracker.finish()
    return runs, uri


def _share_start(store: Store, experiment: str, source_run: str, target_run: str) -> None:
    """Copy the initial and warm-started policies of ``source_run`` into ``target_run``."""
    source_root, target_root = run_path(experiment, source_run), run_path(experiment, target_run)
    for path in store.list(source_root):
        relative = path[len(source_root) + 1 :]
        if not relative.startswith(("init/policy/", "warmstart/policy/")) or store.exists(f"{target_root}/{relative}"):
            continue
        with tempfile.TemporaryDirectory() as scratch:
            local = store.open(path).download(Path(scratch) / "copy")
            with store.writer(
                f"{target_root}/{relative}", meta={"stage": relative.split("/")[0], "copied_from": store.uri(path)}
            ) as out:
                out.put_dir(local, "")


VISIBLE_MISMATCH = 0.1
"""How far from 1 a second-moment ratio must be for the global baseline to matter visibly."""


def mismatch_reading(ratios: dict[str, float]) -> str:
    """What the measured second-moment ratios predict for the comparison, in one sentence."""
    measured = {agent: value for agent, value in ratios.items() if np.isfinite(value)}
    if not measured:
        return (
            "No batch had rewards that differed within a prompt group: the ratios are undefined, "
            "and neither mode had a gradient to scale."
        )
    agent, value = max(measured.items(), key=lambda item: abs(item[1] - 1))
    if abs(value - 1) < VISIBLE_MISMATCH:
        return (
            f"In this setting every agent's measured ratio is within {abs(value - 1):.2f} of 1: the global "
            "baseline gives each agent about the advantage scale Dr. MAS gives it, so the two modes "
            "should behave alike; differences within the spread over seeds below are noise, not the "
            "effect the paper reports."
        )
    return (
        f"In this setting the global baseline scales {agent}'s advantage second moment by {value:.2f} "
        f"on average (so its gradient norm by about {np.sqrt(value):.2f}) relative to Dr. MAS: the "
        "results below show what that does."
    )


def spike(values: list[float]) -> float:
    """The largest value over the median: how far the worst step stands out of the run."""
    finite = [v for v in values if np.isfinite(v)]
    if not finite:
        return float("nan")
    median = float(np.median(finite))
    return float(np.max(finite) / median) if median > 0 else float("inf")


def _series(history: History, key: str) -> tuple[np.ndarray, np.ndarray]:
    steps, values = series(history, key)
    return np.array(steps), np.array(values, dtype=float)


def _agents(runs: list[ComparisonRun]) -> list[str]:
    return sorted(
        {
            key.split("/")[1]
            for run in runs
            for _, m in run.history
            for key in m
            if key.startswith("agent/") and key.endswith("/reward_mean")
        }
    )


def _last(history: History, key: str) -> float:
    _, values = _series(history, key)
    return float(values[-1]) if len(values) else float("nan")


def _band(axis, runs: list[ComparisonRun], key: str, label: str) -> None:
    """Mean over seeds as a line, min-max over seeds as a band (steps every run has)."""
    series = [_series(run.history, key) for run in runs]
    series = [s for s in series if len(s[0])]
    if not series:
        return
    steps = sorted(set.intersection(*(set(s[0].tolist()) for s in series)))
    values = np.array([[dict(zip(s[0].tolist(), s[1].tolist(), strict=True))[step] for step in steps] for s in series])
    line = axis.plot(steps, values.mean(axis=0), label=label)[0]
    if len(series) > 1:
        axis.fill_between(steps, values.min(axis=0), values.max(axis=0), color=line.get_color(), alpha=0.2)


def _mean_spread(values: list[float]) -> str:
    finite = [v for v in values if np.isfinite(v)]
    if not finite:
        return "n/a"
    return f"{np.mean(finite):.3f} ± {np.std(finite):.3f}" if len(finite) > 1 else f"{finite[0]:.3f}"


def write_comparison(config: DrmasConfig, store: Store, name: str, runs: list[ComparisonRun], tracker=None) -> str:
    """Figures and ``report.md`` into ``{experiment}/{name}/report`` in the store (and into
    ``tracker``'s MLflow run, when given)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415

    modes = list(dict.fromkeys(run.mode for run in runs))
    agents = _agents(runs)
    k = config.eval.k
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        figures = []
        for stem, title, keys in (
            ("grad_norms", "gradient norm (before clipping)", [("", "grad_norm")]),
            (
                "lemma",
                "global baseline vs Dr. MAS",
                [
                    ("measured A^2 ratio", "adv_sq_ratio"),
                    ("Lemma 4.2 multiplier", "lemma_multiplier"),
                    ("mean gap", "lemma_mean_gap"),
                    ("variance ratio", "lemma_var_ratio"),
                ],
            ),
        ):
            fig, axes = plt.subplots(
                len(keys), len(agents), figsize=(4.5 * len(agents), 3.2 * len(keys)), squeeze=False
            )
            for row, (label, suffix) in enumerate(keys):
                for column, agent in enumerate(agents):
                    axis = axes[row][column]
                    for mode in modes:
                        _band(axis, [r for r in runs if r.mode == mode], f"agent/{agent}/{suffix}", mode)
                    axis.set_title(f"{agent}: {label or title}", fontsize=10)
                    axis.set_xlabel("completed iterations")
                    axis.grid(alpha=0.3)
                    if axis.lines:
                        axis.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / f"{stem}.png", dpi=100)
            plt.close(fig)
            figures.append(f"{stem}.png")
        (out / "report.md").write_text(_markdown(config, name, runs, modes, agents, k, figures))
        path = f"{config.experiment.name}/{name}/report"
        with store.writer(path, overwrite=True, meta={"stage": "compare"}) as writer:
            writer.put_dir(out, "")
        if tracker is not None:
            tracker.log_files(sorted(out.iterdir()), "report")
    return store.uri(path)


def _markdown(
    config: DrmasConfig,
    name: str,
    runs: list[ComparisonRun],
    modes: list[str],
    agents: list[str],
    k: int,
    figures: list[str],
) -> str:
    seeds = sorted({run.seed for run in runs})

    def values_of(agent: str, suffix: str, mode: str | None = None) -> np.ndarray:
        return np.array(
            [v for run in runs if mode in (None, run.mode) for v in _series(run.history, f"agent/{agent}/{suffix}")[1]],
            dtype=float,
        )

    def mean_of(agent: str, suffix: str, mode: str | None = None) -> float:
        values = values_of(agent, suffix, mode)
        finite = values[np.isfinite(values)]
        return float(finite.mean()) if len(finite) else float("nan")

    def cell(value: float) -> str:
        return f"{value:.3f}" if np.isfinite(value) else "n/a"

    lines = [
        f"# Advantage modes compared: {name}",
        "",
        f"Team: {', '.join(a.name for a in config.agents)} on `{config.task.orchestra_name}` "
        f"({len(config.worker_groups())} worker groups), {config.total_iterations} iterations, "
        f"seeds {', '.join(map(str, seeds))}; modes {', '.join(modes)}. Runs: "
        + ", ".join(f"`{run.run_id}`" for run in runs)
        + f"; all start from the policies of `{runs[0].run_id}`.",
        "",
        "## What the global baseline does to each agent",
        "",
        "A global baseline normalises every agent's advantages with one prompt group's "
        "statistics. An agent whose calls concentrate in some episodes (a second Solver attempt "
        "happens only after a rejection; an Answer agent acts mostly in episodes that reach an "
        "answer) sees rewards whose mean and spread differ from the group's. Measured on every "
        "batch of every run (each batch's advantages are computed in both modes), mean over "
        "iterations and seeds: the ratio of the agent's mean A^2 under GRPO over Dr. MAS, and the "
        "Lemma 4.2 multiplier (sigma_k^2 + (mu_k - mu)^2) / sigma^2 per prompt group with its two "
        "terms. Prompt groups whose trajectories all scored the same have no multiplier (both "
        "modes give them advantage 0) and are counted apart.",
        "",
        "| agent | calls per iteration | mean reward | measured A^2 ratio | Lemma 4.2 multiplier "
        "| its p95 | mean gap | variance ratio | groups without spread |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for agent in agents:
        groups, flat = values_of(agent, "lemma_groups").sum(), values_of(agent, "lemma_flat_groups").sum()
        share = f"{flat / groups:.0%}" if groups else "n/a"
        columns = (
            "calls",
            "reward_mean",
            "adv_sq_ratio",
            "lemma_multiplier",
            "lemma_multiplier_p95",
            "lemma_mean_gap",
            "lemma_var_ratio",
        )
        lines.append(f"| {agent} | " + " | ".join(cell(mean_of(agent, column)) for column in columns) + f" | {share} |")
    lines += ["", mismatch_reading({agent: mean_of(agent, "adv_sq_ratio") for agent in agents})]
    if {"grpo", "drmas"} <= set(modes):
        lines += [
            "",
            "## Gradient norms: observed against predicted",
            "",
            "Per agent, the mean gradient norm of its share of the loss in each mode, their ratio, "
            "and what that ratio would be if the gradient norm scaled as the square root of each "
            "prediction above (the lemma is about the second moment of one call's gradient, not the "
            "norm of a mini-batch step: expect agreement in direction more than in size).",
            "",
            "| agent | grad norm, grpo | grad norm, drmas | observed grpo / drmas "
            "| sqrt(measured A^2 ratio) | sqrt(Lemma 4.2 multiplier) |",
            "|---|---|---|---|---|---|",
        ]
        for agent in agents:
            grpo, drmas = mean_of(agent, "grad_norm", "grpo"), mean_of(agent, "grad_norm", "drmas")
            observed = grpo / drmas if drmas > 0 else float("nan")
            lines.append(
                f"| {agent} | {cell(grpo)} | {cell(drmas)} | {cell(observed)} "
                f"| {cell(np.sqrt(mean_of(agent, 'adv_sq_ratio')))} "
                f"| {cell(np.sqrt(mean_of(agent, 'lemma_multiplier')))} |"
            )
    lines += [
        "",
        "## Results (mean ± spread over seeds)",
        "",
        "An agent whose outputs are near-deterministic (a median gradient norm near 0) has a large "
        "spike ratio from tiny absolute norms: read its spike next to its largest gradient norm.",
        "",
        "| mode | agent | largest spike (max / median grad norm) | largest grad norm | median grad norm |",
        "|---|---|---|---|---|",
    ]
    for mode in modes:
        for agent in agents:
            norms = [_series(r.history, f"agent/{agent}/grad_norm")[1] for r in runs if r.mode == mode]
            spikes = [spike(v.tolist()) for v in norms]
            largest = [float(np.nanmax(v)) if np.isfinite(v).any() else float("nan") for v in norms]
            medians = [float(np.nanmedian(v)) if np.isfinite(v).any() else float("nan") for v in norms]
            lines.append(
                f"| {mode} | {agent} | {_mean_spread(spikes)} | {_mean_spread(largest)} | {_mean_spread(medians)} |"
            )
    lines += ["", f"| mode | eval avg@{k} | eval pass@{k} | skipped non-finite steps |", "|---|---|---|---|"]
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        skipped = sum(
            v
            for r in mine
            for _, m in r.history
            for key, v in m.items()
            if key.startswith("wg/") and key.endswith("/skipped")
        )
        lines.append(
            f"| {mode} | {_mean_spread([_last(r.history, f'eval/avg_at_{k}') for r in mine])} "
            f"| {_mean_spread([_last(r.history, f'eval/pass_at_{k}') for r in mine])} | {int(skipped)} |"
        )
    lines += ["", *[f"![{Path(f).stem}]({f})" for f in figures], ""]
    return "\n".join(lines)
