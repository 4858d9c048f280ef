"""What store operations return: plain frozen values, so no memoryview into the map escapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class BlockRef(NamedTuple):
    """One block of a found prefix (a NamedTuple: a long prefix builds hundreds per lookup)."""

    # A public field name that shadows tuple.index, which mypy reports as an incompatible override.
    index: int  # type: ignore[assignment]
    hash: bytes
    payload_size: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest stored prefix of a query, as two parallel tuples (a long prompt has hundreds of
    blocks)."""

    identity_digest: bytes
    block_tokens: int
    hashes: tuple[bytes, ...]
    payload_sizes: tuple[int, ...]

    @property
    def blocks(self) -> tuple[BlockRef, ...]:
        return tuple(
            BlockRef(i, h, size) for i, (h, size) in enumerate(zip(self.hashes, self.payload_sizes))
        )

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)

    @property
    def n_tokens(self) -> int:
        return len(self.hashes) * self.block_tokens

    @property
    def payload_bytes(self) -> int:
        return sum(self.payload_sizes)


@dataclass(frozen=True, slots=True)
class PartRef:
    """One payload of a joint match. A page covers tokens [first_token, first_token + tokens); a
    checkpoint is the state at first_token (tokens 0)."""

    group: str
    block: bytes
    block_index: int
    payload_size: int
    first_token: int
    tokens: int


@dataclass(frozen=True)
class JointMatch:
    """The answer of a hybrid lookup. `reusable_tokens` R: the longest boundary where every group is
    complete; `replay_from`: where the engine recomputes from (earlier than R for groups that store
    nothing); `paged_tokens`: the longest run of complete paged groups; `parts`: the payloads to
    load, in spec order."""

    identity_digest: bytes
    block_tokens: int
    reusable_tokens: int
    replay_from: int
    paged_tokens: int
    matched_tokens: int
    hashes: tuple[bytes, ...]
    parts: tuple[PartRef, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(part.payload_size for part in self.parts)


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int
    existed: int
    hashes: tuple[bytes, ...]
    parts: int = 0


@dataclass(frozen=True, slots=True)
class StateLoad:
    """A hybrid load: `offsets[i]` is where `match.parts[i]` was written in the output."""

    match: JointMatch
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReadResult:
    n_blocks: int
    sizes: tuple[int, ...]

    @property
    def n_bytes(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Verified payloads of `n_blocks` blocks from `first_block` on, at `offsets`. `next_size`: the
    next block's payload size when the buffer had no room for it (0 otherwise), so a caller with
    more room may ask again."""

    n_blocks: int
    n_tokens: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    first_block: int = 0
    next_size: int = 0


@dataclass(frozen=True, slots=True)
class BlockInfo:
    hash: bytes
    parent: bytes
    identity_digest: bytes
    n_tokens: int
    payload_size: int
    stored_size: int
    compression: str
    created_ns: int
    last_access_ns: int
    hits: int


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str
    detail: str
    block: bytes | None = field(default=None, repr=False)

    def __str__(self) -> str:
        where = f" (block {self.block[:4].hex()}..)" if self.block else ""
        return f"{self.kind}: {self.detail}{where}"


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Totals of the store (persisted) and activity since it was opened (this process)."""

    blocks: int
    payload_bytes: int
    stored_bytes: int
    identities: int
    quarantined: int
    collisions: int
    map_size: int
    map_used_bytes: int
    compression_ratio: float
    lookups: int
    hit_blocks: int
    loaded_blocks: int
    loaded_bytes: int
    verify_failures: int
    compress_gbps: float
    decompress_gbps: float
    compressed_payloads_stored_raw: int
    parts: int = 0  # state-group payloads of hybrid identities
    copy_verify_gbps: float = 0.0  # verified copies of payloads stored raw
    # loads whose destination changed while it was written (a client writing into its own
    # region): that load stopped there, nothing was quarantined
    destinations_changed: int = 0
    file_read_bytes: int = 0  # payload bytes loads read from data.mdb with preadv (read_path)
    deadline_cutoffs: int = 0  # loads that stopped at their deadline, answering a shorter hit


@dataclass(frozen=True, slots=True)
class EvictionReport:
    blocks: int
    stored_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RepairReport:
    problems: tuple[Problem, ...]
    quarantined: int
    fixed: int
    remaining: tuple[Problem, ...]


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    """A block as another tier receives it: its record, its verified payload and, for a hybrid
    identity, its verified parts as (group index, payload). The payloads are the buffers they were
    verified into."""

    record: bytes
    payload: bytes | bytearray
    parts: tuple[tuple[int, bytes | bytearray], ...] = ()
