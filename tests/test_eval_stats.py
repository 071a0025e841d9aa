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


def _votes(w: int, t: int, l_: int) -> np.ndarray:
    """Per-prompt counts of one vote per prompt."""
    return np.array([[1, 0, 0]] * w + [[0, 1, 0]] * t + [[0, 0, 1]] * l_, dtype=int).reshape(-1, 3)


@pytest.mark.parametrize("w,t,l_,delta0", [(16, 64, 19, 0.1), (16, 64, 19, -0.1), (3, 57, 0, 0.1),
                                           (0, 99, 0, -0.1), (30, 10, 2, 0.3), (5, 0, 40, -0.5)])
def test_restricted_mle_and_score_statistic_from_first_principles(w, t, l_, delta0):
    """The closed-form restricted lose share maximizes the trinomial likelihood under
    p_win − p_lose = Δ0 (checked by a numerical optimizer), and the statistic is
    (W − L − nΔ0) over the standard deviation of W − L at those shares."""
    from scipy.optimize import minimize_scalar

    n = w + t + l_
    lo, hi = max(0.0, -delta0), (1 - delta0) / 2

    def nll(q: float) -> float:
        pw, pl = q + delta0, q
        pt = 1 - pw - pl
        return -sum(k * math.log(max(p, 1e-300)) for k, p in ((w, pw), (t, pt), (l_, pl)) if k)

    opt = minimize_scalar(nll, bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-12}).x
    q = float(stats.restricted_lose_share(w, l_, n, delta0))
    assert nll(q) <= nll(opt) + 1e-9
    pw, pl = q + delta0, q
    sd = math.sqrt(n * (pw + pl - (pw - pl) ** 2))
    z = float(stats.score_statistic(w, l_, n, delta0, continuity=0))
    assert z == pytest.approx((w - l_ - n * delta0) / sd, rel=1e-9)
    zc = float(stats.score_statistic(w, l_, n, delta0))  # one vote towards 0 (Edwards)
    num = w - l_ - n * delta0
    assert zc == pytest.approx(math.copysign(max(abs(num) - 1.0, 0), num) / sd)


def test_the_cases_the_t_test_got_wrong_come_out_sensibly():
    # 3 win / 57 tie / 0 lose: the t-test said "equivalent, p = 0.042". Three wins and no
    # loss in 60 cannot exclude Δ = +10 points.
    r = stats.margin_test_counts(_votes(3, 57, 0), 0.1, min_n=10)
    assert r.passed is False and r.verdict == "not shown equivalent" and r.ci_high > 0.1
    # 99 ties said "not enough data" and 98 ties + 1 win "equivalent, p = 1.5e-14". Both
    # exclude ±10 points (at most ~3 % wins or losses), with p-values of one size.
    all_ties = stats.margin_test_counts(_votes(0, 99, 0), 0.1, min_n=10)
    one_win = stats.margin_test_counts(_votes(1, 98, 0), 0.1, min_n=10)
    assert all_ties.verdict == one_win.verdict == "equivalent"
    assert 1e-4 < all_ties.p < one_win.p < 0.01
    assert -0.1 < all_ties.ci_low < 0 < all_ties.ci_high < 0.1
    # 10 % wins, 90 % ties, no loss on 60 prompts: the truth may sit on the margin.
    assert stats.margin_test_counts(_votes(6, 54, 0), 0.1, min_n=10).passed is False
    # Intervals never leave ±100 points, even for one-sided data.
    for counts in (_votes(99, 0, 0), _votes(0, 0, 12), _votes(1, 0, 0), _votes(3, 1, 0)):
        r = stats.margin_test_counts(counts, 0.1)
        assert -1 <= r.ci_low <= r.estimate <= r.ci_high <= 1
    assert stats.margin_test_counts(_votes(99, 0, 0), 0.1).ci_high == 1.0


@pytest.mark.parametrize("n,test", [(20, "equivalence"), (60, "equivalence"), (99, "equivalence"),
                                    (20, "non-inferiority"), (60, "non-inferiority")])
