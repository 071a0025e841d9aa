"""How the SageBwd tuning bench picks its defaults from timed variant rows (no GPU: the rows are
made up here; kernels/sagebwd_bench.py times the real ones)."""

from attnqat.kernels.sagebwd_bench import combinations, pick


def row(kernel, config, ms, err=0.0):
    return dict(name=f"{kernel} {config}", kernel=kernel, config=config, ms=[ms, ms + 0.1], err_vs_default=err)


ROWS = [
    row("fwd", {}, 10.4), row("fwd", {"BM": 128, "num_warps": 8, "num_stages": 3}, 9.9),
    row("fwd", {"BM": 64, "num_warps": 4, "num_stages": 4}, 9.0, err=0.3),   # wrong output: never picked
    row("dq", {}, 60.0), row("dq", {"num_warps": 8, "num_stages": 4}, 58.0),
    row("dkdv", {"split": True, "dv": {"num_warps": 4, "num_stages": 2}}, 55.0),
    row("dkdv", {"split": True, "dk": {"num_warps": 8, "num_stages": 1}}, 61.0),   # slower: not combined
    row("dkdv+dq", {"dkdv": {"split": True, "dk": {"num_warps": 8, "num_stages": 1}},
                    "dq": {"stored": True, "num_warps": 8, "num_stages": 3}}, 50.0, err=2e-7),
    {"name": "dq {'num_warps': 2}", "error": "OutOfResources"},
]


def test_combinations_join_the_faster_launch_options():
    combos = combinations(ROWS)
    assert combos[0] == {"dkdv": {"split": True, "dv": {"num_warps": 4, "num_stages": 2}},
                         "dq": {"num_warps": 8, "num_stages": 4}}
    # the stored-dS row gets the dV launch's options; its own dK options stay
    assert combos[1] == {"dkdv": {"split": True, "dk": {"num_warps": 8, "num_stages": 1},
                                  "dv": {"num_warps": 4, "num_stages": 2}},
                         "dq": {"stored": True, "num_warps": 8, "num_stages": 3}}
    assert combinations([r for r in ROWS if r.get("config") != {}]) == []   # no default row: nothing


def test_pick_takes_the_fastest_correct_rows_combos_included():
    assert pick(ROWS) == {"fwd": {"BM": 128, "num_warps": 8, "num_stages": 3}, "schedule": "triton",
                          "dkdv": {"split": True, "dk": {"num_warps": 8, "num_stages": 1}},
                          "dq": {"stored": True, "num_warps": 8, "num_stages": 3}}
    combo = {"dkdv": {"split": False, "num_warps": 8, "num_stages": 1}, "dq": {"stored": True}}
    assert pick(ROWS + [row("combo", combo, 40.0)])["dkdv"] == combo["dkdv"]
    assert pick([row("fwd", {}, 1.0, err=0.5)]) == {}
    # a whole backward configuration (the Gluon schedule with launch options) is taken as it is
    gluon = {"schedule": "gluon", "gluon": {"dq": {"STAGES": 3}}}
    assert pick(ROWS + [row("bwd", gluon, 30.0)]) == {"fwd": {"BM": 128, "num_warps": 8, "num_stages": 3}, **gluon}
