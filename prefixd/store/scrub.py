"""Clearing the store's files of what removals left in them, so a purged tenant's bytes are gone.

LMDB frees pages, it does not clear them. Once a delete commits, the removed entries' bytes stay in
data.mdb: in the pages it freed (payload chunks' overflow pages, the old copies of the pages it
copied on write), and in the unused gap of each live page that lost an entry (a delete moves the
other entries over the hole and leaves the old bytes behind). Worse, LMDB reuses the memory of its
past pages for new ones without clearing it, so the unused part of any page it writes (the gap of a
branch or leaf page, the end of an overflow page the value does not fill) may carry bytes of a page
written earlier, of any table. `clear` therefore clears the whole file, after the removal commits:
  1. it overwrites LMDB's free pages with zero values (one page each, under a private key range of
     the meta table), in short transactions until a commit has to grow the file, then deletes them
     (LMDB reuses a page only once no snapshot can still see it: what is left goes in step 2). The
     first transaction writes as many pages as the store had (at most MAX_LAUNDER_PAGES), so the
     page memory LMDB reuses holds zeros, not old pages a later write would copy from;
  2. holding the writer's lock (puts wait; loads go on), after an fsync so the last commit is the
     one an open picks, it walks every page LMDB reaches (the trees of every table, the free list)
     and writes zeros over each unused gap and each overflow page's unused end, then over every free
     page no reader can still see and the file past the last page: only bytes LMDB never reads;
  3. fsyncs the file; a failed fsync is the store's failure (prefixd.store.sync_state).
The page layout read is LMDB's on-disk format (lmdb.h, mdb.c: stable across the 0.9 releases)."""

from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

import lmdb

from prefixd.errors import CorruptStoreError
from prefixd.store.tables import Tables, prefixed

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

# + u64 BE: zero values in the meta table while a clearing runs, after its one key (b"meta"), so
# they are appended
SCRATCH = b"~scrub:"
BATCH_PAGES = 256  # zero pages per transaction: 1 MiB at 4 KiB pages, a few ms of the writer's lock
PAUSE_S = 0.0002  # between two of its transactions: a put waiting for the writer's lock gets it
# the most pages the first transaction writes (128 MiB at 4 KiB pages): LMDB keeps the memory of as
# many pages as one transaction ever dirtied (at most 1 << 17), and this much more at worst
MAX_LAUNDER_PAGES = 1 << 15
READER_WAIT_S = 30.0  # how long the clearing waits for a read begun before it

# LMDB's on-disk format (64-bit builds): page header, node header, meta page, flags
PAGE_HEADER = 16  # pgno u64, pad u16, flags u16, lower u16 / upper u16 (or overflow pages u32)
NODE_HEADER = 8  # lo u16, hi u16, flags u16, key size u16
P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF2 = 0x01, 0x02, 0x04, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
DB_ROOT_AT = 40  # the root page number in an MDB_db record (48 bytes)
# offsets in a meta page: the free list's and the main tree's MDB_db, the last page, the txn id
META_FREE_DB, META_MAIN_DB, META_LAST_PAGE, META_TXNID, META_END = 40, 88, 136, 144, 152
NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty tree's root
_HEADER = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_INDEX = struct.Struct(">Q")


@dataclass(frozen=True)
class ClearReport:
    zero_filled_bytes: int  # free space overwritten through LMDB (step 1)
    cleared_bytes: int  # unused bytes found not zero and overwritten (step 2)
    scanned_bytes: int  # bytes of the file step 2 read
    seconds: float
    locked_seconds: float  # how long puts waited (step 2)
    complete: bool  # False: a reader older than the removal kept some free pages (logged)

    def describe(self) -> dict[str, object]:
        return dict(vars(self))


def tree_pages(env: lmdb.Environment, tables: Tables) -> int:
    """The pages of every table: a bound on what one transaction of a store this size dirtied, so
    on the page memory LMDB keeps for reuse (one-page values included)."""
    main = env.stat()
    total = main["branch_pages"] + main["leaf_pages"] + main["overflow_pages"]
    with env.begin() as txn:
        for db in vars(tables).values():
            if db is not None:
                stat = txn.stat(db)
                total += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
    return int(total)


