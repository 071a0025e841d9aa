"""Statistics of the blind study against independent computations (statsmodels, scipy, the
``krippendorff`` package) and hand-worked cases."""

from __future__ import annotations

import math

import krippendorff
import numpy as np
import pytest
from scipy import stats as sst
from statsmodels.stats.descriptivestats import sign_test as sm_sign_test
from statsmodels.stats.proportion import proportion_confint
from statsmodels.stats.weightstats import ttost_paired

from attnqat.eval import stats

# The paper's study: Attn-QAT vs BF16 on Wan 14B, 99 prompts, one vote each.
PAPER = {"win": 16, "tie": 64, "lose": 19}


@pytest.mark.parametrize("k,n", [(16, 99), (64, 99), (0, 10), (10, 10), (1, 2), (37, 500)])
def test_wilson_matches_statsmodels(k, n):
    lo, hi = stats.wilson_interval(k, n)
    ref_lo, ref_hi = proportion_confint(k, n, alpha=0.05, method="wilson")
    assert lo == pytest.approx(ref_lo, abs=1e-12)
    assert hi == pytest.approx(ref_hi, abs=1e-12)


def test_wilson_hand_worked_zero_successes():
    # k = 0: lower bound 0, upper bound z² / (n + z²).
    z2 = sst.norm.ppf(0.975) ** 2
    lo, hi = stats.wilson_interval(0, 10)
    assert lo == 0.0
    assert hi == pytest.approx(z2 / (10 + z2), rel=1e-12)
    assert all(math.isnan(v) for v in stats.wilson_interval(0, 0))


@pytest.mark.parametrize("w,l_", [(16, 19), (2, 0), (0, 0), (30, 10), (7, 7)])
def test_sign_test_matches_hand_formula_and_statsmodels(w, l_):
    n = w + l_
    p = stats.sign_test(w, l_)
    if n == 0:
        assert math.isnan(p)  # no decisive vote: no test ("no data"), not p = 1
        return
    # Exact two-sided sign test: double the smaller tail of Binomial(n, 1/2), capped at 1.
    tail = sum(math.comb(n, i) for i in range(min(w, l_) + 1)) / 2 ** n
    assert p == pytest.approx(min(1.0, 2 * tail), rel=1e-12)
    _, sm_p = sm_sign_test(np.array([1.0] * w + [-1.0] * l_), mu0=0)
    assert p == pytest.approx(sm_p, rel=1e-9)


def test_position_bias_is_a_binomial_test():
    assert stats.position_bias_test(30, 12) == pytest.approx(
        sst.binomtest(30, 42, 0.5).pvalue, rel=1e-12)


@pytest.mark.parametrize("margin", [0.05, 0.1, 0.15, 0.3])
def test_tost_matches_statsmodels_on_the_paper_votes(margin):
    x = np.array([1.0] * PAPER["win"] + [0.0] * PAPER["tie"] + [-1.0] * PAPER["lose"])
    res = stats.tost_mean(x, margin)
    p, (t1, p1, df1), (t2, p2, df2) = ttost_paired(x, np.zeros_like(x), -margin, margin)
    assert res.p == pytest.approx(p, rel=1e-9)
    assert res.p_lower == pytest.approx(p1, rel=1e-9)
    assert res.p_upper == pytest.approx(p2, rel=1e-9)
    assert res.df == df1 == df2
    assert res.passed == (p < 0.05)
    assert res.verdict == ("equivalent" if p < 0.05 else "not shown equivalent")
    # Equivalence at level alpha <=> the (1 - 2 alpha) t interval lies inside (-margin, margin).
    assert res.passed == (-margin < res.ci_low and res.ci_high < margin)


def test_tost_on_random_cluster_means_matches_statsmodels():
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.uniform(-1, 1, size=rng.integers(3, 40))
        res = stats.tost_mean(x, 0.2, alpha=0.1)
        p, _, _ = ttost_paired(x, np.zeros_like(x), -0.2, 0.2)
        assert res.p == pytest.approx(p, rel=1e-9)
        assert res.passed == (p < 0.1)


