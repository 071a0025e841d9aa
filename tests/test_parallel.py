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


def _run(tmp_path, method: str, scope: str, backward: bool, world: int = 2) -> dict:
    out = tmp_path / f"{method}-{scope}.json"
    mp.spawn(sp_workers.forward_backward, nprocs=world, join=True,
             args=(world, str(tmp_path / f"store-{method}-{scope}"), str(out), method, scope, backward))
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("method,scope,backward", [
    ("bf16", "self", True),
    ("attnqat", "self", True),
    ("attnqat", "all", True),
    ("nvfp4", "all", False),
    ("sage3", "all", False),
    ("dropin", "self", True),
])
def test_sp2_equals_one_process(tmp_path, method, scope, backward):
    r = _run(tmp_path, method, scope, backward)
    assert r["calls"] == {"self": 2, "cross": 2}      # every attention call went through the processor
    # the attention saw the whole sequence (128 tokens) for half the heads; text keys: 12
    assert [tuple(map(tuple, x[1:])) for x in r["seen"]] == [((2, 128, 2, 32), (2, 12, 2, 32)),
                                                            ((2, 128, 2, 32), (2, 128, 2, 32))]
    assert r["out"] <= 1e-5, r
    if backward:
        assert r["grads"] <= 1e-5, r
    assert r["removed"] <= 1e-5, r

