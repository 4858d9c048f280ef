"""The daemon's operations: one table of handlers keyed by request type, and the services they
share.
"""

from __future__ import annotations

from collections.abc import Mapping

from prefixd.daemon import admin, blocks, engine_ops, session, state_ops
from prefixd.daemon.context import Handler, RequestContext
from prefixd.daemon.peer import Peer
from prefixd.daemon.services import Services
from prefixd.wire.messages import REQUESTS, RequestMessage

HANDLERS: Mapping[type[RequestMessage], Handler] = {
    **session.HANDLERS,
    **blocks.HANDLERS,
    **engine_ops.HANDLERS,
    **state_ops.HANDLERS,
    **admin.HANDLERS,
}


class Operations:
    """Every request type's handler, by type (and by op name, for a frame that decoded to no
    request), and the Services they share."""

    def __init__(self, services: Services) -> None:
        self.handlers = HANDLERS
        self.by_op = {op: HANDLERS[kind] for op, kind in REQUESTS.items() if kind in HANDLERS}
        services.ops = sorted(self.by_op)
        self.services = services

    def context(self, peer: Peer) -> RequestContext:
        return RequestContext(self.services, peer)

    def disconnected(self, peer: Peer) -> None:
        peer.close_regions()
        if peer.pins:
            self.services.store.unpin(peer.pins.elements())
            peer.pins.clear()
