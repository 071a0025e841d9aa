"""A LoRA run's frozen base kept in bfloat16 under bf16 autocast (attnqat.lora.frozen_base_to, the
Trainer in finetune/train.py): the same losses and adapter as with the float32 base, bit for bit,
with the default data workers, resumed, and over two gloo processes with CPU offload; the frozen
linear weights bfloat16, the adapter, norms and modulation tables float32, the parameter memory
down by 2 bytes per cast value; a merged export still the float32 base + scale · B·A.

The float32-base reference is the same run with ``frozen_base_to`` replaced by a no-op (what the
trainer did before). Run as a script (under torchrun), this file is that trainer, with the no-op
when ``ATTNQAT_TEST_F32_BASE`` is set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnqat import lora as L
from attnqat.finetune import checkpoint as ckpt
from attnqat.finetune import train as T
from finetune_data import losses, small_model

REPO = Path(__file__).resolve().parents[1]
#: the default data workers (no --workers 0), bf16 autocast on the CPU
FLAGS = ["--device", "cpu", "--no-tensorboard", "--no-progress", "--precision", "bf16"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--warmup", "0", "--batch-size", "2"]
SCALE = 8 / 4


def _float32_base(monkeypatch) -> None:
    monkeypatch.setattr(L, "frozen_base_to", lambda transformer, dtype=None: 0)


def _adapter(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The adapter's weights in a run's checkpoint."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt.checkpoint_dir(run, step))).read_metadata().state_dict_metadata
    full = {k[len("model."):]: torch.empty(tuple(m.size)) for k, m in meta.items()
            if k.startswith("model.") and ".lora_" in k}
    ckpt.load_full_state(ckpt.checkpoint_dir(run, step), full)
    return full


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The small tiny-wan with float32 transformer weights that bfloat16 cannot hold (the shipped
    folder stores bfloat16: casting those would lose nothing and prove nothing)."""
    from diffusers import WanTransformer3DModel

    folder = small_model(tmp_path_factory.mktemp("lora-dtype") / "small-wan")
    t = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in t.parameters():
            p.mul_(1 + 0.01 * torch.randn(p.shape, generator=gen))
    t.save_pretrained(folder / "transformer", safe_serialization=True)
    w = t.blocks[0].attn1.to_q.weight
    assert w.dtype == torch.float32 and not torch.equal(w, w.bfloat16().float())
    return folder


