"""`PrefixdL2Adapter`: the prefixd daemon as an L2 adapter of LMCache's node server (MP mode).

LMCache's controllers call from two threads and expect every call to return at once, so each call
only queues a task: stores run on one worker with a connection of its own, lookups, unlocks and
loads on another (a pin belongs to the connection that took it, so a key is unpinned where it was
locked). A load task's keys are dealt to `load_lanes` connections that load and copy at once, so
the daemon reads one lane's key while another lane copies its payload into its memory object;
completions are signalled on each kind's event fd. A lookup pins every hit until
`submit_unlock`, so prefixd's eviction cannot take it; a payload that fails its checksum is a miss.
A daemon that is away or slow fails stores and makes lookups misses: nothing raises into LMCache.
An object is named with its layout (each tensor's dtype and shape): a store's and a load's from
the memory object, a lookup's from the layout LMCache gives for the key's object group (its own
`bench l2` gives none: then each layout this adapter has stored or loaded for that group).
All ranks or none: a key is a hit only while every KV rank's part of its chunk is stored (a rank
whose store failed makes the chunk a miss for every rank), and a load task fails every part of a
chunk it holds when one of them fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from prefixd.client import Client, Loaded
from prefixd.integrations.link import DaemonLink
from prefixd.integrations.lmcache.identity import (
    Identities,
    Settings,
    key_of,
    layout_of,
    rank_parts,
    salt_of,
)
from prefixd.integrations.lmcache.listing import list_keys
from prefixd.schema.identity import Identity

log = logging.getLogger(__name__)

MAX_KEYS_PER_LOOKUP = 4096  # the daemon's limit of prompts per lookup
_Tag = TypeVar("_Tag")


@dataclass(frozen=True)
class _Task:
    kind: str  # "store", "lookup", "unlock", "load"
    task_id: L2TaskId
    keys: list[ObjectKey]
    objects: list[MemoryObj]
    layouts: Mapping[int, MemoryLayoutDesc]


def _link(settings: Settings, name: str) -> DaemonLink:
    """One of the adapter's connections (stores; lookups and loads; more loads)."""
    return DaemonLink(
        settings.socket,
        region_bytes=settings.region_bytes,
        timeout_s=settings.timeout_s,
        name=name,
        label="prefixd L2 adapter",
        reconnect_s=settings.reconnect_s,
        daemon_uid=settings.daemon_uid,
    )