def test_exact_size_at_the_margin_stays_at_the_nominal_level(n, test):
    """Type-I error at Δ = ±10 points, enumerated over every (W, T, L) of n prompts with one
    vote each, for tie shares 0 … 95 % (none above 90 % can reach the margin). The full table
    (200 prompts too) is in docs/eval.md: `attnqat eval plan --size-table`."""
    sizes = [stats.margin_test_size(n, t / 100, 0.1, 0.05, test) for t in range(0, 100, 5)]
    assert sizes[-1] is None  # 95 % ties: |Δ| <= 5 points, the null is empty
    assert max(s for s in sizes if s is not None) <= 0.055
    # The enumeration can see a size above nominal: without the continuity correction it
    # reaches 5.7 % (equivalence, 200 prompts, 90 % ties) and 5.8 % (non-inferiority, 20
    # prompts, no ties).
    assert stats.margin_test_size(200, 0.9, 0.1, 0.05, continuity=0) > 0.055
    assert stats.margin_test_size(20, 0.0, 0.1, 0.05, "non-inferiority", continuity=0) > 0.055


def test_enumerated_verdict_probability_agrees_with_simulation():
    rng = np.random.default_rng(5)
    shares = (0.12, 0.80, 0.08)
    exact = stats.verdict_probability(120, shares, 0.1, 0.05)
    draws = rng.multinomial(120, shares, size=3000)
    hits = 0
    passed = {}   # the test is a function of the counts: each distinct (win, lose) is tested once
    for w, _t, l_ in draws:
        key = (int(w), int(l_))
        if key not in passed:
            passed[key] = bool(stats.margin_test_counts(_votes(key[0], 120 - sum(key), key[1]), 0.1).passed)
        hits += passed[key]
    assert hits / 3000 == pytest.approx(exact, abs=3.5 * math.sqrt(exact * (1 - exact) / 3000) + 1e-3)


def test_interval_and_tests_decide_alike():
    rng = np.random.default_rng(3)
    for _ in range(30):
        w, t, l_ = (int(x) for x in rng.multinomial(rng.integers(10, 150), (0.2, 0.6, 0.2)))
        for test in ("equivalence", "non-inferiority"):
            r = stats.margin_test_counts(_votes(w, t, l_), 0.15, 0.05, test=test)
            inside = (r.ci_low > -0.15) and (test == "non-inferiority" or r.ci_high < 0.15)
            assert r.passed == inside == (r.p < 0.05)
            if test == "non-inferiority":
                assert math.isnan(r.p_upper) and r.p == r.p_lower


def test_votes_sharing_a_prompt_inflate_the_variance():
    base = _votes(20, 60, 20)
    assert stats.design_effect(base) == 1.0  # one vote per prompt: no clustering
    # Three raters who always agree add nothing: design effect 3, the statistic of the
    # original votes (without the continuity correction).
    tripled = base * 3
    assert stats.design_effect(tripled) == pytest.approx(3.0)
    w, l_, n = 60, 60, 300
    z3 = float(stats.score_statistic(w, l_, n, 0.1, stats.design_effect(tripled), continuity=0))
    z1 = float(stats.score_statistic(20, 20, 100, 0.1, continuity=0))
    assert z3 == pytest.approx(z1)
    r3 = stats.margin_test_counts(tripled, 0.1)
    assert r3.design_effect == pytest.approx(3.0) and r3.n == 100 and r3.n_votes == 300
    # Raters who disagree within a prompt as much as across prompts: no inflation.
    mixed = np.array([[1, 1, 1]] * 40)
    assert stats.design_effect(mixed) == 1.0


def test_too_few_prompts_report_p_but_no_verdict():
    few = stats.margin_test_counts(_votes(0, 60, 0).reshape(5, 12, 3).sum(axis=1), 0.5, min_n=10)
    enough = stats.margin_test_counts(_votes(0, 60, 0).reshape(5, 12, 3).sum(axis=1), 0.5, min_n=5)
    assert enough.passed is True
    assert few.passed is None and few.verdict == stats.NOT_ENOUGH_DATA and "5 prompts" in few.note
    assert few.p == pytest.approx(enough.p)
    empty = stats.margin_test_counts(np.zeros((0, 3)), 0.1)
    assert empty.passed is None and math.isnan(empty.p)
    with pytest.raises(ValueError):
        stats.margin_test_counts(_votes(1, 1, 1), 0.0)


