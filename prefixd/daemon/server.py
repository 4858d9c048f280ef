"""The asyncio server on a Unix stream socket: binding, accepting, serving and shutting down.

Shutdown follows uvicorn: stop accepting, let in-flight requests finish within the grace period,
then cancel; a second signal cancels at once. Store work still running on a thread after the grace
period (a cancelled request cannot stop its thread) is abandoned, and the store left as a kill would
leave it rather than closed under it: `Server.abandoned` tells the CLI to exit at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixd.clock import Clock, SystemClock
from prefixd.config.policy import TenantPolicy
from prefixd.daemon import systemd
from prefixd.daemon.connection import Connection, reply_and_close
from prefixd.daemon.events import EventPublisher
from prefixd.daemon.exporter import MetricsExporter
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.operations import Operations
from prefixd.daemon.reload import Reloader
from prefixd.daemon.services import Services
from prefixd.daemon.watchers import ManifestWatcher, Retire
from prefixd.daemon.work import WorkPool
from prefixd.errors import ServeError
from prefixd.store import PurgeSelector, Store
from prefixd.store.environment import DATA_FILE, LOCK_FILE
from prefixd.trust import check_private_dir, resolve_user
from prefixd.wire.errors import ErrorCode

if TYPE_CHECKING:
    from prefixd.cluster.bridge import SharedTierBridge
    from prefixd.config.settings import Config

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux; not exported by every Python
_PEERGROUPS_BYTES = 1024  # the most socket.getsockopt accepts (256 groups; more: ERANGE)
RECLAIM_INTERVAL_S = 60.0
# The last steps (the metrics textfile, the store's sync and close) before they are abandoned too
CLOSE_TIMEOUT_S = 5.0
# How often the loop looks whether the store's fsync failed (a flag read: nearly free).
SYNC_WATCH_S = 1.0
# The bridge stops within its own bounds (5 s drains and joins); past this it is not waited for
BRIDGE_STOP_TIMEOUT_S = 20.0


class Server:
    """Serves one store on one Unix socket until stopped."""

    def __init__(
        self,
        config: Config,
        *,
        env: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        reread: Callable[[], Config] | None = None,
    ) -> None:
        """`clock`: what the store and the operations read time from; `reread`: the settings read
        again from their sources, for a reload (SIGHUP; None: no reload)."""
        self.config = config
        self.policy = TenantPolicy(config.tenants.policy, os.geteuid())
        self.env = os.environ if env is None else env
        self.clock: Clock = clock or SystemClock()
        self.store: Store | None = None
        self.stopping = asyncio.Event()
        self.connections: set[Connection] = set()
        self.stats: Counter[str] = Counter()
        self._listener: socket.socket | None = None
        self._created_socket = False
        self._forced = False
        self._force = asyncio.Event()  # set by a second stop(): every shutdown wait ends
        self._grace_ends: float | None = None  # time.monotonic() when the grace period ends
        self._operations: Operations | None = None
        self._pools: tuple[WorkPool, ...] = ()
        self._watcher: ManifestWatcher | None = None
        self._events: EventPublisher | None = None
        self.reloader = Reloader(self, reread) if reread is not None else None
        # Whether shutdown left work running on a thread (and so the store unclosed): the process
        # must then end without waiting for those threads (see run_server and the CLI).
        self.abandoned = False

    @property
    def watcher(self) -> ManifestWatcher | None:
        return self._watcher

    def counters(self) -> dict[str, int]:
        events = self._events.snapshot() if self._events else {}
        return {
            **self.stats,
            "open_connections": len(self.connections),
            "work_running": sum(pool.running for pool in self._pools),
            "manifest_checks": self._watcher.checks if self._watcher is not None else 0,
            "reloads": self.reloader.reloads if self.reloader else 0,
            "reloads_refused": self.reloader.refused if self.reloader else 0,
            **{f"events.{name}": value for name, value in events.items()},
        }

    async def serve(self, *, install_signal_handlers: bool = True) -> int:
        """Serve until SIGTERM/SIGINT or `stop()`; 0 after a graceful stop, 1 after a forced one."""
        loop = asyncio.get_running_loop()
        config = self.config
        if config.socket.daemon_user and resolve_user(config.socket.daemon_user) != os.geteuid():
            # The clients trust a socket of daemon_user: one served by another would be refused.
            raise ServeError(
                f"daemon_user is {config.socket.daemon_user}, but this daemon runs as uid {os.geteuid()}:"
                " start it as that user (systemd: User=), or change daemon_user"
            )
        if not systemd.activated(self.env):
            _refuse_taken(config.socket.path)  # before the store: a refused start leaves no files
        # Only directories no other user may write: one who could would replace the store.
        config.store.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private_dir(config.store.data_dir, "data directory", (DATA_FILE, LOCK_FILE))
        self.store = Store(config.store_config(), exclusive=True, clock=self.clock)
        pool = WorkPool(config.store.workers, thread_name_prefix="prefixd-worker")
        # Everything else the loop hands to threads (health checks, manifest reads, joins), so
        # that shutdown sees that work too; the closing steps get a thread of their own.
        aux = WorkPool(thread_name_prefix="prefixd-aux")
        closer = WorkPool(1, thread_name_prefix="prefixd-close")
        # Administrative work (verify) on a thread of its own: it never takes a worker from the
        # lookups and loads, and one runs at a time (prefixd.daemon.admin refuses a second).
        admin = WorkPool(1, thread_name_prefix="prefixd-admin")
        self._pools = (pool, aux, admin, closer)  # the closer last: shutdown closes with it
        loop.set_default_executor(aux)
        watcher = ManifestWatcher(config.store.model_manifests, self._retirer(pool))
        self._watcher = watcher
        metrics = Metrics(
            self.store, prefill_tokens_per_s=config.metrics.prefill_tokens_per_s, clock=self.clock
        )
        bridge = self._shared_tier()
        if bridge is not None:
            metrics.track_cluster(bridge)
        events = self._events = self._event_publisher()
        if events is not None:
            metrics.track_events(events)
        services = Services(
            store=self.store,
            pool=pool,
            max_frame_bytes=config.limits.max_frame_bytes,
            max_region_bytes=config.limits.max_region_bytes,
            max_prompt_tokens=config.limits.max_prompt_tokens,
            max_request_tokens=config.limits.max_request_tokens,
            models=watcher.fingerprints,
            metrics=metrics,
            min_reusable_tokens=config.limits.min_reusable_tokens,
            load_deadline_s=config.limits.load_deadline_s,
            bridge=bridge,
            clock=self.clock,
            admin_pool=admin,
            server_counters=self.counters,
            open_connections=lambda: len(self.connections),
        )
        operations = self._operations = Operations(services)
        exporter = MetricsExporter(
            metrics.registry,
            port=config.metrics.port,
            address=config.metrics.address,
            textfile=config.metrics.textfile,
            interval_s=config.metrics.interval_s,
            textfile_mode=config.metrics.textfile_mode,
        )
        tasks: list[asyncio.Task[None]] = []
        try:
            await watcher.start()
            await exporter.start(pool)
            if bridge is not None:
                bridge.start()
            if events is not None:
                self.store.observe(events)
                await loop.run_in_executor(aux, events.start)
            self._listener = self._bind()
            self.store.record_socket(self._served_path(self._listener))
            if install_signal_handlers:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(signum, self.stop)
                if self.reloader is not None:
                    loop.add_signal_handler(signal.SIGHUP, self.reloader.request)
            tasks.append(asyncio.create_task(self._accept(operations), name="prefixd-accept"))
            # always: a reload may give tenants times to live
            tasks.append(asyncio.create_task(self._reclaim(pool), name="prefixd-reclaim"))
            tasks.append(asyncio.create_task(self._report_sync_failure(), name="prefixd-sync"))
            interval = systemd.watchdog_interval(self.env)
            if interval:
                watchdog = systemd.Watchdog(interval, self._healthy, env=self.env)
                tasks.append(asyncio.create_task(watchdog.run(), name="prefixd-watchdog"))
            if (
                config.socket.allowed_uids or config.socket.allowed_gids
            ) and not self.policy.configured:
                log.warning(
                    "peers other than uid %d are allowed on the socket without a tenant policy: "
                    "any of them may use, read and purge every tenant (--tenant-policy)",
                    os.geteuid(),
                )
            log.info("serving %s on %s", config.store.data_dir, config.socket.path)
            systemd.notify(f"READY=1\nSTATUS=serving on {config.socket.path}", self.env)
            await self.stopping.wait()
            systemd.notify("STOPPING=1", self.env)
            log.info("stopping: no new connections, draining in-flight requests")
        finally:
            if self._grace_ends is None:  # not stopped by stop(): startup failed, or cancelled
                self._grace_ends = time.monotonic() + config.limits.shutdown_grace_s
            try:
                await self._shut_down(tasks, watcher, exporter, bridge, loop)
            finally:
                for each in self._pools:
                    each.shutdown(wait=False, cancel_futures=True)
                if self.abandoned:
                    # The runner would wait for the default executor's threads: give it one
                    # that has none (the abandoned work ends with the process).
                    loop.set_default_executor(ThreadPoolExecutor(1))
                if install_signal_handlers:
                    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                        loop.remove_signal_handler(signum)
        log.info("stopped%s", " (forced)" if self._forced else "")
        return 1 if self._forced else 0

    async def _shut_down(
        self,
        tasks: list[asyncio.Task[None]],
        watcher: ManifestWatcher,
        exporter: MetricsExporter,
        bridge: SharedTierBridge | None,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Stop everything within the grace period, then close the store unless work of ours still
        runs on a thread (then it is abandoned)."""
        assert self.store is not None and self._grace_ends is not None
        grace_ends = self._grace_ends
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._unbind()
        await self._within(grace_ends, [asyncio.ensure_future(watcher.stop())])
        await self._drain(grace_ends)
        await exporter.stop()
        if not await self._work_done(grace_ends):
            running = sum(pool.running for pool in self._pools)
            log.warning(
                "%s: abandoning %d call(s) still running on store threads; the store is left as "
                "a kill would leave it (committed transactions kept)",
                "forced" if self._forced else "grace period over",
                running,
            )
            self.abandoned = True
            return
        closer = self._pools[-1]
        if self._events is not None:  # what is queued goes out, within its own bound
            self.store.observe(None)
            await loop.run_in_executor(closer, self._events.stop)
        if bridge is not None:
            stopped = loop.run_in_executor(closer, bridge.stop)
            if not await self._within(time.monotonic() + BRIDGE_STOP_TIMEOUT_S, [stopped]):
                log.warning("the shared tier did not stop in time; exiting without closing")
                self.abandoned = True
                return
        store = self.store

        def close() -> None:
            if exporter.textfile is not None:
                exporter.write()  # the last figures, before the store closes
            store.close()

        closed = loop.run_in_executor(closer, close)
        if not await self._within(time.monotonic() + CLOSE_TIMEOUT_S, [closed], forced=False):
            log.warning(
                "closing the store took over %s s; exiting without waiting", CLOSE_TIMEOUT_S
            )
            self.abandoned = True
            return
        closed.result()  # its error, if any

    async def _within(
        self, deadline: float, waiting: Iterable[asyncio.Future[Any]], *, forced: bool = True
    ) -> bool:
        """Wait for `waiting` until `deadline` or, with `forced`, a second stop(); whether all
        finished."""
        left = set(waiting)
        force = asyncio.ensure_future(self._force.wait())
        try:
            while left:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (forced and self._force.is_set()):
                    return False
                watched = left | {force} if forced else left
                done, _ = await asyncio.wait(
                    watched, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                left -= done
            return True
        finally:
            force.cancel()

    async def _work_done(self, deadline: float) -> bool:
        while True:
            unfinished = [f for pool in self._pools for f in pool.unfinished()]
            if not unfinished:
                return True
            if not await self._within(deadline, [asyncio.wrap_future(f) for f in unfinished]):
                return False

    async def _reclaim(self, pool: Executor) -> None:
        """Free the space of expired entries now and then (they are unreachable already)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(RECLAIM_INTERVAL_S)
            assert self.store is not None
            try:
                await loop.run_in_executor(pool, self.store.reclaim_expired)
            except Exception:
                log.exception("reclaiming expired entries failed")

    def _retirer(self, pool: Executor) -> Retire:

        async def retire(model: str, keep: str) -> int:
            assert self._operations is not None
            selector = PurgeSelector(model=model, keep={"weights": keep})
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(pool, self._operations.services.retire, selector)

        return retire

    def _event_publisher(self) -> EventPublisher | None:
        if not self.config.events.endpoint:
            return None
        assert self.store is not None
        return EventPublisher(self.config.events, self.store.inventory)

    def _shared_tier(self) -> SharedTierBridge | None:
        """The bridge to the shared tier, connected lazily: a tier down at start only costs counted
        errors."""
        config = self.config
        if not config.cluster.master:
            return None
        from prefixd.cluster.bridge import SharedTierBridge, TierClient
        from prefixd.cluster.child import ChildTier
        from prefixd.cluster.mooncake import MooncakeSettings, SharedTier

        assert self.store is not None
        settings = MooncakeSettings(
            master=config.cluster.master,
            metadata=config.cluster.metadata,
            local_hostname=config.cluster.local_hostname,
            segment_bytes=config.cluster.segment_bytes,
            timeout_s=config.cluster.timeout_s,
        )
        tier: TierClient
        if config.cluster.client == "inline":
            tier = SharedTier(settings)
        else:
            child = ChildTier.for_mooncake(settings)
            child.start()
            tier = child
        return SharedTierBridge(
            self.store,
            tier,
            pending=config.cluster.pending,
            prefill_tokens_per_s=config.metrics.prefill_tokens_per_s,
        )

    def stop(self) -> None:
        """First call: graceful shutdown. Second call: cancel in-flight requests at once."""
        if self.stopping.is_set():
            self._forced = True
            self._force.set()
            for conn in list(self.connections):
                conn.cancel()
            return
        self._grace_ends = time.monotonic() + self.config.limits.shutdown_grace_s
        self.stopping.set()

    def _bind(self) -> socket.socket:
        activated = systemd.listen_sockets(self.env if isinstance(self.env, dict) else None)
        if activated:
            listener = activated[0]
            for extra in activated[1:]:
                extra.close()
        else:
            listener = self._bind_path()
        listener.setblocking(False)
        return listener

    def _served_path(self, listener: socket.socket) -> Path:
        """The path clients connect to (systemd's, when it passed the socket)."""
        name = listener.getsockname()
        if isinstance(name, (str, bytes)) and name:
            return Path(os.fsdecode(name))
        return self.config.socket.path

    def _bind_path(self) -> socket.socket:
        path = self.config.socket.path
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        # Another user who owns or may write this directory could swap the socket for their own
        # and receive every client's prompts and payloads (as a /tmp/prefixd-UID made beforehand).
        check_private_dir(path.parent, "socket directory")
        if _refuse_taken(path):
            path.unlink()  # a socket nobody answers on: a killed daemon's
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                listener.bind(str(path))
            finally:
                os.umask(old_umask)
            os.chmod(path, self.config.socket.mode)
            listener.listen(min(socket.SOMAXCONN, 4096))
        except BaseException:
            listener.close()
            raise
        self._created_socket = True
        return listener

    def _unbind(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._created_socket:
            with contextlib.suppress(FileNotFoundError):
                self.config.socket.path.unlink()
            self._created_socket = False

    async def _accept(self, operations: Operations) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        reserve: int | None = os.open(os.devnull, os.O_RDONLY)
        try:
            while True:
                try:
                    sock, _ = await loop.sock_accept(self._listener)
                except OSError as exc:  # EMFILE and the like: answer with the reserve, back off
                    log.warning("accept failed: %s", exc)
                    if exc.errno in (errno.EMFILE, errno.ENFILE) and reserve is not None:
                        os.close(reserve)  # one descriptor to take the waiting client and tell it
                        reserve = None
                        with contextlib.suppress(OSError):
                            refused, _ = self._listener.accept()
                            refused.setblocking(False)
                            self.stats["refused"] += 1
                            await reply_and_close(
                                refused, ErrorCode.BUSY, "the daemon is out of file descriptors"
                            )
                        with contextlib.suppress(OSError):
                            reserve = os.open(os.devnull, os.O_RDONLY)
                    await asyncio.sleep(0.1)
                    continue
                if reserve is None:
                    with contextlib.suppress(OSError):
                        reserve = os.open(os.devnull, os.O_RDONLY)
                sock.setblocking(False)
                self.stats["connections"] += 1
                pid, uid, gid = _PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                )
                groups = {gid, *_peer_groups(sock)}
                refusal = self._refusal(uid, groups)
                if refusal is not None:
                    self.stats["refused"] += 1
                    log.warning("refused a connection from pid %d uid %d: %s", pid, uid, refusal[1])
                    await reply_and_close(sock, refusal[0], refusal[1])
                    continue
                grant = self.policy.grant_for(uid, groups)
                conn = Connection(
                    self, operations, sock, pid=pid, uid=uid, groups=groups, grant=grant
                )
                self.connections.add(conn)
                conn.task = asyncio.create_task(conn.run(), name=f"prefixd-conn-{pid}")
        finally:
            if reserve is not None:
                os.close(reserve)

    def regrant(self) -> None:
        """After a reload changed who may connect or the tenant policy: judge each open
        connection's peer again from its uid and groups, as at accept."""
        for conn in self.connections:
            uid, groups = conn.peer.uid, conn.peer.groups
            admitted = self._admits(uid, groups)
            conn.regrant(self.policy.grant_for(uid, groups) if admitted else None)

    def _admits(self, uid: int, gids: AbstractSet[int]) -> bool:
        socket_settings = self.config.socket
        return (
            uid in (0, os.geteuid())
            or uid in socket_settings.allowed_uids
            or not gids.isdisjoint(socket_settings.allowed_gids)
            or (os.getegid() != 0 and os.getegid() in gids)  # the daemon's own group's members
        )

    def _refusal(self, uid: int, gids: set[int]) -> tuple[ErrorCode, str] | None:
        config = self.config
        if not self._admits(uid, gids):
            return ErrorCode.FORBIDDEN, (
                f"uid {uid} (groups {sorted(gids)}) may not use this daemon: add the user to its "
                f"group (gid {os.getegid()}) or to allowed_uids, or its group to allowed_gids"
            )
        if len(self.connections) >= config.limits.max_connections:
            return (
                ErrorCode.BUSY,
                f"the daemon serves at most {config.limits.max_connections} connections",
            )
        held = sum(1 for conn in self.connections if conn.uid == uid)
        if held >= config.limits.max_connections_per_uid:
            limit = config.limits.max_connections_per_uid
            return ErrorCode.BUSY, f"uid {uid} holds {held} connections, at most {limit} allowed"
        return None

    async def _drain(self, grace_ends: float) -> None:
        conns = list(self.connections)
        for conn in conns:
            conn.stop_reading()
        waiting = [c.task for c in conns if c.task is not None]
        if not await self._within(grace_ends, waiting):
            pending = sum(not task.done() for task in waiting)
            why = "forced" if self._forced else "grace period over"
            log.warning("%s: cancelling %d connection(s)", why, pending)
        for conn in conns:
            conn.cancel()
        # Cancelled, a connection only closes its socket and regions (its requests' threads are
        # not waited for here): this is quick, but bounded all the same.
        await self._within(time.monotonic() + CLOSE_TIMEOUT_S, waiting, forced=False)

    async def _report_sync_failure(self) -> None:
        """Once the store's fsync fails, say so in STATUS= and go on serving reads. Neither exit nor
        withhold watchdog pings: a restart is the operator's to make after a look at the disk
        (prefixd.store.sync_state says why)."""
        assert self.store is not None
        while (failure := self.store.sync_failure) is None:
            await asyncio.sleep(SYNC_WATCH_S)
        systemd.notify(
            systemd.status(
                f"writes refused, reads served: {failure.describe()}; check the disk, then "
                "restart (the start checks what was written since the last good sync)"
            ),
            self.env,
        )

    async def _healthy(self) -> bool:
        if self.store is None:
            return False
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.store.stats)
        return True


def _peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups as the kernel recorded them at connect."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _PEERGROUPS_BYTES)
    except OSError:  # kernels before 4.13: primary group only
        return ()
    return struct.unpack(f"={len(raw) // 4}I", raw[: len(raw) - len(raw) % 4])


def _socket_answers(path: os.PathLike[str]) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(os.fspath(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _refuse_taken(path: Path) -> bool:
    """Refuse a path that is not a socket, or one another daemon answers on; whether a stale socket
    lies there."""
    if not (path.exists() or path.is_symlink()):
        return False
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ServeError(f"{path} exists and is not a socket")
    if _socket_answers(path):
        raise ServeError(f"another daemon is serving on {path}")
    return True


def run_server(server: Server) -> int:
    """Run `server.serve` (on uvloop where installed); when `server.abandoned`, the caller must end
    the process without joining the threads still running store work."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(server.serve())
    return uvloop.run(server.serve())
