"""A tier shared by the nodes of a cluster behind each node's local store (Mooncake Store): a
local miss may still be a cluster hit. Optional (`prefixd[cluster]`): Mooncake is imported on the
first connection, not with this package."""

from __future__ import annotations

from prefixd.cluster.mooncake import MooncakeSettings, SharedTier
from prefixd.cluster.mooncake_calls import MAX_KEY_BYTES, close_abandoned
from prefixd.errors import (
    TierBusyError,
    TierError,
    TierFullError,
    TierTransferError,
    TierUnavailableError,
    TierValueError,
)

__all__ = [
    "MAX_KEY_BYTES",
    "MooncakeSettings",
    "SharedTier",
    "TierBusyError",
    "TierError",
    "TierFullError",
    "TierTransferError",
    "TierUnavailableError",
    "TierValueError",
    "close_abandoned",
]