def test_holm_matches_statsmodels():
    from statsmodels.stats.multitest import multipletests

    p = [0.01, 0.04, 0.03, 0.2, 0.005]
    assert stats.holm(p) == pytest.approx(multipletests(p, method="holm")[1].tolist())
    assert math.isnan(stats.holm([0.01, math.nan])[1]) and stats.holm([0.01, math.nan])[0] == 0.01


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
    ref = stats.margin_test_counts(_votes(16, 64, 19), 0.1)
    assert s["margin_test"]["p"] == pytest.approx(ref.p)
    assert s["margin_test"]["passed"] is False  # p = 0.16: not shown equivalent at ±10 points
    assert s["margin_test"]["ci_low"] == pytest.approx(-0.1396, abs=5e-4)
    assert s["margin_test"]["ci_high"] == pytest.approx(0.0793, abs=5e-4)


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


def test_summarize_wtl_tests_prompt_clusters_not_votes():
    rng = np.random.default_rng(7)
    outcomes, clusters = [], []
    for prompt in range(12):
        for _ in range(rng.integers(1, 5)):
            outcomes.append(str(rng.choice(stats.OUTCOMES)))
            clusters.append(prompt)
    s = stats.summarize_wtl(outcomes, clusters, margin=0.2, alpha=0.05, n_boot=200)
    _, counts = stats.counts_by_cluster(outcomes, clusters)
    ref = stats.margin_test_counts(counts, 0.2, 0.05)
    assert s["margin_test"]["n"] == 12 and s["margin_test"]["n_votes"] == len(outcomes)
    assert s["margin_test"]["p"] == pytest.approx(ref.p, rel=1e-12)
    assert s["margin_test"]["design_effect"] == pytest.approx(stats.design_effect(counts))
    assert s["n_votes"] == len(outcomes)


# --------------------------------------------------------------------------- Bradley–Terry

def test_bradley_terry_mm_is_the_maximum_likelihood_fit():
    from scipy.optimize import minimize

    rng = np.random.default_rng(11)
    wins = rng.integers(0, 30, size=(4, 4)).astype(float)
    np.fill_diagonal(wins, 0)
    wins[0, 3] += 0.5
    wins[3, 0] += 0.5  # a tie, half to each side
    prior = stats.BT_PRIOR
    w = wins + prior * ((wins + wins.T) > 0)

    def nll(theta):
        t = np.concatenate([[0.0], theta])
        diff = t[:, None] - t[None, :]
        return float((w * np.log1p(np.exp(-diff))).sum())

    opt = minimize(nll, np.zeros(3), method="BFGS", options={"gtol": 1e-10}).x
    ref = np.concatenate([[0.0], opt])
    ours = stats.bradley_terry(wins)
    assert ours - ours[0] == pytest.approx(ref, abs=1e-5)
    with pytest.raises(ValueError, match="connect"):
        stats.bradley_terry(np.array([[0, 3, 0], [2, 0, 0], [0, 0, 0]]))


def test_bradley_terry_ranking_recovers_known_strengths_with_bootstrap_intervals():
    rng = np.random.default_rng(2)
    true = {"bf16": 0.0, "attnqat": -0.1, "sage3": -0.5, "nvfp4": -1.0}
    comparisons = []
    for prompt in range(150):
        for a in ("attnqat", "sage3", "nvfp4"):
            for b in ("bf16", "attnqat", "sage3"):
                if a != b and (a, b) != ("sage3", "attnqat"):
                    p_a = 1 / (1 + math.exp(true[b] - true[a]))
                    comparisons.append((a, b, "win" if rng.random() < p_a else "lose", prompt))
    r = stats.bradley_terry_ranking(comparisons, anchor="bf16", n_boot=300, seed=1)
    m = r["methods"]
    assert [name for name, _ in sorted(m.items(), key=lambda kv: kv[1]["rank"])] == [
        "bf16", "attnqat", "sage3", "nvfp4"]
    assert m["bf16"]["score"] == 1000.0 and m["bf16"]["interval"] == (1000.0, 1000.0)
    for name, strength in true.items():
        expected = 1000 + stats.BT_SCALE * strength
        lo, hi = m[name]["interval"]
        assert lo <= m[name]["score"] <= hi
        assert lo - 15 <= expected <= hi + 15, (name, expected, lo, hi)
    assert r["n_prompts"] == 150 and r["n_boot"] == 300
