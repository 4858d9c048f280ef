"""Clients for the daemon: `Client` (blocking, for an engine's hot path and its threads) and
`AsyncClient` (asyncio), two thin shells over one core (prefixd.client.core) that bind the same
operations, each declared once (prefixd.client.operations), so they offer the same calls with the
same results and errors.

Both share memory regions with the daemon (sealed memfds, see prefixd.wire.region): payloads are
staged in them for puts and loaded into them by the daemon, so bulk data never crosses the socket.
Every operation leases the region spans it uses (prefixd.client.leases); a loaded result owns its
span until it is released. Both reconnect after a daemon restart (re-attaching the regions) and
retry the request once: every operation is idempotent.
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