@pytest.fixture(scope="module")
def run(model, tmp_path_factory) -> Path:
    """Four LoRA steps with the bfloat16 base (the default under bf16), checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("lora-bf16") / "run"
    assert T.main(["--model", str(model), "--out", str(out), *FLAGS, *LORA, "--steps", "4",
                   "--checkpoint-every", "2"]) == 0
    return out


def test_the_bf16_base_gives_the_float32_base_losses_and_adapter_bit_for_bit(model, run, tmp_path,
                                                                            monkeypatch):
    ref = tmp_path / "f32-base"
    with monkeypatch.context() as m:
        _float32_base(m)
        assert T.main(["--model", str(model), "--out", str(ref), *FLAGS, *LORA, "--steps", "4",
                       "--checkpoint-every", "2"]) == 0
    got, want = losses(run), losses(ref)
    assert sorted(got) == [1, 2, 3, 4]
    assert got == want   # exactly: autocast used the same bfloat16 weights in both
    a, b = _adapter(run, 4), _adapter(ref, 4)
    assert set(a) == set(b) and len(a) == 2 * (8 + 2) * 2
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if ".lora_B." in k)  # it trained
    # the adapter's draw comes from --seed: a third run in this process starts from the same A
    again = tmp_path / "again"
    assert T.main(["--model", str(model), "--out", str(again), *FLAGS, *LORA, "--steps", "2"]) == 0
    assert losses(again) == {s: want[s] for s in (1, 2)}


def test_a_bf16_base_run_resumes_bit_for_bit(model, run, tmp_path):
    out = tmp_path / "resumed"
    common = ["--model", str(model), "--out", str(out), *FLAGS, *LORA, "--checkpoint-every", "2"]
    assert T.main([*common, "--steps", "2"]) == 0
    assert T.main(["--out", str(out), "--resume", *FLAGS, "--steps", "4"]) == 0
    assert losses(out) == losses(run)
    a, b = _adapter(out, 4), _adapter(run, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _trainer(model: Path, precision: str):
    from attnqat.finetune import distributed

    p = T.argparse.ArgumentParser()
    T.add_arguments(p)
    args = T.argparse.Namespace(**{**{k: None for k in vars(p.parse_args([]))}, "model": str(model),
                                   "out": "unused", "device": "cpu", "lora_rank": 4, "lora_alpha": 8.0,
                                   "precision": precision})
    cfg = T.resolve_config(args)
    transformer = T.load_transformer(cfg)
    before = sum(p.numel() * p.element_size() for p in transformer.parameters())
    ctx = distributed.init("cpu")
    try:
        tr = T.Trainer(cfg, transformer, ctx, torch.zeros(cfg.max_sequence_length, 32))
        params = {k: distributed.local(p) for k, p in tr.model.named_parameters()}
    finally:
        distributed.shutdown()
    return tr, params, before


def test_frozen_linear_weights_are_bf16_the_adapter_and_the_rest_float32(model):
    tr, params, before = _trainer(model, "bf16")
    kinds: dict[str, set] = {}
    linear = {name for name, m in tr.model.named_modules() if isinstance(m, L.AUTOCAST_CAST)}
    for k, p in params.items():
        owner = k.rsplit(".", 1)[0]
        if ".lora_" in k:
            kind = "adapter"
            assert p.requires_grad
        elif owner in linear and "time_embedder" not in k:
            kind = "linear"
            assert not p.requires_grad
        else:
            kind = "other"   # norms, modulation tables, the time embedder diffusers keeps in float32
        kinds.setdefault(kind, set()).add(p.dtype)
    assert kinds == {"adapter": {torch.float32}, "linear": {torch.bfloat16}, "other": {torch.float32}}
    assert any("scale_shift_table" in k for k in params) and any("norm2.weight" in k for k in params)
    assert {p.dtype for k, p in params.items() if "patch_embedding" in k or "proj_out" in k} == {torch.bfloat16}
    # memory: 2 bytes less for each cast value; the adapter (float32) is all that was added
    adapter = sum(p.numel() * 4 for k, p in params.items() if ".lora_" in k)
    after = sum(p.numel() * p.element_size() for p in params.values())
    cast = sum(p.numel() for k, p in params.items() if p.dtype == torch.bfloat16)
    assert tr.base_bf16 == cast > 0.9 * (before // 4)
    assert after == before + adapter - 2 * cast
    # in fp32 precision nothing runs under autocast: the base stays float32
    tr, params, _ = _trainer(model, "fp32")
    assert tr.base_bf16 == 0 and {p.dtype for p in params.values()} == {torch.float32}


def test_14b_frozen_base_halves():
    """The arithmetic of docs/benchmarks.md ("14B on one GPU"): the 14B base's 14.29 B values are
    53.2 GiB in float32, 26.7 GiB once its linear weights are bfloat16 (99.8 % of them)."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    from attnqat.bench_wan import model_config

    with init_empty_weights():
        m = WanTransformer3DModel.from_config(model_config("14b"))
    n = sum(p.numel() for p in m.parameters())
    L.add_lora(m, 32)
    cast = L.frozen_base_to(m)
    base = sum(p.numel() * p.element_size() for k, p in m.named_parameters() if ".lora_" not in k)
    assert round(n / 1e9, 2) == 14.29 and cast / n > 0.997
    assert round(n * 4 / 2**30, 1) == 53.2 and round(base / 2**30, 1) == 26.7


