"""The daemon's operations: one table of handlers keyed by request type, and the services they
share.
"""

from __future__ import annotations

from collections.abc import Mapping

from prefixd.config.policy import NOTHING, Grant
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
            self.services.store.unpin(peer.pins.drop())

    def regrant(self, peer: Peer, grant: Grant | None) -> str | None:
        """Hold a connected peer to what a reload left it (`grant` None: no longer admitted at
        all) and release the pins of the tenants it lost; what it lost, in words, or None. A peer
        once taken off the socket stays off on this connection (closed at its next request)."""
        if not peer.admitted:
            return None
        old = peer.grant
        if grant is None:
            peer.admitted, peer.grant = False, NOTHING
            lost: str | None = "its admission to the socket"
        else:
            peer.grant = grant
            lost = _lost(old, grant)
        if peer.pins:
            self.services.store.unpin(peer.pins.drop(keep=peer.grant.may_use))
        return lost


def _lost(old: Grant, new: Grant) -> str | None:
    parts = []
    if new.tenants is not None:
        if old.tenants is None:
            kept = ", ".join(sorted(new.tenants))
            parts.append(f"every tenant but {kept}" if kept else "every tenant")
        elif old.tenants - new.tenants:
            parts.append("tenant(s) " + ", ".join(sorted(old.tenants - new.tenants)))
    if old.ops - new.ops:
        parts.append("op(s) " + ", ".join(sorted(old.ops - new.ops)))
    return "; ".join(parts) or None
