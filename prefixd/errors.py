"""The exceptions prefixd raises on purpose, arranged so a caller can act on the class alone.

Every error derives from `PrefixdError`. Errors caused by a caller's bad value also derive from
`ValueError`, so generic validation handlers keep working.
"""

from __future__ import annotations


class PrefixdError(Exception):
    """Base of every error prefixd raises on purpose."""


class ConfigError(PrefixdError, ValueError):
    """A setting is missing, unknown, of the wrong type or out of range."""


class IdentityError(PrefixdError, ValueError):
    """An identity field holds a bad value; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"identity field {field!r}: {message}")
        self.field = field


class TokenError(PrefixdError, ValueError):
    """Token ids are not a flat sequence of integers in [0, 2**32)."""


# --- opening a store ---------------------------------------------------------------------------


class StoreOpenError(PrefixdError):
    """The data directory cannot be opened as a prefixd store."""


class NotAStoreError(StoreOpenError):
    """The directory holds no prefixd store (or something else entirely); nothing was changed."""


class SchemaVersionError(StoreOpenError):
    """The store was written with an on-disk schema version this code does not read."""

    def __init__(self, found: int, supported: int, path: object = None) -> None:
        where = f"store {path}" if path is not None else "store"
        super().__init__(
            f"{where} has on-disk schema version {found}, this prefixd reads version {supported}"
            + (
                f": stop the daemon and run `prefixd migrate up --data-dir {path or 'DIR'}`"
                if found < supported
                else ": upgrade prefixd"
            )
        )
        self.found = found
        self.supported = supported


class StoreBusyError(StoreOpenError):
    """Another process (a running daemon) holds the store exclusively."""


class CorruptStoreError(StoreOpenError):
    """The store's meta record or table layout is damaged; the store must be rebuilt or repaired."""


class CorruptMetaError(CorruptStoreError):
    """The meta record fails its checksum or cannot be decoded."""


# --- using a store -----------------------------------------------------------------------------


class ServeError(PrefixdError):
    """The daemon cannot serve: its socket path is taken or unusable."""


class StoreClosedError(PrefixdError):
    """The store was closed, or is used from a process other than the one that opened it."""


class StoreFullError(PrefixdError):
    """The store's map is full; the put was rolled back whole. Evict or raise `map_size`."""


class DiskFullError(StoreFullError):
    """The file system under the store has no room left; the write was rolled back whole and
    reads go on. Writes succeed again once space is freed."""


class StoreWriteError(PrefixdError, OSError):
    """The disk refused a write for another reason than space (an I/O error); rolled back."""


class PutRefusedError(PrefixdError, ValueError):
    """A put was refused before anything was written; the store is unchanged."""


class OpenTailError(PutRefusedError):
    """A block has fewer than `block_tokens` tokens: an open tail is never stored."""


class OrphanBlockError(PutRefusedError):
    """The first block's parent is neither stored nor part of the same put."""


class BlockCollisionError(PutRefusedError):
    """A block hash is already owned by a block with other tokens, parent or identity."""


class PayloadError(PutRefusedError):
    """A payload is empty, not a contiguous byte buffer, or there are too few/many of them."""


class DestinationError(PrefixdError, ValueError):
    """A destination buffer is read-only, not contiguous, or too small for its block."""
