"""Tenancy: share groups, quotas and times to live of one store.

Which digests are live is never remembered: it is read in the transaction that acts on it, so a
purge or an identity written since cannot leave quotas, totals or TTLs looking at a stale set."""

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
    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self.apply(ctx.config)

    def apply(self, config: StoreConfig) -> None:
        """Take `config`'s share groups, quotas and times to live; each is replaced whole, so a
        reader sees the old or the new."""
        self._ttl_s = dict(config.tenant_ttls)
        self._quotas = {t: q for t, q in config.tenant_quotas.items() if t != "*"}
        self._default_quota = config.default_quota
        self._share_group = {
            tenant: group for group, tenants in config.share_groups.items() for tenant in tenants
        }
        self._shared: dict[Identity, Identity] = {}

    def namespace(self, identity: Identity, hashes: bytes | None) -> tuple[Identity, bytes | None]:
        """The identity entries are stored under: a share group's tenants store them under the
        group's namespace (where their own chain hashes do not apply)."""
        stored_as = self.stored_as(identity.tenant)
        if stored_as == identity.tenant:
            return identity, hashes
        shared = self._shared.get(identity)
        if shared is None:
            shared = self._shared[identity] = dataclasses.replace(identity, tenant=stored_as)
        return shared, None

    def stored_as(self, tenant: str) -> str:
        if tenant.startswith(SHARE_PREFIX):
            raise IdentityError("tenant", f"names starting with {SHARE_PREFIX!r} are reserved")
        group = self._share_group.get(tenant)
        return tenant if group is None else SHARE_PREFIX + group

    def quota_of(self, tenant: str) -> int:
        """The tenant's quota in stored bytes (0: none)."""
        return self._quotas.get(tenant, self._default_quota)

    def tenant_bytes(self, tenant: str) -> int:
        with self._ctx.env.begin() as txn:
            return self.stored_bytes(txn, self._ctx.tenants.digests_of(txn, tenant))

    def stored_bytes(self, txn: lmdb.Transaction, digests: set[bytes]) -> int:
        db = self._ctx.tables.counters
        return sum(counters.read(txn, db, counters.identity_stored(d)) for d in digests)

    def tenant_totals(self) -> dict[str, dict[str, int]]:
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

    def min_created_ns(self, identity: Identity) -> int:
        """Blocks created before this are past the tenant's time to live (0: no limit)."""
        return self.ttl_cutoff_ns(identity.tenant, self._ctx.clock.time_ns())

    @property
    def expires(self) -> bool:
        return bool(self._ttl_s)

    def ttl_cutoff_ns(self, tenant: str, now_ns: int) -> int:
        ttl = self._ttl_s.get(tenant)
        return now_ns - int(ttl * 1e9) if ttl else 0

    def min_created_for(self, txn: lmdb.Transaction, digest: bytes) -> int:
        if not self._ttl_s:
            return 0
        tenant = self._ctx.tenants.tenant_of(txn, digest) or ""
        return self.ttl_cutoff_ns(tenant, self._ctx.clock.time_ns())
