"""Statistics of a win–tie–lose study (pure functions on plain arrays; no database, no I/O).

Conventions. Every vote is seen from method A of its item (the method under test; B is the
reference): ``win`` (A preferred), ``tie`` or ``lose``. Its score is +1, 0, −1. The *net
preference* Δ is the mean score, i.e. win share − lose share. The *decisive win rate* is
W / (W + L).

Why these tests:

* Wilson intervals for shares (good coverage at small n and near 0 or 1, unlike the Wald interval).
* The exact sign test (binomial, ties dropped) answers "is one method preferred?".
* Failing to reject is not evidence of equality. "As good as" is an equivalence claim: two
  one-sided tests (TOST) of Δ against a margin ±δ declared before the study. Votes on one prompt
  are not independent (same content, several raters), so the TOST runs on per-prompt mean scores
  (one number per prompt, a one-sample t-test each side), and every bootstrap resamples prompts,
  not votes.
* "Not worse than" is a non-inferiority claim: the lower one-sided test alone (Δ > −δ).
* A verdict needs data: fewer than ``min_prompts`` prompts, or per-prompt means without any
  spread (the t-test then has no error estimate and would return p = 0), give "not enough data",
  not "equivalent". Cells without votes give NaN ("no data"), not p = 1.
* A position-bias test (left vs right among decisive votes) checks the counterbalancing.
* Krippendorff's alpha with the ordinal metric (lose < tie < win) measures agreement between raters
  on the same items; it handles any number of raters per item and missing ratings. Random answers
  average to Δ ≈ 0, so an "equivalent" verdict with agreement near chance (α ≈ 0) may be noise:
  the analysis warns about it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as _st

OUTCOMES: tuple[str, str, str] = ("win", "tie", "lose")
SCORES: dict[str, int] = {"win": 1, "tie": 0, "lose": -1}


# --------------------------------------------------------------------------------------------
# Proportions and the sign test
# --------------------------------------------------------------------------------------------

def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (NaNs when ``n`` is 0)."""
    if n <= 0:
        return (math.nan, math.nan)
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} outside 0..{n}")
    z = float(_st.norm.ppf(1 - (1 - confidence) / 2))
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test p-value of wins vs losses (ties excluded); NaN with no data."""
    n = wins + losses
    if n == 0:
        return math.nan
    return float(_st.binomtest(wins, n, 0.5, alternative="two-sided").pvalue)


def position_bias_test(n_left: int, n_right: int) -> float:
    """Two-sided exact binomial p-value that decisive votes pick left and right equally often."""
    return sign_test(n_left, n_right)


# --------------------------------------------------------------------------------------------
# Equivalence (TOST)
# --------------------------------------------------------------------------------------------

#: Verdicts of a margin test.
NOT_ENOUGH_DATA = "not enough data"


@dataclass(frozen=True)
class TostResult:
    """A margin test of the mean of per-prompt scores.

    ``test`` is ``equivalence`` (two one-sided t-tests of −margin < mean < margin) or
    ``non-inferiority`` (one one-sided test of mean > −margin; ``p_upper`` is NaN). Either way
    the decision is read off the (1 − 2 alpha) t interval ``[ci_low, ci_high]``: equivalence when
    it lies inside (−margin, margin), non-inferiority when ``ci_low`` > −margin. ``passed`` is
    None and ``verdict`` "not enough data" when the data cannot support a verdict (``note`` says
    why).
    """

    n: int
    mean: float
    se: float
    df: int
    margin: float
    alpha: float
    p_lower: float  # H0: mean <= -margin
    p_upper: float  # H0: mean >= +margin (equivalence only)
    p: float  # the test's p-value: max of the two (equivalence) or p_lower (non-inferiority)
    passed: bool | None
    ci_low: float  # the (1 - 2 alpha) t interval
    ci_high: float
    test: str = "equivalence"
    verdict: str = ""
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _margin_test(values: Sequence[float], margin: float, alpha: float, test: str,
                 min_n: int) -> TostResult:
    if margin <= 0:
        raise ValueError("the margin must be positive")
    if test not in ("equivalence", "non-inferiority"):
        raise ValueError(f"unknown test {test!r}")
    x = np.asarray(values, dtype=float)
    n = int(x.size)
    nan = math.nan
    mean = float(x.mean()) if n else nan
    if n < 2:
        return TostResult(n, mean, nan, max(n - 1, 0), margin, alpha, nan, nan, nan, None, nan,
                          nan, test, NOT_ENOUGH_DATA,
                          "no prompt with votes" if n == 0 else "one prompt: no spread to test")
    se = float(x.std(ddof=1) / math.sqrt(n))
    df = n - 1
    if se == 0.0:
        return TostResult(n, mean, 0.0, df, margin, alpha, nan, nan, nan, None, mean, mean, test,
                          NOT_ENOUGH_DATA,
                          "every prompt has the same mean score: the t-test has no error "
                          "estimate (it would claim p = 0)")
    p_lower = float(_st.t.sf((mean + margin) / se, df))
    p_upper = float(_st.t.cdf((mean - margin) / se, df)) if test == "equivalence" else nan
    p = max(p_lower, p_upper) if test == "equivalence" else p_lower
    q = float(_st.t.ppf(1 - alpha, df))
    lo, hi = mean - q * se, mean + q * se
    name = "equivalent" if test == "equivalence" else "non-inferior"
    if n < min_n:
        return TostResult(n, mean, se, df, margin, alpha, p_lower, p_upper, p, None, lo, hi, test,
                          NOT_ENOUGH_DATA, f"{n} prompts; a verdict needs at least {min_n}")
    passed = bool(p < alpha)
    return TostResult(n, mean, se, df, margin, alpha, p_lower, p_upper, p, passed, lo, hi, test,
                      name if passed else f"not shown {name}")


def tost_mean(values: Sequence[float], margin: float, alpha: float = 0.05, *,
              min_n: int = 2) -> TostResult:
    """TOST for the mean of ``values`` being within ``±margin`` (one-sample t-tests).

    Fewer than ``min_n`` values (at least 2), or values without spread, give ``passed=None``
    ("not enough data"); the p-values are still reported when they exist.
    """
    return _margin_test(values, margin, alpha, "equivalence", max(2, min_n))


def noninferiority_mean(values: Sequence[float], margin: float, alpha: float = 0.05, *,
                        min_n: int = 2) -> TostResult:
    """One-sided t-test that the mean of ``values`` is above ``−margin`` (same data rules as
    :func:`tost_mean`)."""
    return _margin_test(values, margin, alpha, "non-inferiority", max(2, min_n))


def margin_test(values: Sequence[float], margin: float, alpha: float = 0.05, *,
                test: str = "equivalence", min_n: int = 2) -> TostResult:
    """:func:`tost_mean` or :func:`noninferiority_mean`, by name."""
    return _margin_test(values, margin, alpha, test, max(2, min_n))


# --------------------------------------------------------------------------------------------
# Clustered data: per-prompt aggregation and the prompt bootstrap
# --------------------------------------------------------------------------------------------

def counts_by_cluster(outcomes: Sequence[str], clusters: Sequence[Hashable]
                      ) -> tuple[list[Hashable], np.ndarray]:
    """(cluster keys in first-seen order, array (n_clusters, 3) of win/tie/lose counts)."""
    if len(outcomes) != len(clusters):
        raise ValueError("outcomes and clusters differ in length")
    index: dict[Hashable, int] = {}
    rows: list[list[int]] = []
    for outcome, cluster in zip(outcomes, clusters):
        if outcome not in SCORES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        if cluster not in index:
            index[cluster] = len(rows)
            rows.append([0, 0, 0])
        rows[index[cluster]][OUTCOMES.index(outcome)] += 1
    return list(index), np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def cluster_mean_scores(counts: np.ndarray) -> np.ndarray:
    """Mean score (win − lose share) of each cluster, from its (win, tie, lose) counts."""
    counts = np.asarray(counts, dtype=float)
    return (counts[:, 0] - counts[:, 2]) / counts.sum(axis=1)


def _wtl_statistics(totals: np.ndarray) -> dict[str, np.ndarray]:
    """Shares, decisive win rate and net preference of (…, 3) count totals (NaN where undefined)."""
    totals = np.asarray(totals, dtype=float)
    n = totals.sum(axis=-1)
    decisive = totals[..., 0] + totals[..., 2]
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "win_share": totals[..., 0] / n,
            "tie_share": totals[..., 1] / n,
            "lose_share": totals[..., 2] / n,
            "decisive_win_rate": totals[..., 0] / decisive,
            "net_preference": (totals[..., 0] - totals[..., 2]) / n,
        }


def bootstrap_clusters(counts: np.ndarray, n_boot: int = 2000, seed: int = 0,
                       confidence: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of the W/T/L statistics from resampling whole clusters (prompts).

    ``counts`` is (n_clusters, 3). Each replicate draws n_clusters clusters with replacement and
    sums their counts; replicates where a statistic is undefined (e.g. no decisive vote) are left
    out of that statistic's interval.
    """
    counts = np.asarray(counts, dtype=np.int64)
    m = counts.shape[0]
    keys = ("win_share", "tie_share", "lose_share", "decisive_win_rate", "net_preference")
    if m == 0 or n_boot <= 0:
        return {k: (math.nan, math.nan) for k in keys}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, m, size=(n_boot, m))
    totals = counts[idx].sum(axis=1)
    reps = _wtl_statistics(totals)
    tail = 100 * (1 - confidence) / 2
    out = {}
    for key in keys:
        v = reps[key][~np.isnan(reps[key])]
        out[key] = ((float(np.percentile(v, tail)), float(np.percentile(v, 100 - tail)))
                    if v.size else (math.nan, math.nan))
    return out


