"""Tenancy: which tenant owns each stored identity, share groups, quotas and times to live.

Where each lives:
  * `TenantIndex`: the tenant of an identity digest, read from the identities table in the
    caller's own transaction;
  * `Tenancy.namespace`: a tenant of a share group stores and finds entries under the group's
    namespace ("share:GROUP"), so the group's tenants share them and no one else does;
  * `Tenancy.quota_of` / `tenant_bytes`: a tenant's quota and what counts against it (the
    per-identity stored-bytes counters); a put over it evicts the tenant's leaves
    (prefixd.store.put, prefixd.store.eviction);
  * `Tenancy.min_created_ns` and friends: a tenant's time to live, as a creation-time cutoff the
    walk and the gather apply (an expired block is a miss at once); `reclaim_expired` frees them.

An identity's digest is a hash over all of it, tenant included, so the tenant of a digest can
never change: once decoded it is remembered. Which digests are *live* is never remembered: it is
read from the table each time, in the transaction that acts on it, so a purge, a retirement or an
identity written since cannot leave quotas, totals or TTLs looking at a stale set.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import lmdb

from prefixd.errors import CorruptRecordError, IdentityError
from prefixd.schema.identity import Identity
from prefixd.schema.records import BlockRecord
from prefixd.store import counters
from prefixd.store.config import (
    SHARE_PREFIX,
    StoreConfig,
    parse_share_groups,
    parse_tenant_durations,
    parse_tenant_quotas,
)
from prefixd.store.journal import writing
from prefixd.store.removal import remove_subtree

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

MEMO_LIMIT = 1 << 16  # digests remembered; past it the memo starts again (rows are re-read)


class TenantIndex:
    """digest -> tenant over one store's identities table."""

    def __init__(self, identities: Any) -> None:
        self._identities = identities  # the LMDB database handle of the identities table
        self._memo: dict[bytes, str] = {}

    def tenant_of(self, txn: lmdb.Transaction, digest: bytes) -> str | None:
        """The tenant of the identity `digest` names, or None when the table holds no such
        identity (it was purged or never written)."""
        tenant = self._memo.get(digest)
        if tenant is not None:
            return tenant
        encoded = txn.get(digest, db=self._identities)
        if encoded is None:
            return None
        tenant = owner(encoded)
        if len(self._memo) >= MEMO_LIMIT:
            self._memo.clear()
        self._memo[bytes(digest)] = tenant
        return tenant

    def digests_of(self, txn: lmdb.Transaction, tenant: str) -> set[bytes]:
        """The digests of the tenant's live identities, as this transaction sees them."""
        cursor = txn.cursor(db=self._identities)
        found = set()
        for key in cursor.iternext(keys=True, values=False):
            digest = bytes(key)
            if self.tenant_of(txn, digest) == tenant:
                found.add(digest)
        return found


def owner(encoded: bytes | memoryview) -> str:
    """The tenant of an encoded identity ("" when it is unreadable: `check` reports that row)."""
    try:
        return Identity.decode(bytes(encoded)).tenant
    except IdentityError:
        return ""


