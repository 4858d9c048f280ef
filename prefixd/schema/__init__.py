"""Identities, the prefix chain, and the byte layouts of everything prefixd writes."""

from prefixd.schema.chain import HASH_BYTES, ROOT_PARENT, BlockChain, block_hash, chain_hashes
from prefixd.schema.identity import Identity
from prefixd.schema.meta import SCHEMA_VERSION, StoreMeta
from prefixd.schema.records import BlockRecord, Compression
from prefixd.schema.tokens import TOKEN_DTYPE, MediaItem, Prompt, as_token_array

__all__ = [
    "HASH_BYTES",
    "ROOT_PARENT",
    "SCHEMA_VERSION",
    "TOKEN_DTYPE",
    "BlockChain",
    "BlockRecord",
    "Compression",
    "Identity",
    "MediaItem",
    "Prompt",
    "StoreMeta",
    "as_token_array",
    "block_hash",
    "chain_hashes",
]
