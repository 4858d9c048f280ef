"""What makes two pieces of prompt state interchangeable, and its canonical digest, mixed into
every block hash. The encoding is a msgpack array of the fields in a fixed order behind a format
tag and version: length-prefixed and positional, so no two field values can be confused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from prefixd.errors import IdentityError
from prefixd.schema.state import StateSpec, check_spec, spec_from_value

IDENTITY_FORMAT = "prefixd.identity"
IDENTITY_VERSION = 1
DIGEST_BYTES = 16
MAX_BLOCK_TOKENS = 1 << 20
MAX_FIELD_BYTES = 4096
# Engine block keys: at least 128 bits (README: "Engine-keyed blocks" gives the collision bound),
# whole 4-byte words (they travel as the chain's '<u4' words), and short enough to stay a key.
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 256
# A request-content identity's block: its token ids, then these many '<u4' words of the digest of
# the content its tokens stand for (prefixd.schema.content).
CONTENT_WORDS = 4

_REQUIRED_TEXT = ("model", "weights", "tokenizer", "template", "rope", "kv_layout", "tenant")
_OPTIONAL_TEXT = ("adapter", "mm")
# The encoding order. Append only: a field's position is part of every digest ever written.
_ENCODING_ORDER = (
    "model",
    "weights",
    "tokenizer",
    "template",
    "adapter",
    "mm",
    "rope",
    "kv_layout",
    "block_tokens",
    "tenant",
)
# `state`, `key_bytes` and `request_content` follow the fields above in the encoding up to the last
# one set (a nil for each unset one before it), so the digest of an identity without them is what
# it always was.
_TRAILING = ("state", "key_bytes", "request_content")
_ALL_FIELDS = (*_ENCODING_ORDER, *_TRAILING)


@dataclass(frozen=True)
class Identity:
    """Everything that makes cached prompt state compatible with a request.

    `kv_layout` names the KV dtype, quantisation and layout, sharding and rank included (each
    rank's shard is its own entry). `adapter` and `mm` are None without a LoRA adapter or
    multimodal preprocessing. `state` is a hybrid model's state spec (None: one opaque payload
    per block). `key_bytes` makes the identity engine-keyed: its blocks are named by the engine's
    own keys of that many bytes (prefixd.schema.keys), while `block_tokens` still says how many
    tokens a block holds. `request_content` makes each block's name cover, beside its token ids,
    the request's own content its tokens stand for (multimodal items, adapter, cache salt:
    prefixd.schema.content); a token-keyed identity with `mm` set needs it.
    """

    model: str
    weights: str
    tokenizer: str
    template: str
    rope: str
    kv_layout: str
    block_tokens: int
    tenant: str
    adapter: str | None = None
    mm: str | None = None
    state: StateSpec | None = None
    key_bytes: int | None = None
    request_content: bool = False
    _encoded: bytes = field(init=False, repr=False, compare=False)
    _digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _REQUIRED_TEXT:
            _check_text(name, getattr(self, name), required=True)
        for name in _OPTIONAL_TEXT:
            _check_text(name, getattr(self, name), required=False)
        bt = self.block_tokens
        if isinstance(bt, bool) or not isinstance(bt, int):
            raise IdentityError("block_tokens", f"must be an int, got {type(bt).__name__}")
        if not 0 < bt <= MAX_BLOCK_TOKENS:
            raise IdentityError("block_tokens", f"must be in 1..{MAX_BLOCK_TOKENS}, got {bt}")
        items = [IDENTITY_FORMAT, IDENTITY_VERSION, *(getattr(self, n) for n in _ENCODING_ORDER)]
        if self.state is not None:
            object.__setattr__(self, "state", spec_from_value(self.state))
            check_spec(self.state, bt)
        if self.key_bytes is not None:
            _check_key_bytes(self.key_bytes, self.state)
        if not isinstance(self.request_content, bool):
            raise IdentityError(
                "request_content", f"must be a bool, got {type(self.request_content).__name__}"
            )
        if self.request_content and self.key_bytes is not None:
            raise IdentityError(
                "request_content", "an engine-keyed identity's keys cover the request's content"
            )
        trailing = [
            None if self.state is None else [g.encode_fields() for g in self.state],
            self.key_bytes,
            True if self.request_content else None,
        ]
        while trailing and trailing[-1] is None:
            trailing.pop()
        items.extend(trailing)
        encoded = msgpack.packb(items, use_bin_type=True)
        object.__setattr__(self, "_encoded", encoded)
        object.__setattr__(
            self, "_digest", hashlib.blake2b(encoded, digest_size=DIGEST_BYTES).digest()
        )

    @property
    def block_words(self) -> int:
        """How many '<u4' words name one block in the chain: its token ids, or its engine key."""
        if self.key_bytes is not None:
            return self.key_bytes // 4
        return self.block_tokens + (CONTENT_WORDS if self.request_content else 0)

    @property
    def digest(self) -> bytes:
        """16 bytes, equal in every process and on every machine for equal fields."""
        return self._digest

    def encode(self) -> bytes:
        """The canonical encoding the digest is taken over."""
        return self._encoded

    @classmethod
    def decode(cls, data: bytes, digest: bytes | None = None) -> Identity:
        """Rebuild an identity from `encode()` output (the store keeps one per digest). `digest`:
        the one it is kept under, which it must have: a row damaged into another identity (another
        tenant's, say) is refused like one that no longer decodes."""
        try:
            items = msgpack.unpackb(data, raw=False, use_list=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise IdentityError("encoding", f"cannot be decoded: {exc}") from None
        if (
            not isinstance(items, list)
            or not 2 + len(_ENCODING_ORDER) <= len(items) <= 2 + len(_ALL_FIELDS)
            or items[0] != IDENTITY_FORMAT
        ):
            raise IdentityError("encoding", "is not a prefixd identity")
        if items[1] != IDENTITY_VERSION:
            raise IdentityError("encoding", f"has unknown identity version {items[1]!r}")
        if len(items) > 2 + len(_ENCODING_ORDER) and items[-1] is None:
            raise IdentityError("encoding", "is not canonical (a trailing nil)")
        if len(items) == 2 + len(_ALL_FIELDS) and items[-1] is not True:
            raise IdentityError("encoding", "is not canonical (request_content is not true)")
        values = dict(zip(_ALL_FIELDS, items[2:]))
        values["request_content"] = bool(values.get("request_content"))
        identity = cls(**values)
        if digest is not None and identity.digest != digest:
            raise IdentityError("encoding", "does not match the digest it is stored under")
        return identity

    def servable(self) -> Identity:
        """This identity, if a request may name it: a token-keyed multimodal identity whose
        blocks' names do not cover their images would give one image's state to another."""
        if self.mm is not None and self.key_bytes is None and not self.request_content:
            raise IdentityError(
                "request_content",
                "must be true when mm is set: a block's name must cover the multimodal items its "
                "placeholder tokens stand for (pass each request as a prefixd.Prompt)",
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for wire messages and reports."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        if self.state is not None:
            values["state"] = [group.to_dict() for group in self.state]
        if not self.request_content:
            del values["request_content"]  # unset, as the wire leaves it out
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Identity:
        """Build from plain fields; unknown or missing fields are errors naming the field."""
        if not isinstance(values, dict):
            raise IdentityError("identity", f"must be a mapping, got {type(values).__name__}")
        unknown = sorted(set(values) - set(_ALL_FIELDS), key=str)
        if unknown:
            raise IdentityError(str(unknown[0]), "is not an identity field")
        missing = [n for n in _ENCODING_ORDER if n not in values and n not in _OPTIONAL_TEXT]
        if missing:
            raise IdentityError(missing[0], "is required")
        return cls(**values)


def _check_key_bytes(key_bytes: object, state: StateSpec | None) -> None:
    if isinstance(key_bytes, bool) or not isinstance(key_bytes, int):
        raise IdentityError("key_bytes", f"must be an int, got {type(key_bytes).__name__}")
    if not MIN_KEY_BYTES <= key_bytes <= MAX_KEY_BYTES or key_bytes % 4:
        raise IdentityError(
            "key_bytes",
            f"must be a multiple of 4 in {MIN_KEY_BYTES}..{MAX_KEY_BYTES} (keys shorter than 128 "
            f"bits are refused), got {key_bytes}",
        )
    if state is not None:
        raise IdentityError("key_bytes", "an engine-keyed identity has no state spec")


def _check_text(name: str, value: object, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str):
        raise IdentityError(name, f"must be a str, got {type(value).__name__}")
    if not value:
        raise IdentityError(name, "must not be empty" + ("" if required else " (use None)"))
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise IdentityError(name, "is not valid Unicode text") from None
    if size > MAX_FIELD_BYTES:
        raise IdentityError(name, f"is {size} bytes, at most {MAX_FIELD_BYTES} allowed")
