"""The last hop: verified payloads from the shared region into destination tensors, and back.

A load streams through the client's region cut into `slots` staging slots (double or triple
buffering). The daemon verifies batch k into slot k % slots while batch k-1 is copied to the
device, so verification (and decompression) overlaps the copies. On CUDA the region is registered
as pinned memory and the copies run with `non_blocking=True` on a dedicated stream; an event per
slot tells when the slot may be written again, and the engine's compute stream never waits: the
caller gets an event to make it wait on, or asks the call to wait. Without CUDA (the CPU build of
torch cannot pin memory) the same pipeline runs, the copies being synchronous, so every test runs
everywhere.

Every byte of the region these calls use is leased (prefixd.client.leases): a load's slots, a
store's staging space. The lease is held until the copies that read or write it have completed,
so concurrent calls on one client never overlap.

The loads are steps of the client core (prefixd.client.core), so `Client` and `AsyncClient` run
the same code.

Nothing reaches a destination before the daemon verified it: a slot is copied only after the reply
that says its bytes passed their checksums. A load that fails part way raises TransferError with the
number of tokens installed; loads write the same bytes every time, so a retry is harmless.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

from prefixd.errors import DestinationError, PrefixdError, TransferError
from prefixd.schema.chain import packed_hashes
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TokenIds, as_token_array

if TYPE_CHECKING:
    from prefixd.client.core import ClientCore
    from prefixd.client.leases import Lease
    from prefixd.client.results import HotPrefix, Stored
    from prefixd.client.steps import Steps

DEFAULT_SLOTS = 3
log = logging.getLogger(__name__)


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One dedicated copy stream per device, for the life of the process."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch leaves these untyped


@dataclass(frozen=True)
class Installed:
    """What a load installed: `n_blocks` blocks, `n_tokens` tokens (the caller skips these).
    `event` is recorded after the last copy (None on CPU, or when the call waited); `complete`
    says whether every destination was filled (False: the stored prefix was shorter)."""

    n_blocks: int
    n_tokens: int
    n_bytes: int
    complete: bool
    event: torch.cuda.Event | None = None


@dataclass(frozen=True)
class InstalledState:
    """What a hybrid load installed (see prefixd.store.joint.JointMatch for the fields)."""

    reusable_tokens: int
    replay_from: int
    paged_tokens: int
    n_bytes: int
    event: torch.cuda.Event | None = None


@dataclass(frozen=True)
class WarmUp:
    """What a restart warm-up brought back."""

    prefixes: int
    blocks: int
    tokens: int
    bytes: int


class Copier:
    """Copies between a lease's slots and tensors: on a dedicated CUDA stream with one event per
    slot when the device is CUDA, synchronously otherwise."""

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
        """The event to wait for before the daemon may write `slot` again (its copies out are
        done then), or None."""
        event, self._events[slot] = self._events[slot], None
        return event

    def host(self, offset: int, size: int) -> torch.Tensor:
        assert self._host is not None
        return self._host[offset : offset + size]

    def to_device(self, offset: int, size: int, dest: torch.Tensor) -> None:
        """Queue a copy of region bytes [offset, offset + size) into the start of `dest`."""
        target = _byte_view(dest, size)
        source = self.host(offset, size)
        if self.stream is None:
            target.copy_(source)
            return
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            dest.record_stream(self.stream)

    def from_device(self, source: torch.Tensor, offset: int) -> int:
        """Queue a copy of `source`'s bytes into the region at `offset`; returns its size."""
        data = _byte_view(source, None)
        target = self.host(offset, data.numel())
        if self.stream is None:
            target.copy_(data)
        else:
            with torch.cuda.stream(self.stream):
                target.copy_(data, non_blocking=True)
                source.record_stream(self.stream)
        return data.numel()

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


