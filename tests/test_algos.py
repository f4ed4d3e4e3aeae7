"""drmas.algos: hand-derived numbers (derivations in comments) and properties vs an oracle."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import loop_advantages, loop_lemma_terms

from drmas.algos import (
    advantage_second_moment_ratio,
    agent_reward_stats,
    aggregate_loss,
    compute_advantages,
    low_var_kl,
    policy_loss,
    row_scores,
)
from drmas.grouping import factorize

# The worked example of docs/architecture.md §1 / the reference report: one prompt, three trajectories.
#   t1: solver, verifier         R=1
#   t2: solver, solver, verifier R=0
#   t3: solver, verifier         R=1
UID = ["p"] * 7
TRAJ = ["t1", "t1", "t2", "t2", "t2", "t3", "t3"]
AGENT = ["solver", "verifier", "solver", "solver", "verifier", "solver", "verifier"]
REWARD = np.array([1, 1, 0, 0, 0, 1, 1], dtype=np.float64)


def test_worked_example_grpo():
    # Trajectory values [1, 0, 1]: mean 2/3, unbiased std sqrt(((1/3)^2*2 + (2/3)^2)/2)
    # = sqrt(1/3) = 0.57735. A(t1)=A(t3) = (1/3)/0.57735 = +0.57735, A(t2) = -1.15470,
    # the same on every row of a trajectory, solver and verifier alike.
    advantages = compute_advantages(REWARD, UID, TRAJ, AGENT, "grpo")
    expected = [0.57735, 0.57735, -1.15470, -1.15470, -1.15470, 0.57735, 0.57735]
    np.testing.assert_allclose(advantages, expected, atol=1e-4)
    assert advantages.dtype == np.float32


def test_worked_example_drmas():
    # Solver rows [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735,
    # so A = +-0.5 / 0.57735 = +-0.86603. Verifier rows [1, 0, 1] are the GRPO numbers.
    advantages = compute_advantages(REWARD, UID, TRAJ, AGENT, "drmas")
    expected = [0.86603, 0.57735, -0.86603, -0.86603, -1.15470, 0.86603, 0.57735]
    np.testing.assert_allclose(advantages, expected, atol=1e-4)


def test_penalty_hits_only_the_invalid_call_under_drmas_but_spreads_under_grpo():
    # t1's verifier call is malformed: score 1 - 0.1 = 0.9.
    valid = np.array([1, 0, 1, 1, 1, 1, 1], dtype=bool)
    score = row_scores(REWARD, valid, penalty_coef=0.1)
    np.testing.assert_allclose(score, [1, 0.9, 0, 0, 0, 1, 1])
    drmas = compute_advantages(score, UID, TRAJ, AGENT, "drmas")
    # Solver rows are untouched by the verifier's penalty.
    np.testing.assert_allclose(drmas[[0, 2, 3, 5]], [0.86603, -0.86603, -0.86603, 0.86603], atol=1e-4)
    # Verifier rows [0.9, 0, 1]: mean 0.63333, std sqrt((0.26667^2+0.63333^2+0.36667^2)/2)
    # = sqrt((0.071111+0.401111+0.134444)/2) = 0.55076; (0.9-0.63333)/0.55076 = 0.48418.
    assert drmas[1] == pytest.approx(0.48418, abs=1e-4)
    grpo = compute_advantages(score, UID, TRAJ, AGENT, "grpo")
    assert grpo[0] == grpo[1]  # both rows of t1 share its mean score 0.95


def test_singleton_group_gets_raw_score_and_constant_group_gets_zero():
    # A group with one row: mean 0, std 1, so A = score / (1 + eps).
    single = compute_advantages(np.array([0.7]), ["u"], ["t"], ["a"], "drmas")
    assert single[0] == pytest.approx(0.7 / (1 + 1e-6))
    # The search Answer agent acting once in its group: the same raw-score quirk.
    constant = compute_advantages(np.array([1.0, 1.0, 1.0]), ["u"] * 3, ["a", "b", "c"], ["x"] * 3, "grpo")
    np.testing.assert_array_equal(constant, [0.0, 0.0, 0.0])
    # With eps = 0 a constant group would divide 0 by 0: it gets 0, never NaN.
    no_eps = compute_advantages(np.array([1.0, 1.0]), ["u"] * 2, ["a", "b"], ["x"] * 2, "drmas", eps=0)
    np.testing.assert_array_equal(no_eps, [0.0, 0.0])


def test_scale_by_std_off_only_centres():
    advantages = compute_advantages(REWARD, UID, TRAJ, AGENT, "drmas", scale_by_std=False)
    np.testing.assert_allclose(advantages, [0.5, 1 / 3, -0.5, -0.5, -2 / 3, 0.5, 1 / 3], atol=1e-6)


def test_arrow_columns_string_dictionary_and_chunked_give_the_same_result():
    expected = compute_advantages(REWARD, UID, TRAJ, AGENT, "drmas")
    uid = pa.array(UID).dictionary_encode()
    traj = pa.chunked_array([pa.array(TRAJ[:3]), pa.array(TRAJ[3:])])
    agent = pa.chunked_array(
        [pa.array(AGENT[:4]).dictionary_encode(), pa.array(AGENT[4:]).dictionary_encode()]
    )  # two chunks whose dictionaries differ
    np.testing.assert_array_equal(compute_advantages(REWARD, uid, traj, agent, "drmas"), expected)
    np.testing.assert_array_equal(
        compute_advantages(REWARD, uid, traj, agent, "grpo"),
        compute_advantages(REWARD, UID, TRAJ, AGENT, "grpo"),
    )


@pytest.mark.parametrize("layout", ["runs", "runs that recur", "shuffled"])
def test_every_factorize_path_gives_the_same_partition(tmp_path, layout):
    """Numpy, plain, chunked and per-row-group dictionary columns, with and without long
    runs (a key may also come back in a later run)."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    keys = np.repeat([f"key-{i}" for i in range(500)], rng.integers(1, 20, size=500))
    if layout == "shuffled":
        keys = rng.permutation(keys)
    elif layout == "runs that recur":
        keys = np.concatenate([keys, keys[::-1]])
    pq.write_table(pa.table({"k": keys}), tmp_path / "k.parquet", row_group_size=300)
    forms = {
        "numpy": keys,
        "numpy objects": keys.astype(object),
        "plain": pq.read_table(tmp_path / "k.parquet")["k"],
        "dictionary": pq.read_table(tmp_path / "k.parquet", read_dictionary=["k"])["k"],
        "one chunk": pa.array(keys),
        # Parquet readers hand every batch of a row group the whole row-group dictionary.
        "big dictionaries": pa.chunked_array(
            [pa.array(keys[i : i + 50]).dictionary_encode() for i in range(0, len(keys), 50)]
        ).unify_dictionaries(),
    }
    reference = np.unique(keys, return_inverse=True)[1]
    for name, column in forms.items():
        codes, count = factorize(column)
        assert count == len(set(keys)), name
        pairs = np.unique(np.stack([codes, reference]), axis=1)
        assert pairs.shape[1] == count, name  # codes and reference split the rows alike