def test_tost_degenerate_cases_say_not_enough_data():
    # Every prompt a tie: zero spread. The t statistic is undefined; a t-test would claim p = 0
    # and "equivalent" from two votes. That is not evidence: the verdict is "not enough data".
    for values in ([0.0, 0.0], [0.0] * 50, [1.0] * 10):
        r = stats.tost_mean(values, 0.5)
        assert r.passed is None and r.verdict == stats.NOT_ENOUGH_DATA
        assert "same mean score" in r.note and math.isnan(r.p)
    # Fewer than two prompts: nothing can be concluded either.
    for values in ([], [0.3]):
        r = stats.tost_mean(values, 0.5)
        assert r.passed is None and r.verdict == stats.NOT_ENOUGH_DATA and math.isnan(r.p)
    with pytest.raises(ValueError):
        stats.tost_mean([0.0, 1.0], 0.0)


def test_too_few_prompts_report_p_but_no_verdict():
    x = [0.0, 0.1, -0.1, 0.05, -0.05]
    few = stats.tost_mean(x, 0.5, min_n=10)
    enough = stats.tost_mean(x, 0.5, min_n=5)
    assert enough.passed is True and enough.p < 0.05
    assert few.passed is None and few.verdict == stats.NOT_ENOUGH_DATA and "5 prompts" in few.note
    assert few.p == pytest.approx(enough.p) and few.ci_low == pytest.approx(enough.ci_low)


@pytest.mark.parametrize("margin", [0.05, 0.1, 0.2])
def test_noninferiority_is_the_lower_one_sided_t_test(margin):
    x = np.array([1.0] * PAPER["win"] + [0.0] * PAPER["tie"] + [-1.0] * PAPER["lose"])
    res = stats.noninferiority_mean(x, margin)
    ref = sst.ttest_1samp(x, -margin, alternative="greater").pvalue
    assert res.p == pytest.approx(ref, rel=1e-9) and math.isnan(res.p_upper)
    assert res.passed == (ref < 0.05)
    # Decided by the lower end of the same 90 % interval that decides equivalence.
    assert res.passed == (res.ci_low > -margin)
    assert res.ci_low == pytest.approx(stats.tost_mean(x, margin).ci_low)
    assert res.verdict == ("non-inferior" if res.passed else "not shown non-inferior")


def test_exclusion_rule_error_rates_hand_worked():
    # Two checks, threshold 0.7: a rater is kept only with 2/2. Random (1/3 right): 1/9 kept;
    # careful (95 %): excluded unless both right, 1 − 0.95².
    keep, drop = stats.exclusion_rule_error_rates(2, 0.7)
    assert keep == pytest.approx(1 / 9) and drop == pytest.approx(1 - 0.95 ** 2)
    # Ten checks: kept with at least 7 right.
    keep, drop = stats.exclusion_rule_error_rates(10, 0.7)
    assert keep == pytest.approx(sum(math.comb(10, k) * (1 / 3) ** k * (2 / 3) ** (10 - k)
                                     for k in range(7, 11)))
    assert drop == pytest.approx(sum(math.comb(10, k) * 0.95 ** k * 0.05 ** (10 - k)
                                     for k in range(0, 7)))
    assert keep < 0.05 and drop < 0.05


def test_counts_by_cluster_and_cluster_means():
    keys, counts = stats.counts_by_cluster(["win", "tie", "win", "lose", "lose"],
                                           ["p1", "p1", "p2", "p2", "p3"])
    assert keys == ["p1", "p2", "p3"]
    assert counts.tolist() == [[1, 1, 0], [1, 0, 1], [0, 0, 1]]
    assert stats.cluster_mean_scores(counts).tolist() == [0.5, 0.0, -1.0]
    with pytest.raises(ValueError):
        stats.counts_by_cluster(["draw"], ["p1"])


