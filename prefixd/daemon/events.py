"""KV events: what this node's store holds, published for cache-aware routers in vLLM's format.

The store tells its observer every block a commit stored or removed; `EventPublisher` publishes
vLLM's `KVEventBatch` (vllm 0.32.0; docs/events.md) on a ZeroMQ PUB socket, with vLLM's ROUTER
replay endpoint. A start says `AllBlocksCleared`, then announces the inventory at a bounded rate;
batches carry this start's incarnation. Publishing never delays a write: a commit whose events do
not fit the bounded queue drops what waits there and resynchronises the subscribers instead
(`AllBlocksCleared`, then the inventory again), as does a removed block no event can name (its
record or identity unreadable), so a router's view never keeps a block the node lost. Only
`kv_events_tenants` are published (token ids are prompt content); nothing here logs token ids or
hashes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from prefixd.config.settings import EventSettings
from prefixd.errors import ConfigError
from prefixd.schema.chain import ROOT_PARENT
from prefixd.schema.content import token_part
from prefixd.store.journal import BlockChange

log = logging.getLogger(__name__)

MEDIUM = "STORAGE"  # vLLM's MEDIUM_STORAGE: the block is on this node's disk
LOCALITY = "LOCAL"
OWNERSHIP = "prefixd"
EVENTS_PER_BATCH = 1024
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay, as vLLM's publisher does
# The publisher wakes this often (or for a whole batch), not at every commit: that costs the writers
POLL_S = 0.02
FAILED_PAUSE_MAX_S = 30.0  # the longest a lasting failure to publish waits between resyncs

BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """vLLM's KVEventBatch, then the incarnation of this daemon's start."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    incarnation: str = ""


def event_of(change: BlockChange, hash_only: bool) -> Event:
    """A block's hash is prefixd's chain hash, or the engine's own key for a block stored under one
    (so a router matches it against the engine's events)."""
    identity = change.identity
    keyed = identity is not None and identity.key_bytes is not None
    block = change.tokens if keyed else change.block
    if not change.stored:
        return BlockRemoved([block], MEDIUM, locality=LOCALITY, ownership=OWNERSHIP)
    assert identity is not None  # a stored block's identity is the put's
    if keyed:
        parent: bytes | None = change.parent_tokens or None
        tokens: list[int] = []
    else:
        parent = None if change.parent == ROOT_PARENT else change.parent
        words = b"" if hash_only else token_part(identity, change.tokens)
        tokens = np.frombuffer(words, dtype="<u4").tolist()
    return BlockStored(
        block_hashes=[block],
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=identity.block_tokens,
        lora_id=None,
        medium=MEDIUM,
        lora_name=identity.adapter,
        locality=LOCALITY,
        ownership=OWNERSHIP,
    )