# --------------------------------------------------------------------------------------------
# Agreement
# --------------------------------------------------------------------------------------------

def krippendorff_alpha_ordinal(reliability: np.ndarray | Sequence[Sequence[float]]) -> float:
    """Krippendorff's alpha with the ordinal difference metric.

    ``reliability`` is (n_raters, n_units) with NaN for "not rated". Values are ordered categories
    (any numbers; only their order matters). Units with fewer than two ratings are not pairable
    and are ignored. Returns NaN when there is nothing to compare or only one category is used
    (expected disagreement 0).

    Method (Krippendorff 2011, "Computing Krippendorff's alpha-reliability"): the coincidence
    matrix o_ck counts ordered pairs of values within a unit, each weighted 1/(m_u − 1); n_c are
    its marginals; the ordinal metric is δ²_ck = (Σ_{g=c..k} n_g − (n_c + n_k)/2)²;
    α = 1 − (n − 1) Σ o_ck δ²_ck / Σ n_c n_k δ²_ck.
    """
    data = np.asarray(reliability, dtype=float)
    if data.ndim != 2:
        raise ValueError("reliability data must be a 2-D array (raters × units)")
    values = np.unique(data[~np.isnan(data)])
    k = values.size
    if k == 0:
        return math.nan
    o = np.zeros((k, k))
    for unit in data.T:
        present = unit[~np.isnan(unit)]
        m = present.size
        if m < 2:
            continue
        c = np.searchsorted(values, present)
        counts = np.bincount(c, minlength=k).astype(float)
        pair = np.outer(counts, counts) - np.diag(counts)  # ordered pairs from different raters
        o += pair / (m - 1)
    n_c = o.sum(axis=1)
    n = n_c.sum()
    if n <= 1:
        return math.nan
    cum = np.concatenate([[0.0], np.cumsum(n_c)])
    lo = np.minimum.outer(np.arange(k), np.arange(k))
    hi = np.maximum.outer(np.arange(k), np.arange(k))
    delta2 = (cum[hi + 1] - cum[lo] - (n_c[:, None] + n_c[None, :]) / 2) ** 2
    expected = float((np.outer(n_c, n_c) * delta2).sum())
    if expected == 0.0:
        return math.nan
    observed = float((o * delta2).sum())
    return 1.0 - (n - 1) * observed / expected