def load_into(
    core: ClientCore,
    identity: Identity,
    token_ids: TokenIds,
    destinations: Sequence[torch.Tensor],
    *,
    slots: int = DEFAULT_SLOTS,
    wait: bool = True,
    hashes: bytes | None = None,
    warm: bool = False,
) -> Steps[Installed]:
    """Stream the verified payloads of the stored prefix of `token_ids` into `destinations`
    (block i into destinations[i], any device, contiguous, at least the payload's size), as many
    blocks as there are destinations and the store holds."""
    from prefixd.client.steps import Reserve, Synchronize

    allocator = core.payloads
    if allocator is None:
        raise PrefixdError("load_into needs a client with a shared region (region_bytes)")
    if not destinations:
        return Installed(0, 0, 0, True)
    device = _device_of(destinations)
    if hashes is None:  # hashed once here, not again by the daemon for every batch
        hashes = packed_hashes(identity, token_ids)
    [hit] = yield from core.lookup(identity, [token_ids], [hashes])
    sizes = hit.sizes[: min(len(destinations), hit.n_blocks)]
    for i, (size, dest) in enumerate(zip(sizes, destinations, strict=False)):
        if _nbytes(dest) < size:
            raise DestinationError(f"destination {i} holds {_nbytes(dest)} bytes, needs {size}")
    if not sizes:
        return Installed(0, 0, 0, False)
    slot_bytes = _slot_bytes(sizes, allocator.size, slots)
    batches = _batches(sizes, slot_bytes)
    n_slots = min(slots, len(batches))
    lease: Lease = yield Reserve(allocator, n_slots * slot_bytes)
    copier = Copier(lease, n_slots, slot_bytes, device)
    block_tokens = identity.block_tokens
    copier.begin()
    installed = n_bytes = 0
    try:
        for k, (start, stop) in enumerate(batches):
            slot = k % n_slots
            event = copier.reuse(slot)
            if event is not None:
                yield Synchronize(event)
            loaded = yield from core.load_span(
                identity,
                token_ids,
                lease,
                copier.slot_offset(slot),
                slot_bytes,
                first_block=start,
                max_blocks=stop - start,
                hashes=hashes,
                warm=warm,
            )
            for i, (offset, size) in enumerate(zip(loaded.offsets, loaded.sizes, strict=True)):
                copier.to_device(offset - lease.offset, size, destinations[start + i])
                n_bytes += size
            copier.finish(slot)
            installed = start + loaded.n_blocks
            if loaded.n_blocks < stop - start:
                break  # evicted or failed verification since the lookup: a shorter hit
    except BaseException as exc:
        copier.drain()  # what was queued is installed, then the error says how much
        del copier
        lease.release()
        if not isinstance(exc, Exception):
            raise
        raise TransferError(
            f"load into destinations failed: {exc}", installed * block_tokens
        ) from exc
    done = copier.done(wait)
    del copier
    lease.release_after(done)  # the slots stay leased until the last copy out has read them
    complete = installed == len(destinations)
    return Installed(installed, installed * block_tokens, n_bytes, complete, done)


def load_state_into(
    core: ClientCore,
    identity: Identity,
    token_ids: TokenIds,
    destinations: Mapping[str, Sequence[torch.Tensor]],
    *,
    wait: bool = True,
) -> Steps[InstalledState]:
    """Load a hybrid identity's joint hit and copy each group's payloads into
    `destinations[group]` (pages in order; a checkpoint group's first destination takes the
    checkpoint). The whole hit passes through the region at once, so it must fit there."""
    from prefixd.client import state_steps

    if core.payloads is None:
        raise PrefixdError("load_state_into needs a client with a shared region (region_bytes)")
    devices = [d for dests in destinations.values() for d in dests]
    device = _device_of(devices) if devices else torch.device("cpu")
    hit = yield from state_steps.load_state(core, identity, token_ids, None)
    lease = hit.lease
    assert lease is not None
    copier = Copier(lease, 1, lease.size, device)
    copier.begin()
    n_bytes = 0
    try:
        for group, parts in hit.by_group().items():
            dests = destinations.get(group, ())
            if len(dests) < len(parts):
                raise DestinationError(
                    f"state group {group!r}: {len(parts)} payloads, {len(dests)} destinations"
                )
            for part, dest in zip(parts, dests, strict=False):
                if _nbytes(dest) < part.size:
                    raise DestinationError(
                        f"state group {group!r}: a destination holds {_nbytes(dest)} bytes, "
                        f"the payload needs {part.size}"
                    )
                copier.to_device(part.offset - lease.offset, part.size, dest)
                n_bytes += part.size
    except BaseException:
        copier.drain()
        del copier
        hit.release()
        raise
    copier.finish(0)
    done = copier.done(wait)
    del copier
    lease.release_after(done)
    return InstalledState(hit.reusable_tokens, hit.replay_from, hit.paged_tokens, n_bytes, done)


