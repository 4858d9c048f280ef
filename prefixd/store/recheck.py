"""After a failed fsync: the next open checks the blocks written since the last good sync.

They may lack pages on disk, so each block and part created since then (less RECHECK_SLACK_NS, for a
clock stepped back) is checked as `verify` would, and every damaged record whatever its age; failing
blocks are quarantined with their subtrees and the derived tables rebuilt, in one transaction. After
a restart without a reboot, lost pages may still sit in the page cache: they show later as failed
checksums or damaged pages."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb

from prefixd.errors import CorruptRecordError, CorruptStoreError
from prefixd.schema.chain import HASH_BYTES, ROOT_PARENT
from prefixd.schema.records import BlockRecord, PartRecord
from prefixd.store import quarantine
from prefixd.store.codec import checksum
from prefixd.store.lmdb_errors import DAMAGE
from prefixd.store.sync_state import SyncFailure
from prefixd.store.tables import Tables, decoded_part, payload_chunks

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

# Blocks created this long before the last good sync began are checked too: the store's clock
# may have stepped back between a block's creation and that sync.
RECHECK_SLACK_NS = 60 * 10**9
BAD_PAYLOAD = "payload fails verification"
BAD_PARENT = "parent is not stored"
BAD_IDENTITY = "identity is not registered"


@dataclass(frozen=True)
class RecheckReport:
    """What an open checked after a failed sync, what failed (hash -> why), how many blocks went,
    and whether that quarantine was written."""

    since_ns: int
    blocks: int
    parts: int
    condemned: dict[bytes, str]
    quarantined: int
    complete: bool = True


def recheck(ctx: StoreContext, failure: SyncFailure) -> RecheckReport:
    """Check the blocks `failure` left unsure and quarantine those that fail; damaged pages raise
    CorruptStoreError (a repair cannot mend those)."""
    since = max(0, failure.last_good_ns - RECHECK_SLACK_NS) if failure.last_good_ns else 0
    try:
        with ctx.env.begin(buffers=True) as txn:
            condemned, blocks, parts = _failing(txn, ctx.tables, since)
    except DAMAGE as exc:
        raise CorruptStoreError(
            f"{ctx.path} has damaged pages ({exc}), met while checking the blocks written since "
            f"the last good sync before a failed one ({failure.describe()}); restore the store "
            "from a backup, or delete the directory and let the cache refill"
        ) from None
    quarantined, complete = _quarantine(ctx, condemned) if condemned else (0, True)
    report = RecheckReport(since, blocks, parts, condemned, quarantined, complete)
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(Counter(condemned.values()).items()))
    log.warning(
        "%s: %s; this open checked the %d block(s) and %d part(s) written since the last good "
        "sync: %s%s",
        ctx.path,
        failure.describe(),
        blocks,
        parts,
        f"{len(condemned)} failed ({reasons}), {quarantined} block(s) quarantined with them"
        if condemned
        else "all sound",
        "" if complete else ", but the quarantine could not be written",
    )
    return report


def _failing(
    txn: lmdb.Transaction[memoryview], t: Tables, since_ns: int
) -> tuple[dict[bytes, str], int, int]:
    """The blocks that fail (hash -> why), and how many blocks and parts were recent enough to
    check."""
    condemned: dict[bytes, str] = {}
    blocks = parts = 0
    for key, raw in txn.cursor(db=t.blocks):
        h = bytes(key)
        try:
            record = BlockRecord.decode(raw)
        except CorruptRecordError:
            condemned[h] = quarantine.BAD_RECORD
            continue
        if record.created_ns < since_ns:
            continue
        blocks += 1
        if not _payload_sound(txn, t, h, record):
            condemned[h] = BAD_PAYLOAD
        elif record.parent != ROOT_PARENT and txn.get(record.parent, db=t.blocks) is None:
            condemned[h] = BAD_PARENT
        elif txn.get(record.identity, db=t.identities) is None:
            condemned[h] = BAD_IDENTITY
    if t.parts is not None:
        for key, raw in txn.cursor(db=t.parts):
            part_key = bytes(key)
            part = decoded_part(raw)
            if part is not None and part.created_ns < since_ns:
                continue
            parts += part is not None
            if part is None or not _payload_sound(txn, t, part_key, part):
                condemned.setdefault(part_key[:HASH_BYTES], quarantine.BAD_PART)
    return condemned, blocks, parts


def _payload_sound(
    txn: lmdb.Transaction[memoryview], t: Tables, key: bytes, record: BlockRecord | PartRecord
) -> bool:
    chunks = payload_chunks(txn, t, key, record)
    return chunks is not None and checksum(chunks) == record.checksum


def _quarantine(ctx: StoreContext, condemned: dict[bytes, str]) -> tuple[int, bool]:
    """Remove the condemned subtrees and rebuild what derives from the records, in one transaction;
    (blocks removed, whether it committed)."""
    reasons = {block: f"after a failed sync: {why}" for block, why in condemned.items()}
    try:
        with ctx.writing() as txn:
            removed, _ = quarantine.condemn(ctx, txn, reasons)
    except lmdb.Error as exc:
        log.error("%s: could not quarantine the blocks that failed: %s", ctx.path, exc)
        return 0, False
    return removed, True