def test_integer_keys_work_like_strings():
    codes, count = factorize(np.array([7, 3, 7, 9]))
    assert count == 3 and codes[0] == codes[2] and len(set(codes.tolist())) == 3


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: compute_advantages(REWARD, UID[:3], TRAJ, AGENT, "drmas"), "uid has 3 rows"),
        (lambda: compute_advantages(REWARD, UID, TRAJ, AGENT, "ppo"), "unknown advantage mode"),
        (
            lambda: compute_advantages(REWARD, ["p"] * 6 + ["q"], TRAJ, AGENT, "grpo"),
            "traj_uid 't3' .* belongs to more than one uid",
        ),
        (
            lambda: compute_advantages(np.array([1.0, np.nan]), ["u"] * 2, ["a", "b"], ["x"] * 2, "grpo"),
            "score is not finite at row 1",
        ),
        (
            lambda: compute_advantages(REWARD, pa.array(["p"] * 6 + [None]), TRAJ, AGENT, "drmas"),
            "1 null",
        ),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------
# Properties against the loop oracle
# ------------------------------------------------------------------------------------

# Scores from a set whose sums are exact in binary, plus arbitrary floats.
SCORES = st.one_of(
    st.sampled_from([0.0, 1.0, -0.25, 0.75, 0.5]),
    st.floats(-3, 3, allow_nan=False, width=32),
)


