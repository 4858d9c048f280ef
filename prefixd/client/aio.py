"""`AsyncClient`: the asyncio shell around the client core. Many requests are in flight on one
connection, matched by id. A cancelled or timed-out task leaves its spans to its request: they
are given back when the reply arrives, never while the daemon may still use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, Self, TypeVar

from prefixd.client.blocking import Publishers
from prefixd.client.core import ClientCore, StepsOf
from prefixd.client.leases import Span
from prefixd.client.operations import Operations
from prefixd.client.steps import Call, Publish, Reserve, Step, Synchronize
from prefixd.client.tensors import TensorOperations
from prefixd.errors import DaemonUnavailableError, PrefixdError, RequestTimeoutError
from prefixd.trust import check_peer, check_socket_path, unreachable
from prefixd.wire.decoding import reply_id
from prefixd.wire.frames import FrameReader
from prefixd.wire.region import send_with_fds

P = ParamSpec("P")
S = TypeVar("S")
T = TypeVar("T")


@dataclass(slots=True)
class _Pending:
    """A request in flight: the future its caller awaits (if it still does) and its spans."""

    future: asyncio.Future[memoryview]  # the reply's body
    spans: tuple[Span, ...]
    waited: bool = True  # False once the caller gave up: nobody will retrieve the outcome


class AsyncClient(Operations, TensorOperations):
    """asyncio client; safe to share between tasks of one event loop."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        region_bytes: int = 0,
        token_region_bytes: int = 4 << 20,
        timeout: float = 30.0,
        name: str = "prefixd-async-client",
        serves: Sequence[tuple[str, str]] = (),
        reconnect_wait_s: float = 0.0,
        daemon_uid: int | str | None = None,
    ) -> None:
        """The options are Client's. Use `await AsyncClient.connect(...)` or `async with`."""
        self._core = ClientCore(
            socket_path,
            region_bytes=region_bytes,
            token_region_bytes=token_region_bytes,
            timeout=timeout,
            name=name,
            serves=serves,
            reconnect_wait_s=reconnect_wait_s,
            daemon_uid=daemon_uid,
        )
        self._sock: socket.socket | None = None
        self._greeted = False  # the connection's hello (and region attaches) answered
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, _Pending] = {}
        self._write_lock = asyncio.Lock()
        self._connect_lock = asyncio.Lock()
        self._publishers = Publishers(self._core)  # opened and closed off the event loop
        self._closed = False

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str], **options: Any) -> AsyncClient:
        client = cls(socket_path, **options)
        try:
            await client._ensure_connected(wait_s=0.0)
        except BaseException:
            await client.close()
            raise
        return client

    async def close(self) -> None:
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._publishers.close)
        await self._disconnect(DaemonUnavailableError("the client was closed"))
        self._core.close()

    async def __aenter__(self) -> Self:
        await self._ensure_connected(wait_s=0.0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- the shell: steps over an asyncio socket ------------------------------------------------

    async def run(self, steps_of: StepsOf[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run one operation's steps to its result (see Client.run)."""
        return await self._drive(steps_of(self._core, *args, **kwargs), self._perform)

    @staticmethod
    async def _drive(
        steps: Generator[S, Any, T], perform: Callable[[S], Coroutine[Any, Any, Any]]
    ) -> T:
        """Perform each step and hand its value back to the steps (see Client._drive)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                value = await perform(step)
            except BaseException as exc:  # noqa: BLE001 - handed back to the steps, which raise it
                error = exc

    async def _perform(self, step: Step) -> Any:
        if isinstance(step, Reserve):
            return await step.allocator.acquire_async(
                step.nbytes, timeout=self._core.timeout, largest=step.largest
            )
        if isinstance(step, Synchronize):
            await asyncio.get_running_loop().run_in_executor(None, step.event.synchronize)
            return None
        if isinstance(step, Publish):
            get = self._publishers.get
            return await asyncio.get_running_loop().run_in_executor(None, get, step.region_bytes)
        await self._ensure_connected(wait_s=self._core.reconnect_wait_s)
        instance = self._core.instance
        try:
            return await self._request(step)
        except DaemonUnavailableError:
            if self._closed:
                raise
            await self._ensure_connected(wait_s=self._core.reconnect_wait_s)
            if step.spans and self._core.instance == instance:
                raise  # the same daemon may still work on the lost request: see Client
            return await self._request(step)

    async def _greet(self, step: Call) -> Any:
        return await self._request(step, greeting=True)

    async def _request(self, step: Call, *, greeting: bool = False) -> Any:
        """Send `step` (within the timeout, waiting for the connection's turn) and await its reply.
        A request is in flight, and its spans lent to the daemon, only once its frame is going
        out; a send cancelled or timed out part way leaves half a frame, so it ends the
        connection. Only the greeting goes out before the greeting is answered."""
        sock = self._sock
        if sock is None:
            raise DaemonUnavailableError("not connected")
        loop = asyncio.get_running_loop()
        rid, frame = self._core.frame(step.message)
        pending = _Pending(loop.create_future(), step.spans)
        sending = False
        try:
            async with asyncio.timeout(self._core.timeout), self._write_lock:
                if self._sock is not sock or not (greeting or self._greeted):
                    raise DaemonUnavailableError("the connection was lost before the request went")
                self._pending[rid] = pending
                for span in step.spans:
                    span.begin_request()
                sending = True
                if step.fds:
                    sock.setblocking(True)  # a short frame with a descriptor: send it whole
                    try:
                        send_with_fds(sock, frame, step.fds)
                    finally:
                        sock.setblocking(False)
                else:
                    await loop.sock_sendall(sock, frame)
                sending = False
        except (TimeoutError, asyncio.CancelledError) as exc:  # before OSError: TimeoutError is one
            if sending and self._sock is sock:  # half a frame went: the connection is unusable
                await self._disconnect(DaemonUnavailableError("a request's send was cut short"))
            if isinstance(exc, TimeoutError):
                raise RequestTimeoutError(
                    f"{self._core.socket_path} took no request within {self._core.timeout:g} s"
                ) from None
            raise
        except DaemonUnavailableError:  # never sent (an OSError too, hence first)
            raise
        except OSError as exc:
            await self._disconnect(DaemonUnavailableError(f"connection to the daemon lost: {exc}"))
        try:
            done, _ = await asyncio.wait((pending.future,), timeout=self._core.timeout)
        except BaseException:
            pending.waited = False  # cancelled: the reply (or the connection's end) settles it
            if pending.future.done() and not pending.future.cancelled():
                pending.future.exception()  # retrieved: no "never retrieved" noise
            raise
        if not done:
            pending.waited = False
            raise RequestTimeoutError(
                f"no reply from {self._core.socket_path} within {self._core.timeout:g} s"
            )
        return ClientCore.reply(step.message, pending.future.result())

    async def _ensure_connected(self, *, wait_s: float) -> None:
        if self._sock is not None and self._greeted:
            return
        if self._closed:
            raise DaemonUnavailableError("the client was closed")
        async with self._connect_lock:
            if self._sock is not None and self._greeted:
                return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            delay = 0.02
            while True:
                try:
                    await self._connect_once()
                    return
                except DaemonUnavailableError:
                    if loop.time() + delay > deadline:
                        raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _connect_once(self) -> None:
        loop = asyncio.get_running_loop()
        path = os.fspath(self._core.socket_path)
        check_socket_path(self._core.socket_path, self._core.daemon_uids)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, path), self._core.timeout)
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise unreachable(self._core.socket_path, exc) from None
        try:
            check_peer(sock, self._core.daemon_uids)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._reader = asyncio.create_task(self._read_replies(sock), name="prefixd-replies")
        try:
            await self._drive(self._core.greeting(), self._greet)
        except BaseException:
            await self._disconnect(DaemonUnavailableError("the greeting failed"))
            raise
        self._greeted = True

    async def _read_replies(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        frames = FrameReader()
        try:
            while True:
                view = frames.next_body()
                if view is None:
                    got = await loop.sock_recv_into(sock, frames.space())
                    if not got:
                        raise DaemonUnavailableError("the daemon closed the connection")
                    frames.filled(got)
                    continue
                body = memoryview(bytes(view))  # its task decodes it after the buffer moves on
                rid = reply_id(body)
                if rid is None:
                    continue  # a connection-level error addressed to no request of ours
                pending = self._pending.pop(rid, None)
                if pending is None:
                    continue
                for span in pending.spans:
                    span.end_request(lost=False)
                if pending.waited and not pending.future.done():
                    pending.future.set_result(body)
        except (OSError, PrefixdError) as exc:
            if self._sock is sock:
                await self._disconnect(
                    DaemonUnavailableError(f"connection to the daemon lost: {exc}")
                )

    async def _disconnect(self, reason: DaemonUnavailableError) -> None:
        """Close the connection; every request in flight is lost with it (its spans quarantined)."""
        sock, self._sock = self._sock, None
        self._greeted = False
        if sock is not None:
            sock.close()
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            for span in entry.spans:
                span.end_request(lost=True)
            if entry.waited and not entry.future.done():
                entry.future.set_exception(DaemonUnavailableError(str(reason)))
        if any(entry.spans for entry in pending.values()):
            self._core.lost_with_spans(reason)
