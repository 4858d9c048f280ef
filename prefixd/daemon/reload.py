"""Reloading settings on SIGHUP (`systemctl reload`): re-read from the sources the daemon started
from, apply what can change while serving (RELOADABLE: peers, tenancy, manifests, log level), log
what waits for a restart. Settings that do not parse are refused whole.

A change of peers holds the open connections to it too: each peer is judged again from its uid and
groups, so a reload that takes a uid or group off the socket, or a tenant or operation from a
grant, refuses that peer's next request for it, and releases the pins it held on tenants it lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prefixd.config.policy import TenantPolicy
from prefixd.config.settings import SETTINGS, Config
from prefixd.daemon import systemd
from prefixd.daemon.watchers import ManifestWatcher
from prefixd.errors import PrefixdError
from prefixd.store import Store

log = logging.getLogger(__name__)

TENANCY = ("tenant_ttls", "tenant_quotas", "tenant_quota_bytes", "share_groups")
PEERS = ("allowed_uids", "allowed_gids", "tenant_policy")
RELOADABLE = frozenset((*TENANCY, *PEERS, "model_manifests", "log_level"))


@dataclass(frozen=True)
class Changes:
    applied: tuple[str, ...]
    at_restart: tuple[str, ...]


def changes(old: Config, new: Config) -> Changes:
    changed = [name for name in SETTINGS if old.value(name) != new.value(name)]
    return Changes(
        tuple(n for n in changed if n in RELOADABLE),
        tuple(n for n in changed if n not in RELOADABLE),
    )


class Reloadable(Protocol):
    config: Config
    policy: TenantPolicy

    @property
    def env(self) -> Mapping[str, str]: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def watcher(self) -> ManifestWatcher | None: ...
    def regrant(self) -> None: ...


class Reloader:
    """One reload at a time; a SIGHUP during a reload runs another after it."""

    def __init__(self, server: Reloadable, reread: Callable[[], Config]) -> None:
        self._server = server
        self._reread = reread
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self.reloads = 0  # reloads done (applied, or nothing changed)
        self.refused = 0  # reloads whose settings did not parse

    def request(self) -> None:
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self._again = False
            await self.reload()
            if not self._again:
                return

    async def reload(self) -> Changes | None:
        """Apply what may change; None when the settings were refused."""
        server = self._server
        systemd.notify(f"RELOADING=1\nMONOTONIC_USEC={systemd.monotonic_usec()}", server.env)
        try:
            try:
                new = await asyncio.to_thread(self._reread)
            except PrefixdError as exc:
                self.refused += 1
                log.error("reload refused, the settings in force stay: %s", exc)
                return None
            found = changes(server.config, new)
            try:
                await self._apply(new, found)
            except Exception as exc:  # noqa: BLE001 - a manifest that cannot be watched, say
                self.refused += 1
                log.error("reload refused, the settings in force stay: %s", exc)
                return None
            self.reloads += 1
            log.info("reloaded: %s", ", ".join(found.applied) or "no setting that reloads changed")
            if found.at_restart:
                log.warning(
                    "changed settings that take effect at the next restart: %s",
                    ", ".join(found.at_restart),
                )
            return found
        finally:
            systemd.notify("READY=1", server.env)

    async def _apply(self, new: Config, found: Changes) -> None:
        """The manifests first, the one change that can fail: if they cannot be watched, the old
        ones are watched again and nothing else is applied."""
        server = self._server
        applied = {name: new.value(name) for name in found.applied}
        config = server.config.with_settings(**applied)
        if "model_manifests" in applied and server.watcher is not None:
            try:
                await server.watcher.watch(config.store.model_manifests)
            except Exception:
                await server.watcher.watch(server.config.store.model_manifests)
                raise
        if set(found.applied) & set(TENANCY) and server.store is not None:
            server.store.apply_tenancy(config.store_config())
        if "tenant_policy" in applied:
            server.policy = TenantPolicy(config.tenants.policy, os.geteuid())
        if "log_level" in applied:
            logging.getLogger().setLevel(config.metrics.log_level.upper())
        server.config = config  # who may connect: read at every accept
        if set(found.applied) & set(PEERS):
            server.regrant()  # and by the connections already open