@st.composite
def uneven_batches(draw):
    """Prompts with 1-5 trajectories each, 1-5 calls per trajectory, 1-3 agents, in any order."""
    rows = []
    for prompt in range(draw(st.integers(1, 4))):
        for trajectory in range(draw(st.integers(1, 5))):
            for _ in range(draw(st.integers(1, 5))):
                agent = draw(st.sampled_from(["solver", "verifier", "answer"]))
                rows.append((f"p{prompt}", f"p{prompt}t{trajectory}", agent, draw(SCORES)))
    order = draw(st.permutations(range(len(rows))))
    rows = [rows[i] for i in order]
    uid, traj, agent, score = (list(column) for column in zip(*rows, strict=True))
    return np.array(score), uid, traj, agent


@settings(max_examples=300, deadline=None)
@given(batch=uneven_batches(), mode=st.sampled_from(["grpo", "drmas"]), scale=st.booleans())
def test_matches_the_loop_oracle(batch, mode, scale):
    score, uid, traj, agent = batch
    fast = compute_advantages(score, uid, traj, agent, mode, scale_by_std=scale)
    slow = loop_advantages(score, uid, traj, agent, mode, scale_by_std=scale)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-4)


@settings(max_examples=100, deadline=None)
@given(batch=uneven_batches(), mode=st.sampled_from(["grpo", "drmas"]), seed=st.integers(0, 2**16))
def test_row_order_does_not_matter(batch, mode, seed):
    score, uid, traj, agent = batch
    permutation = np.random.default_rng(seed).permutation(len(score))
    shuffled = compute_advantages(
        score[permutation],
        [uid[i] for i in permutation],
        [traj[i] for i in permutation],
        [agent[i] for i in permutation],
        mode,
    )
    np.testing.assert_array_equal(shuffled, compute_advantages(score, uid, traj, agent, mode)[permutation])


@settings(max_examples=100, deadline=None)
@given(batch=uneven_batches())
def test_grpo_gives_every_row_of_a_trajectory_one_value(batch):
    score, uid, traj, agent = batch
    advantages = compute_advantages(score, uid, traj, agent, "grpo")
    for trajectory in set(traj):
        values = {advantages[i] for i in range(len(traj)) if traj[i] == trajectory}
        assert len(values) == 1


@settings(max_examples=100, deadline=None)
@given(batch=uneven_batches())
def test_drmas_groups_are_standardised(batch):
    # Within each (uid, agent) group of 2+ distinct scores: mean 0, unbiased std ~1.
    score, uid, traj, agent = batch
    advantages = compute_advantages(score, uid, traj, agent, "drmas", eps=0.0)
    for key in set(zip(uid, agent, strict=True)):
        rows = [i for i in range(len(score)) if (uid[i], agent[i]) == key]
        if len(rows) > 1 and np.ptp(score[rows]) > 1e-3:
            assert advantages[rows].mean() == pytest.approx(0.0, abs=1e-4)
            assert advantages[rows].std(ddof=1) == pytest.approx(1.0, abs=1e-3)


# ------------------------------------------------------------------------------------
# Lemma 4.2 diagnostics
# ------------------------------------------------------------------------------------


def _lemma(score, uid, traj, agent):
    return agent_reward_stats(np.asarray(score, dtype=float), agent, uid=uid, traj_uid=traj)


