"""Clients for the daemon: `Client` (blocking, for an engine's hot path and threads) and
`AsyncClient` (asyncio), two thin shells over one core that bind the same operations
(prefixd.client.operations). Bulk data goes through shared memory regions, never the socket; both
reconnect after a daemon restart and retry once, since every operation is idempotent.
"""

from prefixd.client.aio import AsyncClient
from prefixd.client.blocking import Client
from prefixd.client.leases import Lease, RegionUsage
from prefixd.client.results import (
    Loaded,
    Lookup,
    Routed,
    StateLoaded,
    StateLookup,
    Stored,
)
from prefixd.errors import DaemonUnavailableError, RemoteError, RequestTimeoutError
from prefixd.schema.stored import HotPrefix, ListedBlock
from prefixd.wire.messages import StatePart

__all__ = [
    "AsyncClient",
    "Client",
    "DaemonUnavailableError",
    "HotPrefix",
    "Lease",
    "ListedBlock",
    "Loaded",
    "Lookup",
    "RegionUsage",
    "RemoteError",
    "RequestTimeoutError",
    "Routed",
    "StateLoaded",
    "StateLookup",
    "StatePart",
    "Stored",
]
