"""What the KV event publisher (prefixd.daemon.events) is told: its endpoints, checked to stay on
the node (events carry prompt token ids), and which tenants' blocks it publishes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixd.errors import ConfigError
from prefixd.store.journal import BlockChange

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


@dataclass(frozen=True)
class EventSettings:
    endpoint: str
    replay_endpoint: str = ""
    tenants: frozenset[str] = frozenset()  # "*": every tenant
    hash_only: bool = False
    queue_events: int = 100_000  # changes waiting for the publisher; more are dropped
    replay_batches: int = 10_000  # batches the replay endpoint can answer from
    inventory_rate: int = 100_000  # blocks announced per second after a start
    topic: str = ""

    @classmethod
    def parse(cls, endpoint: str, tenants: str, **options: Any) -> EventSettings:
        """Settings from the daemon's flags; ConfigError for an endpoint that is neither an
        ipc:// path nor a loopback tcp:// address (events name prompts: never off the node)."""
        check_endpoint("kv_events_endpoint", endpoint)
        if options.get("replay_endpoint"):
            check_endpoint("kv_events_replay_endpoint", options["replay_endpoint"])
        named = frozenset(t.strip() for t in tenants.split(",") if t.strip())
        return cls(endpoint=endpoint, tenants=named, **options)

    def publishes(self, change: BlockChange) -> bool:
        if "*" in self.tenants:
            return True
        return change.identity is not None and change.identity.tenant in self.tenants


def check_endpoint(name: str, endpoint: str) -> None:
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if host in LOOPBACK_HOSTS and port.isdigit() and 0 < int(port) < 65536:
            return
    raise ConfigError(
        f"{name}: must be ipc://PATH or tcp://127.0.0.1:PORT (a loopback address: events "
        "carry prompt token ids)"
    )
