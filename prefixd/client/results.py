"""What the clients' calls return. A loaded result owns its region span: its views raise once it
is released (explicitly, by `with`, or when it and its views are gone), never showing another
request's bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from prefixd.client.leases import Lease
from prefixd.wire.messages import StatePart

if TYPE_CHECKING:
    import torch  # the loads into tensors only (prefixd.client.tensors)


@dataclass(frozen=True, slots=True)
class Lookup:
    """How much of one prompt is stored and worth loading: `n_tokens` tokens in `n_blocks`
    blocks of `sizes` bytes. `est_load_s` and `est_prefill_s` are the daemon's estimates of
    loading the hit it found and of prefilling it instead; a hit is offered only where loading
    pays (est_load_s < est_prefill_s), else its tokens are `withheld_tokens` and recomputed."""

    n_blocks: int
    n_tokens: int
    sizes: tuple[int, ...]
    est_load_s: float = field(default=0.0, compare=False)  # estimates: not part of the hit
    est_prefill_s: float = field(default=0.0, compare=False)
    withheld_tokens: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Routed:
    """What one node would serve a prompt and what it is worth there, in seconds:
    `score_s` = `prefill_saved_s` - `queue_s` - `load_s` (prefixd.daemon.routing); a router
    sends the request to the node with the best score."""

    hit_blocks: int
    hit_tokens: int
    hit_bytes: int
    load_s: float
    prefill_saved_s: float
    loads_in_flight: int
    queue_bytes: int
    queue_s: float
    score_s: float


@dataclass(frozen=True, slots=True)
class Stored:
    stored: int
    existed: int
    parts: int = 0


class _Releasable:
    """A result whose views are slices of its lease: releasing the lease releases them."""

    __slots__ = ()
    lease: Lease | None

    def release(self) -> None:
        """Give the region space back; the views raise from now on. Harmless twice."""
        if self.lease is not None:
            self.lease.release()

    @property
    def released(self) -> bool:
        return self.lease is not None and self.lease.released

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclass(frozen=True, slots=True)
class Loaded(_Releasable):
    """Verified payloads of `n_blocks` blocks from `first_block` on (usable up to `n_tokens`):
    `views[i]` is block first_block + i's, at region offset `offsets[i]`."""

    n_blocks: int
    n_tokens: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    views: tuple[memoryview, ...]
    first_block: int = 0
    lease: Lease | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class StateLookup:
    """A hybrid identity's joint hit (see prefixd.store.results.JointMatch): every state group is
    complete at `reusable_tokens`; the engine recomputes from `replay_from`."""

    reusable_tokens: int
    replay_from: int
    paged_tokens: int
    matched_tokens: int
    parts: tuple[StatePart, ...]
    est_load_s: float = field(default=0.0, compare=False)
    est_prefill_s: float = field(default=0.0, compare=False)
    withheld_tokens: int = field(default=0, compare=False)

    def by_group(self) -> dict[str, list[StatePart]]:
        """The parts of each group, in order (a paged group's pages, or one checkpoint)."""
        groups: dict[str, list[StatePart]] = {}
        for part in self.parts:
            groups.setdefault(part.group, []).append(part)
        return groups

    @property
    def payload_bytes(self) -> int:
        return sum(part.size for part in self.parts)


@dataclass(frozen=True, slots=True)
class StateLoaded(_Releasable, StateLookup):
    """A joint hit loaded into the region: the lookup's fields, each part with its `view`."""

    lease: Lease | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Installed:
    """What a load installed (the caller skips `n_tokens`). `event`: after the last copy (None
    on CPU, or when the call waited); `complete`: every destination was filled;
    `withheld_tokens`: stored tokens not loaded because loading them would not pay."""

    n_blocks: int
    n_tokens: int
    n_bytes: int
    complete: bool
    event: torch.cuda.Event | None = None
    withheld_tokens: int = 0


@dataclass(frozen=True)
class InstalledState:
    """What a hybrid load installed (see prefixd.store.results.JointMatch for the fields)."""

    reusable_tokens: int
    replay_from: int
    paged_tokens: int
    n_bytes: int
    event: torch.cuda.Event | None = None


@dataclass(frozen=True)
class WarmUp:
    """What a restart warm-up brought back; `skipped`: prefixes not worth loading."""

    prefixes: int
    blocks: int
    tokens: int
    bytes: int
    skipped: int = 0
