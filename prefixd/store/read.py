"""The read path: lookups walk the chain (prefixd.store.walk, after what the lookup memo
remembers) reading records only; loads gather each block's record and chunk views in one read
transaction and have the codec verify and copy them. The first block that fails ends the answer,
its destination bytes are zeroed, and a block damaged where it is stored is quarantined once the
transaction is over."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from prefixd.errors import CorruptRecordError, DestinationError, TokenError
from prefixd.schema.chain import HASH_BYTES, BlockChain
from prefixd.schema.content import chain_words
from prefixd.schema.identity import Identity
from prefixd.schema.records import AccessRecord, BlockRecord, PartRecord, chunk_key, part_key
from prefixd.schema.state import StateSpec
from prefixd.schema.tokens import PromptIds
from prefixd.store import counters
from prefixd.store.codec import Deadline, StoredPayload, byte_view
from prefixd.store.joint import joint_match, require_hybrid, require_plain
from prefixd.store.lookup_memo import VerifiedPrefix
from prefixd.store.quarantine import (
    BAD_PART,
    BAD_PAYLOAD,
    BAD_RECORD,
    Damaged,
    damaged_parts,
    met_by_walk,
    quarantine,
)
from prefixd.store.results import (
    BlockInfo,
    ExportedBlock,
    JointMatch,
    LoadResult,
    PrefixMatch,
    ReadResult,
    StateLoad,
)
from prefixd.store.tables import decoded, decoded_part, parent_key, payload_chunks, prefixed
from prefixd.store.walk import Walk, walk_chain

if TYPE_CHECKING:
    from prefixd.store.access import AccessTimes
    from prefixd.store.context import StoreContext
    from prefixd.store.tenancy import Tenancy

log = logging.getLogger(__name__)


class Reader:
    def __init__(self, ctx: StoreContext, tenancy: Tenancy, access: AccessTimes) -> None:
        self._ctx = ctx
        self._tenancy = tenancy
        self._access = access
        self.memo = ctx.memo

    def longest_prefix(
        self, identity: Identity, token_ids: PromptIds, hashes: bytes | None
    ) -> PrefixMatch:
        identity, hashes = self._tenancy.namespace(identity, hashes)
        require_plain(identity, "lookup_state")
        chain = BlockChain(identity, token_ids, hashes)
        with self._ctx.env.begin(buffers=True) as txn:
            walk = self._walk(txn, chain, chain.n_blocks)
        self._after_walk(walk, chain)
        self._ctx.tallies.count(lookups=1, hit_blocks=len(walk.hashes))
        return PrefixMatch(
            identity.digest, identity.block_tokens, tuple(walk.hashes), tuple(walk.payload_sizes)
        )

    def cached_prefixes(
        self, identity: Identity, queries: Sequence[tuple[PromptIds, bytes | None]]
    ) -> list[PrefixMatch] | None:
        """The memo's answers, reading only the removal epoch; None (counting nothing) unless it
        answers every query."""
        found = [self._remembered(identity, tokens, hashes) for tokens, hashes in queries]
        if any(known is None for known in found):
            return None
        matches = []
        for known in found:
            assert known is not None
            self._access.touch(known.hashes)
            self._ctx.tallies.count(lookups=1, hit_blocks=len(known.hashes))
            matches.append(
                PrefixMatch(
                    known.identity, identity.block_tokens, known.hashes, known.payload_sizes
                )
            )
        return matches

    def _remembered(
        self, identity: Identity, token_ids: PromptIds, hashes: bytes | None
    ) -> VerifiedPrefix | None:
        identity, hashes = self._tenancy.namespace(identity, hashes)
        require_plain(identity, "lookup_state")
        tokens = chain_words(identity, token_ids)  # a view: this answer is never remembered
        n_blocks = len(tokens) // identity.block_words
        if hashes is not None and len(hashes) != n_blocks * HASH_BYTES:
            raise TokenError(f"{len(hashes)} bytes of block hashes for {n_blocks} closed blocks")
        closed = tokens[: n_blocks * identity.block_words]
        if not closed.size:
            return None
        ctx = self._ctx
        try:
            with ctx.env.begin(buffers=True) as txn:
                epoch = counters.read(txn, ctx.tables.counters, counters.REMOVALS)
        except lmdb.Error:
            return None  # a damaged page: `longest_prefix` reports it
        return self.memo.find_whole(
            identity.digest, closed, epoch, self._tenancy.min_created_ns(identity)
        )

    def read_into(self, match: PrefixMatch, dests: Sequence[Any]) -> ReadResult:
        hashes, sizes = match.hashes, match.payload_sizes
        if len(dests) != len(hashes):
            raise DestinationError(f"{len(hashes)} blocks but {len(dests)} destinations")
        views = [dest_view(d, size, i) for i, (size, d) in enumerate(zip(sizes, dests))]
        ctx = self._ctx
        bad: list[Damaged] = []
        digest = match.identity_digest
        parents = [digest, *hashes]
        with ctx.env.begin(buffers=True) as txn:
            min_created = self._tenancy.min_created_for(txn, digest)
            items: list[StoredPayload] = []
            for h, size, dest, parent in zip(hashes, sizes, views, parents):
                item = self._gather(txn, h, parent, digest, size, dest, bad, min_created)
                if item is None:
                    break
                items.append(item)
            n_ok = ctx.codec.decode_verified(items, ctx.copier)
            if n_ok < len(items) and self._stored_damage(items[n_ok]):
                bad.append(Damaged(hashes[n_ok], parents[n_ok], digest, BAD_PAYLOAD))
            items.clear()  # the chunk views die with the transaction
        quarantine(ctx, bad)
        self._access.touch(hashes[:n_ok])
        verified = sizes[:n_ok]
        ctx.tallies.count(loaded_blocks=n_ok, loaded_bytes=sum(verified))
        return ReadResult(n_ok, verified)

    def load(
        self,
        identity: Identity,
        token_ids: PromptIds,
        out: Any,
        max_blocks: int | None,
        hashes: bytes | None,
        first_block: int,
        deadline: float | None = None,
    ) -> LoadResult:
        identity, hashes = self._tenancy.namespace(identity, hashes)
        require_plain(identity, "load_state")
        chain = BlockChain(identity, token_ids, hashes)
        limit = chain.n_blocks
        if max_blocks is not None:
            limit = max(0, min(first_block + max_blocks, chain.n_blocks))
        buffer = dest_view(out, 0, None)
        ctx = self._ctx
        bad: list[Damaged] = []
        offsets: list[int] = []
        digest = identity.digest
        min_created = self._tenancy.min_created_ns(identity)
        cut = None if deadline is None else Deadline(ctx.clock.monotonic, deadline)
        with ctx.env.begin(buffers=True) as txn:
            walk = self._walk(txn, chain, limit)
            items: list[StoredPayload] = []
            parents = [digest, *walk.hashes]
            offset = next_size = 0
            start = min(first_block, len(walk.hashes))
            for h, size, parent in zip(
                walk.hashes[start:], walk.payload_sizes[start:], parents[start:]
            ):
                end = offset + size
                if end > buffer.nbytes:
                    if self._damaged_record(txn, h):  # a damaged size is no reason to stop
                        bad.append(Damaged(h, parent, digest, BAD_RECORD))
                    else:
                        next_size = size
                    break
                item = self._gather(
                    txn, h, parent, digest, size, buffer[offset:end], bad, min_created
                )
                if item is None:
                    break
                items.append(item)
                offsets.append(offset)
                offset = end
            n_ok = ctx.codec.decode_verified(items, ctx.copier, cut)
            if n_ok < len(items):
                next_size = 0  # stopped at a failed payload or the deadline, not for room
                failed = start + n_ok
                if cut is not None and cut.stopped_at(items[n_ok]):
                    pass  # slow storage: the verified prefix is the answer
                elif self._stored_damage(items[n_ok]):
                    bad.append(Damaged(walk.hashes[failed], parents[failed], digest, BAD_PAYLOAD))
            items.clear()
        self._after_walk(walk, chain)
        quarantine(ctx, bad)
        sizes = tuple(walk.payload_sizes[start : start + n_ok])
        ctx.tallies.count(
            lookups=1, hit_blocks=len(walk.hashes), loaded_blocks=n_ok, loaded_bytes=sum(sizes)
        )
        return LoadResult(
            n_ok,
            (start + n_ok) * chain.identity.block_tokens,
            tuple(offsets[:n_ok]),
            sizes,
            start,
            next_size,
        )

    def lookup_state(
        self, identity: Identity, token_ids: PromptIds, hashes: bytes | None
    ) -> JointMatch:
        identity, hashes = self._tenancy.namespace(identity, hashes)
        spec = require_hybrid(identity, "longest_prefix")
        chain = BlockChain(identity, token_ids, hashes)
        damaged: list[bytes] = []
        with self._ctx.env.begin(buffers=True) as txn:
            walk = self._walk(txn, chain, chain.n_blocks)
            match = joint_match(txn, self._ctx.tables, spec, identity, walk.hashes, damaged)
        self._after_walk(walk, chain)
        quarantine(self._ctx, damaged_parts(damaged, chain, walk.hashes))
        self._ctx.tallies.count(lookups=1, hit_blocks=len(match.hashes))
        return match

    def load_state(
        self,
        identity: Identity,
        token_ids: PromptIds,
        out: Any,
        hashes: bytes | None,
        deadline: float | None = None,
    ) -> StateLoad:
        identity, hashes = self._tenancy.namespace(identity, hashes)
        spec = require_hybrid(identity, "load")
        chain = BlockChain(identity, token_ids, hashes)
        buffer = dest_view(out, 0, None)
        cut = None if deadline is None else Deadline(self._ctx.clock.monotonic, deadline)
        while True:
            damaged: list[bytes] = []
            with self._ctx.env.begin(buffers=True) as txn:
                walk = self._walk(txn, chain, chain.n_blocks)
                match = joint_match(txn, self._ctx.tables, spec, identity, walk.hashes, damaged)
                if not damaged:
                    offsets = self._read_parts(txn, spec, match, buffer, damaged, cut)
            self._after_walk(walk, chain)
            if not damaged:
                break
            if not quarantine(self._ctx, damaged_parts(damaged, chain, walk.hashes)):
                offsets = None  # damage that stays (writes refused, a longer prompt's page)
                break
        if offsets is None:  # a state read in part is no state at all
            match, offsets = _nothing(match), ()
        n = len(match.hashes)
        self._ctx.tallies.count(
            lookups=1, hit_blocks=n, loaded_blocks=n, loaded_bytes=match.payload_bytes
        )
        return StateLoad(match, offsets)

    def _read_parts(
        self,
        txn: lmdb.Transaction[memoryview],
        spec: StateSpec,
        match: JointMatch,
        buffer: memoryview,
        damaged: list[bytes],
        cut: Deadline | None = None,
    ) -> tuple[int, ...] | None:
        """Verify and copy every part of `match` into `buffer`; a block whose part is damaged goes
        to `damaged`. None if a part failed otherwise (`cut` stopped the reading, the destination
        changed, data.mdb could not be read): a miss, not a hit with nothing loaded."""
        ctx = self._ctx
        t = ctx.tables
        assert t.parts is not None
        needed = match.payload_bytes
        if needed > buffer.nbytes:
            raise DestinationError(
                f"output buffer holds {buffer.nbytes} bytes, the state needs {needed}"
            )
        groups = {group.name: gi for gi, group in enumerate(spec)}
        items: list[StoredPayload] = []
        offsets: list[int] = []
        offset = 0
        for part in match.parts:
            key = part_key(part.block, groups[part.group])
            record = decoded_part(txn.get(key, db=t.parts))
            chunks = None
            if record is not None and record.payload_size == part.payload_size:
                chunks = payload_chunks(txn, t, key, record)
            if record is None or chunks is None:
                damaged.append(part.block)
                return ()
            end = offset + part.payload_size
            items.append(self._payload(record, chunks, buffer[offset:end]))
            offsets.append(offset)
            offset = end
        n_ok = ctx.codec.decode_verified(items, ctx.copier, cut)
        if n_ok < len(match.parts):
            stopped = cut is not None and cut.stopped_at(items[n_ok])
            if not stopped and self._stored_damage(items[n_ok]):
                damaged.append(match.parts[n_ok].block)
                items.clear()
                return ()
            items.clear()  # a miss: the parts verified before the failed one are unreported
            np.frombuffer(buffer, dtype=np.uint8)[: offsets[n_ok]].fill(0)
            return None
        items.clear()
        return tuple(offsets)

    def export_block(self, block: bytes) -> ExportedBlock | None:
        ctx = self._ctx
        bad: list[Damaged] = []
        with ctx.env.begin(buffers=True) as txn:
            raw = txn.get(block, db=ctx.tables.blocks)
            if raw is None or (record := decoded(raw)) is None:
                return None
            out = bytearray(record.payload_size)
            parent = parent_key(record.identity, record.parent)
            item = self._gather(
                txn, block, parent, record.identity, record.payload_size, memoryview(out), bad
            )
            verified = item is not None and ctx.codec.decode_verified([item], ctx.copier) == 1
            if item is not None and not verified:
                bad.append(Damaged(block, parent, record.identity, BAD_PAYLOAD))
            parts, damaged = self._export_parts(txn, block) if verified else (None, False)
            if damaged:
                bad.append(Damaged(block, parent, record.identity, BAD_PART))
            record_bytes = bytes(raw)
        quarantine(ctx, bad)
        return ExportedBlock(record_bytes, out, parts) if parts is not None else None

    def _export_parts(
        self, txn: lmdb.Transaction[memoryview], block: bytes
    ) -> tuple[tuple[tuple[int, bytes | bytearray], ...] | None, bool]:
        """The verified parts hung on `block` (none for a plain identity), or None if one fails; and
        whether it is damaged where it is stored."""
        ctx = self._ctx
        t = ctx.tables
        if t.parts is None:
            return (), False
        found: list[tuple[int, bytearray, StoredPayload]] = []
        for key, raw in prefixed(txn.cursor(db=t.parts), block):
            record = decoded_part(raw)
            if record is None or len(key) != len(block) + 1 or record.group != key[-1]:
                return None, True
            chunks = payload_chunks(txn, t, key, record)
            if chunks is None:
                return None, True
            out = bytearray(record.payload_size)
            found.append((record.group, out, self._payload(record, chunks, memoryview(out))))
        items = [item for _, _, item in found]
        n_ok = ctx.codec.decode_verified(items, ctx.copier)
        if n_ok < len(items):
            return None, self._stored_damage(items[n_ok])
        return tuple((group, out) for group, out, _ in found), False

    def block_info(self, block: bytes) -> BlockInfo | None:
        """The access fields include reads not yet synced."""
        t = self._ctx.tables
        with self._ctx.env.begin() as txn:
            raw = txn.get(block, db=t.blocks)
            access = txn.get(block, db=t.access)
        if raw is None or (record := decoded(raw)) is None:
            return None
        pending_at, pending_hits = self._access.pending(block)
        stored = AccessRecord.read(access, record.created_ns)
        return BlockInfo(
            block,
            record.parent,
            record.identity,
            record.n_tokens,
            record.payload_size,
            record.stored_size,
            record.compression.name.lower().replace("_", "-"),
            record.created_ns,
            max(stored.last_ns, pending_at),
            stored.hits + pending_hits,
        )

    def _walk(self, txn: lmdb.Transaction, chain: BlockChain, limit: int) -> Walk:
        """`walk_chain`, starting after the longest prefix verified earlier and still valid."""
        epoch = counters.read(txn, self._ctx.tables.counters, counters.REMOVALS)
        min_created = self._tenancy.min_created_ns(chain.identity)
        known = self.memo.find(chain, epoch, limit, min_created)
        start = None if known is None else known.walk()
        walk = walk_chain(txn, self._ctx.tables.blocks, chain, limit, start, min_created)
        if walk.corrupt is None and len(walk.hashes) > (len(known.hashes) if known else 0):
            self.memo.remember(
                chain, epoch, walk.hashes, walk.payload_sizes, walk.oldest_created_ns
            )
        return walk

    def _after_walk(self, walk: Walk, chain: BlockChain) -> None:
        if walk.collided:
            self._ctx.tallies.collided()
        damaged = met_by_walk(walk, chain)
        if damaged is not None:
            quarantine(self._ctx, [damaged])
        self._access.touch(walk.hashes)

    def _gather(
        self,
        txn: lmdb.Transaction[memoryview],
        h: bytes,
        parent: bytes,
        identity_digest: bytes,
        payload_size: int,
        dest: memoryview,
        bad: list[Damaged],
        min_created_ns: int = 0,
    ) -> StoredPayload | None:
        """Block `h`'s record and chunk views (checked against each other; the codec checks the
        checksum as it copies), or None; a damaged block goes to `bad`."""
        raw = txn.get(h, db=self._ctx.tables.blocks)
        if raw is None:
            return None
        try:
            record = BlockRecord.decode(raw)
        except CorruptRecordError:
            bad.append(Damaged(h, parent, identity_digest, BAD_RECORD))
            return None
        if record.identity != identity_digest or record.payload_size != payload_size:
            return None
        if record.created_ns < min_created_ns:
            return None  # past its tenant's time to live since it was found
        chunks_db = self._ctx.tables.chunks
        chunks: list[memoryview] = []
        for n in range(record.n_chunks):
            chunk = txn.get(chunk_key(h, n), db=chunks_db)
            if chunk is None:
                bad.append(Damaged(h, parent, identity_digest, "payload chunk missing"))
                return None
            chunks.append(chunk)
        if sum(c.nbytes for c in chunks) != record.stored_size:
            bad.append(Damaged(h, parent, identity_digest, "payload size differs from its record"))
            return None
        return self._payload(record, chunks, dest)

    def _payload(
        self, record: BlockRecord | PartRecord, chunks: list[memoryview], dest: memoryview
    ) -> StoredPayload:
        """What the codec decodes, with the chunks' place in data.mdb when they are to be read from
        the file (prefixd.store.direct)."""
        return StoredPayload(record, chunks, dest, self._ctx.data_file.spans(record, chunks))

    def _stored_damage(self, failed: StoredPayload) -> bool:
        """Whether a failed payload is damaged where it is stored (then it is quarantined): a client
        writing into its own region during a load fails only its own load, and an unreadable data
        file is a miss; neither makes the store delete a healthy block."""
        failure = self._ctx.codec.failure(failed)
        if failure == "destination":
            log.info("a load's destination changed while it was written: that load stops there")
        elif failure == "unreadable":
            log.warning(
                "data.mdb cannot be read where a payload lies (cut short, or an I/O error): "
                "that load stops there; `prefixd verify` checks the store"
            )
        return failure == "stored"

    def _damaged_record(self, txn: lmdb.Transaction, h: bytes) -> bool:
        raw = txn.get(h, db=self._ctx.tables.blocks)
        return raw is not None and decoded(raw) is None


def _nothing(match: JointMatch) -> JointMatch:
    """A joint miss in place of `match`: a state whose reading was cut off serves no prefix."""
    return dataclasses.replace(
        match, reusable_tokens=0, replay_from=0, paged_tokens=0, hashes=(), parts=()
    )


def dest_view(buffer: Any, size: int, index: int | None) -> memoryview:
    """`buffer` as a writable flat byte view of at least `size` bytes (`index` None: the whole
    output buffer; else block `index`'s destination, cut to `size`)."""
    what = "output buffer" if index is None else f"destination of block {index}"
    view = byte_view(buffer, what, DestinationError, writable=True)
    if view.nbytes < size:
        raise DestinationError(f"{what} holds {view.nbytes} bytes, the payload needs {size}")
    return view if index is None else view[:size]
