"""``attnqat eval plan``: how many prompts a study needs for its margin test to succeed.

The study's verdict is a t-test on per-prompt mean scores (:mod:`attnqat.eval.stats`), so its
power follows from the spread of those means:

* one vote scores +1 / 0 / −1 (win / tie / lose for A); with a tie share ``t`` and a true net
  preference Δ, its variance is (1 − t) − Δ²;
* a prompt rated by ``k`` raters averages k votes; with an intra-prompt correlation ``icc`` (raters
  of one prompt agree more than chance) the variance of that mean is var·(1 + (k − 1)·icc)/k;
* equivalence (TOST): power = P(both one-sided t-tests reject), approximated from the noncentral
  t distribution as P(lower rejects) + P(upper rejects) − 1 (the usual bound; close whenever the
  power is worth having); non-inferiority: P(lower rejects), exact.

``--simulate N`` checks the figure by simulating N studies of discrete votes (prompt-level
Dirichlet-multinomial draws for ``icc`` > 0) through the same analysis code as the report,
"not enough data" rule included.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

from . import stats
from .study import TESTS, add_margin_arguments


def vote_sd(ties: float, delta: float = 0.0) -> float:
    """Standard deviation of one vote's score given the tie share and the true Δ."""
    if not 0 <= ties < 1:
        raise ValueError("the tie share must be in [0, 1)")
    if abs(delta) > 1 - ties:
        raise ValueError(f"|Δ| = {abs(delta)} is impossible with {ties:.0%} ties (at most {1 - ties:.2f})")
    return math.sqrt((1 - ties) - delta * delta)


def prompt_sd(sd_vote: float, raters: int = 1, icc: float = 0.0) -> float:
    """Standard deviation of a prompt's mean score over ``raters`` votes with intra-prompt
    correlation ``icc``."""
    if raters < 1:
        raise ValueError("raters per prompt must be at least 1")
    if not 0 <= icc <= 1:
        raise ValueError("the intra-prompt correlation must be in [0, 1]")
    return sd_vote * math.sqrt((1 + (raters - 1) * icc) / raters)


def power(n: int, margin: float, sd: float, alpha: float = 0.05, delta: float = 0.0,
          test: str = "equivalence") -> float:
    """Power of the margin test on ``n`` per-prompt means with standard deviation ``sd``."""
    if test not in TESTS:
        raise ValueError(f"test must be one of {', '.join(TESTS)}")
    if n < 2 or sd <= 0 or margin <= 0:
        return 0.0
    se = sd / math.sqrt(n)
    df = n - 1
    tc = float(_st.t.ppf(1 - alpha, df))
    lower = float(_st.nct.sf(tc, df, (delta + margin) / se))  # rejects mean <= -margin
    if test == "non-inferiority":
        return lower
    upper = float(_st.nct.cdf(-tc, df, (delta - margin) / se))  # rejects mean >= +margin
    return max(0.0, lower + upper - 1.0)


def prompts_needed(margin: float, sd: float, alpha: float = 0.05, delta: float = 0.0,
                   test: str = "equivalence", target: float = 0.8, minimum: int = 2,
                   limit: int = 1_000_000) -> int | None:
    """The fewest prompts (at least ``minimum``) whose power reaches ``target``; None if even
    ``limit`` prompts do not (e.g. a true Δ outside the margin)."""
    lo = max(2, minimum)
    if power(lo, margin, sd, alpha, delta, test) >= target:
        return lo
    hi = lo
    while power(hi, margin, sd, alpha, delta, test) < target:
        if hi >= limit:
            return None
        hi = min(limit, hi * 2)
    while hi - lo > 1:  # power grows with n: bisect
        mid = (lo + hi) // 2
        if power(mid, margin, sd, alpha, delta, test) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def simulate_power(n: int, margin: float, ties: float, delta: float = 0.0, raters: int = 1,
                   icc: float = 0.0, alpha: float = 0.05, test: str = "equivalence",
                   min_prompts: int = 2, n_sim: int = 2000, seed: int = 0) -> float:
    """Share of ``n_sim`` simulated studies (n prompts × ``raters`` discrete votes) in which the
    report's margin test passes."""
    rng = np.random.default_rng(seed)
    p = np.array([(1 - ties + delta) / 2, ties, (1 - ties - delta) / 2])
    passed = 0
    for _ in range(n_sim):
        if icc > 0 and raters > 1:
            probs = rng.dirichlet(p * (1 / icc - 1) + 1e-9, size=n)
            counts = np.array([rng.multinomial(raters, q / q.sum()) for q in probs])
        else:
            counts = rng.multinomial(raters, p, size=n)
        means = (counts[:, 0] - counts[:, 2]) / raters
        result = stats.margin_test(means, margin, alpha, test=test, min_n=min_prompts)
        passed += bool(result.passed)
    return passed / n_sim


