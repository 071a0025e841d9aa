"""Statistics of a win–tie–lose study (pure functions on plain arrays; no database, no I/O).

Conventions. Every vote is seen from method A of its item (the method under test; B is the
reference): ``win`` (A preferred), ``tie`` or ``lose``. Its score is +1, 0, −1. The *net
preference* Δ is the mean score, i.e. win share − lose share. The *decisive win rate* is
W / (W + L).

Why these tests:

* Wilson intervals for shares (good coverage at small n and near 0 or 1, unlike the Wald interval).
* The exact sign test (binomial, ties dropped) answers "is one method preferred?".
* Failing to reject is not evidence of equality. "As good as" is an equivalence claim: two
  one-sided tests of Δ against a margin ±δ declared before the study. A vote is one draw of a
  trinomial (win, tie, lose), and Δ = p_win − p_lose is the difference of two of its shares —
  the structure of paired binary data, whose discordant pairs play the wins and losses. So Δ gets
  Tango's score test (variance under the null hypothesis, from the restricted maximum-likelihood
  shares), with Edwards' continuity correction; its inversion is the interval reported, which
  never leaves [−1, 1]. A t-test on per-prompt means was used before: on tie-heavy, one-sided
  data its type-I error at the margin reached 13.6 % at nominal 5 %; this test's exact size
  stays below 5 % (``margin_test_size`` enumerates it). Votes on one prompt are not independent
  (same content, several raters): the variance is inflated by the prompt-clustered design effect,
  and every bootstrap resamples prompts, not votes.
* "Not worse than" is a non-inferiority claim: the lower one-sided test alone (Δ > −δ).
* A verdict needs data: fewer than ``min_prompts`` prompts give "not enough data", not
  "equivalent". Cells without votes give NaN ("no data"), not p = 1. Several pairs and
  questions make a family of tests: :func:`holm` adjusts their p-values.
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
# The margin test: a score interval for win share − lose share of paired three-outcome data
# --------------------------------------------------------------------------------------------

#: Verdicts of a margin test.
NOT_ENOUGH_DATA = "not enough data"


@dataclass(frozen=True)
class MarginResult:
    """A margin test of the net preference Δ = win share − lose share.

    ``test`` is ``equivalence`` (two one-sided score tests of −margin < Δ < margin) or
    ``non-inferiority`` (the lower one alone, Δ > −margin; ``p_upper`` is NaN). The decision is
    the inversion of the same tests: ``[ci_low, ci_high]`` is the (1 − 2 alpha) score interval
    of Δ (always inside [−1, 1]); equivalence when it lies inside (−margin, margin),
    non-inferiority when ``ci_low`` > −margin. ``design_effect`` is the variance inflation for
    votes that share a prompt (1 with one vote per prompt). ``passed`` is None and ``verdict``
    "not enough data" when the data cannot support a verdict (``note`` says why).
    """

    n: int  # prompts
    n_votes: int
    estimate: float
    design_effect: float
    margin: float
    alpha: float
    z_lower: float  # score statistic at Δ0 = −margin (large: Δ > −margin)
    z_upper: float  # score statistic at Δ0 = +margin (very negative: Δ < +margin)
    p_lower: float  # H0: Δ <= -margin
    p_upper: float  # H0: Δ >= +margin (equivalence only)
    p: float  # the test's p-value: max of the two (equivalence) or p_lower (non-inferiority)
    passed: bool | None
    ci_low: float  # the (1 - 2 alpha) score interval
    ci_high: float
    test: str = "equivalence"
    verdict: str = ""
    note: str = ""
    method: str = "Tango score interval, prompt-clustered (Rao–Scott design effect)"

    def as_dict(self) -> dict:
        return asdict(self)


def restricted_lose_share(wins, losses, n, delta0):
    """Maximum-likelihood lose share of a trinomial (win, tie, lose) under Δ = ``delta0``
    (Tango 1998's closed form for paired proportions: wins and losses are the discordant pairs).
    Works elementwise on arrays."""
    wins, losses, n = (np.asarray(x, dtype=float) for x in (wins, losses, n))
    a = 2.0 * n
    b = -wins - losses + (2.0 * n - wins + losses) * delta0
    c = -losses * delta0 * (1.0 - delta0)
    disc = np.maximum(b * b - 4.0 * a * c, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = (np.sqrt(disc) - b) / (2.0 * a)
    # Feasibility: 0 <= lose <= 1 and 0 <= win = lose + delta0, win + lose <= 1.
    return np.clip(q, max(0.0, -delta0), (1.0 - delta0) / 2.0)


#: Continuity correction of the score statistic, in votes: |W − L − nΔ0| − 1, as Edwards'
#: correction of McNemar's test (for a fixed number of ties W − L moves in steps of 2).
#: Without it the exact size at the margin reaches 5.7 % at nominal 5 % (equivalence, 200
#: prompts, 90 % ties, no losses) and half a vote leaves 5.8 % (non-inferiority, 20 prompts
#: without ties); with it every size enumerated stays below 5 % (docs/eval.md has the tables).
CONTINUITY = 1.0


def score_statistic(wins, losses, n, delta0, design_effect=1.0, continuity=CONTINUITY):
    """Tango's score statistic of H0: Δ = ``delta0`` for ``n`` votes with ``wins`` and
    ``losses``: (W − L − nΔ0 ∓ c) / sqrt(deff · n · (2 q̃ + Δ0 (1 − Δ0))), q̃ the restricted
    lose share, the numerator moved ``continuity`` (c) votes towards 0. Elementwise on arrays;
    ±inf where the null variance is 0 and the data differ from it, 0 where they agree."""
    wins, losses, n = (np.asarray(x, dtype=float) for x in (wins, losses, n))
    q = restricted_lose_share(wins, losses, n, delta0)
    var = np.asarray(design_effect, dtype=float) * n * (2.0 * q + delta0 * (1.0 - delta0))
    num = wins - losses - n * delta0
    num = np.sign(num) * np.maximum(np.abs(num) - continuity, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = num / np.sqrt(var)
        z = np.where(var > 1e-300, z, np.sign(num) * np.inf)
    return np.where((var <= 1e-300) & (np.abs(num) < 1e-12), 0.0, z)


def design_effect(counts: np.ndarray) -> float:
    """Variance inflation of the vote total from votes that share a prompt (a Rao–Scott
    design effect): the prompt-clustered variance Σ_i (D_i − m_i Δ̂)² over the variance of as
    many independent votes, N (p̂_W + p̂_L − Δ̂²); D_i and m_i are prompt i's win − lose and its
    votes. Kept within [1, Σ m_i² / N] (1: no clustering credit is ever taken; the upper end is
    raters who always agree). With one vote per prompt it is exactly 1. When every vote is the
    same (no variance to compare) the upper end is used."""
    counts = np.asarray(counts, dtype=float).reshape(-1, 3)
    m = counts.sum(axis=1)
    total = m.sum()
    if total == 0:
        return 1.0
    upper = float((m * m).sum() / total)
    if upper <= 1.0:
        return 1.0
    d = counts[:, 0] - counts[:, 2]
    est = d.sum() / total
    independent = total * ((counts[:, 0].sum() + counts[:, 2].sum()) / total - est * est)
    if independent <= 1e-12:
        return upper
    clustered = float(((d - m * est) ** 2).sum())
    return float(min(upper, max(1.0, clustered / independent)))


def _score_interval(w: float, l_: float, n: float, deff: float, z: float) -> tuple[float, float]:
    """{Δ0 : |score statistic| <= z} by bisection (the statistic falls as Δ0 grows)."""
    est = (w - l_) / n

    def stat(d0: float) -> float:
        return float(score_statistic(w, l_, n, d0, deff))

    def solve(lo: float, hi: float, target: float) -> float:
        for _ in range(80):
            mid = (lo + hi) / 2
            if stat(mid) > target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = -1.0 if stat(-1.0 + 1e-12) <= z else solve(-1.0 + 1e-12, est, z)
    high = 1.0 if stat(1.0 - 1e-12) >= -z else solve(est, 1.0 - 1e-12, -z)
    return max(-1.0, low), min(1.0, high)


def margin_test_counts(counts: np.ndarray | Sequence[Sequence[int]], margin: float,
                       alpha: float = 0.05, *, test: str = "equivalence", min_n: int = 2
                       ) -> MarginResult:
    """The margin test on per-prompt (win, tie, lose) counts (one row per prompt).

    Wins and losses of one vote are two outcomes of a trinomial, like the discordant pairs of
    paired binary data, so Δ gets Tango's score test (the variance is the one implied by the
    null hypothesis, through the restricted maximum-likelihood lose share). Votes that share a
    prompt inflate the variance by the design effect of :func:`design_effect`. Two one-sided
    tests at ``alpha`` decide; their inversion is the (1 − 2 alpha) interval reported.
    Fewer than ``min_n`` prompts give ``passed=None`` ("not enough data").
    """
    if margin <= 0:
        raise ValueError("the margin must be positive")
    if test not in ("equivalence", "non-inferiority"):
        raise ValueError(f"unknown test {test!r}")
    counts = np.asarray(counts, dtype=np.int64).reshape(-1, 3)
    counts = counts[counts.sum(axis=1) > 0]
    n_prompts = int(counts.shape[0])
    w, _t, l_ = (int(x) for x in counts.sum(axis=0))
    n = int(counts.sum())
    nan = math.nan
    name = "equivalent" if test == "equivalence" else "non-inferior"
    if n == 0:
        return MarginResult(0, 0, nan, nan, margin, alpha, nan, nan, nan, nan, nan, None, nan,
                            nan, test, NOT_ENOUGH_DATA, "no prompt with votes")
    deff = design_effect(counts)
    z_lo = float(score_statistic(w, l_, n, -margin, deff))
    z_hi = float(score_statistic(w, l_, n, margin, deff))
    p_lower = float(_st.norm.sf(z_lo))
    p_upper = float(_st.norm.cdf(z_hi)) if test == "equivalence" else nan
    p = max(p_lower, p_upper) if test == "equivalence" else p_lower
    lo, hi = _score_interval(w, l_, n, deff, float(_st.norm.ppf(1 - alpha)))
    result = dict(n=n_prompts, n_votes=n, estimate=(w - l_) / n, design_effect=deff,
                  margin=margin, alpha=alpha, z_lower=z_lo, z_upper=z_hi, p_lower=p_lower,
                  p_upper=p_upper, p=p, ci_low=lo, ci_high=hi, test=test)
    if n_prompts < min_n:
        return MarginResult(**result, passed=None, verdict=NOT_ENOUGH_DATA,
                            note=f"{n_prompts} prompts; a verdict needs at least {min_n}")
    passed = bool(p < alpha)
    return MarginResult(**result, passed=passed, verdict=name if passed else f"not shown {name}")


def verdict_probability(n: int, shares: Sequence[float], margin: float = 0.1,
                        alpha: float = 0.05, test: str = "equivalence",
                        continuity: float = CONTINUITY) -> float:
    """Exact probability that :func:`margin_test_counts` gives a verdict (equivalent or
    non-inferior) for ``n`` prompts with one vote each, drawn from the (win, tie, lose)
    ``shares``: the sum over every (W, T, L) with W + T + L = n."""
    w = np.arange(n + 1)[:, None]
    l_ = np.arange(n + 1)[None, :]
    valid = (w + l_) <= n
    z = float(_st.norm.ppf(1 - alpha))
    reject = (score_statistic(w, l_, n, -margin, continuity=continuity) > z) & valid
    if test == "equivalence":
        reject &= score_statistic(w, l_, n, margin, continuity=continuity) < -z
    t = np.clip(n - w - l_, 0, n)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    logp = log_fact[n] - log_fact[w] - log_fact[t] - log_fact[l_]
    for k, share in zip((w, t, l_), shares):
        if share > 0:
            logp = logp + k * math.log(share)
        else:  # a zero share: only k = 0 is possible
            logp = np.where(k > 0, -np.inf, logp)
    return float(np.exp(logp)[reject].sum())


def margin_test_size(n: int, tie_share: float, margin: float = 0.1, alpha: float = 0.05,
                     test: str = "equivalence", continuity: float = CONTINUITY) -> float | None:
    """Exact type-I error of :func:`margin_test_counts` with one vote on each of ``n`` prompts
    when the true Δ lies on the margin: the larger of the probabilities of a verdict at
    Δ = +margin and at Δ = −margin (non-inferiority: at −margin). None when the tie share
    leaves no room for |Δ| = margin."""
    if 1 - tie_share < margin - 1e-12:
        return None
    deltas = (margin, -margin) if test == "equivalence" else (-margin,)
    return max(verdict_probability(n, (max(0.0, (1 - tie_share + d) / 2), tie_share,
                                       max(0.0, (1 - tie_share - d) / 2)),
                                   margin, alpha, test, continuity) for d in deltas)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaNs stay NaN and do not count as tests)."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(~np.isnan(p))
    m = idx.size
    running = 0.0
    for rank, i in enumerate(idx[np.argsort(p[idx], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


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
# Ranking of more than two methods: Bradley–Terry
# --------------------------------------------------------------------------------------------

#: Scale of Bradley–Terry scores: Elo-like points (400 per factor of 10 in the odds of winning).
BT_SCALE = 400.0 / math.log(10.0)
#: Pseudo-votes added to each direction of every compared pair, so a method that never won (or
#: never lost) keeps a finite score.
BT_PRIOR = 0.5


def bradley_terry(wins: np.ndarray, *, prior: float = BT_PRIOR, tol: float = 1e-10,
                  max_iter: int = 10_000) -> np.ndarray:
    """Bradley–Terry log-strengths (mean 0) from ``wins[i, j]``, the (possibly fractional)
    number of times method i was preferred to j — a tie counts half to each. Fitted by
    Hunter's MM algorithm (2004), which increases the likelihood at every step; ``prior``
    pseudo-votes are added to both directions of every pair that was compared. Methods that
    were never compared with the rest cannot be placed: the comparison graph must be
    connected (ValueError otherwise)."""
    w = np.asarray(wins, dtype=float)
    k = w.shape[0]
    n = w + w.T
    compared = n > 0
    reach, frontier = {0}, [0]
    while frontier:
        i = frontier.pop()
        for j in np.flatnonzero(compared[i]):
            if j not in reach:
                reach.add(int(j))
                frontier.append(int(j))
    if len(reach) < k:
        raise ValueError("the methods' comparisons do not connect them all: no common scale")
    w = w + prior * compared
    n = w + w.T
    total_wins = w.sum(axis=1)
    p = np.ones(k)
    for _ in range(max_iter):
        denom = (n / (p[:, None] + p[None, :])).sum(axis=1)
        new = total_wins / denom
        new /= math.exp(np.log(new).mean())
        if np.max(np.abs(np.log(new) - np.log(p))) < tol:
            p = new
            break
        p = new
    logp = np.log(p)
    return logp - logp.mean()


def bradley_terry_ranking(comparisons: Sequence[tuple[str, str, str, Hashable]], *,
                          anchor: str | None = None, n_boot: int = 2000, seed: int = 0,
                          confidence: float = 0.95) -> dict:
    """A ranking of several methods from pairwise votes, with prompt-bootstrap intervals (as
    Chatbot Arena reports). ``comparisons`` are (method A, method B, outcome for A, prompt);
    ties count half a win to each side. Scores are Elo-like points with ``anchor`` (e.g. the
    BF16 reference) at 1000, else the mean at 1000; intervals are percentile intervals over
    ``n_boot`` resamples of prompts (whole clusters of votes), each refitted."""
    if not comparisons:
        raise ValueError("no votes to rank the methods by")
    methods = sorted({m for a, b, _, _ in comparisons for m in (a, b)})
    index = {m: i for i, m in enumerate(methods)}
    prompts = list(dict.fromkeys(c for *_, c in comparisons))
    p_index = {c: i for i, c in enumerate(prompts)}
    k = len(methods)
    per_prompt = np.zeros((len(prompts), k, k))
    half = {"win": (1.0, 0.0), "tie": (0.5, 0.5), "lose": (0.0, 1.0)}
    for a, b, outcome, prompt in comparisons:
        wa, wb = half[outcome]
        c = p_index[prompt]
        per_prompt[c, index[a], index[b]] += wa
        per_prompt[c, index[b], index[a]] += wb

    def points(wins: np.ndarray) -> np.ndarray:
        logp = bradley_terry(wins)
        base = logp[index[anchor]] if anchor in index else 0.0
        return 1000.0 + BT_SCALE * (logp - base)

    estimate = points(per_prompt.sum(axis=0))
    boots = []
    if n_boot > 0 and prompts:
        rng = np.random.default_rng(seed)
        for _ in range(n_boot):
            sample = per_prompt[rng.integers(0, len(prompts), len(prompts))].sum(axis=0)
            try:
                boots.append(points(sample))
            except ValueError:  # a resample that leaves a method unconnected
                continue
    tail = 100 * (1 - confidence) / 2
    boots_arr = np.array(boots) if boots else np.full((0, k), np.nan)
    order = np.argsort(-estimate, kind="stable")
    out = {}
    for rank, i in enumerate(order, start=1):
        ci = ((float(np.percentile(boots_arr[:, i], tail)),
               float(np.percentile(boots_arr[:, i], 100 - tail))) if len(boots) else
              (math.nan, math.nan))
        out[methods[i]] = {"rank": rank, "score": float(estimate[i]), "interval": ci}
    return {"method": "Bradley–Terry (MM), ties half a win, prompt bootstrap",
            "anchor": anchor if anchor in index else None, "scale": "Elo-like points",
            "n_votes": len(comparisons), "n_prompts": len(prompts), "n_boot": len(boots),
            "confidence": confidence, "methods": out}


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
    bootstrap intervals, decisive win rate, exact sign test, the margin test (equivalence or
    non-inferiority; :func:`margin_test_counts`) with its deciding (1 − 2 alpha) interval, and warnings
    about what the data cannot support."""
    keys, counts = counts_by_cluster(outcomes, clusters)
    total = counts.sum(axis=0) if counts.size else np.zeros(3, dtype=np.int64)
    w, t, l_ = (int(v) for v in total)
    n = w + t + l_
    point = {k: float(v) for k, v in _wtl_statistics(total.astype(float)).items()} if n else {}
    boot = bootstrap_clusters(counts, n_boot=n_boot, seed=seed, confidence=confidence)
    boot_decide = bootstrap_clusters(counts, n_boot=n_boot, seed=seed, confidence=1 - 2 * alpha)
    result = margin_test_counts(counts, margin, alpha, test=test, min_n=min_prompts)
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