def test_prompt_bootstrap_agrees_with_scipy_bootstrap_of_clusters():
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 4, size=(30, 3))
    counts[counts.sum(axis=1) == 0, 1] = 1
    ours = stats.bootstrap_clusters(counts, n_boot=6000, seed=1)
    w, t, l_ = (counts[:, i].astype(float) for i in range(3))

    def net(w, t, l_):
        return (w.sum() - l_.sum()) / (w.sum() + t.sum() + l_.sum())

    ref = sst.bootstrap((w, t, l_), net, paired=True, vectorized=False, n_resamples=6000,
                        method="percentile", rng=np.random.default_rng(2)).confidence_interval
    # Two Monte Carlo estimates of the same percentile interval: equal up to resampling noise.
    assert ours["net_preference"][0] == pytest.approx(ref.low, abs=0.03)
    assert ours["net_preference"][1] == pytest.approx(ref.high, abs=0.03)
    point = net(w, t, l_)
    assert ours["net_preference"][0] < point < ours["net_preference"][1]


def test_prompt_bootstrap_is_reproducible_and_respects_clustering():
    # 10 prompts, 5 identical votes each, vs 50 prompts with one vote each: same shares, but
    # the clustered data hold only 10 independent observations, so the interval must be wider.
    pattern = ["win"] * 3 + ["tie"] * 4 + ["lose"] * 3
    clustered = [o for o in pattern for _ in range(5)]
    clusters = [f"p{i}" for i in range(10) for _ in range(5)]
    _, c_counts = stats.counts_by_cluster(clustered, clusters)
    _, i_counts = stats.counts_by_cluster(clustered, [f"q{i}" for i in range(50)])
    a = stats.bootstrap_clusters(c_counts, n_boot=3000, seed=5)
    b = stats.bootstrap_clusters(i_counts, n_boot=3000, seed=5)
    width = lambda ci: ci[1] - ci[0]  # noqa: E731
    assert width(a["net_preference"]) > 1.5 * width(b["net_preference"])
    assert a == stats.bootstrap_clusters(c_counts, n_boot=3000, seed=5)
    # One single prompt: every replicate is that prompt, the interval collapses to its value.
    one = stats.bootstrap_clusters(np.array([[2, 1, 1]]), n_boot=100, seed=0)
    assert one["win_share"] == (0.5, 0.5)


def test_krippendorff_hand_worked_case():
    # Two raters, four units, values 1 < 2 < 3 (worked by hand in the docstring of the test):
    # coincidences o = [[2,1,0],[1,0,1],[0,1,2]], n_c = (3,2,3), n = 8;
    # ordinal δ²: δ²_12 = (3+2 − 2.5)² = 6.25, δ²_23 = 6.25, δ²_13 = (8 − 3)² = 25;
    # Σ o δ² = 25, Σ n_c n_k δ² = 2(6·6.25 + 6·6.25 + 9·25) = 600; α = 1 − 7·25/600 = 17/24.
    data = [[1, 1, 2, 3], [1, 2, 3, 3]]
    assert stats.krippendorff_alpha_ordinal(data) == pytest.approx(17 / 24, rel=1e-12)
    assert stats.krippendorff_alpha_ordinal([[1, 2, 3], [1, 2, 3]]) == pytest.approx(1.0)
    assert math.isnan(stats.krippendorff_alpha_ordinal([[2, 2], [2, 2]]))