def reliability_matrix(ratings: Iterable[tuple[Hashable, Hashable, float]]) -> np.ndarray:
    """(raters × units) matrix with NaN gaps from (rater, unit, value) triples."""
    ratings = list(ratings)
    raters = {r: i for i, r in enumerate(dict.fromkeys(r for r, _, _ in ratings))}
    units = {u: j for j, u in enumerate(dict.fromkeys(u for _, u, _ in ratings))}
    data = np.full((len(raters), len(units)), np.nan)
    for rater, unit, value in ratings:
        data[raters[rater], units[unit]] = value
    return data


# --------------------------------------------------------------------------------------------
# Rater checks
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckScore:
    answered: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.answered if self.answered else math.nan


def check_scores(answers: Iterable[tuple[Hashable, str, str]]) -> dict[Hashable, CheckScore]:
    """Per rater, how many check items they answered and got right, from (rater, given, expected)."""
    tally: dict[Hashable, list[int]] = {}
    for rater, given, expected in answers:
        t = tally.setdefault(rater, [0, 0])
        t[0] += 1
        t[1] += int(given == expected)
    return {r: CheckScore(a, c) for r, (a, c) in tally.items()}


def exclusion_rule_error_rates(n_checks: int, min_accuracy: float, *, p_random: float = 1 / 3,
                               p_careful: float = 0.95) -> tuple[float, float]:
    """How well the exclusion rule separates raters who answered ``n_checks`` check items:
    (probability that a rater answering at random — right with probability ``p_random`` per
    check — is kept, probability that a careful rater — right with ``p_careful`` — is excluded).
    A rater is kept when correct / n_checks >= min_accuracy."""
    if n_checks <= 0:
        return (1.0, 0.0)
    k_min = math.ceil(min_accuracy * n_checks - 1e-12)  # fewest correct answers that keep
    keep_random = float(_st.binom.sf(k_min - 1, n_checks, p_random))
    drop_careful = float(_st.binom.cdf(k_min - 1, n_checks, p_careful))
    return keep_random, drop_careful


