"""The on-disk store: LMDB transactions (store), bytes <-> chunks (codec), settings and checks."""

from prefixd.store.config import Durability, StoreConfig
from prefixd.store.purge import PurgeReport, PurgeSelector
from prefixd.store.results import (
    BlockInfo,
    BlockRef,
    LoadResult,
    PrefixMatch,
    Problem,
    PutResult,
    ReadResult,
    StoreStats,
)
from prefixd.store.store import Store

__all__ = [
    "BlockInfo",
    "BlockRef",
    "Durability",
    "LoadResult",
    "PrefixMatch",
    "Problem",
    "PurgeReport",
    "PurgeSelector",
    "PutResult",
    "ReadResult",
    "Store",
    "StoreConfig",
    "StoreStats",
]
