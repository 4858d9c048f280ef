"""The write path: `put` and `put_state` publish blocks (and state-group parts) atomically.

Each put is one write transaction (shared by puts that arrive together: prefixd.store.commits):
  * ancestry: blocks 0..first_block-1 must be stored, match and be within their time to live,
    so there are no orphans; a prefix the lookup memo verified at the current removal epoch is
    not read or hashed again, so extending a long chain costs only the new blocks;
  * claims: a block is written once; a hash stored for other tokens refuses the put, a damaged
    or expired one is removed with its subtree and written afresh;
  * checksums hold at rest: each payload's checksum is compared with the crc32c of the bytes
    LMDB holds once written, so a client rewriting its payload during the put gets it refused,
    never a block stored under a checksum its bytes do not match.

A refused put aborts its transaction; nothing was written. A full map makes room (a settling
commit, then an eviction) and tries once more."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import crc32c
import lmdb

from prefixd.errors import (
    BlockCollisionError,
    CorruptRecordError,
    OpenTailError,
    OrphanBlockError,
    PayloadError,
    SyncFailedError,
)
from prefixd.schema.chain import BlockChain
from prefixd.schema.identity import Identity
from prefixd.schema.records import (
    AccessRecord,
    BlockRecord,
    Compression,
    PartRecord,
    chunk_key,
    part_key,
)
from prefixd.schema.tokens import PromptIds
from prefixd.store import counters, quarantine
from prefixd.store.codec import EncodedPayload, payload_view, settle
from prefixd.store.commits import CommitQueue
from prefixd.store.eviction import capacity_bytes, evict
from prefixd.store.joint import anchor, plan_put, require_hybrid, require_plain
from prefixd.store.lookup_memo import VerifiedPrefix
from prefixd.store.quarantine import Damaged
from prefixd.store.removal import remove_subtree
from prefixd.store.results import EvictionReport, PutResult
from prefixd.store.tables import Tables, children_key, parent_key
from prefixd.store.walk import Walk, walk_chain

if TYPE_CHECKING:
    from prefixd.errors import PutRefusedError
    from prefixd.store.access import AccessTimes
    from prefixd.store.context import StoreContext
    from prefixd.store.tenancy import Tenancy

log = logging.getLogger(__name__)
_NO_PAYLOAD = EncodedPayload(Compression.NONE, [], 0, 0, 0, 0)


@dataclass(frozen=True)
class Refusal:
    """Why a put's transaction was aborted; a damaged block it met is quarantined after it."""

    error: PutRefusedError
    collided: bool = False
    damaged: Damaged | None = None


class Verified(NamedTuple):
    """The chain prefix the put's transaction verified, at the removal epoch it read: what the
    lookup memo keeps after the commit."""

    epoch: int
    walk: Walk
    grew_from: bytes | None  # the last hash of the memo's entry the put extended


class Written(NamedTuple):
    """What a committed put did, the damaged records it replaced, and the stored bytes it left (what
    its eviction check compares with the capacity)."""

    result: PutResult
    replaced: int
    verified: Verified | None = None
    stored_bytes: int = 0


Outcome = Written | Refusal


class Blocks(NamedTuple):
    written: list[EncodedPayload]
    existed: int
    replaced: int
    verified: Walk


