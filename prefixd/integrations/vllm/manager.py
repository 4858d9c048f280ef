"""The direct spec's scheduler side: lookups that hold their hits, loads that cannot fail, stores.

vLLM calls the manager on its scheduler thread and wants every call to return at once. A lookup
asks the staging thread for the request's keys and answers RETRY until it replies (once per
scheduler step, as vLLM's own async lookups do); the thread asks the daemon what is worth loading
(the benefit rule) and loads it, verified, into this process's region (staging.py). A key is a
HIT only once its payloads, for every worker rank, lie verified there; they stay until the load
that names them completes or the request ends. So a daemon that dies after the lookup, or a block
damaged or evicted after it, never fails a load: it shortens the next request's hit instead.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from prefixd.client.results import Loaded
from prefixd.integrations.vllm.chains import NO_CHAIN, Chains, group_of, positions_of
from prefixd.integrations.vllm.events import KeyEvents
from prefixd.integrations.vllm.jobs import PrefixdLoadSpec, PrefixdStoreSpec, StoreGroup
from prefixd.integrations.vllm.settings import Settings
from prefixd.integrations.vllm.staging import Exports, Held
from prefixd.schema.identity import Identity
from prefixd.schema.keys import pack_keys

log = logging.getLogger(__name__)

MEDIUM = Medium.STORAGE


@dataclass
class _Request:
    """One request's lookups: keys to ask, keys missed, and the chunks held for its load."""

    context: ReqContext
    asked: dict[bytes, None] = field(default_factory=dict)
    missed: set[bytes] = field(default_factory=set)  # a hit is a key in `held`
    held: dict[bytes, list[tuple[Held, int]]] = field(default_factory=dict)  # per rank
    loading: set[bytes] = field(default_factory=set)
    in_flight: bool = False
    finished: bool = False


class _Stored(NamedTuple):
    """Keys a store job put, to be reported stored once the daemon holds them."""

    positions: dict[bytes, int]
    keys: list[bytes]


@dataclass
class _Staged:
    """The staging thread's reply for one request."""

    req_id: str
    missed: list[bytes]
    held: dict[bytes, list[tuple[Held, int]]]


