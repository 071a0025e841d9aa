"""The memory-lean optimizer (attnqat/finetune/optim.py) and FSDP2 CPU offload in the trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnqat.finetune import train as T
from attnqat.finetune.optim import AdamW8bit, dequantize, quantize
from finetune_data import losses, small_model

FLAGS = ["--device", "cpu", "--no-tensorboard", "--no-progress"]


def test_stochastic_rounding_is_unbiased_and_8_bit_codes_are_close():
    x = torch.randn(4, 300) * torch.logspace(-3, 1, 300)
    gen = torch.Generator().manual_seed(0)
    one = dequantize(*quantize(x, True, gen))
    blocks = torch.nn.functional.pad(x, (0, 84)).view(4, -1, 128).abs().amax(-1)
    step = (blocks / 127).repeat_interleave(128, dim=1)[:, :300]
    assert ((one - x).abs() <= step + 1e-7).all()   # within one code of its block
    mean = torch.stack([dequantize(*quantize(x, True, gen)) for _ in range(400)]).mean(0)
    assert (mean - x).abs().max() < 0.15 * step.max()   # unbiased: the average converges
    u = x.abs()
    assert (dequantize(*quantize(u, False, gen)) >= 0).all()


def test_adamw8bit_follows_adamw_with_a_quarter_of_the_state():
    torch.manual_seed(0)
    a_in, w_true = torch.randn(256, 64), torch.randn(64, 32)
    target = a_in @ w_true + 0.01 * torch.randn(256, 32)
    runs = {}
    for name, cls in (("adamw", torch.optim.AdamW), ("8bit", AdamW8bit)):
        w = torch.nn.Parameter(torch.zeros(64, 32))
        b = torch.nn.Parameter(torch.zeros(32))
        opt = cls([w, b], lr=3e-2, weight_decay=0.01)
        curve = []
        for _ in range(300):
            loss = ((a_in @ w + b - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(float(loss.detach()))
        runs[name] = (curve, w.detach().clone(), opt)
    (ca, wa, _), (c8, w8, opt8) = runs["adamw"], runs["8bit"]
    assert c8[-1] < 0.02 * c8[0] and c8[-1] == pytest.approx(ca[-1], rel=0.3, abs=1e-3)
    assert (w8 - wa).norm() / wa.norm() < 0.05
    fp32_bytes = 2 * 4 * (64 * 32 + 32)
    assert opt8.state_bytes() < 0.4 * fp32_bytes   # 2 bytes a weight + block scales + the vector


def _cpu_shard_on_cuda_mesh(local: torch.Tensor, mesh) -> torch.Tensor:
    """A DTensor parameter as FSDP2's CPU offload holds it: the shard in CPU memory, the mesh CUDA."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False)


def test_adamw8bit_keeps_an_offloaded_shards_state_in_cpu_memory():
    """Under FSDP2's CPU offload a parameter's shard lives in CPU memory on a CUDA mesh. The 8-bit
    state must stay beside it: made with DTensor.from_local it went to the GPU, and the first
    optimizer step of a 14B --offload run failed mixing cuda:0 and cpu tensors. Here the mesh
    claims CUDA on a machine without one, so any move to it fails."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _step_offloaded_shards(DeviceMesh("cuda", torch.arange(1), _init_backend=False))
    finally:
        dist.destroy_process_group()


def _step_offloaded_shards(mesh) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(8, 200), torch.randn(8)
    params = [torch.nn.Parameter(_cpu_shard_on_cuda_mesh(t.clone(), mesh)) for t in (w, b)]
    plain = [torch.nn.Parameter(t.clone()) for t in (w, b)]
    opts = [AdamW8bit(ps, lr=1e-2, seed=3) for ps in (params, plain)]
    for step in range(3):
        grads = [torch.randn(8, 200), torch.randn(8)]
        for p, q, g in zip(params, plain, grads):
            p.grad = _cpu_shard_on_cuda_mesh(g.clone(), mesh)
            q.grad = g.clone()
        for opt in opts:
            opt.step()
    for p, q in zip(params, plain):
        assert torch.equal(p.to_local(), q.detach())   # the same update as a plain tensor's
    for st in opts[0].state.values():
        for v in st.values():
            local = v.to_local() if hasattr(v, "to_local") else v
            assert local.device.type == "cpu"
            assert not hasattr(v, "to_local") or v.shape[0] == 8   # sharded like its parameter


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_model(tmp_path_factory.mktemp("optim") / "small-wan")


def test_8bit_optimizer_with_offload_trains_and_resumes_exactly(model, tmp_path):
    """--optimizer adamw8bit --offload (FSDP2 CPUOffloadPolicy; on the CPU it changes no
    numbers): a run stopped at step 3 and resumed gives the uninterrupted run's losses bit for
    bit — the 8-bit states and their rounding noise are saved and re-made."""
    common = [*FLAGS, "--model", str(model), "--batch-size", "2", "--lr", "1e-2", "--warmup", "0",
              "--optimizer", "adamw8bit", "--offload", "--checkpoint-every", "3"]
    assert T.main([*common, "--out", str(tmp_path / "ref"), "--steps", "6"]) == 0
    assert T.main([*common, "--out", str(tmp_path / "cut"), "--steps", "3"]) == 0
    assert T.main(["--out", str(tmp_path / "cut"), "--resume", *FLAGS, "--steps", "6"]) == 0
    ref, cut = losses(tmp_path / "ref"), losses(tmp_path / "cut")
    assert sorted(ref) == list(range(1, 7)) and ref == cut
    plain = [*FLAGS, "--model", str(model), "--batch-size", "2", "--lr", "1e-2", "--warmup", "0"]
    assert T.main([*plain, "--out", str(tmp_path / "adamw"), "--steps", "6"]) == 0
    assert losses(tmp_path / "adamw")[1] == ref[1] and losses(tmp_path / "adamw")[6] != ref[6]
    assert T.main(["--out", str(tmp_path / "cut"), "--resume", *FLAGS, "--steps", "7",
                   "--optimizer", "adamw"]) == 2
