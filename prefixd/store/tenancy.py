"""Tenancy: which tenant owns each stored identity, share groups, quotas and times to live.

Where each lives:
  * `TenantIndex` (prefixd.store.tenants): the tenant of an identity digest;
  * `Tenancy.namespace`: a tenant of a share group stores and finds entries under the group's
    namespace ("share:GROUP"), so the group's tenants share them and no one else does;
  * `Tenancy.quota_of` / `tenant_bytes`: a tenant's quota and what counts against it (the
    per-identity stored-bytes counters); a put over it evicts the tenant's leaves
    (prefixd.store.put, prefixd.store.eviction);
  * `Tenancy.min_created_ns` and friends: a tenant's time to live, as a creation-time cutoff the
    walk and the gather apply (an expired block is a miss at once); eviction's `reclaim_expired`
    frees them.

Which digests are *live* is never remembered: it is read from the table each time, in the
transaction that acts on it, so a purge, a retirement or an identity written since cannot leave
quotas, totals or TTLs looking at a stale set.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import lmdb

from prefixd.errors import IdentityError
from prefixd.schema.identity import Identity
from prefixd.store import counters
from prefixd.store.config import SHARE_PREFIX, StoreConfig

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext


class Tenancy:
    """One store's tenancy settings, applied: share groups, quotas and times to live."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self.apply(ctx.config)

    def apply(self, config: StoreConfig) -> None:
        """Take `config`'s share groups, quotas and times to live (at open, and when a daemon
        reloads its settings). Each is replaced whole, so a reader sees the old or the new."""
        self._ttl_s = dict(config.tenant_ttls)
        self._quotas = {t: q for t, q in config.tenant_quotas.items() if t != "*"}
        self._default_quota = config.default_quota
        self._share_group = {
            tenant: group for group, tenants in config.share_groups.items() for tenant in tenants
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

    @property
    def expires(self) -> bool:
        """Whether any tenant has a time to live."""
        return bool(self._ttl_s)

    def ttl_cutoff_ns(self, tenant: str, now_ns: int) -> int:
        ttl = self._ttl_s.get(tenant)
        return now_ns - int(ttl * 1e9) if ttl else 0

    def min_created_for(self, txn: lmdb.Transaction, digest: bytes) -> int:
        """`min_created_ns` of the identity with this digest, as `txn` sees it."""
        if not self._ttl_s:
            return 0
        tenant = self._ctx.tenants.tenant_of(txn, digest) or ""
        return self.ttl_cutoff_ns(tenant, self._ctx.clock.time_ns())


__all__ = ["Tenancy"]
