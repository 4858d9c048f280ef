"""The daemon's operations: one table of handlers keyed by request type, and the services they
share.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

from prefixd.daemon import admin, blocks, engine_ops, session, state_ops
from prefixd.daemon.context import Handler, RequestContext
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.peer import Peer
from prefixd.daemon.services import Services
from prefixd.store import Store
from prefixd.wire.messages import REQUESTS, RequestMessage

HANDLERS: Mapping[type[RequestMessage], Handler] = {
    **session.HANDLERS,
    **blocks.HANDLERS,
    **engine_ops.HANDLERS,
    **state_ops.HANDLERS,
    **admin.HANDLERS,
}


class Operations:
    def __init__(
        self, store: Store, pool: Executor, *, metrics: Metrics | None = None, **settings: Any
    ) -> None:
        """`settings`: the other fields of Services (limits, shared tier, clock, counters)."""
        self.handlers = HANDLERS
        self.by_op = {op: HANDLERS[kind] for op, kind in REQUESTS.items() if kind in HANDLERS}
        if metrics is None:
            metrics = Metrics(store, prefill_tokens_per_s=1e4)
        ops = sorted(self.by_op)
        self.services = Services(store=store, pool=pool, metrics=metrics, ops=ops, **settings)

    def context(self, peer: Peer) -> RequestContext:
        return RequestContext(self.services, peer)

    def disconnected(self, peer: Peer) -> None:
        peer.close_regions()
        if peer.pins:
            self.services.store.unpin(peer.pins.elements())
            peer.pins.clear()
