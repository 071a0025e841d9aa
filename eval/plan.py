"""``attnqat eval plan``: how many prompts a study needs for its margin test to succeed.

The study's verdict is the score test of :func:`attnqat.eval.stats.margin_test_counts` on the
net preference Δ = win share − lose share. Its power:

* with one vote per prompt (the default plan), **exact**: the probability of a verdict summed
  over every (W, T, L) the study could see (:func:`attnqat.eval.stats.verdict_probability`),
  for true shares (win, tie, lose) = ((1 − t + Δ)/2, t, (1 − t − Δ)/2);
* with several raters per prompt, from the normal approximation of the same statistic: a vote
  scores +1 / 0 / −1 with variance (1 − t) − Δ²; ``k`` votes of one prompt with intra-prompt
  correlation ``icc`` inflate the variance of the total by the design effect 1 + (k − 1)·icc
  (``--sd``, a pilot's SD of per-prompt mean scores, gives the design effect directly); the null
  variance at ±δ is the test's own (restricted maximum-likelihood shares).
  Equivalence power is P(lower rejects) + P(upper rejects) − 1 (the usual bound).

``--simulate N`` checks the figure by simulating N studies of discrete votes (prompt-level
Dirichlet-multinomial draws for ``icc`` > 0) through the same analysis code as the report,
"not enough data" rule included.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st
from tqdm.auto import tqdm

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


#: Largest study whose power with one vote per prompt is enumerated exactly.
EXACT_LIMIT = 1500


def _shares(ties: float, delta: float) -> tuple[float, float, float]:
    return ((1 - ties + delta) / 2, ties, (1 - ties - delta) / 2)


def power(n: int, margin: float, ties: float, alpha: float = 0.05, delta: float = 0.0,
          test: str = "equivalence", raters: int = 1, icc: float = 0.0,
          sd: float | None = None) -> float:
    """Power of the study's margin test with ``n`` prompts (see the module docstring)."""
    if test not in TESTS:
        raise ValueError(f"test must be one of {', '.join(TESTS)}")
    sd_v = vote_sd(ties, delta)  # validates the tie share and Δ
    if n < 2 or margin <= 0:
        return 0.0
    if raters == 1 and icc == 0 and sd is None and n <= EXACT_LIMIT:
        return stats.verdict_probability(n, _shares(ties, delta), margin, alpha, test)
    votes = n * raters
    v1 = sd_v * sd_v
    if sd is not None:
        deff = max(1.0, sd * sd * raters / v1) if v1 > 0 else float(raters)
    else:
        deff = 1 + (raters - 1) * icc
    if v1 <= 0:
        return 0.0
    z = float(_st.norm.ppf(1 - alpha))
    w, _, l_ = (votes * x for x in _shares(ties, delta))
    spread = math.sqrt(deff * votes * v1)

    def rejects(delta0: float, sign: int) -> float:
        q = float(stats.restricted_lose_share(w, l_, votes, delta0))
        null_sd = math.sqrt(deff * votes * max(2 * q + delta0 * (1 - delta0), 0.0))
        shift = sign * (votes * delta - votes * delta0) - stats.CONTINUITY - z * null_sd
        return float(_st.norm.cdf(shift / spread))

    lower = rejects(-margin, +1)  # rejects Δ <= -margin
    if test == "non-inferiority":
        return lower
    return max(0.0, lower + rejects(margin, -1) - 1.0)


