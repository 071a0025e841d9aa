"""The typed generation record (attnqat/record.py): JSON round trip, lenient reading of the
minimal records the study accepts, and no object that an API client would take for a file."""

from __future__ import annotations

import json

import pytest

from attnqat.record import GenerationRecord, MethodRecord, QATRecord, RecordError, Timings


def _paths(obj, where="record"):
    """Every object in ``obj`` that has a "path" key (gradio_client downloads those)."""
    if isinstance(obj, dict):
        found = [where] if "path" in obj else []
        for k, v in obj.items():
            found += _paths(v, f"{where}.{k}")
        return found
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _paths(v, f"{where}[{i}]")]
    return []


def full_record() -> GenerationRecord:
    return GenerationRecord(
        prompt="a red circle", seed=7, negative_prompt="",
        settings={"methods": ["bf16", "attnqat"], "steps": 2, "dtype": "float32"},
        methods={"bf16": MethodRecord(video="bf16.mp4", label="BF16",
                                      timings=Timings(denoising_s=1.0, decoding_s=0.5, total_s=1.5)),
                 "attnqat": MethodRecord(video="attnqat.mp4", label="Attn-QAT fine-tuned", psnr=30.0,
                                         ssim=0.9, identical_to_bf16=False)},
        qat=QATRecord(checkpoint="/ckpt/qat.safetensors", scheme="fastvideo", fine_tuned=True,
                      label="Attn-QAT fine-tuned"))


def test_round_trip_through_json(tmp_path):
    rec = full_record()
    path = rec.save(tmp_path / "record.json")
    back = GenerationRecord.load(path)
    assert back == rec
    assert back.methods["bf16"].timings.total_s == 1.5 and back.qat.scheme == "fastvideo"
    assert json.loads(path.read_text())["qat"]["checkpoint"] == "/ckpt/qat.safetensors"
    assert _paths(rec.to_dict()) == []


def test_minimal_records_are_read_with_defaults(tmp_path):
    (tmp_path / "record.json").write_text(json.dumps(
        {"prompt": "p", "seed": "3", "methods": {"nvfp4": {"video": "n.mp4"}}, "extra": 1}))
    rec = GenerationRecord.load(tmp_path / "record.json")
    assert rec.seed == 3 and rec.qat is None and rec.methods["nvfp4"].timings == Timings()
    assert rec.videos(tmp_path) == {"nvfp4": tmp_path / "n.mp4"}
    assert GenerationRecord.from_dict({"prompt": "p", "methods": {}}).seed is None


@pytest.mark.parametrize("data, message", [
    ([], "expected a JSON object"),
    ({"methods": {}}, "needs 'prompt' and 'methods'"),
    ({"prompt": " ", "methods": {}}, "needs 'prompt' and 'methods'"),
    ({"prompt": "p", "methods": {"bf16": 3}}, "is not an object"),
    ({"prompt": "p", "seed": "x", "methods": {}}, "is not an integer"),
])
def test_records_that_cannot_be_read(data, message):
    with pytest.raises(RecordError, match=message):
        GenerationRecord.from_dict(data)


def test_a_method_without_a_video_and_bad_files(tmp_path):
    rec = GenerationRecord.from_dict({"prompt": "p", "methods": {"bf16": {}}})
    with pytest.raises(RecordError, match="has no 'video'"):
        rec.videos(tmp_path)
    (tmp_path / "record.json").write_text("{not json")
    with pytest.raises(RecordError, match="cannot read"):
        GenerationRecord.load(tmp_path / "record.json")
