"""`PrefixdTier`: prefixd as a secondary tier of vLLM's tiering offloading manager.

vLLM calls the tier on its scheduler thread and wants every call to return at once, so lookups go
through vLLM's AsyncLookupManager (RETRY until answered) and stores and loads through a job thread.
Each KV group is an engine-keyed identity whose chain is the request's keys in prefix order
(chains.py): a block is stored only after its parents and a hit never reaches past a gap. A daemon
that is down or slow makes lookups misses and jobs fail: vLLM recomputes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from prefixd.integrations.link import DaemonLink
from prefixd.integrations.vllm.chains import (
    NO_CHAIN,
    Chain,
    Chains,
    group_of,
    positions_of,
)
from prefixd.integrations.vllm.events import KeyEvents
from prefixd.integrations.vllm.identity import group_identities
from prefixd.schema.identity import Identity
from prefixd.schema.keys import pack_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """Consecutive blocks `first .. first + len(rows) - 1` of one group's chain, with the
    primary-tier rows they come from or go to."""

    identity: Identity
    chain: list[bytes]  # the group's keys 0 .. first + len(rows) - 1
    first: int
    keys: list[bytes]
    rows: list[int]


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's async lookup manager, asking the daemon for a batch of one request's keys."""

    def __init__(self, tier: PrefixdTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.present(keys, req_context)


class PrefixdTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier backed by the prefixd daemon at `socket`, loaded from the settings
    `kv_transfer_config` builds."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        socket: str,
        identity: Mapping[str, str | None],
        tenant: str = "default",
        region_bytes: int = 64 << 20,
        timeout_s: float = 2.0,
        reconnect_s: float = 1.0,
        daemon_uid: int | str | None = None,
        enable_kv_events: bool = False,
        backpressure_detector: Any = None,
        **unused: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if unused:
            log.warning("prefixd tier: ignoring unknown settings %s", sorted(unused))
        if not primary_kv_view.c_contiguous:
            raise ValueError("prefixd tier: the primary tier's memory is not contiguous")
        self._rows = primary_kv_view.cast("B")
        self._row_bytes = self.block_size_bytes
        config = offloading_spec.config
        self._identities = group_identities(config, identity, tenant, f"row={self._row_bytes}")
        self._chains = Chains(
            {g.group_id: g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups}
        )
        region_bytes = max(region_bytes, self._row_bytes)
        self._per_call = region_bytes // self._row_bytes  # blocks one put or load moves
        self._link = DaemonLink(
            socket,
            region_bytes=region_bytes,
            timeout_s=timeout_s,
            name="vllm-tier",
            label="prefixd tier",
            reconnect_s=reconnect_s,
            daemon_uid=daemon_uid,  # the daemon's user, if not this process's own or root
        )
        kv_events = enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        self._events = KeyEvents(self.medium, enabled=kv_events)
        self._jobs: queue.SimpleQueue[tuple[str, TransferJob, dict[bytes, int]] | None]
        self._jobs = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._lookups = _Lookups(self, tier_type)
        self._worker = threading.Thread(target=self._work, name="prefixd-tier-jobs", daemon=True)
        self._worker.start()

    # --- vLLM's calls (scheduler thread; none of them waits) -----------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = []
        while True:
            try:
                finished.append(self._finished.get_nowait())
            except queue.Empty:
                return finished

    @property
    def connected(self) -> bool:
        return self._link.connected

    def status(self) -> dict[str, Any]:
        """The link to the daemon, for an operator (DaemonLink.status)."""
        return self._link.status()

    def has_pending_work(self) -> bool:
        return self._pending > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._events.take()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._worker.join()
        self._lookups.shutdown()
        self._link.close()
        self._rows.release()  # vLLM unmaps the primary tier after its tiers shut down

    # --- the lookup thread ----------------------------------------------------------------------

    def present(self, keys: Sequence[bytes], req_context: ReqContext) -> list[bool]:
        """Which of `keys` are stored after every key before them (one daemon call per group)."""
        chains = self._chains.of(positions_of(req_context))
        hit_blocks: dict[int, int] = {}
        for group in {group_of(k) for k in keys}:
            identity, chain = self._identities.get(group), chains.get(group, NO_CHAIN)
            wanted = [chain.places[k] for k in keys if group_of(k) == group and k in chain.places]
            if identity is None or not wanted:
                continue
            prefix = chain.keys[: max(wanted) + 1]
            found = self._link.call(lambda c: c.lookup(identity, [pack_keys(identity, prefix)]))  # noqa: B023
            hit_blocks[group] = found[0].n_blocks if found else 0
        hits = []
        for key in keys:
            place = chains.get(group_of(key), NO_CHAIN).places.get(key)
            hits.append(place is not None and place < hit_blocks.get(group_of(key), 0))
        if self._events.watching:
            self._events.note([k for k, hit in zip(keys, hits) if not hit], removed=True)
        return hits

    # --- the job thread -------------------------------------------------------------------------

    def _submit(self, kind: str, job: TransferJob) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put((kind, job, positions_of(job.req_context)))

    def _work(self) -> None:
        self._link.client()  # at once, off vLLM's thread: the region is touched before any load
        while (item := self._jobs.get()) is not None:
            kind, job, positions = item
            chains = self._chains.of(positions)
            started = time.monotonic()
            try:
                result = self._store(job, chains) if kind == "store" else self._load(job, chains)
            except Exception:  # a bug must not stop the tier: the job fails, vLLM recomputes
                log.exception("prefixd tier: %s job failed", kind)
                result = JobResult(job.job_id, success=False)
            result.transfer_time = time.monotonic() - started
            self._finished.put(result)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _store(self, job: TransferJob, chains: dict[int, Chain]) -> JobResult:
        runs, unplaced = self._runs(job, chains)
        stored: list[bytes] = []
        for run in runs:
            # blocks the daemon has already (a chunk stored again) are not copied again
            words = pack_keys(run.identity, run.chain)
            identity = run.identity  # what is stored, not whether loading it pays
            found = self._link.call(
                lambda c: c.lookup(identity, [words], stored_only=True)  # noqa: B023
            )
            if found is None:
                break
            have = min(len(run.keys), max(0, found[0].n_blocks - run.first))
            stored.extend(run.keys[:have])
            for at in range(have, len(run.keys), self._per_call):
                rows = run.rows[at : at + self._per_call]
                payloads = [self._row(r) for r in rows]
                first = run.first + at
                chain = run.chain[: first + len(rows)]
                identity, words = run.identity, pack_keys(run.identity, chain)
                put = self._link.call(lambda c: c.put(identity, words, payloads, first_block=first))  # noqa: B023
                if put is None:
                    break  # refused (say, a parent not stored) or the daemon is away
                stored.extend(run.keys[at : at + self._per_call])
        self._events.note(stored, removed=False)
        success = not unplaced and len(stored) == len(job.keys)
        return JobResult(job.job_id, success=success, transfer_bytes=len(stored) * self._row_bytes)

    def _load(self, job: TransferJob, chains: dict[int, Chain]) -> JobResult:
        runs, unplaced = self._runs(job, chains)
        loaded: list[bytes] = []
        for run in runs:
            done = self._load_run(run)
            loaded.extend(run.keys[:done])
            if done < len(run.keys):
                break
        if len(loaded) == len(job.keys) and not unplaced:
            return JobResult(job.job_id, success=True, transfer_bytes=len(loaded) * self._row_bytes)
        failed = [k for k in job.keys if k not in set(loaded)]
        self._lookups.mark_miss(failed)
        self._events.note(failed, removed=True)
        return JobResult(
            job.job_id,
            success=False,
            successful_keys=tuple(loaded) or None,
            transfer_bytes=len(loaded) * self._row_bytes,
        )

    def _load_run(self, run: Run) -> int:
        """Copy run's verified payloads into their rows; how many leading blocks made it."""
        done = 0
        while done < len(run.keys):
            first = run.first + done
            count = min(self._per_call, len(run.keys) - done)
            words = pack_keys(run.identity, run.chain[: first + count])
            result = self._link.call(
                lambda c: c.load(run.identity, words, first_block=first, max_blocks=count)  # noqa: B023
            )
            if result is None:
                return done
            with result:
                ok = 0
                for view, row in zip(result.views, run.rows[done : done + result.n_blocks]):
                    if len(view) != self._row_bytes:
                        break  # stored by an engine with other rows: not this layout's bytes
                    self._row(row)[:] = view
                    ok += 1
            done += ok
            if ok < count:
                return done
        return done

    def _runs(self, job: TransferJob, chains: dict[int, Chain]) -> tuple[list[Run], list[bytes]]:
        """The job's keys as runs of consecutive chain blocks per group; keys with no place in
        a chain (or of a group this tier does not know) are returned apart."""
        by_group: dict[int, list[tuple[int, bytes, int]]] = {}
        unplaced: list[bytes] = []
        for key, row in zip(job.keys, job.chunk_ids):
            group = group_of(key)
            place = chains.get(group, NO_CHAIN).places.get(key)
            if group not in self._identities or place is None:
                unplaced.append(key)
                continue
            by_group.setdefault(group, []).append((place, key, int(row)))
        runs = []
        for group, entries in by_group.items():
            chain, identity = chains[group].keys, self._identities[group]
            # consecutive places, less their index in the sorted entries, are equal
            for _, run in itertools.groupby(enumerate(sorted(entries)), lambda e: e[1][0] - e[0]):
                part = [entry for _, entry in run]
                first = part[0][0]
                keys, rows = [key for _, key, _ in part], [row for _, _, row in part]
                runs.append(Run(identity, chain[: first + len(part)], first, keys, rows))
        return runs, unplaced

    def _row(self, chunk_id: int) -> memoryview:
        at = chunk_id * self._row_bytes
        return self._rows[at : at + self._row_bytes]


__all__ = ["PrefixdTier", "group_identities"]
