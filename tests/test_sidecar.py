"""The model folder's attnqat.json (attnqat/sidecar.py): one typed record, old files still read."""

from __future__ import annotations

import json

import pytest

from attnqat import sidecar as sc
from attnqat.tiny import TINY_MODEL_DIR, TINY_QAT_DIR


def test_the_shipped_folders_read_as_typed_records():
    base, qat = sc.read(TINY_MODEL_DIR), sc.read(TINY_QAT_DIR)
    assert base.kind == "tiny-wan" and base.defaults["frames"] == 33 and base.qat_transformer == "../tiny-wan-qat"
    assert qat.weights and qat.note   # the Attn-QAT folder says what its weights are


def test_a_version_1_file_reads_and_writes_back_its_unknown_keys(tmp_path):
    old = {"kind": "attnqat-transformer", "weights": "attnqat-finetuned", "qat_weights_note": "n",
           "training": {"steps": 3}, "exported": "2026-11-20T00:00:00Z", "something_else": [1, 2]}
    (tmp_path / sc.SIDECAR).write_text(json.dumps(old))
    s = sc.read(tmp_path)
    assert s.version == 1 and s.weights == "attnqat-finetuned" and s.training == {"steps": 3}
    assert s.extra == {"something_else": [1, 2]} and s.note == "n"
    sc.write(tmp_path, s)
    again = json.loads((tmp_path / sc.SIDECAR).read_text())
    assert again == {**old, "version": sc.VERSION}
    assert sc.read(tmp_path) == sc.Sidecar.from_dict(again)


def test_sha256_of_the_weights_is_recorded_and_checked(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"weights")
    s = sc.Sidecar(kind="attnqat-transformer", weights_sha256=sc.weights_sha256(tmp_path))
    import hashlib

    assert s.weights_sha256 == {"w.safetensors": hashlib.sha256(b"weights").hexdigest()}
    assert s.verify(tmp_path) == []
    (tmp_path / "w.safetensors").write_bytes(b"other")
    assert s.verify(tmp_path) == ["w.safetensors"]


def test_bad_files_are_named(tmp_path):
    (tmp_path / sc.SIDECAR).write_text("{not json")
    with pytest.raises(sc.SidecarError, match="cannot read .*attnqat.json"):
        sc.read(tmp_path)
    (tmp_path / sc.SIDECAR).write_text(json.dumps({"version": 99}))
    with pytest.raises(sc.SidecarError, match="newer attnqat"):
        sc.read(tmp_path)
    assert sc.read(tmp_path / "nothing") is None
