"""The client at the other end of one connection, as handlers see it: its uid, groups and grant,
whether it is still admitted and said hello, its regions and pins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from prefixd.config.policy import EVERYTHING, Grant
from prefixd.errors import ProtocolError
from prefixd.wire.errors import ErrorCode
from prefixd.wire.region import MappedRegion


class Pins:
    """The blocks one connection pinned, by the tenant it named: a reload that takes a tenant from
    the peer releases that tenant's pins, the connection's end all of them. A block of a share group
    may be pinned under several of its tenants."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, Counter[bytes]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_tenant)

    def hold(self, tenant: str, blocks: Iterable[bytes]) -> None:
        held = self._by_tenant.setdefault(tenant, Counter())
        held.update(blocks)
        if not held:
            del self._by_tenant[tenant]

    def release(self, tenant: str, blocks: Iterable[bytes]) -> list[bytes]:
        """One pin of each block this connection holds, the named tenant's first (else one another
        tenant of its share group took); the blocks released."""
        released = []
        for block in blocks:
            for name in (tenant, *self._by_tenant):
                held = self._by_tenant.get(name)
                if held is not None and held[block] > 0:
                    held[block] -= 1
                    if not held[block]:
                        del held[block]
                        if not held:
                            del self._by_tenant[name]
                    released.append(block)
                    break
        return released

    def drop(self, keep: Callable[[str], bool] = lambda tenant: False) -> list[bytes]:
        """Forget every pin of the tenants not kept; each pin's block, once per pin."""
        dropped = [name for name in self._by_tenant if not keep(name)]
        return [block for name in dropped for block in self._by_tenant.pop(name).elements()]


class Peer:
    def __init__(
        self,
        uid: int,
        grant: Grant = EVERYTHING,
        *,
        max_inflight: int,
        groups: Iterable[int] = (),
    ) -> None:
        self.uid = uid
        self.groups = frozenset(groups)  # as at connect: a reload judges the peer again by them
        self.grant = grant  # what the tenant policy lets this peer do (a reload may narrow it)
        self.admitted = True  # False once a reload took it off the socket: every request refused
        self.max_inflight = max_inflight
        self.greeted = False
        self.regions: dict[int, MappedRegion] = {}
        self.pins = Pins()  # blocks this client pinned (released at its end)
        self._next_region = 1

    def add_region(self, region: MappedRegion) -> int:
        region_id = self._next_region
        self._next_region += 1
        self.regions[region_id] = region
        return region_id

    def region(self, region_id: int) -> MappedRegion:
        region = self.regions.get(region_id)
        if region is None:
            raise ProtocolError(ErrorCode.BAD_REGION, f"no region {region_id} on this connection")
        return region

    def span(self, span: tuple[int, int, int]) -> memoryview:
        region_id, offset, length = span
        return self.region(region_id).span(offset, length)

    def close_regions(self) -> None:
        for region in self.regions.values():
            region.close()  # a copy still running on a pool thread keeps the mapping alive
        self.regions.clear()
