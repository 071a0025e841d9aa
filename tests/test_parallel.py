"""Ulysses sequence parallelism (attnqat/parallel.py): two gloo CPU processes against one, every
method, forward and backward; the checks of what cannot be split."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import sp_workers
from attnqat.parallel import SequenceParallelError, check_heads, check_tokens


def test_sp_must_divide_heads_and_tokens():
    check_heads(40, 4)
    check_heads(12, 4)
    with pytest.raises(SequenceParallelError, match=r"--sp 8 does not divide .* 12 attention heads.*1, 2, 3, 4, 6, 12"):
        check_heads(12, 8)
    with pytest.raises(SequenceParallelError, match="at least 1"):
        check_heads(12, 0)
    check_tokens(32760, 4)
    with pytest.raises(SequenceParallelError, match="sequence of 390 tokens .* --sp 4"):
        check_tokens(390, 4)


CASES = [("bf16", "self", True), ("attnqat", "self", True), ("attnqat", "all", True),
         ("nvfp4", "all", False), ("sage3", "all", False), ("dropin", "self", True)]


@pytest.mark.slow
def test_sp2_equals_one_process_for_every_method(tmp_path):
    """Two spawned gloo processes (one spawn for all cases: the imports dominate)."""
    out = tmp_path / "results.json"
    mp.spawn(sp_workers.forward_backward, nprocs=2, join=True,
             args=(2, str(tmp_path / "store"), str(out), CASES))
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(f"{m}/{sc}" for m, sc, _ in CASES)
    for (method, scope, backward) in CASES:
        r = results[f"{method}/{scope}"]
        assert r["calls"] == {"self": 2, "cross": 2}, (method, r)  # every call went through it
        # the attention saw the whole sequence (128 tokens) for half the heads; text keys: 12
        assert [tuple(map(tuple, x[1:])) for x in r["seen"]] == [
            ((2, 128, 2, 32), (2, 12, 2, 32)), ((2, 128, 2, 32), (2, 128, 2, 32))], (method, r)
        assert r["out"] <= 1e-5, (method, scope, r)
        if backward:
            assert r["grads"] <= 1e-5, (method, scope, r)
        assert r["removed"] <= 1e-5, (method, scope, r)