def test_lemma_example_multiplier_is_eight():
    """The project page's example: mu = 0, sigma = 0.5, mu_k = 1, sigma_k = 1 gives a
    variance ratio of 4, a mean mismatch of 4 and a multiplier of 8.00."""
    # One prompt, five trajectories; agent j's rows set the trajectory means.
    #   t1: j -0.5 | t2: j -0.5 | t3: k 0, j 0 | t4: k 1, j 0 | t5: k 2, j -1
    # Trajectory means [-0.5, -0.5, 0, 0.5, 0.5]: mu = 0, unbiased var 1/4 -> sigma = 0.5.
    # Agent k's calls [0, 1, 2]: mu_k = 1, unbiased var 1 -> sigma_k = 1.
    # gap = 1; var_ratio = 1 / 0.25 = 4; inflation = (1 + 1) / 0.25 = 8.
    traj = ["t1", "t2", "t3", "t3", "t4", "t4", "t5", "t5"]
    agent = ["j", "j", "k", "j", "k", "j", "k", "j"]
    score = [-0.5, -0.5, 0.0, 0.0, 1.0, 0.0, 2.0, -1.0]
    stats = _lemma(score, ["p"] * 8, traj, agent)
    k = stats["k"]
    assert (k.mean_gap_mean, k.var_ratio_mean, k.multiplier) == pytest.approx((1.0, 4.0, 8.0))
    assert (k.inflation_p95, k.inflation_max, k.groups, k.flat_groups, k.rows) == pytest.approx((8.0, 8.0, 1, 0, 3))
    # Agent j's calls [-0.5, -0.5, 0, 0, -1]: mu_j = -0.4, unbiased var 0.7 / 4 = 0.175;
    # var_ratio 0.7, mean mismatch 0.16 / 0.25 = 0.64, multiplier 1.34.
    assert (stats["j"].mean_gap_mean, stats["j"].var_ratio_mean, stats["j"].multiplier) == pytest.approx(
        (-0.4, 0.7, 1.34)
    )


def test_worked_example_lemma_terms_and_measured_ratio():
    """The worked example above, both diagnostics derived by hand."""
    uid, traj, agent, score = UID, TRAJ, AGENT, REWARD
    # GRPO: trajectory values [1, 0, 1]: mu = 2/3, unbiased var 1/3.
    # Solver calls [1, 0, 0, 1]: mu_k = 1/2, var 1/3 -> gap -1/6, var_ratio 1,
    # multiplier 1 + (1/36) / (1/3) = 13/12. Verifier calls [1, 0, 1]: exactly the team's.
    stats = _lemma(score, uid, traj, agent)
    solver, verifier = stats["solver"], stats["verifier"]
    assert (solver.mean_gap_mean, solver.var_ratio_mean, solver.multiplier) == pytest.approx((-1 / 6, 1.0, 13 / 12))
    assert (verifier.mean_gap_mean, verifier.multiplier) == pytest.approx((0.0, 1.0), abs=1e-12)
    # Measured: GRPO gives tau1, tau3 +1/sqrt(3) (A^2 = 1/3) and tau2 -2/sqrt(3) (A^2 = 4/3).
    # Solver rows: 1/3 + 4/3 + 4/3 + 1/3 = 10/3 under GRPO; Dr. MAS gives its four calls
    # +-0.866 (A^2 = 3/4 each): 3. Ratio 10/9. Verifier: 1/3 + 4/3 + 1/3 = 2 both ways: 1.
    grpo = compute_advantages(score, uid, traj, agent, "grpo")
    drmas = compute_advantages(score, uid, traj, agent, "drmas")
    ratio = advantage_second_moment_ratio(grpo, drmas, agent)
    assert ratio == pytest.approx({"solver": 10 / 9, "verifier": 1.0}, rel=1e-5)


