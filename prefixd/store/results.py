"""What store operations return. Plain frozen values: no memoryview into the map escapes."""

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
    """The longest stored prefix of a query: `n_blocks` whole blocks, `n_tokens` tokens.

    Kept as two parallel tuples (a long prompt has hundreds of blocks); `blocks` gives them as
    `BlockRef`s."""

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
    """One payload of a joint match: which group, the block it hangs on, and what it covers.

    A page covers tokens [first_token, first_token + tokens); a checkpoint is the state at
    first_token (tokens is 0)."""

    group: str
    block: bytes
    block_index: int
    payload_size: int
    first_token: int
    tokens: int


@dataclass(frozen=True)
class JointMatch:
    """The answer of a hybrid lookup.

    `reusable_tokens` R: the longest boundary where every group is complete; `replay_from`: where
    the engine recomputes from (R, or earlier for groups whose policy stores nothing);
    `paged_tokens`: the longest run of complete paged groups (what sparse checkpoints cost is
    paged_tokens - R); `matched_tokens`: the stored chain, by token ids; `parts`: the payloads to
    load, group by group in spec order (pages in order, then the checkpoint at R)."""

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
    """`stored` blocks were written, `existed` were already there (the put left them untouched);
    `parts` state-group payloads were written (hybrid identities only)."""

    stored: int
    existed: int
    hashes: tuple[bytes, ...]
    parts: int = 0


@dataclass(frozen=True, slots=True)
class StateLoad:
    """A hybrid load: the joint match, and where each of its parts was written in the output
    (`offsets[i]` for `match.parts[i]`, back to back)."""

    match: JointMatch
    offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReadResult:
    """The first `n_blocks` blocks were verified and written to their destinations; the rest are a
    miss. `sizes` gives each verified payload's length."""

    n_blocks: int
    sizes: tuple[int, ...]

    @property
    def n_bytes(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Verified payloads of `n_blocks` blocks from `first_block` on, back to back at `offsets`
    in the buffer; the prefix is usable up to `n_tokens` (the end of the last verified block).
    `next_size` is the payload size of the next stored block when the buffer had no room for it
    (0 when the load stopped for another reason): a caller with more room may ask again."""

    n_blocks: int
    n_tokens: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    first_block: int = 0
    next_size: int = 0


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the store keeps about one block besides its payload."""

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
    """One inconsistency found by `Store.check`. `block` is the affected block hash, if any."""

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
    """What an eviction round removed."""

    blocks: int
    stored_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RepairReport:
    """What `Store.repair` found and did: `problems` found, `quarantined` blocks removed (with
    their subtrees), `fixed` index and counter entries rebuilt, and what `remaining` still fails."""

    problems: tuple[Problem, ...]
    quarantined: int
    fixed: int
    remaining: tuple[Problem, ...]


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    """A block as another tier receives it: its record (with token ids, parent and identity),
    its verified payload and, for a hybrid identity's block, the verified state-group payloads
    hung on it as (group index, payload), by group index. The payloads are the buffers they
    were verified into, not copies."""

    record: bytes
    payload: bytes | bytearray
    parts: tuple[tuple[int, bytes | bytearray], ...] = ()