@pytest.mark.parametrize("seed", range(4))
def test_krippendorff_matches_package_with_missing_ratings(seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(-1, 2, size=(6, 25)).astype(float)
    data[:3] = np.where(rng.random((3, 25)) < 0.7, data[3:], data[:3])  # some agreement
    data[rng.random(data.shape) < 0.35] = np.nan
    ref = krippendorff.alpha(reliability_data=data, level_of_measurement="ordinal")
    assert stats.krippendorff_alpha_ordinal(data) == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_reliability_matrix_from_triples():
    m = stats.reliability_matrix([("r1", "i1", 1), ("r2", "i1", 0), ("r1", "i2", -1)])
    assert m.shape == (2, 2)
    assert m[0].tolist() == [1, -1]
    assert m[1, 0] == 0 and math.isnan(m[1, 1])


def test_check_scores_and_exclusion_rule():
    answers = [("r1", "tie", "tie"), ("r1", "a", "a"), ("r1", "b", "a"),  # 2/3
               ("r2", "a", "tie"), ("r2", "b", "a"),  # 0/2
               ("r3", "tie", "tie")]  # 1/1
    scores = stats.check_scores(answers)
    assert (scores["r1"].answered, scores["r1"].correct) == (3, 2)
    assert scores["r2"].accuracy == 0.0
    assert stats.excluded_raters(scores, 0.7) == {"r1", "r2"}
    assert stats.excluded_raters(scores, 0.6) == {"r2"}
    assert stats.excluded_raters(scores, 0.7, min_checks=3) == {"r1"}


def test_summarize_wtl_on_the_paper_counts():
    outcomes = ["win"] * 16 + ["tie"] * 64 + ["lose"] * 19
    clusters = list(range(99))  # one vote per prompt, as in the paper
    s = stats.summarize_wtl(outcomes, clusters, margin=0.1, n_boot=500)
    assert s["counts"] == PAPER and s["n_prompts"] == 99
    assert s["shares"]["win"]["wilson"] == pytest.approx(
        proportion_confint(16, 99, method="wilson"))
    assert s["decisive"]["win_rate"] == pytest.approx(16 / 35)
    assert s["decisive"]["wilson"] == pytest.approx(proportion_confint(16, 35, method="wilson"))
    assert s["decisive"]["sign_test_p"] == pytest.approx(sst.binomtest(16, 35).pvalue)
    assert s["net_preference"]["estimate"] == pytest.approx(-3 / 99)
    p, _, _ = ttost_paired(np.array([1.0] * 16 + [0.0] * 64 + [-1.0] * 19), np.zeros(99), -0.1, 0.1)
    assert s["margin_test"]["p"] == pytest.approx(p)
    assert s["margin_test"]["passed"] is False  # p = 0.12: not shown equivalent at ±10 points
    assert s["margin_test"]["ci_low"] == pytest.approx(-0.130, abs=5e-4)
    assert s["margin_test"]["ci_high"] == pytest.approx(0.069, abs=5e-4)


def test_summarize_wtl_empty_and_tiny_cells():
    empty = stats.summarize_wtl([], [], margin=0.1, n_boot=50)
    assert empty["n_votes"] == 0 and empty["warnings"] == ["no votes"]
    assert math.isnan(empty["decisive"]["sign_test_p"]) and empty["margin_test"]["passed"] is None
    # The case the issue found: two "tie" votes once printed "equivalent: yes".
    two_ties = stats.summarize_wtl(["tie", "tie"], ["p1", "p2"], margin=0.1, n_boot=50,
                                   min_prompts=10)
    assert two_ties["margin_test"]["verdict"] == stats.NOT_ENOUGH_DATA
    assert any("not enough data" in w for w in two_ties["warnings"])
    assert any("decisive" in w for w in two_ties["warnings"])


def test_summarize_wtl_tests_per_prompt_means_not_votes():
    rng = np.random.default_rng(7)
    outcomes, clusters = [], []
    for prompt in range(12):
        for _ in range(rng.integers(1, 5)):
            outcomes.append(str(rng.choice(stats.OUTCOMES)))
            clusters.append(prompt)
    s = stats.summarize_wtl(outcomes, clusters, margin=0.2, alpha=0.05, n_boot=200)
    # Independent per-prompt means.
    scores = np.array([stats.SCORES[o] for o in outcomes], dtype=float)
    cl = np.array(clusters)
    means = np.array([scores[cl == p].mean() for p in range(12)])
    p, _, _ = ttost_paired(means, np.zeros_like(means), -0.2, 0.2)
    assert s["margin_test"]["n"] == 12
    assert s["margin_test"]["p"] == pytest.approx(p, rel=1e-9)
    assert s["n_votes"] == len(outcomes)
