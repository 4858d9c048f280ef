"""A local model's weights fingerprint (prefixd.integrations.identity.local_weights), which the
vLLM, SGLang and LMCache identities take as their `weights`: other weight bytes in the same files
are other weights."""

from __future__ import annotations

import json
from pathlib import Path

from prefixd.integrations.identity import local_weights
from prefixd.schema.fingerprint import fingerprint_files

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def sharded(path: Path, fill: bytes) -> Path:
    """A model saved in two shards with their index (as save_pretrained writes a large one)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    index = {"metadata": {"total_size": 2048}, "weight_map": {"a": SHARDS[0], "b": SHARDS[1]}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in SHARDS:
        (path / name).write_bytes(fill * 1024)
    return path


def test_a_sharded_checkpoint_rewritten_in_place_is_other_weights(tmp_path: Path) -> None:
    """A fine-tune saved over the last one: the same config, index and shard sizes."""
    model = sharded(tmp_path / "ft", b"\x01")
    before = local_weights(model)
    assert local_weights(model) == before
    sharded(model, b"\x02")
    assert local_weights(model) != before
    assert local_weights(sharded(tmp_path / "copy", b"\x02")) == local_weights(model)


def test_one_weight_file_fingerprints_as_it_did(tmp_path: Path) -> None:
    """An unsharded model's fingerprint is still its config and its one file's: its stored entries
    stay reachable."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    assert local_weights(tmp_path) == "local:" + fingerprint_files(
        [tmp_path / "config.json", tmp_path / "model.safetensors"]
    )


def test_pytorch_bin_files_count_where_there_is_no_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin.index.json").write_text("{}")
    (tmp_path / "pytorch_model-00001-of-00001.bin").write_bytes(b"a" * 64)
    before = local_weights(tmp_path)
    (tmp_path / "pytorch_model-00001-of-00001.bin").write_bytes(b"b" * 64)
    assert local_weights(tmp_path) != before
