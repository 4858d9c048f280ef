"""Token ids as one contiguous little-endian uint32 array: the only form hashed or stored; and a
prompt's own content beside its token ids, which an identity with `request_content` hashes into
each block (prefixd.schema.content)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prefixd.errors import TokenError

TOKEN_DTYPE = np.dtype("<u4")
TOKEN_BYTES = TOKEN_DTYPE.itemsize
MAX_TOKEN_ID = (1 << 32) - 1

MAX_ITEMS = 4096
MAX_ITEM_HASH_BYTES = 256
MAX_CONTENT_TEXT_BYTES = 4096


@dataclass(frozen=True)
class MediaItem:
    """A multimodal item (image, audio, video) whose placeholder tokens are prompt tokens
    [offset, offset + length): `hash` is its content hash (vLLM's `mm_hash`, say)."""

    hash: bytes | str
    offset: int
    length: int

    def __post_init__(self) -> None:
        raw = self.hash.encode("utf-8") if isinstance(self.hash, str) else self.hash
        if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_ITEM_HASH_BYTES:
            raise TokenError(f"a media item's hash must be 1..{MAX_ITEM_HASH_BYTES} bytes or text")
        for name in ("offset", "length"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_TOKEN_ID
            ):
                raise TokenError(f"a media item's {name} must be an int in 0..{MAX_TOKEN_ID}")
        if not self.length:
            raise TokenError("a media item covers at least one token (length 0)")

    @property
    def hash_bytes(self) -> bytes:
        return self.hash.encode("utf-8") if isinstance(self.hash, str) else self.hash


@dataclass(frozen=True)
class Prompt:
    """Token ids with the content they stand for: the media items whose placeholders lie among
    them, the request's adapter and its cache salt. Two prompts with the same token ids and other
    content name other blocks from the first block the difference touches."""

    token_ids: TokenIds
    items: tuple[MediaItem, ...] = ()
    adapter: str | None = None
    salt: str | None = None

    def __post_init__(self) -> None:
        items = tuple(self.items)
        if len(items) > MAX_ITEMS or not all(isinstance(i, MediaItem) for i in items):
            raise TokenError(f"a prompt's items are at most {MAX_ITEMS} MediaItems")
        object.__setattr__(self, "items", items)
        for name in ("adapter", "salt"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                size = len(value.encode("utf-8")) if isinstance(value, str) else 0
            except UnicodeEncodeError:
                size = 0
            if not 0 < size <= MAX_CONTENT_TEXT_BYTES:
                raise TokenError(
                    f"a prompt's {name} must be None or text of 1..{MAX_CONTENT_TEXT_BYTES} bytes"
                )


TokenIds = Sequence[int] | np.ndarray | bytes | bytearray | memoryview
# What names a prompt to the store and the clients: its token ids, or (for an identity with
# request_content) a Prompt, or the packed chain words a Prompt becomes (the wire form).
PromptIds = TokenIds | Prompt


def as_token_array(token_ids: TokenIds) -> np.ndarray:
    """`token_ids` as a C-contiguous '<u4' array: bytes-like input as packed ids (the wire form,
    no copy), integers range-checked (a negative or too-large id is an error, never wrapped)."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        view = memoryview(token_ids)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if view.nbytes % TOKEN_BYTES:
            raise TokenError(f"packed token ids are {view.nbytes} bytes, not a multiple of 4")
        return np.frombuffer(view, dtype=TOKEN_DTYPE)
    if isinstance(token_ids, np.ndarray):
        array = token_ids
    else:
        if isinstance(token_ids, (str, dict)) or not isinstance(token_ids, Sequence):
            raise TokenError(
                f"token ids must be a sequence of ints, got {type(token_ids).__name__}"
            )
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in token_ids):
            raise TokenError("token ids must all be ints")
        try:
            array = np.asarray(token_ids, dtype=np.int64) if token_ids else np.empty(0, np.int64)
        except OverflowError:
            raise TokenError(f"token ids must lie in [0, {MAX_TOKEN_ID}]") from None
    if array.ndim != 1:
        raise TokenError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.dtype.kind not in "iu" or array.dtype == np.bool_:
        raise TokenError(f"token ids must be integers, got dtype {array.dtype}")
    unsigned_fits = array.dtype.kind == "u" and array.dtype.itemsize <= TOKEN_BYTES
    if (
        array.size
        and not unsigned_fits
        and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID)
    ):
        raise TokenError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(array, dtype=TOKEN_DTYPE)