class Writer:
    def __init__(self, ctx: StoreContext, tenancy: Tenancy, access: AccessTimes) -> None:
        self._ctx = ctx
        self._tenancy = tenancy
        self._access = access  # for the evictions a put sets off
        self._commits: CommitQueue[Outcome] = CommitQueue(ctx, _refused)

    def put(
        self,
        identity: Identity,
        token_ids: PromptIds,
        payloads: Sequence[Any],
        first_block: int,
        created_ns: int | None = None,
    ) -> PutResult:
        check_first_block(first_block)
        identity, _ = self._tenancy.namespace(identity, None)
        require_plain(identity, "put_state")
        chain = BlockChain(identity, token_ids)
        views = [
            payload_view(p, f"payload of block {first_block + i}") for i, p in enumerate(payloads)
        ]
        if not views:
            return PutResult(0, 0, ())
        end = first_block + len(views)
        if end > chain.n_blocks:
            bt = identity.block_tokens
            have = chain.n_tokens - chain.n_blocks * bt
            raise OpenTailError(
                f"block {chain.n_blocks} has {have if end == chain.n_blocks + 1 else 'too few'} of "
                f"{bt} tokens: only closed blocks are stored"
            )
        ctx = self._ctx
        known: VerifiedPrefix | None = None
        todo: Sequence[int] = range(len(views))
        compressed = ctx.codec.compression is not Compression.NONE
        if compressed:
            with ctx.env.begin(buffers=True) as txn:  # compress only what is not stored yet
                known = self._remembered(txn, chain, first_block)
                todo = [
                    i
                    for i in range(len(views))
                    if txn.get(chain.hash(first_block + i), db=ctx.tables.blocks) is None
                ]
        # Raw payloads are encoded whatever is stored (a checksum costs less than a transaction
        # to find out), and the memo is asked inside the put's own transaction.
        encoded: dict[int, EncodedPayload] = dict(
            zip(
                (first_block + i for i in todo),
                ctx.codec.encode_many([views[i] for i in todo], ctx.pool),
            )
        )

        def payload_of(index: int) -> EncodedPayload:
            return encoded.get(index) or ctx.codec.encode(views[index - first_block])

        def body(txn: lmdb.Transaction) -> Outcome:
            remembered = known if compressed else self._remembered(txn, chain, first_block)
            now = ctx.clock.time_ns()
            born = now if created_ns is None else min(now, created_ns)
            blocks = self._write_blocks(
                txn, chain, first_block, end, payload_of, (now, born), remembered
            )
            if isinstance(blocks, Refusal):
                return blocks
            return self._written(txn, chain, range(first_block, end), blocks, remembered, [])

        written = sum(payload.stored_size for payload in encoded.values())
        try:
            return self._publish(body, identity.tenant, chain, written)
        finally:
            settle(list(encoded.values()))

    def put_state(
        self,
        identity: Identity,
        token_ids: PromptIds,
        paged: Mapping[str, Sequence[Any]],
        checkpoints: Mapping[str, Mapping[int, Any]],
        upto_tokens: int | None,
        first_block: int,
        created_ns: int | None = None,
    ) -> PutResult:
        check_first_block(first_block)
        identity, _ = self._tenancy.namespace(identity, None)
        spec = require_hybrid(identity, "put")
        chain = BlockChain(identity, token_ids)
        bt = identity.block_tokens
        n_tokens = chain.n_tokens
        upto = n_tokens if upto_tokens is None else upto_tokens
        if isinstance(upto, bool) or not isinstance(upto, int) or not 0 <= upto <= n_tokens:
            raise PayloadError(f"upto_tokens must be an int in 0..{n_tokens}, got {upto!r}")
        if upto % bt:
            raise OpenTailError(
                f"{upto} tokens end inside block {upto // bt} ({upto % bt} of {bt} tokens): only "
                "closed blocks are stored"
            )
        end = upto // bt
        if first_block > end:
            raise PayloadError(f"first_block {first_block} is past the put's last block {end - 1}")
        planned = plan_put(spec, bt, first_block, end, paged, checkpoints)
        ctx = self._ctx
        encoded = ctx.codec.encode_many([part.view for part in planned], ctx.pool)
        with ctx.env.begin(buffers=True) as txn:
            known = self._remembered(txn, chain, first_block)

        def body(txn: lmdb.Transaction) -> Outcome:
            t = ctx.tables
            assert t.parts is not None
            now = ctx.clock.time_ns()
            born = now if created_ns is None else min(now, created_ns)
            # a block of a hybrid identity has no payload of its own: its state is in parts
            blocks = self._write_blocks(
                txn, chain, first_block, end, lambda index: None, (now, born), known
            )
            if isinstance(blocks, Refusal):
                return blocks
            parts: list[EncodedPayload] = []
            at_rest: list[AtRest] = []
            for part, payload in zip(planned, encoded):
                key = part_key(chain.hash(anchor(spec[part.group], part.block_index)), part.group)
                if txn.get(key, db=t.parts) is not None:
                    continue  # a part is written once, like a block
                stored = _put_chunks(txn, t, key, payload.chunks)
                record = PartRecord(
                    payload.compression,
                    part.group,
                    part.block_index,
                    payload.chunk_bytes,
                    len(payload.chunks),
                    stored,
                    payload.payload_size,
                    payload.stored_size,
                    born,
                )
                txn.put(key, record.encode(), db=t.parts)
                parts.append(payload)
                at_rest.append(AtRest(f"the part of block {part.block_index}", payload, stored))
            changed = _first_changed(at_rest)
            if changed is not None:
                return changed
            return self._written(txn, chain, range(first_block, end), blocks, known, parts)

        written = sum(payload.stored_size for payload in encoded)
        try:
            return self._publish(body, identity.tenant, chain, written)
        finally:
            settle(encoded)

    def _publish(
        self,
        body: Callable[[lmdb.Transaction], Outcome],
        tenant: str,
        chain: BlockChain,
        written: int,
    ) -> PutResult:
        """Run a put's transaction (making room on a full map), remember the verified chain, then
        keep the store within capacity and the tenant within quota; raise a refusal's error.
        `written`: about the bytes it writes (what the write-behind counts)."""
        outcome = self._with_room(lambda: self._commits.run(body, written))
        if isinstance(outcome, Refusal):
            if outcome.collided:
                self._ctx.tallies.collided()
            if outcome.damaged is not None:
                quarantine.quarantine(self._ctx, [outcome.damaged])
            raise outcome.error
        if outcome.result.stored:
            self._ctx.write_behind.committed(written)
        if outcome.verified is not None:
            epoch, walk, grew_from = outcome.verified
            self._ctx.memo.remember(
                chain,
                epoch,
                walk.hashes,
                walk.payload_sizes,
                walk.oldest_created_ns,
                replacing=grew_from,
            )
        if outcome.replaced:
            log.warning(
                "replaced %d stored block(s) whose records failed verification", outcome.replaced
            )
        if (outcome.result.stored or outcome.result.parts) and self._ctx.syncs.failure is None:
            try:
                self._keep_within_limits(tenant, outcome.stored_bytes)
            except (lmdb.Error, SyncFailedError) as exc:
                # The put is committed and acknowledged; only the eviction after it failed (a full
                # map, a full disk, an I/O error, an fsync failed on the way: then the store writes
                # nothing more). The next put (or the daemon's own eviction) tries again: never
                # report the put as lost.
                log.warning("eviction after a put failed (%s); the put is stored", exc)
        return outcome.result

    def _with_room(self, write: Callable[[], Outcome]) -> Outcome:
        """Run the put; on a full map, make room and try again.

        LMDB reuses the pages a transaction frees only after a later commit, so right after a delete
        the map can look full: first a small settling commit, then an eviction and another."""
        try:
            return write()
        except lmdb.MapFullError:
            self._settle()
        try:
            return write()
        except lmdb.MapFullError:
            if not self._evict().blocks:
                raise
        self._settle()
        return write()

    def _keep_within_limits(self, tenant: str, stored: int) -> None:
        """The tenant's quota first: a put past it and the capacity pays with its tenant's own
        blocks before any other tenant's are weighed."""
        config = self._ctx.config
        high = config.high_watermark
        quota = self._tenancy.quota_of(tenant)
        if quota and self._tenancy.tenant_bytes(tenant) > quota * high:
            stored -= self._evict(int(quota * config.low_watermark), tenant).stored_bytes
        if stored > capacity_bytes(config) * high:
            self._evict()

    def _evict(self, target_bytes: int | None = None, tenant: str | None = None) -> EvictionReport:
        return evict(self._ctx, self._tenancy, self._access, target_bytes, tenant)

    def _settle(self) -> None:
        self._ctx.syncs.check_writable()
        with self._ctx.env.begin(write=True) as txn:
            counters.add(txn, self._ctx.tables.counters, counters.SETTLES, 1)

    def _write_blocks(
        self,
        txn: lmdb.Transaction,
        chain: BlockChain,
        first_block: int,
        end: int,
        payload_of: Callable[[int], EncodedPayload | None],
        times: tuple[int, int],
        known: VerifiedPrefix | None,
    ) -> Blocks | Refusal:
        """Check the ancestry, record the identity, claim each block and write those not stored yet
        (refused if a payload's stored bytes do not match its checksum). `times`: now, and when
        the new blocks were first stored (a shared-tier install: at their origin, so that a
        tenant's time to live counts from there)."""
        born = times[1]
        min_created = self._tenancy.min_created_ns(chain.identity)
        ancestry = self._check_ancestry(txn, chain, first_block, min_created, known)
        if isinstance(ancestry, Refusal):
            return ancestry
        identity = chain.identity
        txn.put(identity.digest, identity.encode(), db=self._ctx.tables.identities, overwrite=False)
        written: list[EncodedPayload] = []
        at_rest: list[AtRest] = []
        existed = replaced = 0
        hashes, sizes = ancestry.hashes, ancestry.payload_sizes  # this put's own lists
        oldest = ancestry.oldest_created_ns
        for index in range(first_block, end):
            claim = self._claim_block(txn, chain, index, min_created)
            if isinstance(claim, Refusal):
                return claim
            record, dropped = claim
            replaced += dropped
            hashes.append(chain.hash(index))
            if record is not None:
                existed += 1
                sizes.append(record.payload_size)
                oldest = min(oldest, record.created_ns)
                continue
            payload = payload_of(index) or _NO_PAYLOAD
            stored = self._write_block(txn, chain, index, payload, times)
            at_rest.append(AtRest(f"block {index}", payload, stored))
            written.append(payload)
            sizes.append(payload.payload_size)
            oldest = min(oldest, born)
        changed = _first_changed(at_rest)
        if changed is not None:
            return changed
        return Blocks(written, existed, replaced, Walk(hashes, sizes, oldest_created_ns=oldest))

    def _remembered(
        self, txn: lmdb.Transaction, chain: BlockChain, first_block: int
    ) -> VerifiedPrefix | None:
        """The memo's longest verified prefix of blocks 0..first_block-1; the chain adopts its
        hashes, so only the put's own blocks are hashed."""
        if not first_block:
            return None
        ctx = self._ctx
        epoch = counters.read(txn, ctx.tables.counters, counters.REMOVALS)
        min_created = self._tenancy.min_created_ns(chain.identity)
        known = ctx.memo.find(chain, epoch, first_block, min_created)
        if known is not None:
            chain.adopt(known.hashes)
        return known

    def _written(
        self,
        txn: lmdb.Transaction,
        chain: BlockChain,
        indexes: range,
        blocks: Blocks,
        known: VerifiedPrefix | None,
        parts: list[EncodedPayload],
    ) -> Written:
        """Add the put's blocks and parts to the counters in its own transaction; what it did."""
        t = self._ctx.tables
        digest = chain.identity.digest
        payloads = blocks.written + parts
        stored_bytes = sum(p.stored_size for p in payloads)
        for name, delta in (
            (counters.BLOCKS, len(blocks.written)),
            (counters.PARTS, len(parts)),
            (counters.PAYLOAD_BYTES, sum(p.payload_size for p in payloads)),
            (counters.STORED_BYTES, stored_bytes),
            (counters.identity_stored(digest), stored_bytes),
            (counters.identity_blocks(digest), len(blocks.written)),
        ):
            counters.add(txn, t.counters, name, delta)
        hashes = tuple(chain.hash(i) for i in indexes)
        result = PutResult(len(blocks.written), blocks.existed, hashes, len(parts))
        epoch = counters.read(txn, t.counters, counters.REMOVALS)
        verified = Verified(epoch, blocks.verified, known.hashes[-1] if known else None)
        total = counters.read(txn, t.counters, counters.STORED_BYTES)
        return Written(result, blocks.replaced, verified, total)

    def _check_ancestry(
        self,
        txn: lmdb.Transaction,
        chain: BlockChain,
        first_block: int,
        min_created: int,
        known: VerifiedPrefix | None,
    ) -> Walk | Refusal:
        """Blocks 0..first_block-1, stored and fresh, or the put's refusal. A memo prefix is trusted
        only at the removal epoch this transaction reads and within its time to live."""
        start = None
        if (
            known is not None
            and counters.read(txn, self._ctx.tables.counters, counters.REMOVALS) == known.epoch
            and known.oldest_created_ns >= min_created
        ):
            start = known.walk()
            if len(start.hashes) >= first_block:
                return start
        walk = walk_chain(txn, self._ctx.tables.blocks, chain, first_block, start, min_created)
        if len(walk.hashes) >= first_block:
            return walk
        missing = len(walk.hashes)
        if walk.collided:
            return Refusal(
                BlockCollisionError(f"block {missing} of the prefix is owned by other tokens"),
                collided=True,
            )
        state = "damaged" if walk.corrupt else "expired" if walk.expired else "missing"
        error = OrphanBlockError(
            f"block {first_block}'s ancestry is not stored (block {missing} is {state}); put "
            f"from block {missing}"
        )
        return Refusal(error, damaged=quarantine.met_by_walk(walk, chain))

    def _claim_block(
        self, txn: lmdb.Transaction, chain: BlockChain, index: int, min_created: int
    ) -> tuple[BlockRecord | None, int] | Refusal:
        """Block `index`'s record if stored and matching, and how many damaged records were dropped.

        A damaged or expired record is removed with its subtree so the block is written afresh; a
        hash owned by other tokens refuses the put."""
        ctx = self._ctx
        digest = chain.identity.digest
        h = chain.hash(index)
        parent = chain.parent_of(index)
        raw = txn.get(h, db=ctx.tables.blocks)
        if raw is None:
            return None, 0
        try:
            record = BlockRecord.decode(raw)
        except CorruptRecordError:
            remove_subtree(ctx, txn, h, parent_key(digest, parent), digest, reason="quarantined")
            quarantine.note(ctx, txn, h, quarantine.BAD_RECORD)
            return None, 1
        if (
            record.identity != digest
            or record.parent != parent
            or record.tokens != chain.block_bytes(index)
        ):
            error = BlockCollisionError(f"block {index}'s hash is owned by other tokens")
            return Refusal(error, collided=True)
        if record.created_ns >= min_created:
            return record, 0
        # past its tenant's time to live: stored afresh (with nothing below it)
        remove_subtree(ctx, txn, h, parent_key(digest, parent), digest, reason="expired")
        return None, 0

    def _write_block(
        self,
        txn: lmdb.Transaction,
        chain: BlockChain,
        index: int,
        payload: EncodedPayload,
        times: tuple[int, int],
    ) -> int:
        """Write the chunks, record, index entry and access record (not counters); the checksum of
        the stored bytes, which the record holds and the put compares with the payload's.
        `times`: now (its last read), and when it was first stored."""
        now, born = times
        t = self._ctx.tables
        h = chain.hash(index)
        stored = _put_chunks(txn, t, h, payload.chunks)
        record = BlockRecord(
            payload.compression,
            payload.chunk_bytes,
            len(payload.chunks),
            stored,
            payload.payload_size,
            payload.stored_size,
            born,
            chain.identity.digest,
            chain.parent_of(index),
            bytes(chain.block_bytes(index)),
        )
        txn.put(h, record.encode(), db=t.blocks)
        journal = self._ctx.journals.current()
        if journal is not None:
            journal.stored(txn, h, record, chain.identity)
        txn.put(children_key(record), h, db=t.children)
        txn.put(h, AccessRecord(now, 0).encode(), db=t.access)
        return stored