def test_merged_export_is_the_float32_base_plus_scaled_BA(model, run, tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file

    from attnqat.finetune.export import export
    from attnqat.lora import LORA_FILE

    trained = {k.replace(".default.", "."): v for k, v in _adapter(run, 4).items()}   # live weights
    adapter = load_file(str(export(run, tmp_path / "adapter", weights="live") / LORA_FILE))
    assert len(adapter) == len(trained)
    for k, v in trained.items():
        assert v.dtype == torch.float32 and torch.equal(adapter[f"transformer.{k}"], v)
    merged = WanTransformer3DModel.from_pretrained(export(run, tmp_path / "merged", weights="live",
                                                          merge=True, dtype=torch.float32),
                                                   dtype=torch.float32)
    base = WanTransformer3DModel.from_pretrained(model, subfolder="transformer", dtype=torch.float32)
    got, want = merged.state_dict(), base.state_dict()
    assert set(got) == set(want)
    targets = {k.rsplit(".lora_", 1)[0] for k in trained}
    assert len(targets) == 2 * 10
    rounded = 0
    for name in targets:
        a, b = trained[f"{name}.lora_A.weight"], trained[f"{name}.lora_B.weight"]
        w = want[f"{name}.weight"]
        torch.testing.assert_close(got[f"{name}.weight"], w + SCALE * (b @ a), rtol=0, atol=1e-6)
        # the original float32 weights, not the bfloat16 ones training used
        rounded += not torch.allclose(got[f"{name}.weight"], w.bfloat16().float() + SCALE * (b @ a),
                                      rtol=0, atol=1e-6)
        assert torch.equal(got[f"{name}.bias"], want[f"{name}.bias"])
    assert rounded == len(targets)
    for k in want:   # every weight the adapter does not touch: the base's, float32, unrounded
        if k.rsplit(".", 1)[0] not in targets:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.slow   # the tiny bench train, as in test_bench_train_14b.py
def test_bench_train_keeps_the_lora_base_in_bf16_under_bf16(monkeypatch, tmp_path):
    """``bench train`` builds its model through the same Trainer: under bf16 (the GPU's precision;
    forced here on the CPU) its LoRA row keeps the frozen base in bfloat16 and says so."""
    from attnqat.cli import main
    from attnqat.finetune import bench_train

    monkeypatch.setattr(bench_train, "TrainConfig",
                        lambda **kw: T.TrainConfig(**{**kw, "precision": "bf16"}))
    out = tmp_path / "rec.json"
    assert main(["bench", "train", "--config", "tiny", "--resolution", "32x32", "--frames", "5",
                 "--device", "cpu", "--methods", "attnqat", "--steps", "1", "--warmup", "0",
                 "--lora-rank", "4", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["fits"] and row["loss_finite"] and row["precision"] == "bf16"
    assert row["lora_base_dtype"] == "bfloat16"


def _torchrun(out: Path, model: Path, *extra: str, f32_base: bool = False) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
    env.pop("ATTNQAT_TEST_F32_BASE", None)
    if f32_base:
        env["ATTNQAT_TEST_F32_BASE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).resolve()), "--model", str(model), "--out", str(out), *FLAGS, *LORA,
           "--batch-size", "1", "--steps", "3", *extra]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.subprocess   # torchrun
def test_two_gloo_processes_with_offload_match_the_float32_base(model, tmp_path):
    """FSDP2 with bfloat16 and float32 parameters in one block unit, sharded over two processes
    and offloaded (CPUOffloadPolicy): the float32 base's losses, bit for bit."""
    bf16 = tmp_path / "bf16-offload"
    _torchrun(bf16, model, "--offload")
    f32 = tmp_path / "f32"
    _torchrun(f32, model, f32_base=True)
    assert sorted(losses(bf16)) == [1, 2, 3]
    assert losses(bf16) == losses(f32)
    start = (bf16 / "log.jsonl").read_text().splitlines()[0]
    assert json.loads(start)["world"] == 2


if __name__ == "__main__":   # the trainer, for the torchrun test
    if os.environ.get("ATTNQAT_TEST_F32_BASE"):
        L.frozen_base_to = lambda transformer, dtype=None: 0
    sys.exit(T.main(sys.argv[1:]))
