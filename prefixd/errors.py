"""The exceptions prefixd raises on purpose, arranged so a caller can act on the class alone.

Every error derives from `PrefixdError`; a caller's bad value also derives from `ValueError`.
`CorruptRecordError` is no `PrefixdError` on purpose: it never leaves the store, so one that
escapes is a bug. Each class names its wire error code (`code`, prefixd.wire.errors): the daemon
replies with it and the client raises the same class again (`from_wire`).
"""

from __future__ import annotations

from typing import ClassVar, Self


class PrefixdError(Exception):
    """Base of every error prefixd raises on purpose."""

    code: ClassVar[str] = "internal"  # the wire error code a daemon replies with
    message: str = ""  # the daemon's text, when the error came through the socket

    @classmethod
    def from_wire(cls, message: str) -> Self:
        """The error for an error reply of this class's code, built without the constructor
        (whose arguments the reply does not carry)."""
        error = cls.__new__(cls)
        Exception.__init__(error, f"{cls.code}: {message}")
        error.message = message
        return error


class InternalError(PrefixdError):
    """The daemon failed in a way it did not expect; its log says more."""

    code = "internal"


class RemoteError(PrefixdError):
    """An error reply whose code this client does not know (a newer daemon's)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code  # type: ignore[misc]
        self.message = message


# --- the conversation with the daemon ----------------------------------------------------------


class DaemonUnavailableError(PrefixdError, ConnectionError):
    """The daemon cannot be reached (not running, wrong socket path, or gone mid-request)."""

    code = "unavailable"  # never sent: a client-side condition


class UntrustedDaemonError(DaemonUnavailableError):
    """The socket, its directory or the process serving it belongs to another user than the
    daemon's: nothing was sent (prefixd.trust)."""


class ShuttingDownError(DaemonUnavailableError):
    """The daemon is shutting down and takes no new requests; a restarted one will."""

    code = "shutting_down"


class RequestTimeoutError(PrefixdError, TimeoutError):
    """No reply within the client's timeout; the request may still run in the daemon, so its
    spans stay quarantined."""

    code = "timeout"  # never sent: a client-side condition


class ProtocolError(PrefixdError):
    """A request the daemon could not take (frame, operation or field); `code`: an ErrorCode."""

    code = "bad_request"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{getattr(code, 'value', code)}: {message}")
        self.code = code  # type: ignore[misc]
        self.message = message


class BadFrameError(ProtocolError):
    """A frame body that is not a msgpack map with an int id and a str op."""

    code = "bad_frame"


class FrameTooLargeError(ProtocolError):
    """A frame longer than the daemon's `max_frame_bytes`."""

    code = "frame_too_large"


class HelloRequiredError(ProtocolError):
    """A request before `hello`."""

    code = "hello_required"


class UnsupportedVersionError(ProtocolError):
    """The client speaks a protocol version the daemon does not."""

    code = "unsupported_version"


class UnknownOperationError(ProtocolError):
    """An operation the daemon does not have."""

    code = "unknown_op"


class BadRequestError(ProtocolError, ValueError):
    """A field is missing, of the wrong type or out of range."""

    code = "bad_request"


class RequestError(ProtocolError):
    """A frame body refused as a request, with its `rid` and `op` when they could be read."""

    def __init__(
        self, code: str, message: str, *, rid: int | None = None, op: str | None = None
    ) -> None:
        super().__init__(code, message)
        self.rid = rid
        self.op = op


class BusyError(PrefixdError):
    """The daemon is at its limit of connections or of requests in flight on this connection."""

    code = "busy"


class ForbiddenError(PrefixdError, PermissionError):
    """The peer may not use the daemon, or not for this tenant or operation."""

    code = "forbidden"


class RegionError(PrefixdError, ValueError):
    """A shared region or span is unusable: not a sealed memfd, out of bounds, not leased, or
    too small."""

    code = "bad_region"


class RegionFullError(RegionError):
    """The client's region has no free span of the size an operation needs."""


class ConfigError(PrefixdError, ValueError):
    """A setting is missing, unknown, of the wrong type or out of range."""

    code = "bad_request"


class IdentityError(PrefixdError, ValueError):
    """An identity field holds a bad value; `field` names it."""

    code = "bad_identity"
    field: str = ""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"identity field {field!r}: {message}")
        self.field = field