def check_first_block(first_block: object) -> None:
    if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
        raise PayloadError(f"first_block must be a non-negative int, got {first_block!r}")


def _put_chunks(txn: lmdb.Transaction, t: Tables, owner: bytes, chunks: Sequence[Any]) -> int:
    """Write a payload's chunks; return the crc32c of the bytes LMDB now holds (each chunk read back
    while in cache), which must match the payload's checksum."""
    value = 0
    for n, chunk in enumerate(chunks):
        key = chunk_key(owner, n)
        txn.put(key, chunk, db=t.chunks)
        stored = txn.get(key, db=t.chunks)
        assert stored is not None  # written just now, in this transaction
        value = crc32c.crc32c(stored, value)
    return value


class AtRest(NamedTuple):
    """A payload written in the put's transaction and the checksum of the bytes LMDB holds."""

    what: str
    payload: EncodedPayload
    stored: int


def _first_changed(written: Sequence[AtRest]) -> Refusal | None:
    """The refusal of the first payload whose stored bytes are not the bytes it was checksummed
    from, compared last (a large raw put's checksums are taken on the pool meanwhile)."""
    for what, payload, stored in written:
        if stored != payload.checksum:
            return Refusal(
                PayloadError(
                    f"{what}'s payload changed while it was being stored (a client wrote into it "
                    "during the put): nothing was stored"
                )
            )
    return None


def _refused(outcome: Outcome) -> bool:
    return isinstance(outcome, Refusal)
