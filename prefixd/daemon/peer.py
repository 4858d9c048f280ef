"""The client at the other end of one connection, as handlers see it: its uid and grant, whether it
said hello, its regions and pins.
"""

from __future__ import annotations

from collections import Counter

from prefixd.config.policy import EVERYTHING, Grant
from prefixd.errors import ProtocolError
from prefixd.wire.errors import ErrorCode
from prefixd.wire.region import MappedRegion


class Peer:
    def __init__(self, uid: int, grant: Grant = EVERYTHING, *, max_inflight: int) -> None:
        self.uid = uid
        self.grant = grant  # what the tenant policy lets this peer do
        self.max_inflight = max_inflight
        self.greeted = False
        self.regions: dict[int, MappedRegion] = {}
        self.pins: Counter[bytes] = Counter()  # blocks this client pinned (released at its end)
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
