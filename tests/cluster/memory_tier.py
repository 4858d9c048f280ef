"""An in-memory shared tier with Mooncake's put semantics, and two bridged stores over it."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixd import Store
from prefixd.cluster.bridge import SharedTierBridge
from prefixd.errors import TierFullError, TierUnavailableError

from ..must_check import assert_store_checks, checks_on_teardown


class MemoryTier:
    """A shared tier in a dict; `down` makes every call fail as an unreachable tier would, `full`
    every put as a pool without room would."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False
        self.full = False
        self.calls: Counter[str] = Counter()  # round trips by kind
        self.fail_after = -1  # calls that succeed before every call fails (-1: no such limit)

    def _check(self, call: str = "") -> None:
        self.calls[call] += 1
        if self.fail_after == 0:
            self.down = True
        self.fail_after -= 1
        if self.down:
            raise TierUnavailableError("shared tier unavailable")

    def put(self, key: str, value: bytes, *, overwrite: bool = False) -> None:
        self._check()
        if self.full:
            raise TierFullError("put failed: NO_AVAILABLE_HANDLE (-200)", -200)
        if overwrite or key not in self.objects:  # Mooncake's put keeps the first value
            self.objects[key] = bytes(value)

    def get(self, key: str) -> bytes | None:
        self._check()
        return self.objects.get(key)

    def size(self, key: str) -> int | None:
        self._check("size")
        value = self.objects.get(key)
        return None if value is None else len(value)

    def get_into(self, key: str, buffer: bytearray) -> int | None:
        self._check("get_into")
        value = self.objects.get(key)
        if value is None:
            return None
        buffer[: len(value)] = value
        return len(value)

    def get_many_into(self, keys: list[str], buffer: memoryview, capacity: int) -> list[int | None]:
        self._check("get_many_into")
        out: list[int | None] = []
        for i, key in enumerate(keys):
            value = self.objects.get(key)
            if value is None or len(value) > capacity:
                out.append(None if value is None else -1)
                continue
            buffer[i * capacity : i * capacity + len(value)] = value
            out.append(len(value))
        return out

    in_flight = 0

    def buffer(self, size: int) -> memoryview:
        return memoryview(bytearray(size))

    def release(self, view: memoryview) -> None:
        pass

    def remove_prefix(self, prefix: str, *, force: bool = True) -> int:
        self._check()
        gone = [k for k in self.objects if k.startswith(prefix)]
        for key in gone:
            del self.objects[key]
        return len(gone)

    def close(self) -> None:
        pass


Nodes = tuple[MemoryTier, list[Store], list[SharedTierBridge]]


@contextlib.contextmanager
def two_nodes(path: Path, *, check: bool = False, **settings: Any) -> Iterator[Nodes]:
    """Two stores (`settings`: their StoreConfig fields), each with a started bridge to one
    MemoryTier; at the end the bridges stop, then (`check`) the stores must check clean, and
    they close."""
    tier = MemoryTier()
    stores = [Store.open(path / name, map_size=64 << 20, **settings) for name in ("a", "b")]
    bridges = [SharedTierBridge(s, tier, pending=64, prefill_tokens_per_s=1000.0) for s in stores]
    try:
        for bridge in bridges:
            bridge.start()
        yield tier, stores, bridges
    finally:
        for bridge in bridges:
            bridge.stop(timeout_s=0.5)
        try:
            for store in stores if check else ():
                assert_store_checks(store)
        finally:
            for store in stores:
                store.close()


@pytest.fixture
def nodes(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Nodes]:
    with two_nodes(tmp_path, check=checks_on_teardown(request)) as made:
        yield made