class PrefixdManager(OffloadingManager):  # type: ignore[misc]
    """The OffloadingManager of PrefixdOffloadingSpec (see the module's docstring)."""

    def __init__(
        self,
        config: OffloadingConfig,
        settings: Settings,
        identities: list[dict[int, Identity]],
        kv_events: bool,
    ) -> None:
        self._identities = identities
        self._chains = Chains(
            {g.group_id: g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups}
        )
        self._prefill_tokens_per_s = settings.prefill_tokens_per_s
        self._link = settings.link("vllm-spec", "prefixd spec", settings.region_bytes)
        self._exports = Exports()
        self._events = KeyEvents(MEDIUM, enabled=kv_events and settings.enable_kv_events)
        self._requests: dict[str, _Request] = {}
        self._asks: queue.SimpleQueue[tuple[str, dict[bytes, int], list[bytes]] | _Stored | None]
        self._asks = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[_Staged] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._stage, name="prefixd-spec-lookups", daemon=True
        )
        self._thread.start()

    # --- vLLM's calls (scheduler thread; none of them waits) -----------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._take_replies()
        request = self._request(req_context)
        if key in request.held:
            return LookupResult.HIT
        if key in request.missed:
            return LookupResult.MISS
        position = req_context.get_offload_key_position(key)
        if group_of(key) not in self._identities[0] or not self._chains.closes_chunk(key, position):
            return LookupResult.MISS  # a partial tail's boundary, or a group not stored here
        request.asked[key] = None
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._take_replies()
        for req_id, request in self._requests.items():
            for key in [k for k in request.asked if k in request.missed or k in request.held]:
                del request.asked[key]
            if request.asked and not request.in_flight and not request.finished:
                asked = list(request.asked)
                request.asked.clear()
                request.in_flight = True
                self._asks.put((req_id, positions_of(request.context), asked))

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrefixdLoadSpec:
        request = self._requests[req_context.req_id]
        chunks = []
        for key in keys:
            held = request.held.get(key)
            if held is None:  # vLLM loads only what lookup() answered HIT, and that is held
                raise AssertionError("prefixd spec: a load names a chunk it did not hold")
            chunks.append([h.entry(index) for h, index in held])
            request.loading.add(key)
        return PrefixdLoadSpec(chunks)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        request = self._requests.get(req_context.req_id)
        if request is None:
            return
        for key in keys:
            request.loading.discard(key)
            request.asked.pop(key, None)
            self._release(request, key)  # asked again if looked up again: held again
        self._forget_if_done(req_context.req_id, request)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        chains = self._chains.of(positions_of(req_context))
        places: dict[int, list[tuple[int, bytes]]] = {}
        for key in keys:
            group = group_of(key)
            place = chains.get(group, NO_CHAIN).places.get(key)
            if group in self._identities[0] and place is not None:
                places.setdefault(group, []).append((place, key))
        stored: list[OffloadKey] = []
        groups = []
        for group, entries in places.items():
            entries.sort()
            chain = chains[group].keys[: entries[-1][0] + 1]
            groups.append(StoreGroup(group, tuple(chain), tuple(p for p, _ in entries)))
            stored.extend(OffloadKey(k) for _, k in entries)
        return PrepareStoreOutput(stored, PrefixdStoreSpec(groups), evicted_keys=[])

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        # the worker reports every store job done, puts it skipped or the daemon refused
        # included (vLLM fails the engine on a failed store): the keys are asked for first, on
        # the staging thread, and only those every rank's daemon holds are reported stored
        if success and self._events.enabled and keys:
            self._asks.put(_Stored(positions_of(req_context), list(keys)))

    def on_request_finished(self, req_context: ReqContext) -> None:
        request = self._requests.get(req_context.req_id)
        if request is None:
            return
        request.finished = True
        for key in [k for k in request.held if k not in request.loading]:
            self._release(request, key)
        self._forget_if_done(req_context.req_id, request)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._events.take()

    def has_pending_work(self) -> bool:
        return any(r.in_flight for r in self._requests.values())

    def shutdown(self) -> None:
        self._asks.put(None)
        self._thread.join()
        self._take_replies()
        for request in self._requests.values():
            _drop(*request.held.values())
        self._requests.clear()
        self._link.close()
        self._exports.close()

    def status(self) -> dict[str, object]:
        """For an operator: the link to the daemon (DaemonLink.status), the chunks held for hits
        not loaded yet and the region bytes they and other calls lease."""
        client = self._link.client() if self._link.connected else None
        usage = client.region_usage() if client is not None else None
        return {
            **self._link.status(),
            "held_chunks": sum(len(r.held) for r in list(self._requests.values())),
            "region_leased_bytes": usage.leased_bytes if usage is not None else 0,
        }

    # --- scheduler-thread helpers ----------------------------------------------------------------

    def _request(self, req_context: ReqContext) -> _Request:
        request = self._requests.get(req_context.req_id)
        if request is None:
            request = self._requests[req_context.req_id] = _Request(req_context)
        return request

    def _take_replies(self) -> None:
        while True:
            try:
                reply = self._replies.get_nowait()
            except queue.Empty:
                return
            request = self._requests.get(reply.req_id)
            if request is None or request.finished:  # ended while its lookup was away
                _drop(*reply.held.values())
                if request is not None:
                    request.in_flight = False
                    self._forget_if_done(reply.req_id, request)
                continue
            request.in_flight = False
            for key in [*reply.missed, *reply.held]:  # asked again while the reply was away
                request.asked.pop(key, None)
            for key, holds in reply.held.items():
                if key in request.held:  # held already: the new copy is not needed
                    _drop(holds)
                else:
                    request.held[key] = holds
            request.missed.update(reply.missed)

    # --- the staging thread ---------------------------------------------------------------------

    def _stage(self) -> None:
        self._link.client()  # at once, off vLLM's thread: the region is made before any lookup
        while (ask := self._asks.get()) is not None:
            if isinstance(ask, _Stored):
                try:
                    self._events.note(self._held_by_daemon(*ask), removed=False)
                except Exception:  # a bug must not stop the lookups: the keys go unreported
                    log.exception("prefixd spec: a store's keys could not be confirmed")
                continue
            req_id, positions, keys = ask
            try:
                reply = self._stage_request(req_id, positions, keys)
            except Exception:  # a bug must not stop the lookups: a miss, vLLM recomputes
                log.exception("prefixd spec: a lookup failed")
                reply = _Staged(req_id, keys, {})
            self._replies.put(reply)

    def _stage_request(
        self, req_id: str, positions: dict[bytes, int], keys: list[bytes]
    ) -> _Staged:
        """Hold the verified payloads of the leading stored run of `keys`, per group."""
        chains = self._chains.of(positions)
        held: dict[bytes, list[tuple[Held, int]]] = {}
        for group in sorted({group_of(k) for k in keys}):
            chain = chains.get(group, NO_CHAIN)
            places = sorted(chain.places[k] for k in keys if chain.places.get(k) is not None)
            if not places:
                continue
            first, last = places[0], places[-1]
            loads = self._load_ranks(group, chain.keys[: last + 1], first)
            count = min((loaded.n_blocks for loaded in loads), default=0)
            holds = [Held(loaded, self._exports.of(loaded), count) for loaded in loads]
            for index in range(count):
                key = chain.keys[first + index]
                held[key] = [(h, index) for h in holds]
        missed = [k for k in keys if k not in held]
        if self._events.watching:
            self._events.note(missed, removed=True)
        return _Staged(req_id, missed, held)

    def _held_by_daemon(self, positions: dict[bytes, int], keys: list[bytes]) -> list[bytes]:
        """The keys of `keys` whose chunks the daemon holds for every rank, in their order."""
        chains = self._chains.of(positions)
        held: set[bytes] = set()
        for group in {group_of(k) for k in keys}:
            chain = chains.get(group, NO_CHAIN)
            places = [chain.places[k] for k in keys if k in chain.places]
            if group not in self._identities[0] or not places:
                continue
            stored = len(chain.keys)
            for identities in self._identities:
                identity = identities[group]
                words = pack_keys(identity, chain.keys[: max(places) + 1])
                found = self._link.call(
                    lambda c: c.lookup(identity, [words], stored_only=True)  # noqa: B023
                )
                stored = min(stored, found[0].n_blocks if found else 0)
            held.update(chain.keys[:stored])
        return [k for k in keys if k in held]

    def _load_ranks(self, group: int, chain: list[bytes], first: int) -> list[Loaded]:
        """Every rank's verified payloads of chain blocks `first..` worth loading, or none."""
        loads: list[Loaded] = []
        for identities in self._identities:
            identity = identities[group]
            words = pack_keys(identity, chain)
            rate = self._prefill_tokens_per_s
            found = self._link.call(
                lambda c: c.lookup(identity, [words], prefill_tokens_per_s=rate)  # noqa: B023
            )
            wanted = (found[0].n_blocks if found else 0) - first
            loaded = None
            if wanted > 0:
                loaded = self._link.call(
                    lambda c: c.load(identity, words, first_block=first, max_blocks=wanted)  # noqa: B023
                )
            if loaded is None or loaded.n_blocks == 0:
                for done in loads:
                    done.release()
                if loaded is not None:
                    loaded.release()
                return []
            loads.append(loaded)
        return loads

    def _release(self, request: _Request, key: bytes) -> None:
        _drop(request.held.pop(key, []))

    def _forget_if_done(self, req_id: str, request: _Request) -> None:
        if request.finished and not request.loading and not request.in_flight:
            self._requests.pop(req_id, None)


def _drop(*holds: list[tuple[Held, int]]) -> None:
    """Give back each chunk of `holds` (a chunk's load, per rank): its payloads, with the last."""
    for by_rank in holds:
        for held, _ in by_rank:
            held.drop()
