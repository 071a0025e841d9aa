"""``attnqat eval plan``: power of the study's margin tests, against statsmodels and simulation."""

from __future__ import annotations

import math

import pytest
from statsmodels.stats.power import TTestPower

from attnqat.cli import main as cli_main
from attnqat.eval import plan


def test_spread_of_votes_and_prompt_means():
    # 65 % ties, no true difference: a vote is ±1 with probability 0.35.
    assert plan.vote_sd(0.65) == pytest.approx(math.sqrt(0.35))
    # Δ = 0.1 with 60 % ties: 25 % wins, 15 % losses; variance 0.4 − 0.01.
    assert plan.vote_sd(0.6, 0.1) == pytest.approx(math.sqrt(0.39))
    assert plan.prompt_sd(0.6, raters=4) == pytest.approx(0.3)  # independent votes: sd / √k
    assert plan.prompt_sd(0.6, raters=4, icc=1.0) == pytest.approx(0.6)  # raters always agree
    with pytest.raises(ValueError, match="impossible"):
        plan.vote_sd(0.9, 0.2)
    with pytest.raises(ValueError):
        plan.prompt_sd(0.5, raters=0)


@pytest.mark.parametrize("n,delta", [(20, 0.0), (99, 0.0), (218, 0.0), (60, 0.05), (40, -0.05)])
def test_noninferiority_power_is_statsmodels_one_sided_t_power(n, delta):
    sd, margin = 0.59, 0.1
    ours = plan.power(n, margin, sd, 0.05, delta, "non-inferiority")
    ref = TTestPower().power(effect_size=(delta + margin) / sd, nobs=n, alpha=0.05,
                             alternative="larger")
    assert ours == pytest.approx(ref, rel=1e-6)


def test_equivalence_power_bounds_and_simulation():
    sd, margin = plan.vote_sd(0.65), 0.1
    # With Δ = 0 the two one-sided tests are mirror images: power = 2·P(one rejects) − 1.
    one = plan.power(302, margin, sd, test="non-inferiority")
    assert plan.power(302, margin, sd) == pytest.approx(2 * one - 1)
    n = plan.prompts_needed(margin, sd, target=0.8)
    assert plan.power(n, margin, sd) >= 0.8 > plan.power(n - 1, margin, sd)
    assert n == 302
    # The discrete votes of simulated studies, analysed by the report's own test, agree.
    sim = plan.simulate_power(n, margin, ties=0.65, n_sim=400, seed=1)
    assert sim == pytest.approx(plan.power(n, margin, sd), abs=0.07)
    # A true difference at the margin can never be shown equivalent.
    assert plan.prompts_needed(margin, sd, delta=0.1, limit=20_000) is None
    assert plan.power(1, margin, sd) == 0.0


def test_the_minimum_prompt_rule_is_part_of_the_plan():
    # A huge margin needs hardly any prompts, but the study's verdict needs min_prompts.
    assert plan.prompts_needed(0.9, 0.3, minimum=2) < 10
    assert plan.prompts_needed(0.9, 0.3, minimum=10) == 10
    assert plan.simulate_power(5, 0.9, ties=0.65, n_sim=50, min_prompts=10) == 0.0


def test_cli_plan_prints_the_sample_size(capsys):
    assert cli_main(["eval", "plan", "--margin", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "prompts needed for 80% power: 302 (302 votes)" in out
    assert cli_main(["eval", "plan", "--margin", "0.1", "--non-inferiority", "--prompts", "99",
                     "--raters-per-prompt", "3", "--icc", "0.2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("non-inferiority test of Δ > −0.1")
    assert "     99  " in out
    for bad, message in [(["--margin", "0"], "--margin"), (["--ties", "1.2"], "tie share"),
                         (["--delta", "0.5", "--ties", "0.7"], "impossible"),
                         (["--prompts", "1"], "--prompts")]:
        assert cli_main(["eval", "plan", *bad]) == 2
        assert message in capsys.readouterr().err