@dataclass
class Plan:
    sd_vote: float
    sd_prompt: float
    prompts: int | None
    votes: int | None


def make_plan(margin: float, ties: float, delta: float = 0.0, raters: int = 1, icc: float = 0.0,
              alpha: float = 0.05, test: str = "equivalence", target: float = 0.8,
              min_prompts: int = 10, sd: float | None = None) -> Plan:
    """Prompts (and votes) needed for ``target`` power under the stated assumptions."""
    sd_v = vote_sd(ties, delta)
    sd_p = sd if sd is not None else prompt_sd(sd_v, raters, icc)
    n = prompts_needed(margin, sd_p, alpha, delta, test, target, min_prompts)
    return Plan(sd_v, sd_p, n, None if n is None else n * raters)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_margin_arguments(parser)
    parser.add_argument("--power", type=float, default=0.8, help="power to plan for")
    parser.add_argument("--ties", type=float, default=0.65,
                        help="expected share of ties (the paper's study: 64 of 99)")
    parser.add_argument("--delta", type=float, default=0.0,
                        help="expected true Δ (0: the methods really are alike)")
    parser.add_argument("--raters-per-prompt", type=int, default=1,
                        help="votes per prompt (raters per item × pairs sharing a prompt)")
    parser.add_argument("--icc", type=float, default=0.0,
                        help="intra-prompt correlation of votes (0: independent; raters of one "
                             "prompt usually agree somewhat, which makes extra raters worth less)")
    parser.add_argument("--sd", type=float, default=None,
                        help="standard deviation of per-prompt mean scores, e.g. from a pilot "
                             "(replaces --ties, --raters-per-prompt and --icc for the power)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="also give the power of a study with this many prompts")
    parser.add_argument("--simulate", type=int, default=0, metavar="N",
                        help="check the power at the planned size by simulating N studies")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulation")


def _fail(message: str) -> int:
    print(f"attnqat eval plan: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if not 0 < args.equivalence_margin <= 1:
        return _fail("--margin must be in (0, 1]")
    if args.min_prompts < 2:
        return _fail("--min-prompts must be at least 2")
    if not 0 < args.alpha < 0.5:
        return _fail("--alpha must be in (0, 0.5)")
    if not 0 < args.power < 1:
        return _fail("--power must be in (0, 1)")
    if args.sd is not None and args.sd <= 0:
        return _fail("--sd must be positive")
    if args.prompts is not None and args.prompts < 2:
        return _fail("--prompts must be at least 2")
    if args.simulate < 0:
        return _fail("--simulate must be 0 or positive")
    try:
        plan = make_plan(args.equivalence_margin, args.ties, args.delta, args.raters_per_prompt, args.icc,
                         args.alpha, args.test, args.power, args.min_prompts, args.sd)
    except ValueError as exc:
        return _fail(str(exc))
    claim = (f"−{args.equivalence_margin:g} < Δ < {args.equivalence_margin:g}" if args.test == "equivalence"
             else f"Δ > −{args.equivalence_margin:g}")
    print(f"{args.test} test of {claim} at α = {args.alpha:g} on per-prompt mean scores")
    if args.sd is None:
        print(f"assumed: {args.ties:.0%} ties, true Δ = {args.delta:+g}, "
              f"{args.raters_per_prompt} vote(s) per prompt, intra-prompt correlation {args.icc:g}")
    print(f"SD of one vote: {plan.sd_vote:.3f}; SD of a prompt's mean: {plan.sd_prompt:.3f}")
    if plan.prompts is None:
        print(f"no number of prompts reaches {args.power:.0%} power (is |Δ| at least the margin?)")
    else:
        print(f"prompts needed for {args.power:.0%} power: {plan.prompts} "
              f"({plan.votes} votes)")
    rows = sorted({n for n in (plan.prompts, args.prompts, 20, 50, 100, 200, 500) if n})
    print("prompts  power")
    for n in rows:
        print(f"{n:7d}  {power(n, args.equivalence_margin, plan.sd_prompt, args.alpha, args.delta, args.test):.3f}")
    if args.simulate and (plan.prompts or args.prompts):
        n = args.prompts or plan.prompts
        if args.sd is not None:
            print("(the simulation draws votes from --ties/--raters-per-prompt/--icc, not --sd)")
        sim = simulate_power(n, args.equivalence_margin, args.ties, args.delta, args.raters_per_prompt,
                             args.icc, args.alpha, args.test, args.min_prompts, args.simulate,
                             args.seed)
        print(f"simulated power at {n} prompts ({args.simulate} studies): {sim:.3f}")
    return 0
