"""What the engine adapters' identities share: the text fields, and a local model's weights
fingerprinted as the daemon's `--model-manifests` fingerprints files (prefixd.schema.fingerprint).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefixd.schema.fingerprint import fingerprint_files
from prefixd.schema.identity import Identity

TEXT_FIELDS = ("model", "weights", "tokenizer", "template", "rope")
# What turns an image, a video or audio into the model's inputs (transformers' file names): edited
# in place, the same item gets the same hash from the engine and other embeddings.
PREPROCESSING_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


def identity_of(fields: Mapping[str, Any], **given: Any) -> Identity:
    """An Identity of `fields` (the text ones as text, `adapter` and `mm` as they are) and
    `given`."""
    text: dict[str, Any] = {name: str(fields[name]) for name in TEXT_FIELDS}
    return Identity(**text, adapter=fields.get("adapter"), mm=fields.get("mm"), **given)


def digest_of(text: str) -> str:
    """A short, stable stand-in for `text` in an identity field, where `text` could outgrow the
    field's limit (a model's every layer name, a memory object's every tensor)."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a model or adapter directory: the safetensors files and their index,
    else the .bin ones, in name order."""
    return sorted(directory.glob("*.safetensors*")) or sorted(directory.glob("*.bin*"))


def local_weights(model: Path) -> str:
    """`local:` and the fingerprint of the model's config.json and weight files, read whole: an
    index names each shard's tensors, not their values, so a checkpoint rewritten in place keeps
    its index."""
    return "local:" + fingerprint_files([model / "config.json", *weight_files(model)])


def local_preprocessing(model: Path) -> str | None:
    """The fingerprint of a local model's multimodal preprocessing files, None without any."""
    found = [model / name for name in PREPROCESSING_FILES if (model / name).is_file()]
    return fingerprint_files(found) if found else None


__all__ = [
    "PREPROCESSING_FILES",
    "digest_of",
    "identity_of",
    "local_preprocessing",
    "local_weights",
    "weight_files",
]
