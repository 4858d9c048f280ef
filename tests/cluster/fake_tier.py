"""A tier in a dict for prefixd.cluster.tier_child, opened in the child by `open_fake_tier`:
fast, and able to misbehave on demand the way Mooncake's client does (a call that holds the GIL,
a call that waits until it is released, a close that holds the GIL)."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

from prefixd.errors import TierFullError, TierTransferError, TierUnavailableError, TierValueError
from tests.cluster.memory_tier import MemoryTier

HOLD_GIL = "hold-the-gil"  # a put of this key holds the child's GIL for good
HOLD = "hold"  # a put of this key waits, the GIL released, until a put of RELEASE
RELEASE = "release"
LOGGED = "prefixd-logged-"  # a put of a key starting so logs it, as Mooncake's errors do


def _hold_gil(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)  # a C call through PyDLL keeps the GIL


class FakeTier(MemoryTier):
    """MemoryTier with the rest of SharedTier's calls, and misbehaviour on demand."""

    def __init__(self, close_holds_gil: bool = False) -> None:
        super().__init__()
        self.close_holds_gil = close_holds_gil
        self.released = threading.Event()

    def connect(self) -> None:
        pass

    def put(self, key: str, value: Any, *, overwrite: bool = False) -> None:
        if key == HOLD_GIL:
            _hold_gil(3600)
        if key == HOLD:
            self.released.wait()
        if key == RELEASE:
            self.released.set()
        if key == "bad":
            raise TierValueError("the key is bad", -600)
        if key == "full":
            raise TierFullError("no room", -200)
        if key == "lost":
            raise TierTransferError("transfer failed", -800)
        if key == "unavail":
            raise TierUnavailableError("no answer within 1.0 s")
        if key.startswith(LOGGED):  # as Mooncake's client logs a failed put, on its stderr
            os.write(2, f"E1206 client_service.cpp:1893] put failed for key={key}: RPC\n".encode())
        super().put(key, bytes(value), overwrite=overwrite)

    def get_into(self, key: str, buffer: Any) -> int | None:
        return super().get_into(key, memoryview(buffer).cast("B"))  # type: ignore[arg-type]

    def get_many_into(self, keys: Sequence[str], buffer: Any, capacity: int) -> list[int | None]:
        return super().get_many_into(list(keys), memoryview(buffer).cast("B"), capacity)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.objects for k in keys]

    def remove(self, key: str, *, force: bool = True) -> bool:
        return self.objects.pop(key, None) is not None

    def close(self) -> None:
        if self.close_holds_gil:
            _hold_gil(3600)


def open_fake_tier(**settings: Any) -> FakeTier:
    if settings.get("pid_file"):
        with open(settings.pop("pid_file"), "w") as f:
            f.write(str(os.getpid()))
    return FakeTier(**settings)
