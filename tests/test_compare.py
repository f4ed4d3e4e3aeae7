"""The advantage-mode comparison: its spike statistic and its report."""

from __future__ import annotations

import math

from drmas.compare import ComparisonRun, spike, write_comparison
from drmas.config import load_config
from drmas.store import Store


def test_spike_is_the_worst_step_over_the_median():
    assert spike([1.0, 1.0, 1.0, 5.0]) == 5.0
    assert spike([2.0, 2.0, 2.0]) == 1.0
    assert spike([1.0, float("nan"), 3.0, 1.0]) == 3.0  # a skipped (non-finite) step is not a spike
    assert math.isnan(spike([]))


def _history(norms: list[float], multiplier: float, final_eval: float) -> list[tuple[int, dict[str, float]]]:
    history = [(0, {"eval/avg_at_4": 0.5, "eval/pass_at_4": 0.8})]
    for i, norm in enumerate(norms):
        history.append((i + 1, {
            "agent/solver/reward_mean": 0.6, "agent/verifier/reward_mean": 0.7,
            "agent/solver/grad_norm": norm, "agent/verifier/grad_norm": 1.0,
            "agent/solver/lemma_multiplier": multiplier, "agent/verifier/lemma_multiplier": 1.0,
            "agent/solver/lemma_variance_ratio": multiplier - 0.1, "agent/solver/lemma_mean_mismatch": 0.1,
            "wg/solver/skipped": 0.0, "wg/verifier/skipped": 1.0 if i == 0 else 0.0,
        }))
    history[-1][1].update({"eval/avg_at_4": final_eval, "eval/pass_at_4": 0.9})
    return history


def test_report_names_modes_agents_spikes_and_results(tmp_path):
    config = load_config("configs/math_tiny.yaml", [f"store.root={tmp_path}"])
    store = Store.from_config(config.store)
    runs = [
        ComparisonRun("grpo", 0, "c-grpo-s0", _history([1.0, 1.0, 8.0, 1.0], 1.5, 0.60)),
        ComparisonRun("grpo", 1, "c-grpo-s1", _history([1.0, 4.0, 1.0, 1.0], 1.5, 0.70)),
        ComparisonRun("drmas", 0, "c-drmas-s0", _history([1.0, 1.0, 1.0, 1.0], 1.5, 0.80)),
    ]
    uri = write_comparison(config, store, "c", runs)
    assert uri == store.uri("math-tiny/c/report")
    report = store.open("math-tiny/c/report")
    assert report.read_bytes("grad_norms.png").startswith(b"\x89PNG") and report.read_bytes("lemma.png").startswith(b"\x89PNG")
    text = report.read_bytes("report.md").decode()
    assert "| grpo | solver | 6.000 ± 2.000 |" in text  # spikes 8 and 4 over a median of 1
    assert "| drmas | solver | 1.000 |" in text
    assert "| solver | 0.600 | 1.500 | 1.400 | 0.100 |" in text
    assert "| grpo | 0.650 ± 0.050 | 0.900 ± 0.000 | 2 |" in text  # one skipped step per grpo run
    assert "| drmas | 0.800 | 0.900 | 1 |" in text