def test_constant_prompt_groups_have_no_multiplier():
    """Every prompt scored the same in all its trajectories (one prompt all 1, the other
    all 0): both modes' advantages are exactly 0, so neither baseline scales anything.
    Pooled over the batch, as drmas computed it before, agent a got a multiplier of 0.94
    ((2/9 + 1/225) / 0.24) from the spread between prompts; per prompt group it is
    undefined, and the count of flat groups says why."""
    uid = ["good"] * 6 + ["bad"] * 4
    traj = ["g1", "g1", "g1", "g2", "g2", "g2", "b1", "b1", "b2", "b2"]
    agent = ["a", "a", "b", "a", "a", "b", "a", "b", "a", "b"]
    score = np.array([1.0] * 6 + [0.0] * 4)
    stats = _lemma(score, uid, traj, agent)
    assert stats["a"].flat_groups == stats["a"].groups == 2
    assert math.isnan(stats["a"].multiplier) and math.isnan(stats["b"].inflation_max)
    grpo = compute_advantages(score, uid, traj, agent, "grpo")
    drmas = compute_advantages(score, uid, traj, agent, "drmas")
    assert not grpo.any() and not drmas.any()
    assert all(math.isnan(v) for v in advantage_second_moment_ratio(grpo, drmas, agent).values())
    # All calls penalised (-0.1 with rounding noise) is no spread either.
    flat = _lemma(np.zeros(4) - 0.1 * np.ones(4), ["p"] * 4, ["t1", "t1", "t2", "t2"], ["a", "b", "a", "b"])
    assert flat["b"].flat_groups == 1 and math.isnan(flat["b"].multiplier)
    # The reference keeps flat groups (sigma^2 + 1e-12 below): here every one gives 0.
    assert stats["a"].reference["inflation_factor_mean"] == stats["b"].reference["var_ratio_max"] == 0.0


def test_the_references_summaries_keep_flat_groups():
    """As the reference logs them (``adv_diag/<agent>/...``): a flat prompt where agent b
    made one call (mean 0, std 1 by convention, against trajectory means of 1) gives
    (1 + 1) / 1e-12; one where every call of b scored alike gives 0. drmas's own summaries
    leave both out (NaN), the reference's mean is 1e12."""
    uid = ["single"] * 3 + ["alike"] * 4
    traj = ["s1", "s1", "s2", "a1", "a1", "a2", "a2"]
    agent = ["a", "b", "a", "a", "b", "a", "b"]
    stats = _lemma(np.ones(7), uid, traj, agent)["b"]
    assert stats.flat_groups == stats.groups == 2 and math.isnan(stats.multiplier)
    assert stats.reference["inflation_factor_max"] == pytest.approx(2e12)
    assert stats.reference["inflation_factor_mean"] == pytest.approx(1e12)
    assert stats.reference["mean_gap_abs_max"] == pytest.approx(1.0)