class PrefixdL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """An LMCache L2 adapter backed by the prefixd daemon at `adapter_params["socket"]`. No
    capacity is declared, so LMCache's own L2 eviction stays off: prefixd keeps its store within
    its capacity itself, never evicting a locked key."""

    def __init__(self, adapter_params: dict[str, Any], **unused: Any) -> None:
        super().__init__(max_capacity_bytes=0)
        self._settings = Settings.from_params(adapter_params)
        self._identities = Identities(self._settings)
        # per (model name, object group): the object layouts seen, the last one last
        self._layouts: dict[tuple[str, int], dict[str, None]] = {}
        # per (model name, cache salt, engine key): the identity of each pin the lookups took
        self._pins: dict[tuple[str, str, bytes], list[Identity]] = {}
        self._keys_without_layout = 0  # asked for with no layout given or seen: misses
        # per task kind that completes: its event fd, and its finished tasks' results
        self._efds = {kind: create_event_notifier() for kind in ("store", "lookup", "load")}
        self._done: dict[str, dict[L2TaskId, Any]] = {kind: {} for kind in self._efds}
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._usage: tuple[float, AdapterUsage] | None = None
        self._storer = _link(self._settings, "lmcache-l2-store")
        self._fetcher = _link(self._settings, "lmcache-l2-prefetch")
        # a load task's lanes: the fetcher (which holds the lookups' pins), then a link each
        self._lanes = [self._fetcher] + [
            _link(self._settings, f"lmcache-l2-load-{lane}")
            for lane in range(1, self._settings.load_lanes)
        ]
        self._lane_threads = ThreadPoolExecutor(
            len(self._lanes), thread_name_prefix="prefixd-l2-load"
        )
        for link in self._lanes[1:]:  # connected at once, off LMCache's threads, like the workers
            self._lane_threads.submit(link.client)
        self._store_jobs: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._fetch_jobs: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._workers = [
            threading.Thread(target=self._work, args=work, name=f"prefixd-l2-{name}", daemon=True)
            for name, work in (
                ("store", (self._store_jobs, self._storer)),
                ("fetch", (self._fetch_jobs, self._fetcher)),
            )
        ]
        for worker in self._workers:
            worker.start()

    # --- event fds ------------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._efds["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._efds["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._efds["load"].fileno())

    # --- LMCache's calls (its controller threads; none waits for the daemon) -------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._store_jobs, "store", keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit(self._fetch_jobs, "lookup", keys, layouts=group_layout_descs)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done["lookup"].pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._submit(self._fetch_jobs, "unlock", keys)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit(self._fetch_jobs, "load", keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done["load"].pop(task_id, None)

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete each key in every object layout this adapter has seen for its group."""
        deleted, sizes = [], []
        with self._lock:
            named = [(key, key, layout) for key in keys for layout in self._seen(key)]
        for identity, batch in self._by_identity(named).items():
            for key, words in batch:
                found = self._storer.call(
                    lambda c: c.lookup(identity, [words], stored_only=True)  # noqa: B023
                )
                removed = self._storer.call(lambda c: c.delete(identity, [words]))  # noqa: B023
                if removed and found and found[0].sizes:
                    deleted.append(key)
                    sizes.append(found[0].sizes[0])
        if deleted:
            self._notify_keys_deleted(deleted, sizes)

    def get_usage(self) -> AdapterUsage:
        """The daemon's own stored bytes of this adapter's tenants, by cache salt, read at most
        every `usage_refresh_s`."""
        now = time.monotonic()
        cached = self._usage
        if cached is not None and now - cached[0] < self._settings.usage_refresh_s:
            return cached[1]
        stats = self._storer.call(lambda c: c.stats())
        if stats is None:
            return cached[1] if cached is not None else AdapterUsage(0, 0)
        by_salt: dict[str, int] = {}
        for tenant, totals in stats.get("metrics", {}).get("tenants", {}).items():
            salt = salt_of(self._settings.tenant, tenant)
            stored = int(totals.get("stored_bytes", 0))
            if salt is not None and stored > 0:
                by_salt[salt] = stored
        usage = AdapterUsage(sum(by_salt.values()), 0, MappingProxyType(by_salt))
        self._usage = (now, usage)
        return usage

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        entries, next_cursor = list_keys(
            self._storer, self._settings.tenant, model_name, page_size, cursor
        )
        return KeyListPage(
            entries=tuple(
                KeyEntry(key=k.to_encoded_object_key(), size_bytes=n) for k, n in entries
            ),
            next_page_token=next_cursor,
        )

    def report_status(self) -> dict[str, Any]:
        return {
            "is_healthy": self._storer.connected or self._fetcher.connected,
            "type": "PrefixdL2Adapter",
            "socket": self._settings.socket,
            "store_connected": self._storer.connected,
            "prefetch_connected": self._fetcher.connected,
            "keys_without_layout": self._keys_without_layout,
            # each link's last problem and fix, failures by kind, calls missed for them
            "store_link": self._storer.status(),
            "prefetch_link": self._fetcher.status(),
            "load_links": [link.status() for link in self._lanes[1:]],
        }

    def close(self) -> None:
        self._store_jobs.put(None)
        self._fetch_jobs.put(None)
        for worker in self._workers:
            worker.join()
        self._lane_threads.shutdown()
        self._storer.close()
        for link in self._lanes:  # the fetcher's end releases its pins in the daemon
            link.close()
        for efd in self._efds.values():
            efd.close()

    # --- the workers ----------------------------------------------------------------------------

    def _submit(
        self,
        jobs: queue.SimpleQueue[_Task | None],
        kind: str,
        keys: list[ObjectKey],
        objects: Sequence[MemoryObj] = (),
        layouts: Mapping[int, MemoryLayoutDesc] | None = None,
    ) -> L2TaskId:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
        jobs.put(_Task(kind, task_id, list(keys), list(objects), dict(layouts or {})))
        return task_id

    def _work(self, jobs: queue.SimpleQueue[_Task | None], link: DaemonLink) -> None:
        link.client()  # at once, off LMCache's threads: the region is touched before any task
        while (task := jobs.get()) is not None:
            try:
                self._run(task)
            except Exception:  # a bug must not stop the worker: the task fails, LMCache goes on
                log.exception("prefixd L2 adapter: %s task failed", task.kind)
                self._finish(task, None)

    def _run(self, task: _Task) -> None:
        if task.kind == "unlock":
            self._unlock(task.keys)
        elif task.kind == "lookup":
            self._finish(task, self._lookup(task.keys, task.layouts))
        else:
            work = self._store if task.kind == "store" else self._load
            self._finish(task, work(task.keys, task.objects))

    def _finish(self, task: _Task, result: Any) -> None:
        """Record a task's result (None: a failure; a store of nothing new is a 0, and falsy)
        and signal its event fd."""
        if task.kind == "unlock":
            return
        if result is None:
            result = L2StoreResult(False, 0) if task.kind == "store" else Bitmap(len(task.keys))
        with self._lock:
            self._done[task.kind][task.task_id] = result
        self._efds[task.kind].notify()

    def _store(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        written = 0
        ok = len(keys) == len(objects)
        new_keys, new_sizes = [], []
        for key, obj in zip(keys, objects):
            identity, words = self._named(key, self._object_layout(key, obj))
            if identity is None:
                ok = False
                continue
            payload = obj.byte_array
            put = self._storer.call(lambda c: c.put(identity, words, [payload]))  # noqa: B023
            if put is None:
                ok = False
                continue
            if put.stored:
                written += len(payload)
                new_keys.append(key)
                new_sizes.append(len(payload))
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)
        return L2StoreResult(ok, written)

    def _lookup(self, keys: list[ObjectKey], layouts: Mapping[int, MemoryLayoutDesc]) -> Bitmap:
        """Which keys are stored with every other rank's part of their chunk, each such hit
        pinned on the daemon until `submit_unlock`. One lookup per identity (per
        MAX_KEYS_PER_LOOKUP keys) pins the keys asked for; parts of other ranks LMCache did not
        ask for (it asks for every rank's at once) are looked up beside them unpinned, and a
        hit whose chunk lacks a part is unpinned again: a miss for every rank."""
        found = Bitmap(len(keys))
        given = {
            group: layout_of(desc.shapes, desc.dtypes)
            for group, desc in layouts.items()
            if desc.shapes
        }
        with self._lock:
            for key in keys:
                if key.object_group_id in given:
                    self._note(key, given[key.object_group_id])
            candidates = [
                [given[key.object_group_id]] if key.object_group_id in given else self._seen(key)
                for key in keys
            ]
        unnamed = candidates.count([])
        if unnamed and not self._keys_without_layout:
            log.warning(
                "prefixd L2 adapter: a lookup gave no object layout for a group this adapter has "
                "not stored or loaded: its keys are misses (counted in report_status). Fix: pass "
                "each object group's MemoryLayoutDesc, as LMCache's node server does"
            )
        self._keys_without_layout += unnamed
        for turn in range(max(map(len, candidates), default=0)):
            named = [
                (place, key, layouts_[turn])
                for place, (key, layouts_) in enumerate(zip(keys, candidates))
                if turn < len(layouts_) and not found.test(place)
            ]
            for identity, batch in self._by_identity(named).items():
                self._pin_whole_chunks(identity, batch, keys, found)
        return found

    def _pin_whole_chunks(
        self,
        identity: Identity,
        batch: list[tuple[int, bytes]],
        keys: list[ObjectKey],
        found: Bitmap,
    ) -> None:
        """Set in `found` the place of each key of `batch` (place, engine key) stored in
        `identity` with its chunk's other parts, and pin it (see `_lookup`)."""
        asked = [words for _, words in batch]
        present = dict(zip(asked, self._present(identity, asked, pin=True)))
        parts = {place: self._parts(keys[place]) for place, _ in batch}
        others = list(dict.fromkeys(w for p in parts.values() for w in p if w not in present))
        present.update(zip(others, self._present(identity, others, pin=False)))
        torn = []
        for place, words in batch:
            if not present[words]:
                continue
            if all(present[part] for part in parts[place]):
                found.set(place)
                pin = (keys[place].model_name, keys[place].cache_salt, words)
                self._pins.setdefault(pin, []).append(identity)
            else:
                torn.append(words)
        for at in range(0, len(torn), MAX_KEYS_PER_LOOKUP):
            part = torn[at : at + MAX_KEYS_PER_LOOKUP]
            self._fetcher.call(lambda c: c.unpin(identity, part))  # noqa: B023

    def _present(self, identity: Identity, asked: list[bytes], *, pin: bool) -> list[bool]:
        """Whether each engine key is stored (pinned for this connection when `pin`); a daemon
        that does not answer finds nothing."""
        present: list[bool] = []
        for at in range(0, len(asked), MAX_KEYS_PER_LOOKUP):
            part = asked[at : at + MAX_KEYS_PER_LOOKUP]
            hits = self._fetcher.call(lambda c: c.lookup(identity, part, pin=pin))  # noqa: B023
            hits = hits if hits is not None and len(hits) == len(part) else []
            present += [hit.n_blocks == 1 for hit in hits] or [False] * len(part)
        return present

    def _unlock(self, keys: list[ObjectKey]) -> None:
        """Release one pin of each key, in the layout its lookup pinned it in (a connection
        lost since took its pins with it)."""
        by_identity: dict[Identity, list[bytes]] = {}
        for key in keys:
            if not 0 <= key.kv_rank < 1 << 32:
                continue  # never a key, never pinned
            words = key_of(key.chunk_hash, key.kv_rank, key.object_group_id)
            pins = self._pins.get((key.model_name, key.cache_salt, words))
            if pins:
                by_identity.setdefault(pins.pop(), []).append(words)
                if not pins:
                    del self._pins[key.model_name, key.cache_salt, words]
        for identity, batch in by_identity.items():
            for at in range(0, len(batch), MAX_KEYS_PER_LOOKUP):
                part = batch[at : at + MAX_KEYS_PER_LOOKUP]
                self._fetcher.call(lambda c: c.unpin(identity, part))  # noqa: B023

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        """Load each key's verified payload into its memory object. A chunk is loaded whole or
        not at all: a rank's part that fails (missing, damaged, another size) fails the other
        parts of its chunk in the same task too. The keys are dealt to the lanes in turn; each
        lane loads a payload, leased at its object's size, and copies it out while the other
        lanes' loads run in the daemon."""
        ok = [False] * len(keys)
        n_lanes = len(self._lanes)

        def lane(first: int) -> None:
            link = self._lanes[first]
            for place in range(first, min(len(keys), len(objects)), n_lanes):
                key, obj = keys[place], objects[place]
                identity, words = self._named(key, self._object_layout(key, obj))
                if identity is None:
                    continue
                size = obj.get_size()
                leased = link.call(lambda c: _load_leased(c, identity, words, size))  # noqa: B023
                if leased is not None:
                    _copy_out(leased, obj)
                    ok[place] = True

        lanes = [self._lane_threads.submit(lane, first) for first in range(n_lanes)]
        wait(lanes)  # every lane ends before the task does, even when one fails: no late writes
        for done in lanes:
            done.result()
        chunks: dict[tuple[Any, ...], list[int]] = {}
        for place, key in enumerate(keys[: len(objects)]):
            chunk = (key.model_name, key.chunk_hash, key.object_group_id, key.cache_salt)
            chunks.setdefault((*chunk, rank_parts(key.kv_rank)), []).append(place)
        loaded = Bitmap(len(keys))
        accessed = []
        for places in chunks.values():
            if all(ok[place] for place in places):
                for place in places:
                    loaded.set(place)
                    accessed.append(keys[place])
        if accessed:
            self._notify_keys_accessed(accessed)
        return loaded

    # --- keys -----------------------------------------------------------------------------------

    def _object_layout(self, key: ObjectKey, obj: MemoryObj) -> str:
        """The layout of a memory object (`layout_of`), noted for `key`'s group."""
        meta = obj.metadata
        layout = layout_of(meta.shapes or [meta.shape], meta.dtypes or [meta.dtype])
        with self._lock:
            self._note(key, layout)
        return layout

    def _note(self, key: ObjectKey, layout: str) -> None:
        """Note `layout` as the last seen for `key`'s model and object group (under _lock)."""
        group = (key.model_name, key.object_group_id)
        if group not in self._layouts and len(self._layouts) >= 4096:
            self._layouts.clear()
        seen = self._layouts.setdefault(group, {})
        seen.pop(layout, None)
        seen[layout] = None

    def _seen(self, key: ObjectKey) -> list[str]:
        """The layouts seen for `key`'s model and object group, the last one first: a copy,
        taken under _lock, that the workers' notes cannot change while it is read."""
        return list(reversed(self._layouts.get((key.model_name, key.object_group_id), {})))

    def _named(self, key: ObjectKey, layout: str) -> tuple[Identity | None, bytes]:
        """A key's identity in `layout` and its engine key (None when LMCache's key cannot
        be one)."""
        identity = self._identities.of(key.model_name, len(key.chunk_hash), key.cache_salt, layout)
        if identity is None or not (0 <= key.kv_rank < 1 << 32):
            return None, b""
        return identity, key_of(key.chunk_hash, key.kv_rank, key.object_group_id)

    def _parts(self, key: ObjectKey) -> list[bytes]:
        """The engine keys of every rank's part of `key`'s chunk (`key`'s own among them)."""
        return [
            key_of(key.chunk_hash, rank, key.object_group_id) for rank in rank_parts(key.kv_rank)
        ]

    def _by_identity(
        self, named: Sequence[tuple[_Tag, ObjectKey, str]]
    ) -> dict[Identity, list[tuple[_Tag, bytes]]]:
        """(tag, key, layout) grouped by identity, as (tag, engine key)."""
        groups: dict[Identity, list[tuple[_Tag, bytes]]] = {}
        for tag, key, layout in named:
            identity, words = self._named(key, layout)
            if identity is not None:
                groups.setdefault(identity, []).append((tag, words))
        return groups


def _load_leased(client: Client, identity: Identity, words: bytes, size: int) -> Loaded | None:
    """One key's verified payload in a lease of `size` bytes (a payload larger than the region
    raises RegionFullError: the link reports it with its fix); None on a miss or a payload of
    another size (another engine layout's)."""
    loaded = client.load(identity, words, max_blocks=1, length=size)
    if loaded.n_blocks != 1 or len(loaded.views[0]) != size:
        loaded.release()
        return None
    return loaded


def _copy_out(loaded: Loaded, obj: MemoryObj) -> None:
    """Copy a loaded payload into its memory object, then give its lease back."""
    with loaded:
        # numpy copies without the GIL (a memoryview's assignment holds it): the other lanes
        # send their loads meanwhile. LMCache's view is ctypes' "<B".
        np.copyto(
            np.frombuffer(obj.byte_array.cast("B"), np.uint8),
            np.frombuffer(loaded.views[0], np.uint8),
        )


__all__ = ["PrefixdL2Adapter"]