class TokenError(PrefixdError, ValueError):
    """Token ids are not a flat sequence of integers in [0, 2**32)."""

    code = "bad_tokens"


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

    code = "store_damaged"


class CorruptMetaError(CorruptStoreError):
    """The meta record fails its checksum or cannot be decoded."""


# --- using a store -----------------------------------------------------------------------------


class ServeError(PrefixdError):
    """The daemon cannot serve: its socket path is taken or unusable."""


class UntrustedPathError(ServeError):
    """The daemon's socket or data directory is not its own, or others may write it."""


class StoreClosedError(PrefixdError):
    """The store was closed, or is used from a process other than the one that opened it."""


class StoreFullError(PrefixdError):
    """The store's map is full; the put was rolled back whole. Evict or raise `map_size`."""

    code = "store_full"


class DiskFullError(StoreFullError):
    """The file system under the store is full; the write was rolled back, reads go on."""


class StoreWriteError(PrefixdError, OSError):
    """The disk refused a write for another reason than space (an I/O error); rolled back."""

    code = "write_failed"


class PutRefusedError(PrefixdError, ValueError):
    """A put was refused before anything was written; the store is unchanged."""

    code = "bad_request"


class OpenTailError(PutRefusedError):
    """A block has fewer than `block_tokens` tokens: an open tail is never stored."""

    code = "open_tail"


class OrphanBlockError(PutRefusedError):
    """The first block's parent is neither stored nor part of the same put."""

    code = "orphan"


class BlockCollisionError(PutRefusedError):
    """A block hash is already owned by a block with other tokens, parent or identity."""

    code = "collision"


class PayloadError(PutRefusedError):
    """A payload is empty, not a contiguous byte buffer, or there are too few/many of them."""

    code = "bad_payload"


class DestinationError(RegionError):
    """A destination buffer is read-only, not contiguous, or too small for its block."""


# --- device memory and engines -----------------------------------------------------------------


class TransferError(PrefixdError):
    """A load into destinations failed part way, after `installed_tokens` tokens were installed
    (a retry is harmless: loads write the same bytes)."""

    def __init__(self, message: str, installed_tokens: int) -> None:
        super().__init__(f"{message} ({installed_tokens} tokens were installed)")
        self.installed_tokens = installed_tokens


class LayoutError(PrefixdError, ValueError):
    """The config, the cache and the payloads disagree on the state layout; nothing was restored."""


# --- migrating a store -------------------------------------------------------------------------


class MigrationError(PrefixdError):
    """A migration cannot run (a bad target version, a backup directory in the way...)."""


# --- inside the store --------------------------------------------------------------------------


class CorruptRecordError(Exception):
    """A record fails its checksum or layout; internal to the store, which quarantines the block."""


# --- the shared tier ---------------------------------------------------------------------------


class RemoteBlockError(PrefixdError):
    """A value fetched from the shared tier is not the block asked for, or is damaged."""


class TierError(PrefixdError):
    """A shared-tier operation failed; `code` is Mooncake's error code where there was one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        # Mooncake's code, on the instance; prefixd.wire reads the class's (`type(exc).code`).
        self.code = code  # type: ignore[misc, assignment]


class TierUnavailableError(TierError):
    """The shared tier cannot be reached now (master down or hung, package missing, timeout);
    `SharedTier` refuses calls for `cooldown_s` after one, so a dead master costs no timeouts."""


class TierValueError(TierError, ValueError):
    """A key, value or buffer the shared tier cannot take (empty, too long, not contiguous...)."""


class TierFullError(TierError):
    """No segment of the pool has room for the value: the pool is full or, for about a second
    after a master restart, no client has remounted its segment yet. A later put may succeed."""


class TierTransferError(TierError):
    """The value's bytes could not be moved to or from the segment that holds them: that segment's
    client is most likely dead (the master keeps its segment in the pool for a while)."""


class TierBusyError(TierError):
    """`remove(key, force=False)` met a read lease (a reader fetched the key lately); force it,
    or retry after the master's `--default_kv_lease_ttl`."""


# --- durability --------------------------------------------------------------------------------


class SyncFailedError(StoreWriteError):
    """An fsync of the store failed: what was acknowledged since the last good sync may be lost,
    so writes are refused from then on (reads go on); a restart checks those blocks."""

    code = "sync_failed"
