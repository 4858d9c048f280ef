"""Tiers shared by the nodes of a cluster, behind each node's local store.

`SharedTier` (on Mooncake Store, see `prefixd.cluster.mooncake`) holds prefix objects in a memory
pool that every daemon of the cluster can read: a local miss may still be a cluster hit. It is
optional (`pip install prefixd[cluster]`); importing this package does not import Mooncake, whose
client is loaded on the first connection.
"""

from __future__ import annotations

from prefixd.cluster.mooncake import MAX_KEY_BYTES, MooncakeSettings, SharedTier, close_abandoned
from prefixd.errors import TierBusyError, TierError, TierUnavailableError, TierValueError

__all__ = [
    "MAX_KEY_BYTES",
    "MooncakeSettings",
    "SharedTier",
    "TierBusyError",
    "TierError",
    "TierUnavailableError",
    "TierValueError",
    "close_abandoned",
]
