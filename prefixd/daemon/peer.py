"""The client at the other end of one connection, as handlers see it: its uid, groups and grant,
whether it is still admitted and said hello, its regions and pins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from prefixd.config.policy import EVERYTHING, Grant
from prefixd.errors import ProtocolError
from prefixd.wire.errors import ErrorCode
from prefixd.wire.region import MappedRegion


class Pins:
    """The blocks one connection pinned, each with the tenants it named: a reload that takes a
    tenant from the peer releases that tenant's pins, the connection's end all of them. A block of
    a share group may be pinned under several of its tenants. Kept by block, so that an unpin of
    many blocks costs one probe each, however many tenants hold pins. `pinned`: the bytes each
    tenant's pins hold, over every connection (the daemon's PIN_SHARE limit weighs them)."""

    def __init__(self, pinned: Counter[str] | None = None) -> None:
        self._by_block: dict[bytes, Counter[str]] = {}
        self._sizes: dict[bytes, int] = {}  # each pinned block's stored bytes
        self.pinned: Counter[str] = Counter() if pinned is None else pinned

    def __bool__(self) -> bool:
        return bool(self._by_block)

    def __contains__(self, block: bytes) -> bool:
        """Whether the connection holds a pin of `block` (a dict probe, safe from a pool thread)."""
        return block in self._by_block

    def hold(self, tenant: str, blocks: Iterable[bytes], sizes: Iterable[int] = ()) -> None:
        """Pin `blocks` for `tenant`; `sizes`: their stored bytes (none given: 0 each)."""
        sized = iter(sizes)
        for block in blocks:
            self._by_block.setdefault(block, Counter())[tenant] += 1
            size = self._sizes[block] = next(sized, self._sizes.get(block, 0))
            self.pinned[tenant] += size

    def release(self, tenant: str, blocks: Iterable[bytes]) -> list[bytes]:
        """One pin of each block this connection holds, the named tenant's first (else one another
        tenant of its share group took); the blocks released."""
        released = []
        for block in blocks:
            tenants = self._by_block.get(block)
            if tenants is None:
                continue
            name = tenant if tenant in tenants else next(iter(tenants))
            self._unpinned(block, name, 1)
            released.append(block)
        return released

    def drop(self, keep: Callable[[str], bool] = lambda tenant: False) -> list[bytes]:
        """Forget every pin of the tenants not kept; each pin's block, once per pin."""
        dropped = []
        for block, tenants in list(self._by_block.items()):
            for name in [name for name in tenants if not keep(name)]:
                count = tenants[name]
                self._unpinned(block, name, count)
                dropped += [block] * count
        return dropped

    def _unpinned(self, block: bytes, tenant: str, count: int) -> None:
        tenants = self._by_block[block]
        tenants[tenant] -= count
        self.pinned[tenant] -= count * self._sizes[block]
        if self.pinned[tenant] <= 0:
            del self.pinned[tenant]
        if not tenants[tenant]:
            del tenants[tenant]
            if not tenants:
                del self._by_block[block]
                del self._sizes[block]


class Peer:
    def __init__(
        self,
        uid: int,
        grant: Grant = EVERYTHING,
        *,
        max_inflight: int,
        groups: Iterable[int] = (),
        pinned: Counter[str] | None = None,
    ) -> None:
        """`pinned`: the bytes each tenant's pins hold, over every connection (Pins)."""
        self.uid = uid
        self.groups = frozenset(groups)  # as at connect: a reload judges the peer again by them
        self.grant = grant  # what the tenant policy lets this peer do (a reload may narrow it)
        self.admitted = True  # False once a reload took it off the socket: every request refused
        self.max_inflight = max_inflight
        self.greeted = False
        self.regions: dict[int, MappedRegion] = {}
        self.attaching = 0  # attaches mapping their region now
        self.pins = Pins(pinned)  # blocks this client pinned (released at its end)
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

    def payloads(self, spans: Sequence[tuple[int, int, int]]) -> list[memoryview]:
        """A put's payload spans. They may overlap, but not name more bytes than their regions
        hold: else one small frame would store its region many times over."""
        views = [self.span(span) for span in spans]
        named, room = sum(map(len, views)), sum(self.regions[r].size for r in {s[0] for s in spans})
        if named > room:
            raise ProtocolError(
                ErrorCode.BAD_REGION,
                f"the spans name {named} bytes, more than the {room} of their regions",
            )
        return views

    def close_regions(self) -> None:
        for region in self.regions.values():
            region.close()  # a copy still running on a pool thread keeps the mapping alive
        self.regions.clear()
