"""The operations into device memory (`load_into`, `load_state_into`, `warm_up`, `store_from`):
steps of the client core, bound to both clients by `TensorOperations`. The copies need torch
(prefixd.client.transfer, the [gpu] extra), imported only when one of these runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixd.client import state_steps
from prefixd.client.core import ClientCore
from prefixd.client.leases import Lease
from prefixd.client.operations import Background, Operation, hot, lookup
from prefixd.client.results import Installed, InstalledState, Stored, WarmUp
from prefixd.client.steps import Publish, Reserve, Steps, Synchronize, unpacked
from prefixd.errors import DestinationError, PrefixdError, TransferError
from prefixd.schema.chain import packed_hashes
from prefixd.schema.identity import Identity
from prefixd.schema.stored import HotPrefix
from prefixd.schema.tokens import PromptIds

if TYPE_CHECKING:
    import torch

    from prefixd.client.transfer import Publisher

DEFAULT_SLOTS = 3


def load_into(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    destinations: Sequence[torch.Tensor],
    *,
    slots: int = DEFAULT_SLOTS,
    wait: bool = True,
    hashes: bytes | None = None,
    warm: bool = False,
    prefill_tokens_per_s: float | None = None,
) -> Steps[Installed]:
    """Stream the stored prefix of `token_ids` into `destinations` (block i into the contiguous
    destinations[i], on any device) through `slots` staging slots, where loading it pays (the
    daemon's benefit rule; `prefill_tokens_per_s`: the engine's measured prefill throughput).
    `warm` counts it as restart warm-up."""
    from prefixd.client.transfer import Copier, device_of, nbytes

    allocator = core.payloads
    if allocator is None:
        raise PrefixdError("load_into needs a client with a shared region (region_bytes)")
    if not destinations:
        return Installed(0, 0, 0, True)
    device = device_of(destinations)
    if hashes is None:  # hashed once here, not again by the daemon for every batch
        hashes = packed_hashes(identity, token_ids)
    [hit] = yield from lookup(
        core, identity, [token_ids], hashes=[hashes], prefill_tokens_per_s=prefill_tokens_per_s
    )
    sizes = hit.sizes[: min(len(destinations), hit.n_blocks)]
    for i, (size, dest) in enumerate(zip(sizes, destinations, strict=False)):
        if nbytes(dest) != size:  # a tail no payload writes would pass for part of the block
            raise DestinationError(f"destination {i} holds {nbytes(dest)} bytes, the block {size}")
    if not sizes:
        return Installed(0, 0, 0, False, withheld_tokens=hit.withheld_tokens)
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
            offsets, loaded_sizes = unpacked(loaded.offsets), unpacked(loaded.sizes)
            fitting = 0  # a block stored again since the lookup, at another size, ends the hit
            for offset, size, looked_up in zip(offsets, loaded_sizes, sizes[start:], strict=False):
                if size != looked_up:
                    break
                copier.to_device(offset - lease.offset, size, destinations[start + fitting])
                n_bytes += size
                fitting += 1
            copier.finish(slot)
            installed = start + fitting
            if fitting < stop - start:
                break  # evicted, failed verification or changed since the lookup: a shorter hit
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
    token_ids: PromptIds,
    destinations: Mapping[str, Sequence[torch.Tensor]],
    *,
    wait: bool = True,
) -> Steps[InstalledState]:
    """Load a hybrid identity's joint hit and copy each group's payloads into
    `destinations[group]` (pages in order; a checkpoint group's first destination takes the
    checkpoint). The whole hit passes through the region at once, so it must fit there."""
    from prefixd.client.transfer import Copier, device_of, nbytes

    if core.payloads is None:
        raise PrefixdError("load_state_into needs a client with a shared region (region_bytes)")
    devices = [d for dests in destinations.values() for d in dests]
    device = device_of(devices)
    hit = yield from state_steps.load_state(core, identity, token_ids)
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
                if nbytes(dest) != part.size:
                    raise DestinationError(
                        f"state group {group!r}: a destination holds {nbytes(dest)} bytes, "
                        f"the payload needs {part.size}"
                    )
                copier.to_device((part.offset or 0) - lease.offset, part.size, dest)
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


def warm_up(
    core: ClientCore,
    budget_bytes: int,
    destinations_factory: Callable[[HotPrefix[np.ndarray]], Sequence[torch.Tensor] | None],
    *,
    tenant: str,
    limit: int = 64,
    slots: int = DEFAULT_SLOTS,
    prefill_tokens_per_s: float | None = None,
) -> Steps[WarmUp]:
    """After a restart, stream the tenant's most valuable prefixes (by eviction score), up to
    `budget_bytes`, into what `destinations_factory(prefix)` allocates (None skips it), each
    where loading it pays (`skipped` counts the others)."""
    prefixes = blocks = tokens = n_bytes = skipped = 0
    for prefix in (yield from hot(core, budget_bytes, tenant=tenant, limit=limit)):
        destinations = destinations_factory(prefix)
        if destinations is None:
            continue
        installed = yield from load_into(
            core,
            prefix.identity,
            prefix.tokens,
            destinations,
            slots=slots,
            warm=True,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        if installed.withheld_tokens and not installed.n_blocks:
            skipped += 1
            continue
        prefixes += 1
        blocks += installed.n_blocks
        tokens += installed.n_tokens
        n_bytes += installed.n_bytes
    return WarmUp(prefixes, blocks, tokens, n_bytes, skipped)


def store_from(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    sources: Sequence[Any],
    *,
    first_block: int = 0,
    ready: Any = None,
    region_bytes: int = 256 << 20,
) -> Steps[Future[Stored]]:
    """Publish blocks from device tensors in the background (Publisher.store_from), through a
    connection and region of their own, of at least `region_bytes`."""
    publisher: Publisher = yield Publish(region_bytes)
    return publisher.store_from(identity, token_ids, sources, first_block=first_block, ready=ready)


def _slot_bytes(sizes: Sequence[int], region_bytes: int, slots: int) -> int:
    """The whole hit when it fits one slot's share of the region, else that share."""
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


class TensorOperations:
    """The operations into device memory, for `Client` and `AsyncClient` (see Operations)."""

    load_into = Operation(load_into)
    load_state_into = Operation(load_state_into)
    warm_up = Operation(warm_up)
    store_from = Background(store_from)
