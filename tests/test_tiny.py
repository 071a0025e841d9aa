"""The embedded tiny pipeline and its tokenizer (attnqat/tiny.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from attnqat import tiny


def test_tokenizer_from_a_word_list():
    tok = tiny.build_tokenizer(["red", "circle", "moves", "left", "red"])
    assert len(tok) == 3 + 4  # specials + distinct words
    enc = tok(["Red circle, moves LEFT zebra"], padding="max_length", max_length=10,
              add_special_tokens=True, return_attention_mask=True)
    ids = enc["input_ids"][0]
    unk, eos, pad = (tok.convert_tokens_to_ids(t) for t in ("<unk>", "</s>", "<pad>"))
    assert (pad, eos, unk) == (0, 1, 2)
    red, circle, moves, left = tok.convert_tokens_to_ids(["red", "circle", "moves", "left"])
    assert ids == [red, circle, unk, moves, left, unk, eos, pad, pad, pad]  # "," and "zebra" unknown
    assert enc["attention_mask"][0] == [1] * 7 + [0] * 3
    with pytest.raises(ValueError, match="single words"):
        tiny.build_tokenizer(["two words"])


def test_vocabulary_covers_the_shapes_captions():
    from attnqat.synthetic import heldout_prompts, spec_at

    vocab = tiny.tiny_vocabulary()
    tok = tiny.build_tokenizer(vocab)
    unk = tok.unk_token_id
    for shape in tiny.SHAPES:
        for colour in ("red", "blue", "yellow"):
            for d in tiny.DIRECTIONS:
                ids = tok(f"a {colour} {shape} moves {d} on a green background")["input_ids"]
                assert unk not in ids
    # every word of the synthetic data's captions (grows / shrinks included) is in the vocabulary
    captions = heldout_prompts(60) + [spec_at(0, k).caption for k in range(200)]
    assert any("grows" in c for c in captions) and any("shrinks" in c for c in captions)
    for c in captions:
        assert unk not in tok(c)["input_ids"], c
    assert len(vocab) == len(set(vocab))


def test_build_is_deterministic():
    a = tiny.build_tiny_pipeline(seed=3).transformer.state_dict()
    b = tiny.build_tiny_pipeline(seed=3).transformer.state_dict()
    c = tiny.build_tiny_pipeline(seed=4).transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_transformer_uses_head_dim_64():
    cfg = json.loads((tiny.TINY_MODEL_DIR / "transformer" / "config.json").read_text())
    assert cfg["attention_head_dim"] == 64
    pipe_index = json.loads((tiny.TINY_MODEL_DIR / "model_index.json").read_text())
    assert pipe_index["_class_name"] == "WanPipeline"


def test_shipped_assets_match_their_description():
    side = json.loads((tiny.TINY_MODEL_DIR / tiny.SIDECAR).read_text())
    qat_side = json.loads((tiny.TINY_QAT_DIR / tiny.SIDECAR).read_text())
    assert side["defaults"] == {"height": 128, "width": 128, "frames": 33, "fps": 16, "steps": 20,
                                "guidance": 5.0, "shift": 3.0, "max_sequence_length": 32}
    assert (tiny.TINY_MODEL_DIR / side["qat_transformer"]).resolve() == tiny.TINY_QAT_DIR.resolve()
    size = sum(p.stat().st_size for d in (tiny.TINY_MODEL_DIR, tiny.TINY_QAT_DIR)
               for p in d.rglob("*") if p.is_file())
    assert size < 60 * 2 ** 20
    base = load_file(str(tiny.TINY_MODEL_DIR / "transformer" / "diffusion_pytorch_model.safetensors"))
    qat = load_file(str(tiny.TINY_QAT_DIR / "diffusion_pytorch_model.safetensors"))
    assert qat_side["weights"] == "attnqat-finetuned"   # shipped by `attnqat repro --stages ship`
    assert qat_side["training"]["attention"] == "attnqat" and qat_side["training"]["ablation"] is None
    assert qat_side["training"]["steps"] == 1200 and "docs/repro.md" in qat_side["qat_weights_note"]
    assert base.keys() == qat.keys() and not all(torch.equal(base[k], qat[k]) for k in base)
    assert {k: v.dtype for k, v in base.items()} == {k: v.dtype for k, v in qat.items()}
    if side.get("weights") == "random-init":
        # the shipped random weights are exactly what the builder makes from the recorded seed
        rebuilt = tiny.build_tiny_pipeline(seed=side["seed"]).transformer.state_dict()
        assert base.keys() == rebuilt.keys()
        for k, v in base.items():
            assert torch.equal(v, rebuilt[k].to(v.dtype)), k
    else:
        assert side["weights"] == "trained"
        # TinyWanConfig's defaults describe the shipped architecture
        assert side["config"] == tiny.config_dict(tiny.TinyWanConfig())
        cfg = json.loads((tiny.TINY_MODEL_DIR / "transformer" / "config.json").read_text())
        for k, v in tiny._transformer_config(tiny.TinyWanConfig()).items():
            assert cfg[k] == (list(v) if isinstance(v, tuple) else v), k
        vae = json.loads((tiny.TINY_MODEL_DIR / "vae" / "config.json").read_text())
        assert vae["base_dim"] == tiny.TinyWanConfig().vae_base_dim
        assert vae["latents_std"] != [1.0] * 16 and min(vae["latents_std"]) > 0
        training = side["training"]
        assert training["vae"]["steps"] > 0 and training["t2v"]["steps"] > 0
        for stage in ("vae", "t2v"):   # a run may train one stage only
            assert sum(r.get(stage, {}).get("steps", 0) for r in training["runs"]) == training[stage]["steps"]
        assert f"{training['t2v']['steps']} steps" in side["weights_note"]
        # stored as loaded: transformer in bf16 except diffusers' float32 modules, VAE in float32
        assert base["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
        assert base["scale_shift_table"].dtype == torch.float32


def test_rebuild_refuses_to_replace_trained_weights(tmp_path, capsys):
    out, qat = tmp_path / "m", tmp_path / "q"
    tiny.save_tiny_assets(out, qat, seed=2)
    side = json.loads((out / tiny.SIDECAR).read_text())
    (out / tiny.SIDECAR).write_text(json.dumps({**side, "weights": "trained"}))
    with pytest.raises(SystemExit):
        tiny.main(["--out", str(out), "--qat-out", str(qat)])
    assert "--force" in capsys.readouterr().err
    assert json.loads((out / tiny.SIDECAR).read_text())["weights"] == "trained"
    assert tiny.main(["--out", str(out), "--qat-out", str(qat), "--force"]) == 0
    assert json.loads((out / tiny.SIDECAR).read_text())["weights"] == "random-init"


def test_save_tiny_assets_replaces_folders_atomically(tmp_path):
    out, qat = tiny.save_tiny_assets(tmp_path / "m" / "tiny-wan", tmp_path / "m" / "tiny-wan-qat", seed=1)
    assert (out / "model_index.json").is_file() and (qat / "config.json").is_file()
    side = json.loads((out / tiny.SIDECAR).read_text())
    assert side["seed"] == 1 and side["qat_transformer"] == "../tiny-wan-qat"
    (out / "stale.txt").write_text("x")
    tiny.save_tiny_assets(out, None, seed=1)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["tiny-wan", "tiny-wan-qat"]
    tok = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.mark.slow
def test_shipped_qat_weights_generate_a_clip_that_follows_its_caption():
    """The Attn-QAT transformer with the NVFP4 attention it deploys, on a held-out prompt
    (its colour × shape × motion triple was never shown in training), default settings, CPU.
    Measured: every attribute right (prompt score 1.0), as the base model in BF16."""
    from attnqat.eval.procedural import score_clip
    from attnqat.generate import generate
    from attnqat.synthetic import heldout_prompts

    prompt = heldout_prompts(7)[6]
    res = generate(prompt, seed=6, methods="attnqat", device="cpu", progress=False)
    assert res.record.methods["attnqat"].attention_method == "nvfp4"
    assert res.record.qat.identical_to_base is False and res.record.qat.fine_tuned is True
    score = score_clip(prompt, res.videos["attnqat"])
    assert score["prompt_score"] >= 0.75, score["objects"]
