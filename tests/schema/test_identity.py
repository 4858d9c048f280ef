"""Identity validation, canonical encoding and golden digests."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from prefixd import Identity
from prefixd.errors import IdentityError

BASE = {
    "model": "llama-3-8b",
    "weights": "sha256:0123",
    "tokenizer": "tok-v2",
    "template": "chat-v3",
    "rope": "rope-theta-500000",
    "kv_layout": "bf16/paged-16/tp1-rank0",
    "block_tokens": 4,
    "tenant": "acme",
}

# Pinned: an accidental change of the encoding must fail here, not silently orphan every store.
GOLDEN = {
    "base": "5be7ee09bffd01d670b66e33bf28636f",
    "adapter+mm": "aea60f085418f05a567b9008e66f22bb",
}


def test_golden_digests() -> None:
    assert Identity(**BASE).digest.hex() == GOLDEN["base"]
    full = Identity(**BASE, adapter="sql-lora@3", mm="clip-pre-v1")
    assert full.digest.hex() == GOLDEN["adapter+mm"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "llama-3-8b-instruct"),
        ("weights", "sha256:0124"),
        ("tokenizer", "tok-v3"),
        ("template", "chat-v4"),
        ("adapter", "lora@1"),
        ("mm", "clip-pre-v2"),
        ("rope", "rope-theta-1000000"),
        ("kv_layout", "bf16/paged-16/tp2-rank1"),
        ("block_tokens", 8),
        ("tenant", "globex"),
    ],
)
def test_every_field_changes_the_digest(field: str, value: object) -> None:
    base = Identity(**BASE)
    changed = dataclasses.replace(base, **{field: value})
    assert changed.digest != base.digest
    assert changed != base


def test_no_ambiguous_concatenation() -> None:
    a = Identity(**{**BASE, "model": "ab", "weights": "c"})
    b = Identity(**{**BASE, "model": "a", "weights": "bc"})
    assert a.digest != b.digest


def test_adapter_name_never_collides_with_tenant_name() -> None:
    a = Identity(**{**BASE, "tenant": "x"}, adapter="y")
    b = Identity(**{**BASE, "tenant": "y"}, adapter="x")
    assert a.digest != b.digest
    same_string = Identity(**{**BASE, "tenant": "shared"}, adapter="shared")
    no_adapter = Identity(**{**BASE, "tenant": "shared"})
    assert same_string.digest != no_adapter.digest


def test_absent_optional_field_differs_from_any_string() -> None:
    assert Identity(**BASE).digest != Identity(**BASE, adapter="None").digest
    assert Identity(**BASE, mm=None).digest == Identity(**BASE).digest


def test_encode_decode_round_trip() -> None:
    full = Identity(**BASE, adapter="lora@1", mm="mm@2")
    again = Identity.decode(full.encode())
    assert again == full and again.digest == full.digest
    assert Identity.from_dict(full.to_dict()) == full


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("model", "", "must not be empty"),
        ("weights", None, "must be a str"),
        ("tenant", 7, "must be a str"),
        ("block_tokens", 0, "must be in"),
        ("block_tokens", -16, "must be in"),
        ("block_tokens", True, "must be an int"),
        ("block_tokens", 16.0, "must be an int"),
        ("adapter", "", "must not be empty"),
        ("mm", b"clip", "must be a str"),
        ("rope", "\ud800", "not valid Unicode"),
        ("kv_layout", "x" * 5000, "at most"),
    ],
)
def test_bad_values_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(IdentityError, match=message) as caught:
        Identity(**{**BASE, field: value})
    assert caught.value.field == field
    assert field in str(caught.value)


def test_from_dict_rejects_unknown_and_missing_fields() -> None:
    with pytest.raises(IdentityError) as caught:
        Identity.from_dict({**BASE, "temperature": "0.7"})
    assert caught.value.field == "temperature"
    partial = dict(BASE)
    del partial["tenant"]
    with pytest.raises(IdentityError) as caught:
        Identity.from_dict(partial)
    assert caught.value.field == "tenant"


def test_decode_rejects_foreign_bytes() -> None:
    with pytest.raises(IdentityError):
        Identity.decode(b"\x93\x01\x02\x03")
    with pytest.raises(IdentityError):
        Identity.decode(b"\xc1")


def test_identity_is_immutable() -> None:
    ident = Identity(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.tenant = "other"  # type: ignore[misc]


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_digest_is_the_same_under_any_hash_seed(seed: str) -> None:
    code = f"from prefixd import Identity;print(Identity(**{BASE!r}).digest.hex())"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == GOLDEN["base"]
