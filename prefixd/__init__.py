"""prefixd: a persistent, verified prefix KV-cache store for LLM inference nodes."""

from prefixd import errors
from prefixd.schema import BlockChain, Identity, MediaItem, Prompt, chain_hashes
from prefixd.store import Durability, PrefixMatch, Store, StoreConfig
from prefixd.version import __version__

__all__ = [
    "BlockChain",
    "Durability",
    "Identity",
    "MediaItem",
    "PrefixMatch",
    "Prompt",
    "Store",
    "StoreConfig",
    "__version__",
    "chain_hashes",
    "errors",
]
