"""The steps a client call yields to the shell that drives it (sans-I/O, as in h11), and the
lease bookkeeping every call shares. A call releases what it leased in `finally` blocks, so an
error, a timeout or a cancelled task never leaks space, nor frees space a request in flight still
names (see leases.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from prefixd.client.leases import Lease, RegionAllocator, Span
from prefixd.wire import messages as wire

T = TypeVar("T")


class Call(NamedTuple):
    """Send `message` (with `fds` attached) and return its reply: the typed reply of a typed
    request (prefixd.wire.messages), or the map of a raw one (a dict, given its id on sending)."""

    message: wire.RequestMessage | dict[str, Any]
    spans: tuple[Span, ...] = ()
    fds: tuple[int, ...] = ()
    # Whether the call alone holds `spans` (so no one can release them while a blocking shell
    # waits for the reply); False for spans a caller leased and may release from another thread.
    owned: bool = True


class Reserve(NamedTuple):
    """Lease `nbytes` of `allocator`'s region (with `largest`: the largest free span of at least
    `nbytes`), waiting for space up to the client's timeout."""

    allocator: RegionAllocator
    nbytes: int
    largest: bool = False

    @classmethod
    def up_to(cls, allocator: RegionAllocator, length: int | None) -> Reserve:
        """`length` bytes, or with None all the free space there is (the largest span)."""
        return cls(allocator, 1, largest=True) if length is None else cls(allocator, max(length, 1))


class Synchronize(NamedTuple):
    """Wait until a CUDA event has completed."""

    event: Any


class Publish(NamedTuple):
    """The client's publisher of stores from tensors, of at least `region_bytes` (Publishers)."""

    region_bytes: int


Step = Call | Reserve | Synchronize | Publish
Steps = Generator[Step, Any, T]


def spans_of(leases: Sequence[Lease | Span]) -> tuple[Span, ...]:
    """The spans held leases and spans cover, as a `Call` names them."""
    return tuple(lease.span for lease in leases)


@contextlib.contextmanager
def holding() -> Iterator[list[Lease | Span]]:
    """What a call holds until its reply is in (or it failed), released on the way out."""
    held: list[Lease | Span] = []
    try:
        yield held
    finally:
        for lease in held:
            lease.release()


@contextlib.contextmanager
def released_on_error(lease: Lease) -> Iterator[Lease]:
    """`lease`, released when the block fails (else its caller keeps it)."""
    try:
        yield lease
    except BaseException:
        lease.release()
        raise


def unpacked(packed: bytes) -> tuple[int, ...]:
    """Sizes or offsets a reply packs as little-endian u64s."""
    return tuple(np.frombuffer(packed, "<u8").tolist())
