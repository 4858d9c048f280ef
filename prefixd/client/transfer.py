"""The torch side of the loads into tensors (prefixd.client.tensors) and of `store_from`.

A load streams through `slots` staging slots of the region: the daemon verifies batch k into slot
k % slots while batch k-1 is copied out, so verification overlaps the copies. On CUDA the region
is pinned and the copies run on a dedicated stream, one event per slot saying when it may be
written again, so the engine's stream never waits; without CUDA the same pipeline runs with
synchronous copies, so every test runs everywhere. A slot is copied only after the reply that
says its bytes passed their checksums.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

try:
    import torch
except ModuleNotFoundError as missing:  # serving does not need torch: it is an extra
    if missing.name != "torch":
        raise
    raise ModuleNotFoundError(
        "prefixd.client.transfer needs torch, which the base install leaves out: "
        "pip install 'prefixd[gpu]' (or any torch >= 2.4)",
        name="torch",
    ) from missing

from prefixd.client.operations import Drives, put_spans, reserve
from prefixd.errors import DestinationError
from prefixd.schema.content import chain_words
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import PromptIds

if TYPE_CHECKING:
    from prefixd.client.leases import Lease
    from prefixd.client.results import Stored

log = logging.getLogger(__name__)


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One dedicated copy stream per device, for the life of the process."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch leaves these untyped


class Copier:
    """Copies between a lease's slots and tensors (on CUDA: a dedicated stream, an event per
    slot)."""

    def __init__(self, lease: Lease, slots: int, slot_bytes: int, device: torch.device) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.cuda = device.type == "cuda"
        self._host = torch.frombuffer(lease.view, dtype=torch.uint8) if lease.size else None
        self.stream: torch.cuda.Stream | None = None
        self._events: list[torch.cuda.Event | None] = [None] * slots
        if self.cuda:
            if not lease.allocator.region.pin():
                log.warning("the region could not be pinned: copies to the GPU will be slower")
            self.stream = _copy_stream(device)

    def begin(self) -> None:
        """Order the copies after what the caller's stream has queued (destinations it wrote or
        allocated, sources it computed)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def slot_offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def reuse(self, slot: int) -> torch.cuda.Event | None:
        """The event to wait for before the daemon may write `slot` again, or None."""
        event, self._events[slot] = self._events[slot], None
        return event

    def host(self, offset: int, size: int) -> torch.Tensor:
        assert self._host is not None
        return self._host[offset : offset + size]

    def to_device(self, offset: int, size: int, dest: torch.Tensor) -> None:
        """Queue a copy of region bytes [offset, offset + size) into the start of `dest`."""
        self._copy(_byte_view(dest, size), self.host(offset, size), dest)

    def from_device(self, source: torch.Tensor, offset: int) -> int:
        """Queue a copy of `source`'s bytes into the region at `offset`; returns its size."""
        data = _byte_view(source, None)
        self._copy(self.host(offset, data.numel()), data, source)
        return data.numel()

    def _copy(self, target: torch.Tensor, source: torch.Tensor, device: torch.Tensor) -> None:
        """`target.copy_(source)`, queued on the copy stream on CUDA, where the caller's
        `device` tensor is kept from reuse until the copy ran."""
        if self.stream is None:
            target.copy_(source)
            return
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            device.record_stream(self.stream)

    def finish(self, slot: int) -> None:
        """Mark the end of the copies that use `slot`."""
        if self.stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves these untyped
            event.record(self.stream)
            self._events[slot] = event

    def done(self, wait: bool) -> torch.cuda.Event | None:
        """An event after every queued copy, or None once they are all done (`wait`, or CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves these untyped
        event.record(self.stream)
        if wait:
            event.synchronize()
            return None
        return event

    def drain(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class PublishingClient(Drives, Protocol):
    """The blocking client a Publisher puts through."""

    def close(self) -> None: ...


class Publisher:
    """Stores from device tensors without making the engine wait: the copies to the host and the
    put run on a thread of their own, through `client` (its own, of `region_bytes`)."""

    def __init__(self, client: PublishingClient, region_bytes: int) -> None:
        self.region_bytes = region_bytes
        self._client = client
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefixd-publish")

    def store_from(
        self,
        identity: Identity,
        token_ids: PromptIds,
        sources: Sequence[torch.Tensor],
        *,
        first_block: int = 0,
        ready: torch.cuda.Event | None = None,
    ) -> Future[Stored]:
        """Publish blocks first_block.. of `token_ids` from `sources` (one tensor per block, any
        device). On CUDA the copies wait for `ready` (recorded by the caller after it wrote the
        sources; default: everything queued on the current stream now). The sources must not be
        changed until the returned future is done."""
        tokens = chain_words(identity, token_ids).tobytes()  # a snapshot, as packed words
        sources = list(sources)
        if ready is None and sources and device_of(sources).type == "cuda":
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves these untyped
            ready.record(torch.cuda.current_stream(sources[0].device))
        return self._executor.submit(self._publish, identity, tokens, sources, first_block, ready)

    def _publish(
        self,
        identity: Identity,
        tokens: Any,
        sources: list[torch.Tensor],
        first_block: int,
        ready: torch.cuda.Event | None,
    ) -> Stored:
        sizes = [nbytes(source) for source in sources]
        with self._client.run(reserve, max(sum(sizes), 1)) as lease:
            device = device_of(sources)
            copier = Copier(lease, 1, lease.size, device)
            if copier.stream is not None and ready is not None:
                copier.stream.wait_event(ready)
            spans, offset = [], 0
            for source, size in zip(sources, sizes, strict=True):
                copier.from_device(source, offset)
                spans.append((lease.offset + offset, size))
                offset += size
            copier.drain()
            del copier
            return self._client.run(
                put_spans, identity, tokens, spans, first_block=first_block, lease=lease
            )

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._client.close()


def device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The one device all the tensors are on (the CPU for none)."""
    if not tensors:
        return torch.device("cpu")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise DestinationError(
            f"all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):  # a copy into `meta` writes nothing, and says so not
        raise DestinationError(f"tensors must be on the CPU or a CUDA device, not {device}")
    return device


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _byte_view(tensor: torch.Tensor, size: int | None) -> torch.Tensor:
    """The first `size` bytes (all with None) of a contiguous tensor, as a flat uint8 tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise DestinationError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise DestinationError("tensors must be contiguous")
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat if size is None else flat[:size]
