"""Checkpoint naming schemes: detection, conversion, checked loading (attnqat/convert.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from attnqat import convert
from attnqat.convert import CheckpointError, load_wan_transformer

CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=16,
              out_channels=16, text_dim=32, freq_dim=32, ffn_dim=96, num_layers=2,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)


@pytest.fixture(scope="module")
def reference():
    """A small diffusers Wan transformer with random (non-default) values everywhere."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))  # norms and biases too: a mapping error cannot hide
    return {k: v.clone() for k, v in model.state_dict().items()}


# Written out here from DESIGN.md §4 and the original Wan module names, independently of the
# rule tables in attnqat/convert.py.
def fastvideo_name(k: str) -> str:
    import re

    pairs = [
        (r"^patch_embedding\.", "patch_embedding.proj."),
        (r"^condition_embedder\.text_embedder\.linear_1\.", "condition_embedder.text_embedder.fc_in."),
        (r"^condition_embedder\.text_embedder\.linear_2\.", "condition_embedder.text_embedder.fc_out."),
        (r"^condition_embedder\.time_embedder\.linear_1\.", "condition_embedder.time_embedder.mlp.fc_in."),
        (r"^condition_embedder\.time_embedder\.linear_2\.", "condition_embedder.time_embedder.mlp.fc_out."),
        (r"^condition_embedder\.time_proj\.", "condition_embedder.time_modulation.linear."),
        (r"\.attn1\.to_out\.0\.", ".to_out."),
        (r"\.attn1\.", "."),
        (r"\.attn2\.to_out\.0\.", ".attn2.to_out."),
        (r"\.ffn\.net\.0\.proj\.", ".ffn.fc_in."),
        (r"\.ffn\.net\.2\.", ".ffn.fc_out."),
        (r"\.norm2\.", ".self_attn_residual_norm.norm."),
    ]
    for a, b in pairs:
        k = re.sub(a, b, k)
    return k


