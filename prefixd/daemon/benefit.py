"""The benefit rule: a hit is offered for loading only where loading and verifying it costs less
than the prefill it saves, and only from `min_reusable_tokens` up. The daemon applies it in every
lookup reply, so whatever loads what a lookup offers (`load_into`, `warm_up`, the vLLM, SGLang and
LMCache adapters) recomputes a hit that would not pay, and the reply says how many tokens it held
back.

Both sides are learned online, per tenant: the load time from the tenant's own verified loads
(an overhead and a bandwidth, prefixd.loadtime; the shared tier's fetches have a model of their
own, prefixd.cluster.benefit), the prefill throughput from what its engines measure and send with
their lookups, else the configured `prefill_tokens_per_s`. Neither is shared between tenants: one
tenant's odd loads (many tiny blocks, loads held up by its own traffic) or reports never hold
back another's hits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prefixd.loadtime import LoadTimeModel

_RATE_MEMORY = 1024  # tenants whose reported prefill throughput is remembered
_REPORTED_WEIGHT = 0.2  # of a new report in a tenant's average
_LOAD_MEMORY = 256  # tenants whose load time is remembered
LOAD_IDLE_S = 300.0  # a tenant's load time no load reached for this long is forgotten
# tokens/s a report is held to: the bounds of the prefill_tokens_per_s setting (a rate of 1e-300
# would make every estimate, and the node's totals of prefill saved, infinite)
RATE_BOUNDS = (1.0, 1e9)


@dataclass(frozen=True, slots=True)
class Benefit:
    """What a hit would cost to load and what it would save, in seconds."""

    load_s: float
    prefill_s: float

    @property
    def pays(self) -> bool:
        return self.load_s < self.prefill_s


class PrefillRates:
    """Each tenant's prefill throughput, tokens/s: the average of what its engines reported with
    their lookups, else the configured one. Thread-safe."""

    def __init__(self, configured: float) -> None:
        self.configured = configured
        self._reported: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def report(self, tenant: str, tokens_per_s: float) -> None:
        with self._lock:
            known = self._reported.get(tenant)
            self._reported[tenant] = (
                tokens_per_s
                if known is None
                else (1 - _REPORTED_WEIGHT) * known + _REPORTED_WEIGHT * tokens_per_s
            )
            self._reported.move_to_end(tenant)
            if len(self._reported) > _RATE_MEMORY:
                self._reported.popitem(last=False)

    def of(self, tenant: str) -> float:
        with self._lock:
            return self._reported.get(tenant, self.configured)


class LoadTimes:
    """Each tenant's load time, fitted to its own loads only. A model learns only from loads, and
    a hit it holds back is not loaded: a model no load reached for LOAD_IDLE_S is forgotten, so a
    tenant whose hits it held back (its loads crawled for a while, say) loads again and is measured
    afresh. `now`: monotonic seconds. Thread-safe."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.default = LoadTimeModel()  # never observed: a tenant's until its loads fit a line
        self._now = now
        self._models: OrderedDict[str, tuple[LoadTimeModel, float]] = OrderedDict()  # last load
        self._lock = threading.Lock()

    def observe(self, tenant: str, n_bytes: int, seconds: float) -> None:
        now = self._now()
        with self._lock:
            model = self._live(tenant, now) or LoadTimeModel()
            self._models[tenant] = (model, now)
            self._models.move_to_end(tenant)
            if len(self._models) > _LOAD_MEMORY:
                self._models.popitem(last=False)
        model.observe(n_bytes, seconds)

    def of(self, tenant: str) -> LoadTimeModel:
        with self._lock:
            return self._live(tenant, self._now()) or self.default

    def learned(self) -> dict[str, LoadTimeModel]:
        """The tenants' models that are not forgotten."""
        now = self._now()
        with self._lock:
            return {t: m for t in list(self._models) if (m := self._live(t, now)) is not None}

    def _live(self, tenant: str, now: float) -> LoadTimeModel | None:
        """The tenant's model, unless forgotten (under the lock)."""
        found = self._models.get(tenant)
        if found is None:
            return None
        if now - found[1] >= LOAD_IDLE_S:
            del self._models[tenant]
            return None
        return found[0]


class BenefitRule:
    """Whether a hit pays, from the tenant's learned load time and prefill throughput."""

    def __init__(self, load_times: LoadTimes, rates: PrefillRates, floor_tokens: int) -> None:
        self.load_times = load_times
        self.rates = rates
        self.floor_tokens = floor_tokens

    def report(self, tenant: str, reported: float | None) -> float | None:
        """Take the prefill throughput a request's engine sent (once per request, however many
        prompts it has), held to RATE_BOUNDS; the rate to judge that request's hits by."""
        if reported is None:
            return None
        rate = min(max(reported, RATE_BOUNDS[0]), RATE_BOUNDS[1])
        self.rates.report(tenant, rate)
        return rate

    def judge(
        self, tenant: str, hit_tokens: int, hit_bytes: int, rate: float | None = None
    ) -> Benefit:
        """The hit's estimates; `rate`: what `report` made of its request's throughput."""
        rate = rate if rate is not None else self.rates.of(tenant)
        return Benefit(self.load_times.of(tenant).estimate(hit_bytes), hit_tokens / rate)

    def offered(self, hit_tokens: int, benefit: Benefit, *, judged: bool = True) -> bool:
        """A hit is offered from the floor up and where loading it pays (unless not `judged`:
        a question of what is stored, not of what to load)."""
        return hit_tokens >= self.floor_tokens and hit_tokens > 0 and (benefit.pays or not judged)