class Publisher:
    """Stores from device tensors without making the engine wait: the copies to the host and the
    put run on a thread of their own, through a connection and a region of their own."""

    def __init__(self, core: ClientCore, region_bytes: int) -> None:
        from prefixd.client.blocking import Client

        self.region_bytes = region_bytes
        self._client = Client(
            core.socket_path,
            region_bytes=region_bytes,
            timeout=core.timeout,
            name=f"{core.name}-publisher",
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefixd-publish")
        self._lock = threading.Lock()

    def store_from(
        self,
        identity: Identity,
        token_ids: TokenIds,
        sources: Sequence[torch.Tensor],
        *,
        first_block: int = 0,
        ready: torch.cuda.Event | None = None,
    ) -> Future[Stored]:
        """Publish blocks first_block.. of `token_ids` from `sources` (one tensor per block, any
        device). On CUDA the copies wait for `ready` (recorded by the caller after it wrote the
        sources; default: everything queued on the current stream now). The sources must not be
        changed until the returned future is done."""
        tokens = as_token_array(token_ids).copy()
        sources = list(sources)
        if ready is None and sources and _device_of(sources).type == "cuda":
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
        sizes = [_nbytes(source) for source in sources]
        with self._client.reserve(max(sum(sizes), 1)) as lease:
            device = _device_of(sources) if sources else torch.device("cpu")
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
            return self._client.put_spans(identity, tokens, spans, first_block=first_block)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._client.close()


def warm_up(
    core: ClientCore,
    budget_bytes: int,
    destinations_factory: Callable[[HotPrefix], Sequence[torch.Tensor] | None],
    *,
    tenant: str,
    limit: int = 64,
    slots: int = DEFAULT_SLOTS,
) -> Steps[WarmUp]:
    """After a restart, stream the tenant's most valuable stored prefixes (by eviction score) into
    destinations until `budget_bytes` of payload: `destinations_factory(prefix)` allocates one
    destination per block of `prefix` (or returns None to skip it). The daemon counts what was
    warmed (`prefixd stats`: warmed_blocks, warmed_bytes)."""
    prefixes = blocks = tokens = n_bytes = 0
    for prefix in (yield from core.hot(budget_bytes, tenant, limit)):
        destinations = destinations_factory(prefix)
        if destinations is None:
            continue
        installed = yield from load_into(
            core, prefix.identity, prefix.tokens, destinations, slots=slots, warm=True
        )
        prefixes += 1
        blocks += installed.n_blocks
        tokens += installed.n_tokens
        n_bytes += installed.n_bytes
    return WarmUp(prefixes, blocks, tokens, n_bytes)


def _slot_bytes(sizes: Sequence[int], region_bytes: int, slots: int) -> int:
    """A staging slot's size: the whole hit when it fits in one slot's share of the region, else
    that share (so a small load leases little of a shared region)."""
    share = region_bytes // max(slots, 1)
    return max(1, min(share, max(sum(sizes), 1)))


def _batches(sizes: Sequence[int], slot_bytes: int) -> list[tuple[int, int]]:
    """Consecutive runs of blocks [start, stop) whose payloads fit in one slot."""
    batches: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes):
        if size > slot_bytes:
            raise DestinationError(
                f"block {i}'s payload is {size} bytes, a staging slot holds {slot_bytes}: "
                "use a larger region or fewer slots"
            )
        if used + size > slot_bytes:
            batches.append((start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        batches.append((start, len(sizes)))
    return batches


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise DestinationError(
            f"all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    return devices.pop()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _byte_view(tensor: torch.Tensor, size: int | None) -> torch.Tensor:
    """The first `size` bytes (all with None) of a contiguous tensor, as a flat uint8 tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise DestinationError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise DestinationError("tensors must be contiguous")
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat if size is None else flat[:size]
