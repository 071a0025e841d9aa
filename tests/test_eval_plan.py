"""``attnqat eval plan``: power of the study's margin test, exact, approximated and simulated."""

from __future__ import annotations

import math

import pytest

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


@pytest.mark.parametrize("n,ties,delta,test", [(99, 0.65, 0.0, "non-inferiority"),
                                               (218, 0.65, 0.0, "non-inferiority"),
                                               (150, 0.5, 0.03, "equivalence"),
                                               (320, 0.65, 0.0, "equivalence")])
def test_exact_power_agrees_with_simulation_and_the_normal_approximation(n, ties, delta, test):
    exact = plan.power(n, 0.1, ties, delta=delta, test=test)
    sim = plan.simulate_power(n, 0.1, ties, delta, test=test, n_sim=600, seed=2)
    assert sim == pytest.approx(exact, abs=4 * math.sqrt(exact * (1 - exact) / 600) + 0.01)
    # The normal approximation (used for several raters per prompt) with one rater.
    approx = plan.power(n, 0.1, ties, delta=delta, test=test, sd=plan.vote_sd(ties, delta))
    assert approx == pytest.approx(exact, abs=0.04)


def test_equivalence_power_and_the_planned_size():
    n = plan.prompts_needed(0.1, 0.65, target=0.8)
    assert n == 320
    assert all(plan.power(m, 0.1, 0.65) >= 0.8 for m in range(n, n + 30))
    assert plan.power(n - 5, 0.1, 0.65) < 0.8
    # A true difference at the margin can never be shown equivalent.
    assert plan.prompts_needed(0.1, 0.65, delta=0.1, limit=4000) is None
    assert plan.power(1, 0.1, 0.65) == 0.0
    # Raters who share a prompt: the design effect 1 + (k − 1)·icc, checked by simulation.
    clustered = plan.power(149, 0.1, 0.65, raters=3, icc=0.2)
    sim = plan.simulate_power(149, 0.1, 0.65, raters=3, icc=0.2, n_sim=300, seed=3)
    assert sim == pytest.approx(clustered, abs=0.1)


def test_the_minimum_prompt_rule_is_part_of_the_plan():
    # A huge margin needs hardly any prompts, but the study's verdict needs min_prompts.
    assert plan.prompts_needed(0.9, 0.3, minimum=2) < 10
    assert plan.prompts_needed(0.9, 0.3, minimum=10) == 10
    assert plan.simulate_power(5, 0.9, ties=0.65, n_sim=50, min_prompts=10) == 0.0


def test_cli_plan_prints_the_sample_size(capsys):
    assert cli_main(["eval", "plan", "--margin", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "prompts needed for 80% power: 320 (320 votes)" in out
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


def test_cli_size_table(capsys):
    assert cli_main(["eval", "plan", "--size-table", "--prompts", "60"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| 60 |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 22 and cells[-2] == "—"  # 95 % ties: no null to test
    assert float(cells[-1].strip("*")) <= 5.5