def wan_name(k: str) -> str:
    import re

    pairs = [
        (r"^condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
        (r"^condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
        (r"^condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
        (r"^condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
        (r"^condition_embedder\.time_proj\.", "time_projection.1."),
        (r"^proj_out\.", "head.head."),
        (r"^scale_shift_table$", "head.modulation"),
        (r"\.scale_shift_table$", ".modulation"),
        (r"\.attn1\.to_out\.0\.", ".self_attn.o."),
        (r"\.attn2\.to_out\.0\.", ".cross_attn.o."),
        (r"\.attn1\.to_", ".self_attn."),
        (r"\.attn2\.to_", ".cross_attn."),
        (r"\.attn1\.", ".self_attn."),
        (r"\.attn2\.", ".cross_attn."),
        (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
        (r"\.ffn\.net\.2\.", ".ffn.2."),
        (r"\.norm2\.", ".norm3."),  # diffusers' cross-attention norm is Wan's norm3
    ]
    for a, b in pairs:
        k = re.sub(a, b, k)
    return k


RENAMERS = {"diffusers": lambda k: k, "fastvideo": fastvideo_name, "wan": wan_name}


def test_spot_check_names_from_the_design_notes(reference):
    assert fastvideo_name("blocks.3.attn1.to_q.weight") == "blocks.3.to_q.weight"
    assert wan_name("blocks.3.norm2.weight") == "blocks.3.norm3.weight"
    fv = convert.from_diffusers(reference, "fastvideo")
    for k in ("blocks.1.to_out.weight", "blocks.1.attn2.to_out.bias", "blocks.0.ffn.fc_in.weight",
              "blocks.0.self_attn_residual_norm.norm.weight", "patch_embedding.proj.weight",
              "condition_embedder.time_embedder.mlp.fc_out.bias",
              "condition_embedder.time_modulation.linear.weight"):
        assert k in fv
    wan = convert.from_diffusers(reference, "wan")
    for k in ("blocks.0.self_attn.q.weight", "blocks.1.cross_attn.o.bias", "blocks.0.norm3.weight",
              "blocks.0.modulation", "head.modulation", "head.head.weight", "text_embedding.2.bias",
              "time_projection.1.weight", "blocks.1.ffn.0.weight"):
        assert k in wan


@pytest.mark.parametrize("scheme", ["diffusers", "fastvideo", "wan"])
def test_detect_scheme_and_rename_match_the_independent_names(reference, scheme):
    sd = {RENAMERS[scheme](k): v for k, v in reference.items()}
    assert len(sd) == len(reference)
    assert convert.detect_scheme(sd) == scheme
    assert set(convert.from_diffusers(reference, scheme)) == set(sd)
    back, found = convert.to_diffusers(sd)
    assert found == scheme
    assert set(back) == set(reference)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
@pytest.mark.parametrize("scheme", ["diffusers", "fastvideo", "wan"])
def test_single_file_loads_bit_exactly(tmp_path, reference, scheme, prefix):
    sd = {prefix + RENAMERS[scheme](k): v.contiguous() for k, v in reference.items()}
    f = tmp_path / f"{scheme}.safetensors"
    save_file(sd, str(f))
    model, info = load_wan_transformer(f, config=CONFIG, dtype=torch.float32)
    assert info.scheme == scheme and info.prefix == prefix and info.tensors == len(reference)
    loaded = model.state_dict()
    assert set(loaded) == set(reference)
    for k, v in reference.items():
        assert loaded[k].dtype == torch.float32
        assert torch.equal(loaded[k], v), k


def test_bf16_load_keeps_diffusers_fp32_modules(tmp_path, reference):
    f = tmp_path / "w.safetensors"
    save_file({wan_name(k): v.contiguous() for k, v in reference.items()}, str(f))
    model, _ = load_wan_transformer(f, config=CONFIG, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["blocks.0.attn1.to_q.weight"], reference["blocks.0.attn1.to_q.weight"].bfloat16())
    for k in ("blocks.0.norm2.weight", "blocks.1.scale_shift_table", "scale_shift_table",
              "condition_embedder.time_embedder.linear_1.weight"):
        assert sd[k].dtype == torch.float32
        assert torch.equal(sd[k], reference[k]), k


def test_fastvideo_folder_with_config(tmp_path, reference):
    folder = tmp_path / "fv"
    folder.mkdir()
    half = sorted(reference)
    save_file({fastvideo_name(k): reference[k].contiguous() for k in half[:20]}, str(folder / "a.safetensors"))
    save_file({fastvideo_name(k): reference[k].contiguous() for k in half[20:]}, str(folder / "b.safetensors"))
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", **CONFIG}))
    model, info = load_wan_transformer(folder, dtype=torch.float32)
    assert info.scheme == "fastvideo"
    for k, v in model.state_dict().items():
        assert torch.equal(v, reference[k]), k


def test_folder_whose_config_differs_from_the_base_is_refused(tmp_path, reference):
    folder = tmp_path / "t"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in reference.items()}, str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError, match="num_layers 2 vs 3"):
        load_wan_transformer(folder, config={**CONFIG, "num_layers": 3})


def test_unknown_missing_and_misshaped_tensors_are_named(tmp_path, reference):
    sd = {wan_name(k): v.contiguous() for k, v in reference.items()}
    sd["blocks.0.self_attn.extra_thing.weight"] = torch.zeros(3)
    del sd["blocks.1.cross_attn.k.bias"]
    sd["blocks.0.ffn.2.weight"] = torch.zeros(5, 5)
    f = tmp_path / "bad.safetensors"
    save_file(sd, str(f))
    with pytest.raises(CheckpointError) as err:
        load_wan_transformer(f, config=CONFIG)
    msg = str(err.value)
    assert "unknown tensor" in msg and "blocks.0.self_attn.extra_thing.weight" in msg
    assert "missing tensor" in msg and "blocks.1.attn2.to_k.bias" in msg
    assert "blocks.1.cross_attn.k.bias" in msg  # the name the file should have had
    assert "wrong shape" in msg and "blocks.0.ffn.net.2.weight" in msg and "(5, 5)" in msg
    assert "blocks.0.ffn.2.weight" in msg
    assert "wan naming scheme" in msg


def test_mixed_and_unrecognized_schemes(reference):
    mixed = {**{k: v for k, v in reference.items()}, "blocks.0.self_attn.q.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="mixes naming schemes"):
        convert.detect_scheme(mixed)
    with pytest.raises(CheckpointError, match="cannot tell the naming scheme"):
        convert.detect_scheme({"encoder.layer.0.weight": torch.zeros(1)})


def test_corrupted_file_and_wrong_inputs(tmp_path, reference):
    f = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in reference.items()}, str(f))
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted or not a safetensors file"):
        load_wan_transformer(f, config=CONFIG)
    g = tmp_path / "junk.safetensors"
    g.write_bytes(b"\x00\x01not a header")
    with pytest.raises(CheckpointError, match="corrupted"):
        convert.read_state_dict(g)
    with pytest.raises(CheckpointError, match="not found"):
        load_wan_transformer(tmp_path / "nope.safetensors", config=CONFIG)
    pt = tmp_path / "w.pt"
    pt.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_wan_transformer(pt, config=CONFIG)
    good = tmp_path / "ok.safetensors"
    save_file({k: v.contiguous() for k, v in reference.items()}, str(good))
    with pytest.raises(CheckpointError, match="needs the base transformer's config"):
        load_wan_transformer(good)


def test_strip_prefix_only_when_every_key_has_it():
    sd, p = convert.strip_prefix({"module._orig_mod.a": 1, "module._orig_mod.b": 2})
    assert p == "module._orig_mod." and set(sd) == {"a", "b"}
    sd, p = convert.strip_prefix({"model.a": 1, "b": 2})
    assert p == "" and set(sd) == {"model.a", "b"}