@settings(max_examples=200, deadline=None)
@given(batch=uneven_batches())
def test_lemma_terms_match_the_reference_definitions(batch):
    score, uid, traj, agent = batch
    fast = _lemma(score, uid, traj, agent)
    slow = loop_lemma_terms(score, uid, traj, agent)
    for name, stats in fast.items():
        terms = np.array(slow.get(name, []))
        assert stats.groups - stats.flat_groups == len(terms)
        if len(terms):
            expected = (
                terms[:, 0].mean(),
                np.abs(terms[:, 0]).max(),
                terms[:, 1].min(),
                terms[:, 2].mean(),
                np.percentile(terms[:, 2], 95),
            )
            actual = (
                stats.mean_gap_mean,
                stats.mean_gap_abs_max,
                stats.var_ratio_min,
                stats.inflation_mean,
                stats.inflation_p95,
            )
            np.testing.assert_allclose(actual, expected, rtol=1e-7, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(batch=uneven_batches())
def test_one_agent_with_one_call_per_episode_makes_drmas_grpo(batch):
    """One agent calling once per episode: its calls are the trajectories, so Dr. MAS's
    groups are GRPO's and the two advantages, and both diagnostics, coincide."""
    score, uid, traj, _ = batch
    first = sorted({t: i for i, t in reversed(list(enumerate(traj)))}.values())  # one call per episode
    score, uid, traj = score[first], [uid[i] for i in first], [traj[i] for i in first]
    agent = ["solo"] * len(first)
    grpo = compute_advantages(score, uid, traj, agent, "grpo")
    drmas = compute_advantages(score, uid, traj, agent, "drmas")
    np.testing.assert_array_equal(grpo, drmas)
    stats = _lemma(score, uid, traj, agent)["solo"]
    if stats.groups > stats.flat_groups:
        assert (stats.mean_gap_abs_max, stats.multiplier) == pytest.approx((0.0, 1.0))
    if drmas.any():
        assert advantage_second_moment_ratio(grpo, drmas, agent)["solo"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------
# Policy loss
# ------------------------------------------------------------------------------------


def _tensor(*values):
    return torch.tensor([list(values)], dtype=torch.float64)


def test_clipped_loss_positive_advantage():
    # A = +1, ratios [1.5, 0.9]; clip 0.2 -> [1.2, 0.9].
    # unclipped -A*r = [-1.5, -0.9]; clipped = [-1.2, -0.9]; max = [-1.2, -0.9]; mean -1.05.
    # The clipped branch is taken on token 0 only: clipfrac 0.5.
    logprobs = torch.log(_tensor(1.5, 0.9)).requires_grad_()
    loss, metrics = policy_loss(logprobs, _tensor(0.0, 0.0), torch.tensor([1.0]), _tensor(1, 1))
    assert loss.item() == pytest.approx(-1.05)
    assert metrics["clipfrac"] == pytest.approx(0.5)
    # approx_kl = mean(old - new) = -(log 1.5 + log 0.9) / 2.
    assert metrics["approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.9)) / 2)
    loss.backward()
    # Clipped token: no gradient. Unclipped: d(-r/2)/dlogp = -r/2 = -0.45.
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.45])


def test_dual_clip_bounds_negative_advantage_loss():
    # A = -1, ratios [1.5, 4.0]: unclipped [1.5, 4.0], clipped [1.2, 1.2], max [1.5, 4.0];
    # dual clip min(., -A*3) = [1.5, 3.0]; mean 2.25; token 1 is dual-clipped.
    logprobs = torch.log(_tensor(1.5, 4.0))
    loss, metrics = policy_loss(logprobs, _tensor(0.0, 0.0), torch.tensor([-1.0]), _tensor(1, 1))
    assert loss.item() == pytest.approx(2.25)
    assert metrics["dual_clipfrac"] == pytest.approx(0.5)
    assert metrics["clipfrac"] == 0.0


def test_asymmetric_clip_range():
    # clip_ratio_high 0.28: ratio 1.5 is clipped to 1.28, loss -1.28 for A = +1.
    loss, _ = policy_loss(torch.log(_tensor(1.5)), _tensor(0.0), torch.tensor([1.0]), _tensor(1), clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_aggregations():
    # seq 1: values [1, 2, 9] mask [1, 1, 0]; seq 2: values [4, 5, 6] mask [1, 0, 0].
    # token-mean (1+2+4)/3 = 7/3; seq-mean-token-mean mean(1.5, 4) = 2.75;
    # seq-mean-token-sum mean(3, 4) = 3.5; token-mean over a 7-token mini-batch = 1.
    values = torch.tensor([[1.0, 2.0, 9.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate_loss(values, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert aggregate_loss(values, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert aggregate_loss(values, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert aggregate_loss(values, mask, "token-mean", num_tokens=7).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(values, mask, "sum")


def test_kl_and_entropy_terms():
    # k3 KL with logp = 0, ref = log 2: 2 - log 2 - 1 = 0.30685; with kl_coef 0.5 and the
    # ratio 1 pg loss -A = -1: loss = -1 + 0.5 * 0.30685. Entropy 2.0 with coef 0.1: -0.2.
    assert low_var_kl(_tensor(0.0), torch.log(_tensor(2.0))).item() == pytest.approx(1 - math.log(2))
    assert low_var_kl(_tensor(-1.3), _tensor(-1.3)).item() == 0.0
    loss, metrics = policy_loss(
        _tensor(0.0),
        _tensor(0.0),
        torch.tensor([1.0]),
        _tensor(1),
        ref_logprobs=torch.log(_tensor(2.0)),
        kl_coef=0.5,
        entropy=_tensor(2.0),
        entropy_coef=0.1,
    )
    assert metrics["kl"] == pytest.approx(1 - math.log(2))
    assert metrics["entropy"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx(-1 + 0.5 * (1 - math.log(2)) - 0.2)


def test_padding_tokens_do_not_count():
    # The second token is padding: huge values there change nothing.
    logprobs = torch.tensor([[0.0, 50.0]])
    loss, metrics = policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([2.0]), torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(-2.0) and metrics["clipfrac"] == 0.0
