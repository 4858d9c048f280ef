"""Who may act for which tenant: the tenant policy (`--tenant-policy`).

Being allowed on the socket (`--allowed-uids`, `--allowed-gids`) is not the same as being allowed
to use every tenant's entries. With a policy, each peer gets the union of the grants of its uid
and its groups: the tenants it may use (store, look up, load) and the administrative operations
it may run. Root and the daemon's own uid may do everything, as may every peer when no policy is
set (a single-engine node works unchanged; `prefixd serve` warns when other uids are allowed
without one).

An entry is `uid:N=GRANT+GRANT...` or `gid:N=...`; a grant is a tenant name, `*` (every
tenant), or `op:NAME` for an administrative operation: `purge`, `retire` (a hello's `serves`),
`verify`, `hot` (the hottest prefixes, which show a tenant's prompts), or `op:*`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from prefixd.errors import ConfigError

ADMIN_OPS = frozenset({"purge", "retire", "verify", "hot"})


@dataclass(frozen=True)
class Grant:
    """What one peer may do: `tenants` None means every tenant."""

    tenants: frozenset[str] | None
    ops: frozenset[str]

    def may_use(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants

    def may_run(self, op: str) -> bool:
        return op in self.ops


EVERYTHING = Grant(None, ADMIN_OPS)
NOTHING = Grant(frozenset(), frozenset())


class TenantPolicy:
    """The parsed `--tenant-policy` entries."""

    def __init__(self, entries: Sequence[str], daemon_uid: int) -> None:
        self.daemon_uid = daemon_uid
        self.uids: dict[int, Grant] = {}
        self.gids: dict[int, Grant] = {}
        for entry in entries:
            principal, sep, grants = entry.partition("=")
            kind, colon, number = principal.strip().partition(":")
            if not sep or not colon or kind not in ("uid", "gid") or not number.isdigit():
                raise ConfigError(
                    f"tenant_policy: {entry!r} is not uid:N=GRANT[+GRANT...] or gid:N=..."
                )
            table = self.uids if kind == "uid" else self.gids
            table[int(number)] = _union(table.get(int(number), NOTHING), _grant(entry, grants))

    @property
    def configured(self) -> bool:
        return bool(self.uids or self.gids)

    def grant_for(self, uid: int, gids: Collection[int]) -> Grant:
        """The union of the grants of `uid` and of its groups."""
        if not self.configured or uid in (0, self.daemon_uid):
            return EVERYTHING
        grant = self.uids.get(uid, NOTHING)
        for gid in gids:
            grant = _union(grant, self.gids.get(gid, NOTHING))
        return grant


def _grant(entry: str, text: str) -> Grant:
    tenants: set[str] | None = set()
    ops: set[str] = set()
    for item in (part.strip() for part in text.split("+")):
        if not item:
            raise ConfigError(f"tenant_policy: {entry!r} has an empty grant")
        if item.startswith("op:"):
            name = item[3:]
            if name == "*":
                ops |= ADMIN_OPS
            elif name in ADMIN_OPS:
                ops.add(name)
            else:
                raise ConfigError(
                    f"tenant_policy: {entry!r}: unknown operation {name!r} "
                    f"(one of {', '.join(sorted(ADMIN_OPS))}, or *)"
                )
        elif item == "*":
            tenants = None
        elif tenants is not None:
            tenants.add(item)
    return Grant(None if tenants is None else frozenset(tenants), frozenset(ops))


def _union(a: Grant, b: Grant) -> Grant:
    tenants = None if a.tenants is None or b.tenants is None else a.tenants | b.tenants
    return Grant(tenants, a.ops | b.ops)


__all__ = ["ADMIN_OPS", "EVERYTHING", "NOTHING", "Grant", "TenantPolicy"]
