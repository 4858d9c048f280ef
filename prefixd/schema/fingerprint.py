"""A model's weights fingerprint from its files, taken the same way by the daemon
(`--model-manifests`) and the engine integrations, so both name the same version."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

_READ_BYTES = 1 << 20


def fingerprint_files(paths: Iterable[Path]) -> str:
    """`sha256:<hex>` over each file's name and content, in order; a missing file counts as empty
    (a model mid-copy then fingerprints differently, and settles on the next change)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        try:
            with open(path, "rb") as file:
                while chunk := file.read(_READ_BYTES):
                    digest.update(chunk)
        except FileNotFoundError:
            digest.update(b"\0missing\0")
    return "sha256:" + digest.hexdigest()


__all__ = ["fingerprint_files"]
