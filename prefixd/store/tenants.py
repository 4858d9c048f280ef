"""digest -> tenant over one store's identities table. A digest covers the tenant, so once decoded
it is remembered; which digests are live is read each time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lmdb

from prefixd.errors import IdentityError
from prefixd.schema.identity import Identity

MEMO_LIMIT = 1 << 16  # digests remembered; past it the memo starts again (rows are re-read)


class TenantIndex:
    def __init__(self, identities: Any) -> None:
        self._identities = identities  # the LMDB database handle of the identities table
        self._memo: dict[bytes, str] = {}

    def tenant_of(self, txn: lmdb.Transaction, digest: bytes) -> str | None:
        """The tenant of the identity `digest` names; None when the table holds none."""
        tenant = self._memo.get(digest)
        if tenant is not None:
            return tenant
        encoded = txn.get(digest, db=self._identities)
        if encoded is None:
            return None
        tenant = owner(encoded, bytes(digest))
        if len(self._memo) >= MEMO_LIMIT:
            self._memo.clear()
        self._memo[bytes(digest)] = tenant
        return tenant

    def forget(self, digests: Iterable[bytes]) -> None:
        """Drop deleted identities, so a purged tenant's name does not outlive its rows."""
        for digest in digests:
            self._memo.pop(digest, None)

    def digests_of(self, txn: lmdb.Transaction, tenant: str) -> set[bytes]:
        cursor = txn.cursor(db=self._identities)
        found = set()
        for key in cursor.iternext(keys=True, values=False):
            digest = bytes(key)
            if self.tenant_of(txn, digest) == tenant:
                found.add(digest)
        return found


def owner(encoded: bytes | memoryview, digest: bytes) -> str:
    """The tenant of the identity row `digest` keeps ("" when unreadable: `check` reports it)."""
    try:
        return Identity.decode(bytes(encoded), digest).tenant
    except IdentityError:
        return ""