def prompts_needed(margin: float, ties: float, alpha: float = 0.05, delta: float = 0.0,
                   test: str = "equivalence", target: float = 0.8, minimum: int = 2,
                   limit: int = 1_000_000, raters: int = 1, icc: float = 0.0,
                   sd: float | None = None) -> int | None:
    """The fewest prompts (at least ``minimum``) whose power reaches ``target``; None if even
    ``limit`` prompts do not (e.g. a true Δ outside the margin). The exact power of a discrete
    test is not monotone in n: the answer is the first n from which it stays at ``target`` for
    the next 10 % of sizes checked."""
    def pw(n: int) -> float:
        return power(n, margin, ties, alpha, delta, test, raters, icc, sd)

    lo = max(2, minimum)
    hi = lo
    while pw(hi) < target:
        if hi >= limit:
            return None
        hi = min(limit, hi * 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pw(mid) >= target:
            hi = mid
        else:
            lo = mid
    n = hi
    while n < limit and any(pw(m) < target for m in range(n + 1, n + 1 + max(1, n // 10), max(1, n // 50))):
        n += 1
        while pw(n) < target:
            n += 1
    return n


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
        result = stats.margin_test_counts(counts, margin, alpha, test=test, min_n=min_prompts)
        passed += bool(result.passed)
    return passed / n_sim


@dataclass
class Plan:
    sd_vote: float
    design_effect: float
    prompts: int | None
    votes: int | None


def make_plan(margin: float, ties: float, delta: float = 0.0, raters: int = 1, icc: float = 0.0,
              alpha: float = 0.05, test: str = "equivalence", target: float = 0.8,
              min_prompts: int = 10, sd: float | None = None) -> Plan:
    """Prompts (and votes) needed for ``target`` power under the stated assumptions."""
    sd_v = vote_sd(ties, delta)
    prompt_sd(sd_v, raters, icc)  # validates raters and icc
    deff = (max(1.0, sd * sd * raters / (sd_v * sd_v)) if sd is not None and sd_v > 0
            else 1 + (raters - 1) * icc)
    n = prompts_needed(margin, ties, alpha, delta, test, target, min_prompts, raters=raters,
                       icc=icc, sd=sd)
    return Plan(sd_v, deff, n, None if n is None else n * raters)


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
    parser.add_argument("--size-table", action="store_true",
                        help="print the exact type-I error of the margin test at the margin "
                             "(one vote per prompt; 20, 60, 99, 200 prompts or --prompts; tie "
                             "shares 0 … 95 %%) and exit")


def size_table(margin: float, alpha: float, test: str, sizes: Sequence[int]) -> str:
    """Markdown table of the exact size at the margin by number of prompts and tie share."""
    ties = list(range(0, 100, 5))
    lines = ["| prompts | " + " | ".join(f"{t} %" for t in ties) + " | max |",
             "|---:|" + "---:|" * (len(ties) + 1)]
    for n in tqdm(sizes, desc="enumerating", unit="size", leave=False):
        row = [stats.margin_test_size(n, t / 100, margin, alpha, test) for t in ties]
        cells = ["—" if r is None else f"{100 * r:.2f}" for r in row]
        worst = max(r for r in row if r is not None)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | **{100 * worst:.2f}** |")
    return "\n".join(lines)


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
    if args.size_table:
        where = (f"Δ = ±{args.equivalence_margin:g}" if args.test == "equivalence"
                 else f"Δ = −{args.equivalence_margin:g}")
        print(f"exact size (%) of the {args.test} test at {where}, "
              f"nominal α = {args.alpha:g}, one vote per prompt (— : the tie share leaves "
              "no room for |Δ| = margin)")
        print(size_table(args.equivalence_margin, args.alpha, args.test,
                         [args.prompts] if args.prompts else [20, 60, 99, 200]))
        return 0
    try:
        plan = make_plan(args.equivalence_margin, args.ties, args.delta, args.raters_per_prompt, args.icc,
                         args.alpha, args.test, args.power, args.min_prompts, args.sd)
    except ValueError as exc:
        return _fail(str(exc))
    claim = (f"−{args.equivalence_margin:g} < Δ < {args.equivalence_margin:g}" if args.test == "equivalence"
             else f"Δ > −{args.equivalence_margin:g}")
    print(f"{args.test} test of {claim} at α = {args.alpha:g} (score test of win − lose share)")
    if args.sd is None:
        print(f"assumed: {args.ties:.0%} ties, true Δ = {args.delta:+g}, "
              f"{args.raters_per_prompt} vote(s) per prompt, intra-prompt correlation {args.icc:g}")
    exact = args.raters_per_prompt == 1 and args.icc == 0 and args.sd is None
    print(f"SD of one vote: {plan.sd_vote:.3f}; design effect of votes sharing a prompt: "
          f"{plan.design_effect:.2f}; power "
          + ("exact (enumerated)" if exact else "from the normal approximation"))
    if plan.prompts is None:
        print(f"no number of prompts reaches {args.power:.0%} power (is |Δ| at least the margin?)")
    else:
        print(f"prompts needed for {args.power:.0%} power: {plan.prompts} "
              f"({plan.votes} votes)")
    rows = sorted({n for n in (plan.prompts, args.prompts, 20, 50, 100, 200, 500) if n})
    print("prompts  power")
    for n in rows:
        p = power(n, args.equivalence_margin, args.ties, args.alpha, args.delta, args.test,
                  args.raters_per_prompt, args.icc, args.sd)
        print(f"{n:7d}  {p:.3f}")
    if args.simulate and (plan.prompts or args.prompts):
        n = args.prompts or plan.prompts
        if args.sd is not None:
            print("(the simulation draws votes from --ties/--raters-per-prompt/--icc, not --sd)")
        sim = simulate_power(n, args.equivalence_margin, args.ties, args.delta, args.raters_per_prompt,
                             args.icc, args.alpha, args.test, args.min_prompts, args.simulate,
                             args.seed)
        print(f"simulated power at {n} prompts ({args.simulate} studies): {sim:.3f}")
    return 0