class EventPublisher:
    """The store's observer: a bounded queue, a thread owning the ZeroMQ sockets, and one announcing
    the inventory after a start."""

    def __init__(
        self, settings: EventSettings, inventory: Callable[[int], Iterator[list[BlockChange]]]
    ) -> None:
        """`inventory(batch)`: every stored block, `batch` at a time (Store.inventory)."""
        try:
            import zmq
        except ImportError:
            raise ConfigError(
                "kv_events_endpoint: publishing KV events needs pyzmq (pip install 'prefixd[events]')"
            ) from None

        self.settings = settings
        self.incarnation = uuid.uuid4().hex
        self._zmq = zmq
        self._context = zmq.Context()
        self._inventory = inventory
        self._order = threading.Lock()  # an inventory batch and a commit's changes never interleave
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # events to send (the publisher waits)
        self._room = threading.Condition(lock)  # room for an inventory batch (the announcer waits)
        self._resyncs = 0
        self._inventory_done = False  # the announcer's: it announced every block since the resync
        # an inventory batch leaves room in the queue for commits' events
        self._batch = max(1, min(EVENTS_PER_BATCH, settings.queue // 2))
        self._pending: deque[list[Event]] = deque()
        self._pending_events = 0
        self._stop = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        published = ("published_events", "published_batches", "dropped_events", "resyncs")
        self.counts = dict.fromkeys((*published, "inventory_blocks", "replays", "failures"), 0)
        self._seq = 0  # the next batch's: the publisher thread's alone
        self._bound = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._publish, name="prefixd-events", daemon=True)
        self._announcer = threading.Thread(
            target=self._announce, name="prefixd-inventory", daemon=True
        )

    def committed(self, changes: Sequence[BlockChange]) -> None:
        """Called by the store's writers after each commit, in commit order: never waits."""
        events = self._published(changes)
        if events is None or events:
            with self._order:
                self._enqueue(events)

    def _published(self, changes: Sequence[BlockChange]) -> list[Event] | None:
        """The events of `changes`; None when a removed block cannot be named (its identity, or an
        engine-keyed block's key, unreadable): only a resync then tells subscribers it went. A
        stored block whose identity is unreadable is left out."""
        settings, events = self.settings, []
        for change in changes:
            identity = change.identity
            if identity is not None and not settings.publishes(change):
                continue
            if identity is None or (identity.key_bytes is not None and not change.tokens):
                if not change.stored:
                    return None
                continue
            events.append(event_of(change, settings.hash_only))
        return events

    def _enqueue(self, events: list[Event] | None) -> None:
        """Queue `events`; when they do not fit, or are None, resynchronise instead: what waits is
        dropped (and counted), subscribers are told AllBlocksCleared and the inventory is
        announced again, from its first block. Called under the order lock."""
        with self._ready:
            if events is not None and self._pending_events + len(events) <= self.settings.queue:
                self._pending.append(events)
                self._pending_events += len(events)
                if self._pending_events >= EVENTS_PER_BATCH:
                    self._ready.notify()
                return
            self.counts["dropped_events"] += self._cleared() + len(events or ())
            self.counts["resyncs"] += 1
            self._resyncs += 1
            self._ready.notify()
            self._room.notify_all()

    def _cleared(self) -> int:
        """Drop what waits and queue AllBlocksCleared, for the inventory to follow; how many
        events were dropped. Under the ready lock."""
        dropped = self._pending_events
        self._pending.clear()
        self._pending.append([AllBlocksCleared()])
        self._pending_events = 1
        return dropped

    def start(self) -> None:
        """Bind (raising what binding raised), say AllBlocksCleared, announce."""
        self._thread.start()
        self._bound.wait()
        if self._failed is not None:
            raise ConfigError(f"kv_events_endpoint: cannot publish there ({self._failed})")
        with self._ready:
            self._cleared()  # the inventory announces whatever was committed before
        self._announcer.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        with self._ready:
            self._ready.notify_all()
            self._room.notify_all()
        for thread in (self._announcer, self._thread):
            if thread.is_alive():
                thread.join(timeout_s)
        self._context.destroy(linger=0)

    def snapshot(self) -> dict[str, int]:
        with self._ready:
            return {**self.counts, "queued_events": self._pending_events}

    def _announce(self) -> None:
        try:
            self._announce_inventory()
        except Exception:  # a store that cannot be read: said, and the events go on
            log.exception("KV events: the inventory could not be announced")

    def _announce_inventory(self) -> None:
        """At most `inventory_rate` blocks a second, each batch under the order lock once the queue
        has room for it: a block removed meanwhile is told removed after it was told stored. After
        a resync, again from the first block."""
        resync = -1
        inventory: Iterator[list[BlockChange]] = iter(())
        started, announced = time.monotonic(), 0
        while not self._stop.is_set():
            with self._room:
                while not self._stop.is_set() and (
                    self._pending_events + self._batch > self.settings.queue
                    or (resync == self._resyncs and self._inventory_done)
                ):
                    self._room.wait()
            with self._order:
                if resync != self._resyncs:
                    resync, inventory = self._resyncs, self._inventory(self._batch)
                    started, announced = time.monotonic(), 0
                    self._inventory_done = False
                batch = next(inventory, None)
                if batch is None:
                    self._inventory_done = True
                    continue
                events = self._published(batch)
                if events:
                    self._enqueue(events)
            announced += len(batch)
            self.counts["inventory_blocks"] += len(events or ())
            ahead = announced / self.settings.inventory_rate - (time.monotonic() - started)
            if ahead > 0:
                self._stop.wait(ahead)

    def _publish(self) -> None:
        sockets = self._bind()
        if sockets is None:
            return
        pub, replay = sockets
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.settings.replay_batches)
        pause = POLL_S
        while True:
            try:
                if replay is not None and replay.poll(0):
                    self._replay(replay, buffer)
                taken = self._take()
                if taken is None:
                    return
                for batch in _batches(taken):
                    self._send(pub, buffer, batch)
                pause = POLL_S
            except Exception:  # noqa: BLE001 - the events go on: counted, logged, resynced
                self._failure("KV events: publishing failed; resyncing")
                with self._order:
                    self._enqueue(None)  # what it had taken is lost: subscribers start over
                self._stop.wait(pause)  # a failure that lasts resyncs less and less often
                pause = min(2 * pause, FAILED_PAUSE_MAX_S)

    def _bind(self) -> tuple[Any, Any] | None:
        """The PUB socket and the replay ROUTER (None without one); None, for start() to raise
        it, when binding failed."""
        zmq = self._zmq
        try:
            pub = self._context.socket(zmq.PUB)
            pub.set_hwm(100_000)
            pub.bind(self.settings.endpoint)
            replay = None
            if self.settings.replay_endpoint:
                replay = self._context.socket(zmq.ROUTER)
                replay.bind(self.settings.replay_endpoint)
        except Exception as exc:  # noqa: BLE001 - start() raises it in the daemon's thread
            self._failed = exc
            return None
        finally:
            self._bound.set()
        return pub, replay

    def _take(self) -> list[list[Event]] | None:
        """What waits, once there is some or POLL_S passed; None once stopped and sent."""
        with self._ready:
            if not self._pending:
                if self._stop.is_set():
                    return None
                self._ready.wait(POLL_S)
            taken = list(self._pending)
            self._pending.clear()
            self._pending_events = 0
            if taken:
                self._room.notify_all()
        return taken

    def _send(self, pub: Any, buffer: deque[tuple[int, bytes]], batch: list[Event]) -> None:
        """Publish one batch under the next seq, kept for replay even where sending failed: a
        subscriber sees the gap and asks for it."""
        zmq, seq = self._zmq, self._seq
        payload = self._encoder.encode(EventBatch(time.time(), batch, None, self.incarnation))
        buffer.append((seq, payload))
        self._seq += 1
        try:
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.counts["dropped_events"] += len(batch)
            if exc.errno != zmq.EAGAIN:  # a subscriber's full socket is no failure
                self._failure("KV events: a batch could not be sent")
        self.counts["published_batches"] += 1
        self.counts["published_events"] += len(batch)

    def _failure(self, what: str) -> None:
        """Count a failure and log it (the 1st, 2nd, 4th, 8th...: a lasting one never floods)."""
        self.counts["failures"] += 1
        n = self.counts["failures"]
        if n & (n - 1) == 0:
            log.exception("%s (%d failures so far)", what, n)

    def _replay(self, replay: Any, buffer: deque[tuple[int, bytes]]) -> None:
        """Answer one replay request, `[identity, b"", start seq]`, as vLLM does."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.counts["replays"] += 1
        for seq, payload in list(buffer):
            if seq >= first:
                replay.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _batches(queued: list[list[Event]]) -> Iterator[list[Event]]:
    events = [event for batch in queued for event in batch]
    for start in range(0, len(events), EVENTS_PER_BATCH):
        yield events[start : start + EVENTS_PER_BATCH]