def clear(ctx: StoreContext, launder_pages: int = 0) -> ClearReport:
    """Clear the store's files of every byte no entry holds (what a committed removal left), then
    fsync; SyncFailedError if an fsync fails. `launder_pages`: the pages the trees had before the
    removal (tree_pages), at least as many as LMDB's reused page memory holds."""
    started = time.perf_counter()
    env = ctx.env
    filled = _zero_free_pages(ctx, launder_pages)
    _readers_gone(env, env.info()["last_txnid"])  # bounded: what they keep is reported
    fd = os.open(ctx.path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
    try:
        locked = time.perf_counter()
        with env.begin(write=True) as txn:  # the writer's lock; nothing is written through it
            # the last commit durable first: an open never goes back to the one before, whose
            # pages are cleared now
            if not ctx.syncs.sync(env):
                ctx.syncs.check_writable()
            walk = _Walk(fd, env.stat()["psize"])
            complete = walk.run(_oldest_reader(env), txn.id() - 1)
            try:
                os.fdatasync(fd)
            except OSError as exc:
                ctx.syncs.fail(f"fsync after clearing the store's free space: {exc}")
                ctx.syncs.check_writable()
        locked = time.perf_counter() - locked
    finally:
        os.close(fd)
    if not complete:
        log.warning(
            "clearing the store's free space: a read begun before the removal outlived %.0f s; "
            "the pages it still saw were not cleared (the next clearing clears them)",
            READER_WAIT_S,
        )
    return ClearReport(
        filled,
        walk.cleared,
        walk.scanned,
        round(time.perf_counter() - started, 6),
        round(locked, 6),
        complete,
    )


def _zero_free_pages(ctx: StoreContext, at_least: int) -> int:
    """Put one-page zero values until a commit grows the file (the reusable free pages are used
    up), the first transaction at least `at_least` of them, then delete them; the bytes written."""
    env, meta = ctx.env, ctx.tables.meta
    psize = env.stat()["psize"]
    zero = bytes(psize - PAGE_HEADER)
    room = env.info()["map_size"] // psize - env.info()["last_pgno"] - 2 * BATCH_PAGES
    first = max(BATCH_PAGES, min(at_least, MAX_LAUNDER_PAGES, room))
    n = 0
    _delete_scratch(ctx)  # what a clearing cut short left: appending starts from the first key
    try:
        while True:
            before = env.info()["last_pgno"]
            batch = first if n == 0 else BATCH_PAGES
            try:
                with env.begin(write=True) as txn:
                    for i in range(n, n + batch):
                        if not txn.put(SCRATCH + _INDEX.pack(i), zero, db=meta, append=True):
                            raise CorruptStoreError(f"the meta table has a key after {SCRATCH!r}")
            except lmdb.MapFullError:
                break  # every reusable page was taken: the walk clears what this could not
            n += batch
            if env.info()["last_pgno"] > before or n * psize > env.info()["map_size"]:
                break
            time.sleep(PAUSE_S)  # the lock's waiters are not woken in turn: let a put in
    finally:
        _delete_scratch(ctx)
    return n * len(zero)


def _delete_scratch(ctx: StoreContext) -> None:
    """Delete every scratch value (a clearing cut short leaves some: the next one deletes them)."""
    meta = ctx.tables.meta
    while True:
        with ctx.env.begin(write=True) as txn:
            scratch = prefixed(txn.cursor(db=meta), SCRATCH)
            keys = [key for key, _ in islice(scratch, 4 * BATCH_PAGES)]
            for key in keys:
                txn.delete(key, db=meta)
        if len(keys) < 4 * BATCH_PAGES:
            return


class _Walk:
    """One pass over data.mdb under the writer's lock: every page LMDB reaches from the newest meta
    page, each unused byte written as zero where it is not."""

    def __init__(self, fd: int, psize: int) -> None:
        self.fd = fd
        self.psize = psize
        self.cleared = 0
        self.scanned = 0
        self.seen: set[int] = set()

    def run(self, oldest_reader: float, last_txn: int) -> bool:
        """Clear the newest snapshot's pages, and the free pages no reader older than them can see;
        whether every free page could be."""
        metas = [self.read(n * self.psize, self.psize) for n in (0, 1)]
        meta = _newest(metas)
        txnid = _U64.unpack_from(meta, META_TXNID)[0]
        if txnid != last_txn:
            raise CorruptStoreError(
                f"the newest meta page names transaction {txnid}, LMDB {last_txn}: not clearing"
            )
        for n, page in enumerate(metas):
            self.zero_if_set(n * self.psize + META_END, page[META_END:])
        free_list = self.free_list(meta)
        self.tree(_U64.unpack_from(meta, META_MAIN_DB + DB_ROOT_AT)[0], None)
        complete = True
        # a page freed by transaction K is seen by readers of snapshots before K only
        bound = min(oldest_reader, txnid)
        for freed_by, pages in free_list:
            if freed_by > bound:
                complete = False
                continue
            for pgno in pages:
                self.free_page(pgno)
        last_pgno = _U64.unpack_from(meta, META_LAST_PAGE)[0]
        end = os.fstat(self.fd).st_size
        at = (last_pgno + 1) * self.psize
        while at < end:
            piece = min(end - at, 256 * self.psize)
            self.zero_if_set(at, self.read(at, piece))
            at += piece
        return complete

    def free_list(self, meta: bytes) -> list[tuple[int, list[int]]]:
        """The free list of the snapshot of `meta` (its pages cleared like any tree's): each
        freeing transaction, with the pages it freed."""
        records: list[tuple[int, bytes]] = []
        self.tree(_U64.unpack_from(meta, META_FREE_DB + DB_ROOT_AT)[0], records)
        freed = []
        for freed_by, idl in records:  # an ID list: its count, then the page numbers
            count = _U64.unpack_from(idl, 0)[0]
            freed.append(
                (freed_by, [pgno for (pgno,) in struct.iter_unpack("<Q", idl[8 : 8 * (count + 1)])])
            )
        return freed

    def tree(self, root: int, free_lists: list[tuple[int, bytes]] | None) -> None:
        """Clear the pages of the tree at `root`; with `free_lists`, collect its entries (the free
        list's: freeing transaction, page numbers)."""
        stack = [root]
        while stack:
            pgno = stack.pop()
            if pgno == NO_PAGE or pgno in self.seen:  # an empty table, or a page met before
                continue
            self.seen.add(pgno)
            at = pgno * self.psize
            page = self.read_page(pgno, self.psize)
            _, _, flags, lower, upper = _HEADER.unpack_from(page, 0)
            if not flags & (P_BRANCH | P_LEAF) or not PAGE_HEADER <= lower <= upper <= self.psize:
                raise CorruptStoreError(f"page {pgno} is no branch or leaf page: not clearing")
            self.zero_if_set(at + lower, page[lower:upper])
            if flags & P_LEAF2:
                continue
            for i in range((lower - PAGE_HEADER) // 2):
                node = _U16.unpack_from(page, PAGE_HEADER + 2 * i)[0]
                lo, hi, node_flags, ksize = _NODE.unpack_from(page, node)
                if flags & P_BRANCH:
                    stack.append(lo | hi << 16 | node_flags << 32)
                    continue
                size = lo | hi << 16
                data = node + NODE_HEADER + ksize
                if node_flags & F_BIGDATA:
                    ovpgno = _U64.unpack_from(page, data)[0]
                    value = self.overflow(ovpgno, size, wanted=free_lists is not None)
                elif node_flags & F_DUPDATA and not node_flags & F_SUBDATA:  # a sub-page
                    sub_lower, sub_upper = struct.unpack_from("<HH", page, data + 12)
                    self.zero_if_set(
                        at + data + sub_lower, page[data + sub_lower : data + sub_upper]
                    )
                    value = b""
                else:
                    value = page[data : data + size]
                if node_flags & F_SUBDATA:
                    stack.append(_U64.unpack_from(value, DB_ROOT_AT)[0])
                elif free_lists is not None:
                    key = page[node + NODE_HEADER : node + NODE_HEADER + ksize]
                    free_lists.append((_U64.unpack_from(key, 0)[0], value))

    def free_page(self, pgno: int) -> None:
        """Zero a free page; the header LMDB wrote on it (its own number and a page kind, no entry's
        bytes: the zero values of step 1 leave one) is kept, so a cleared page is not written again.
        """
        at = pgno * self.psize
        page = self.read(at, self.psize)
        if len(page) < self.psize:  # LMDB never wrote it (freed in the transaction that took it)
            self.zero_if_set(at, page)
            return
        own, _, flags, _, _ = _HEADER.unpack_from(page, 0)
        headed = own == pgno and flags in (P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF | P_LEAF2)
        skip = PAGE_HEADER if headed else 0
        self.zero_if_set(at + skip, page[skip:])

    def overflow(self, pgno: int, size: int, *, wanted: bool) -> bytes:
        """Clear the unused end of the overflow pages holding a `size`-byte value; the value when
        `wanted` (a free list's), else b""."""
        at = pgno * self.psize
        head = self.read_page(pgno, PAGE_HEADER)
        pages = _U32.unpack_from(head, 12)[0]
        if not _U16.unpack_from(head, 10)[0] & P_OVERFLOW or pages * self.psize < size:
            raise CorruptStoreError(
                f"page {pgno} is no overflow page of {size} bytes: not clearing"
            )
        end = at + PAGE_HEADER + size
        self.zero_if_set(end, self.read(end, at + pages * self.psize - end))
        return self.read(at + PAGE_HEADER, size) if wanted else b""

    def read_page(self, pgno: int, length: int) -> bytes:
        """The start of a page an entry or the free list reaches: LMDB wrote it, so the file has it."""
        page = self.read(pgno * self.psize, length)
        if len(page) < length:
            raise CorruptStoreError(f"page {pgno} lies past the end of the file: not clearing")
        return page

    def read(self, at: int, length: int) -> bytes:
        self.scanned += length
        return os.pread(self.fd, length, at)

    def zero_if_set(self, at: int, found: bytes) -> None:
        if found.count(0) != len(found):
            os.pwrite(self.fd, bytes(len(found)), at)
            self.cleared += len(found)


def _newest(metas: list[bytes]) -> bytes:
    """The meta page of the newest commit (LMDB writes its two in turn)."""
    return max(metas, key=lambda page: _U64.unpack_from(page, META_TXNID)[0])


def _readers_gone(env: lmdb.Environment, txnid: int) -> bool:
    """Wait until no reader sees a snapshot older than `txnid` (the pages it sees stay), at most
    READER_WAIT_S; whether they went."""
    deadline = time.monotonic() + READER_WAIT_S
    delay = 0.001
    while _oldest_reader(env) < txnid:
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


def _oldest_reader(env: lmdb.Environment) -> float:
    """The oldest snapshot a reader holds (inf: none), from LMDB's reader table."""
    oldest = float("inf")
    for line in env.readers().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 3 and fields[2].isdigit():
            oldest = min(oldest, int(fields[2]))
    return oldest
