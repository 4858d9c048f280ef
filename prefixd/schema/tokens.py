"""Token ids as one contiguous little-endian uint32 array: the only form hashed or stored."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixd.errors import TokenError

TOKEN_DTYPE = np.dtype("<u4")
TOKEN_BYTES = TOKEN_DTYPE.itemsize
MAX_TOKEN_ID = (1 << 32) - 1

TokenIds = Sequence[int] | np.ndarray | bytes | bytearray | memoryview


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
