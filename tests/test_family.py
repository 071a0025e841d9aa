"""Model families (attnqat/family.py): factors read from the model's configs, one clip-size rule
for every command, and a second family added as one entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnqat import family as fam
from attnqat.generate import InvalidInput, resolve_settings
from attnqat.tiny import TINY_MODEL_DIR
from attnqat.wan import model_info


def test_wan_is_the_first_family_and_reads_the_tiny_models_configs():
    f = fam.for_folder(TINY_MODEL_DIR)
    assert f.name == "wan2.1-t2v" and f.pipeline_class == "WanPipeline"
    assert (f.vae_temporal, f.vae_spatial, tuple(f.patch_size)) == (4, 8, (1, 2, 2))
    assert f.size_multiple == 16 and f.frame_step == 4
    assert f.self_attention == "attn1" and f.cross_attention == "attn2"
    assert f.checkpoint_schemes == ("diffusers", "fastvideo", "wan")
    assert model_info(TINY_MODEL_DIR).family == f


def test_the_clip_rule_and_its_messages():
    f = fam.WAN21_T2V
    assert f.clip_errors(128, 224, 33) == {}
    errors = f.clip_errors(100, 0, 32, max_side=512)
    assert errors["height"].startswith("a multiple of 16 (the VAE downsamples by 8")
    assert errors["width"].startswith("a multiple of 16 from 16 to 512")
    assert errors["frames"].startswith("4k+1 frames (1, 5, 9, …, 33, …) because the VAE compresses time by 4")
    with pytest.raises(ValueError, match=r"^--frames: 4k\+1 frames"):
        f.check_clip(frames=6, names={"frames": "--frames"})


@pytest.fixture()
def other_family(tmp_path) -> Path:
    """A second family (VAE 16× in space, 8× in time, 1×2×2 patches) and a folder of its kind."""
    f = fam.register(fam.ModelFamily(name="fake-dit", label="Fake DiT", pipeline_class="FakeDiTPipeline",
                                     vae_temporal=4, vae_spatial=8, patch_size=(1, 2, 2),
                                     defaults={"height": 64, "width": 64, "frames": 17, "fps": 8, "steps": 4,
                                               "guidance": 1.0, "shift": 2.0, "negative_prompt": ""},
                                     shift_for=lambda h, w: 2.0))
    folder = tmp_path / "fake-model"
    (folder / "vae").mkdir(parents=True)
    (folder / "transformer").mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FakeDiTPipeline"}))
    (folder / "vae" / "config.json").write_text(json.dumps({"scale_factor_spatial": 16,
                                                             "scale_factor_temporal": 8}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"patch_size": [1, 2, 2]}))
    try:
        yield folder
    finally:
        fam.unregister(f.name)


def test_a_second_family_is_one_entry_and_its_factors_come_from_the_model(other_family):
    f = fam.for_folder(other_family)
    assert f.name == "fake-dit" and (f.vae_temporal, f.vae_spatial) == (8, 16)   # read, not declared
    assert f.size_multiple == 32 and f.frame_step == 8
    info = model_info(other_family)
    assert info.family == f and info.defaults["frames"] == 17
    settings, _ = resolve_settings("a red ball", model=other_family, methods="bf16", device="cpu")
    assert (settings.height, settings.frames, settings.shift) == (64, 17, 2.0)
    with pytest.raises(InvalidInput) as e:
        resolve_settings("a red ball", model=other_family, methods="bf16", device="cpu", height=48, frames=13)
    assert e.value.errors["height"].startswith("a multiple of 32 (the VAE downsamples by 16")
    assert e.value.errors["frames"].startswith("8k+1 frames (1, 9, 17, …")