def excluded_raters(scores: Mapping[Hashable, CheckScore], min_accuracy: float,
                    min_checks: int = 1) -> set[Hashable]:
    """The exclusion rule: a rater who answered at least ``min_checks`` check items and got less
    than ``min_accuracy`` of them right is excluded. Raters with fewer answered checks are kept
    (there is not enough evidence against them)."""
    return {r for r, s in scores.items()
            if s.answered >= min_checks and s.accuracy < min_accuracy}


# --------------------------------------------------------------------------------------------
# The whole summary of one comparison
# --------------------------------------------------------------------------------------------

#: Fewer decisive votes than this make the win rate and the sign test weak; the summary says so.
FEW_DECISIVE = 10


def summarize_wtl(outcomes: Sequence[str], clusters: Sequence[Hashable], *, margin: float,
                  alpha: float = 0.05, n_boot: int = 2000, seed: int = 0,
                  confidence: float = 0.95, test: str = "equivalence", min_prompts: int = 2
                  ) -> dict:
    """Everything the report says about one comparison: counts, shares with Wilson and prompt
    bootstrap intervals, decisive win rate, exact sign test, the margin test (TOST or
    non-inferiority) on per-prompt means with its deciding (1 − 2 alpha) interval, and warnings
    about what the data cannot support."""
    keys, counts = counts_by_cluster(outcomes, clusters)
    total = counts.sum(axis=0) if counts.size else np.zeros(3, dtype=np.int64)
    w, t, l_ = (int(v) for v in total)
    n = w + t + l_
    point = {k: float(v) for k, v in _wtl_statistics(total.astype(float)).items()} if n else {}
    boot = bootstrap_clusters(counts, n_boot=n_boot, seed=seed, confidence=confidence)
    boot_decide = bootstrap_clusters(counts, n_boot=n_boot, seed=seed, confidence=1 - 2 * alpha)
    result = margin_test(cluster_mean_scores(counts) if n else [], margin, alpha, test=test,
                         min_n=min_prompts)
    shares = {}
    for name, count in zip(OUTCOMES, (w, t, l_)):
        shares[name] = {
            "count": count,
            "share": count / n if n else math.nan,
            "wilson": wilson_interval(count, n, confidence),
            "bootstrap": boot[f"{name}_share"],
        }
    warnings = []
    if n == 0:
        warnings.append("no votes")
    else:
        if result.passed is None:
            warnings.append(f"{result.test}: not enough data ({result.note})")
        if w + l_ < FEW_DECISIVE:
            warnings.append(f"only {w + l_} decisive vote(s): the win rate and the sign test "
                            "can detect only large differences")
    return {
        "n_votes": n,
        "n_prompts": len(keys),
        "counts": {"win": w, "tie": t, "lose": l_},
        "shares": shares,
        "decisive": {
            "n": w + l_,
            "win_rate": point.get("decisive_win_rate", math.nan) if w + l_ else math.nan,
            "wilson": wilson_interval(w, w + l_, confidence),
            "bootstrap": boot["decisive_win_rate"],
            "sign_test_p": sign_test(w, l_),
        },
        "net_preference": {
            "estimate": point.get("net_preference", math.nan),
            "bootstrap": boot["net_preference"],
            "bootstrap_decision_interval": boot_decide["net_preference"],
        },
        "margin_test": result.as_dict(),
        "warnings": warnings,
    }
