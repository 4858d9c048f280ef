"""Verified payloads held in the scheduler's shared region between a lookup's hit and the load.

vLLM's offloading connector cannot take back a hit: a load job that fails stops the engine. So the
direct spec answers a hit only for chunks whose payloads the daemon has already verified into this
process's region (`Held`), and keeps them there until the worker has copied them into the KV cache.
The worker maps the same memfd through /proc (`Exported` names it: pid, a descriptor kept open for
as long as anything is held in it, and its inode, which the worker checks), so a daemon that
restarts or a connection that is made again never changes bytes a spec already points at.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from prefixd.client.results import Loaded
from prefixd.wire.region import SharedRegion


@dataclass(frozen=True)
class RegionRef:
    """How a worker finds a region: /proc/{pid}/fd/{fd}, which must be the memfd `inode`."""

    pid: int
    fd: int
    inode: int
    size: int


class Exported:
    """A client's region kept open for workers (a duplicate descriptor) while chunks are held."""

    def __init__(self, region: SharedRegion, owners: Exports) -> None:
        self.fd = os.dup(region.fd)
        self.ref = RegionRef(os.getpid(), self.fd, os.fstat(self.fd).st_ino, region.size)
        self.region = region
        self.owners = owners
        self.holds = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Held:
    """The first `chunks` payloads of one load (one group, one rank), verified; released with
    the last of them."""

    def __init__(self, loaded: Loaded, exported: Exported, chunks: int) -> None:
        self.loaded = loaded
        self.exported = exported
        self._chunks = chunks  # at least one: a load of none is never held

    def entry(self, index: int) -> tuple[RegionRef, int, int]:
        """Chunk `index` of the load: its region, offset and size."""
        return self.exported.ref, self.loaded.offsets[index], self.loaded.sizes[index]

    def drop(self) -> None:
        self._chunks -= 1
        if self._chunks == 0:
            self.loaded.release()
            self.exported.owners.unhold(self.exported)


class Exports:
    """The regions workers may be told of: the current client's, and older ones still held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held on the staging thread, dropped on vLLM's
        self._current: Exported | None = None
        self._older: list[Exported] = []

    def of(self, loaded: Loaded) -> Exported:
        """The export of the region `loaded` lies in, holding one more load."""
        assert loaded.lease is not None  # a load's payloads always lie in a lease
        region = loaded.lease.allocator.region
        with self._lock:
            current = self._current
            if current is None or current.region is not region:
                if current is not None:
                    self._retire(current)
                current = self._current = Exported(region, self)
            current.holds += 1
            return current

    def unhold(self, exported: Exported) -> None:
        with self._lock:
            exported.holds -= 1
            if exported is not self._current and exported.holds <= 0:
                self._older.remove(exported)
                exported.close()

    def close(self) -> None:
        with self._lock:
            for exported in [*self._older, *([self._current] if self._current else [])]:
                exported.close()
            self._older.clear()
            self._current = None

    def _retire(self, exported: Exported) -> None:
        if exported.holds > 0:
            self._older.append(exported)
        else:
            exported.close()


__all__ = ["Exported", "Exports", "Held", "RegionRef"]