class Tenancy:
    """One store's tenancy settings, applied: share groups, quotas and times to live."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self.apply(ctx.config)

    def apply(self, config: StoreConfig) -> None:
        """Take `config`'s share groups, quotas and times to live (at open, and when a daemon
        reloads its settings). Each is replaced whole, so a reader sees the old or the new."""
        self._ttl_s = parse_tenant_durations(config.tenant_ttls)
        self._quotas = parse_tenant_quotas(config.tenant_quotas)
        self._default_quota = config.tenant_quota_bytes
        self._share_group = {
            tenant: group
            for group, tenants in parse_share_groups(config.share_groups).items()
            for tenant in tenants
        }
        self._shared: dict[Identity, Identity] = {}

    # --- share groups ---------------------------------------------------------------------------

    def namespace(self, identity: Identity, hashes: bytes | None) -> tuple[Identity, bytes | None]:
        """The identity entries are stored under: a tenant of a share group stores and finds
        them under the group's namespace (and its own chain hashes do not apply there)."""
        if identity.tenant.startswith(SHARE_PREFIX):
            raise IdentityError("tenant", f"names starting with {SHARE_PREFIX!r} are reserved")
        group = self._share_group.get(identity.tenant)
        if group is None:
            return identity, hashes
        shared = self._shared.get(identity)
        if shared is None:
            shared = dataclasses.replace(identity, tenant=SHARE_PREFIX + group)
            self._shared[identity] = shared
        return shared, None

    def stored_as(self, tenant: str) -> str:
        """The tenant name `tenant`'s entries are stored under (its group's, in a share group)."""
        if tenant.startswith(SHARE_PREFIX):
            raise IdentityError("tenant", f"names starting with {SHARE_PREFIX!r} are reserved")
        group = self._share_group.get(tenant)
        return tenant if group is None else SHARE_PREFIX + group

    # --- quotas ---------------------------------------------------------------------------------

    def quota_of(self, tenant: str) -> int:
        """The tenant's quota in stored bytes (0: none)."""
        return self._quotas.get(tenant, self._default_quota)

    def tenant_bytes(self, tenant: str) -> int:
        """Stored bytes of every identity of `tenant` (what its quota limits)."""
        with self._ctx.env.begin() as txn:
            return self.stored_bytes(txn, self._ctx.tenants.digests_of(txn, tenant))

    def stored_bytes(self, txn: lmdb.Transaction, digests: set[bytes]) -> int:
        """Stored bytes of these identities, as `txn` sees them."""
        db = self._ctx.tables.counters
        return sum(counters.read(txn, db, counters.identity_stored(d)) for d in digests)

    def tenant_totals(self) -> dict[str, dict[str, int]]:
        """Stored blocks and bytes per tenant (from the per-identity counters)."""
        ctx = self._ctx
        totals: dict[str, dict[str, int]] = {}
        with ctx.env.begin() as txn:
            stored = counters.read_prefixed(txn, ctx.tables.counters, counters.IDENTITY_STORED)
            blocks = counters.read_prefixed(txn, ctx.tables.counters, counters.IDENTITY_BLOCKS)
            for digest in stored.keys() | blocks.keys():
                n_blocks, n_bytes = blocks.get(digest, 0), stored.get(digest, 0)
                owner = ctx.tenants.tenant_of(txn, digest)
                if owner is None and not (n_blocks or n_bytes):
                    continue  # the spent counters of a purged identity
                tenant = totals.setdefault(owner or "", {"blocks": 0, "stored_bytes": 0})
                tenant["blocks"] += n_blocks
                tenant["stored_bytes"] += n_bytes
        return totals

    # --- times to live --------------------------------------------------------------------------

    def min_created_ns(self, identity: Identity) -> int:
        """Blocks created before this are past the tenant's time to live (0: no limit)."""
        return self.ttl_cutoff_ns(identity.tenant, self._ctx.clock.time_ns())

    def ttl_cutoff_ns(self, tenant: str, now_ns: int) -> int:
        ttl = self._ttl_s.get(tenant)
        return now_ns - int(ttl * 1e9) if ttl else 0

    def min_created_for(self, txn: lmdb.Transaction, digest: bytes) -> int:
        """`min_created_ns` of the identity with this digest, as `txn` sees it."""
        if not self._ttl_s:
            return 0
        tenant = self._ctx.tenants.tenant_of(txn, digest) or ""
        return self.ttl_cutoff_ns(tenant, self._ctx.clock.time_ns())

    def reclaim_expired(self) -> int:
        """Remove the blocks past their tenant's time to live (already unreachable: lookups and
        loads skip them); return how many went."""
        if not self._ttl_s:
            return 0
        ctx = self._ctx
        now = ctx.clock.time_ns()
        removed = 0
        with writing(ctx) as txn:
            expired = []
            for key, raw in txn.cursor(db=ctx.tables.blocks):
                try:
                    record = BlockRecord.decode(raw)
                except CorruptRecordError:
                    continue
                tenant = ctx.tenants.tenant_of(txn, record.identity) or ""
                if record.created_ns < self.ttl_cutoff_ns(tenant, now):
                    expired.append(bytes(key))
            for block in expired:
                removed += remove_subtree(ctx, txn, block, reason="expired")
        if removed:
            log.info("reclaimed %d expired block(s)", removed)
        return removed


__all__ = ["Tenancy", "TenantIndex", "owner"]
