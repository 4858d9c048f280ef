"""The groups, the tensors inside a group's payload, and the bytes they become.

Paged rows have shapes that follow from the config, so a page is bare bytes. Checkpoint tensors do
not: each linear-attention mixer sizes its states from attributes of its own, and some families
size a window's heads in their code. So a checkpoint payload describes its tensors in a header
(`pack_described`) instead of a table of families.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from prefixd.errors import LayoutError
from prefixd.schema.state import CHECKPOINT, PAGED

KV = "kv"
MLA = "mla"
COMPRESSED = "compressed"
INDEXER = "indexer"
WINDOW = "window"
COMPRESSOR = "compressor"
RECURRENT = "recurrent"
# Groups appear in a spec in this order, so a spec is the same for equal configs.
GROUP_ORDER = (KV, MLA, COMPRESSED, INDEXER, WINDOW, COMPRESSOR, RECURRENT)
KINDS = {
    KV: PAGED,
    MLA: PAGED,
    COMPRESSED: PAGED,
    INDEXER: PAGED,
    WINDOW: CHECKPOINT,
    COMPRESSOR: CHECKPOINT,
    RECURRENT: CHECKPOINT,
}
F32 = torch.float32  # V4 gates are float32 in every model dtype

Buffer = bytes | bytearray | memoryview | np.ndarray


@dataclass(frozen=True)
class Field:
    """One tensor of one layer inside a paged group's records: `shape` is one row's, covering
    `tokens_per_row` tokens (a compressed entry's compression rate, else 1)."""

    group: str
    layer: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tokens_per_row: int = 1

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.name)

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype)

    def __str__(self) -> str:
        return f"layer {self.layer} {self.name}"


# --- described tensors -------------------------------------------------------------------------

_MAGIC = b"PXDT"
_VERSION = 1
_HEAD = struct.Struct("<4sHH")  # magic, version, tensor count
_ENTRY = struct.Struct("<HBBB")  # layer, dtype code, ndim, name length; then name, ndim u32 dims
_DIM = struct.Struct("<I")
MAX_NDIM = 6
# Codes are part of the stored format: append only.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def pack_described(tensors: Mapping[tuple[int, str], torch.Tensor]) -> bytes:
    """A header naming each tensor's layer, name, dtype and shape; then their bytes, in order."""
    head = [_HEAD.pack(_MAGIC, _VERSION, len(tensors))]
    body: list[memoryview] = []
    for (layer, name), tensor in tensors.items():
        code = _CODES.get(tensor.dtype)
        if code is None:
            raise LayoutError(f"layer {layer} {name}: dtype {tensor.dtype} cannot be stored")
        if tensor.dim() > MAX_NDIM:
            raise LayoutError(
                f"layer {layer} {name}: {tensor.dim()} dimensions, at most {MAX_NDIM}"
            )
        encoded = name.encode("ascii")
        if len(encoded) > 255:
            raise LayoutError(f"layer {layer}: the name {name[:32]!r}... is too long to store")
        head.append(_ENTRY.pack(layer, code, tensor.dim(), len(encoded)) + encoded)
        head.extend(_DIM.pack(size) for size in tensor.shape)
        body.append(raw_bytes(tensor).numpy().data)  # joined below: one copy of the bytes
    return b"".join([*head, *body])


def unpack_described(payload: Buffer, what: str) -> dict[tuple[int, str], torch.Tensor]:
    """The tensors of a `pack_described` payload, each a fresh copy; LayoutError if malformed."""
    data = byte_view(payload, what)
    if data.size < _HEAD.size:
        raise LayoutError(f"{what}: {data.size} bytes, shorter than its header")
    magic, version, count = _HEAD.unpack_from(data.data)
    if magic != _MAGIC or version != _VERSION:
        raise LayoutError(f"{what}: not a described payload of version {_VERSION}")
    offset = _HEAD.size
    entries: list[tuple[tuple[int, str], torch.dtype, tuple[int, ...]]] = []
    for _ in range(count):
        if offset + _ENTRY.size > data.size:
            raise LayoutError(f"{what}: the header is cut short")
        layer, code, ndim, length = _ENTRY.unpack_from(data.data, offset)
        offset += _ENTRY.size
        end = offset + length + ndim * _DIM.size
        if code >= len(_DTYPES) or ndim > MAX_NDIM or end > data.size:
            raise LayoutError(f"{what}: a malformed header entry")
        name = bytes(data[offset : offset + length]).decode("ascii", "replace")
        shape = struct.unpack_from(f"<{ndim}I", data.data, offset + length)
        offset = end
        entries.append(((layer, name), _DTYPES[code], shape))
    out: dict[tuple[int, str], torch.Tensor] = {}
    for key, dtype, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        if key in out or offset + nbytes > data.size:
            raise LayoutError(f"{what}: layer {key[0]} {key[1]} is repeated or cut short")
        out[key] = from_raw(np.array(data[offset : offset + nbytes]), dtype, shape)
        offset += nbytes
    if offset != data.size:
        raise LayoutError(f"{what}: {data.size - offset} bytes past its last tensor")
    return out


# --- bytes -------------------------------------------------------------------------------------


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order, as a flat uint8 CPU tensor."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def from_raw(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `raw` (fresh, writable uint8 memory owned by this package)."""
    return torch.from_numpy(raw).reshape(-1).view(dtype).reshape(shape)


def byte_view(payload: object, what: str) -> np.ndarray:
    """A flat uint8 view of a payload; no copy, so it may be read-only."""
    if isinstance(payload, str):
        raise LayoutError(f"{what}: a payload must be a byte buffer, got str")
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise LayoutError(
            f"{what}: a payload must be a byte buffer, got {type(payload).__name__}"
        ) from None
    if not view.c_contiguous:
        raise LayoutError(f"{what}: the payload buffer is not contiguous")
    return np.frombuffer(
        view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8
    )
