"""The steps a client call yields to the shell that drives it (in the manner of h11's sans-I/O
core), and the lease bookkeeping every call shares:

- `Reserve(allocator, nbytes)`: the shell waits for region space (a thread blocks, a task
  awaits) and sends back the `Lease`;
- `Call(message, spans)`: the shell sends one request and sends back its reply (an error reply is
  raised into the generator as its exception class); `spans` are the leased region spans the
  request names, kept out of use until its reply arrives;
- `Synchronize(event)`: the shell waits for a CUDA event (copies to or from a device).

A generator releases what it leased in `finally` blocks, so an error, a timeout or a cancelled
task never leaks space, and never frees space a request in flight still names (see leases.py).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
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


class Synchronize(NamedTuple):
    """Wait until a CUDA event has completed."""

    event: Any


Step = Call | Reserve | Synchronize
Steps = Generator[Step, Any, T]


def spans_of(leases: Sequence[Lease | Span]) -> tuple[Span, ...]:
    """The spans held leases and spans cover, as a `Call` names them."""
    return tuple(lease.span for lease in leases)


def release_all(leases: Sequence[Lease | Span]) -> None:
    """Give back what a call held, once its reply is in (or it failed)."""
    for lease in leases:
        lease.release()


def unpacked(packed: bytes) -> tuple[int, ...]:
    """Sizes or offsets a reply packs as little-endian u64s."""
    return tuple(np.frombuffer(packed, "<u8").tolist())
